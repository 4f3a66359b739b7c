"""Expert parallelism's pieces (docs/architecture.md §4a): the group's exchange of routed
rows (gather) and of their outputs (combine) over real gloo groups (one thread per rank),
the rendezvous through a real Redis, and the share of experts each rank holds."""

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


def test_gather_sends_each_rank_only_its_rows_and_combine_brings_their_outputs_back(
    redis_client,
) -> None:
    """Rank r sends r + 1 rows to each expert of rank d (two experts a rank): each rank
    receives every source's rows for its own experts, in source order, and what it sends
    back arrives where the rows came from."""
    groups = form_group(redis_client, 3, generation=1)

    def sent(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.full((3, 2), rank + 1, dtype=torch.long)
        rows = torch.arange(int(counts.sum()), dtype=torch.float32)[:, None] + 100 * rank
        return rows.expand(-1, 4).contiguous(), counts

    def exchange(rank: int, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, counts = sent(rank)
        got, received = group.gather(rows, counts)
        back = group.combine(got * -1, counts, received)
        return got, received, back

    results = on_every_rank(groups, exchange)
    for rank, (got, received, back) in enumerate(results):
        assert received.tolist() == [[s + 1, s + 1] for s in range(3)]
        want = torch.cat(
            [sent(s)[0][2 * (s + 1) * rank : 2 * (s + 1) * (rank + 1)] for s in range(3)]
        )
        assert torch.equal(got, want)
        assert torch.equal(back, -sent(rank)[0])


def test_a_group_forms_again_under_a_new_generation(redis_client) -> None:
    first = form_group(redis_client, 2, generation=1)
    again = form_group(redis_client, 2, generation=2)
    assert redis_client.hget(KEYS.rendezvous("ep"), "generation") == b"2"
    one_each = torch.ones(2, 1, dtype=torch.long)  # one row for each rank's one expert
    gathered = on_every_rank(again, lambda r, g: g.gather(torch.full((2, 1), float(r)), one_each))
    assert all(rows.flatten().tolist() == [0.0, 1.0] for rows, _ in gathered)
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
