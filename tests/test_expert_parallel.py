"""Expert parallelism's pieces (docs/architecture.md §4a): the group's gather and combine
over real gloo groups (one thread per rank), the rendezvous through a real Redis, and the
share of experts each rank holds."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from npu_worker.expert_parallel import Rendezvous, RendezvousTimeout
from npu_worker.models.moe import expert_share
from schemas.keys import Keys

pytestmark = pytest.mark.fast

KEYS = Keys()


def form_group(redis_client, size: int, generation: int, timeout_s: float = 10.0) -> list:
    """Every rank's ProcessGroupExperts, formed at once from threads of this process."""
    groups: list = [None] * size
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            rendezvous = Rendezvous(
                redis_client, KEYS, "ep", rank, size, torch.device("cpu"), timeout_s
            )
            groups[rank] = rendezvous.form(generation)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 5)
    assert not errors, errors
    return groups


def on_every_rank(groups: list, work) -> list:
    """`work(rank, group)` on one thread per rank (collectives need them all at once)."""
    results: list = [None] * len(groups)

    def run(rank: int) -> None:
        results[rank] = work(rank, groups[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(groups))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_gather_stacks_every_rank_and_combine_sums_each_ranks_rows_in_rank_order(
    redis_client,
) -> None:
    groups = form_group(redis_client, 3, generation=1)
    gathered = on_every_rank(groups, lambda r, g: g.gather(torch.full((2, 4), float(r))))
    want = torch.cat([torch.full((2, 4), float(r)) for r in range(3)])
    assert all(torch.equal(g, want) for g in gathered)

    def partial(rank: int) -> torch.Tensor:  # rank r's partial sums for every rank's 2 tokens
        rows = torch.arange(6, dtype=torch.float32)[:, None].expand(6, 4)
        return rows * 10.0**rank

    combined = on_every_rank(groups, lambda r, g: g.combine(partial(r)))
    for rank, got in enumerate(combined):
        mine = slice(2 * rank, 2 * rank + 2)
        want = partial(0)[mine] + partial(1)[mine] + partial(2)[mine]
        assert torch.equal(got, want)


def test_a_group_forms_again_under_a_new_generation(redis_client) -> None:
    first = form_group(redis_client, 2, generation=1)
    again = form_group(redis_client, 2, generation=2)
    assert redis_client.hget(KEYS.rendezvous("ep"), "generation") == b"2"
    gathered = on_every_rank(again, lambda r, g: g.gather(torch.tensor([float(r)])))
    assert all(g.tolist() == [0.0, 1.0] for g in gathered)
    del first


def test_a_rendezvous_whose_peers_never_come_fails_within_its_timeout(redis_client) -> None:
    lonely = Rendezvous(redis_client, KEYS, "ep", 0, 2, torch.device("cpu"), timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(RendezvousTimeout, match="expert-parallel group 7 did not form"):
        lonely.form(7)
    waiting = Rendezvous(redis_client, KEYS, "ep", 1, 2, torch.device("cpu"), timeout_s=1.0)
    with pytest.raises(RendezvousTimeout, match="rank 0 published no address for .* group 8"):
        waiting.form(8)
    assert time.monotonic() - started < 10


def test_each_rank_holds_a_contiguous_share_of_the_experts() -> None:
    assert [list(expert_share(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="8 routed experts do not divide over 3"):
        expert_share(8, 0, 3)
