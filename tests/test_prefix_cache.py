"""The prefix cache's index and the planner's use of it (batcher/prefix.py, §3b): which
slot holds which blocks, when they count as held, and how a hit is placed. The end-to-end
exactness of hits is in test_prefix_cache_pool."""

from __future__ import annotations

import pytest

from batcher.blocks import BlockPool
from batcher.outcomes import apply_result
from batcher.prefix import block_keys
from batcher.scheduler import (
    PlannerConfig,
    PoolState,
    Sequence,
    finish,
    join_rank,
    lose_rank,
    plan_step,
)
from schemas.control import RequestOutcome, StepResult

pytestmark = pytest.mark.fast

BLOCK = 16
SHARED = list(range(100, 100 + 3 * BLOCK))  # three full blocks


def make_state(ranks: int = 1, slots: int = 4, **overrides: bool | int) -> PoolState:
    values: dict[str, bool | int] = dict(
        num_ranks=ranks,
        max_num_seqs=64,
        kv_slots_per_rank=slots,
        decode_batch=8,
        prefill_chunk=32,
        prefill_slots=4,
        pack_prefill=True,
        prefix_caching=True,
        block_size=BLOCK,
    )
    return PoolState(PlannerConfig(**{**values, **overrides}))  # type: ignore[arg-type]


def queue(state: PoolState, name: str, tokens: list[int], order: int = 0) -> Sequence:
    seq = Sequence(name, len(tokens), 8, order=order)
    seq.block_keys = block_keys(tokens, BLOCK, "m")
    seq.admission = 1
    state.waiting.append(seq)
    return seq


def first_token(state: PoolState, seq: Sequence) -> None:
    """The request's rank reports its first token (its prompt has been computed)."""
    outcome = RequestOutcome(seq.request_id, seq.admission, 1)
    apply_result(state, StepResult(epoch=1, step=1, rank=seq.rank, outcomes=[outcome]))


def served(state: PoolState, name: str, tokens: list[int], order: int = 0) -> Sequence:
    """Admit a request, plan its prefill and report its first token."""
    seq = queue(state, name, tokens, order)
    plan_step(state)
    assert seq.is_admitted and seq.is_prefilled
    first_token(state, seq)
    return seq


def test_block_keys_chain_every_token_before_them_and_the_model() -> None:
    keys = block_keys(SHARED + [1, 2, 3], BLOCK, "m")
    assert len(keys) == 3  # the partial last block has no key
    assert len(set(keys)) == 3
    other = SHARED.copy()
    other[0] += 1  # a change in the first block changes every key after it
    assert not set(block_keys(other, BLOCK, "m")) & set(keys)
    other = SHARED.copy()
    other[-1] += 1  # in the last: only its own
    assert block_keys(other, BLOCK, "m")[:2] == keys[:2] != block_keys(other, BLOCK, "m")
    assert not set(block_keys(SHARED, BLOCK, "other model")) & set(keys)


def test_a_hit_starts_its_prefill_after_the_cached_blocks_in_the_holders_free_slot() -> None:
    state = make_state()
    a = served(state, "a", SHARED + [1] * 5)
    finish(state, "a")
    b = queue(state, "b", SHARED[: 2 * BLOCK] + [7] * 9, order=1)
    plan = plan_step(state)
    assert plan.admitted == [b]
    assert (b.rank, b.slot, b.cached_from, b.num_cached) == (a.rank, a.slot, a.slot, 2 * BLOCK)
    [[chunk]] = plan.prefill[0]
    assert (chunk.start, chunk.num_tokens) == (2 * BLOCK, 9)  # only what is not cached


def test_a_hit_on_a_running_request_copies_its_blocks_into_another_slot() -> None:
    state = make_state()
    a = served(state, "a", SHARED + [1] * 5)
    b = queue(state, "b", SHARED + [2] * 5, order=1)
    plan = plan_step(state)
    assert b.slot != a.slot
    assert (b.cached_from, b.num_cached) == (a.slot, 3 * BLOCK)
    [[chunk]] = plan.prefill[0]
    assert (chunk.slot, chunk.start, chunk.num_tokens) == (b.slot, 3 * BLOCK, 5)


def test_the_last_prompt_token_is_always_computed_and_with_mtp_the_last_cached_one() -> None:
    state = make_state()
    served(state, "a", SHARED)
    b = queue(state, "b", SHARED, order=1)  # the whole prompt is cached
    plan_step(state)
    assert b.num_cached == 3 * BLOCK - 1
    state = make_state(mtp=True)
    served(state, "a", SHARED + [1])
    b = queue(state, "b", SHARED + [2], order=1)
    plan_step(state)
    assert b.num_cached == 3 * BLOCK - 1  # its draft entry reads the token after it


def test_blocks_count_only_once_their_first_token_shows_they_were_computed() -> None:
    state = make_state()
    a = queue(state, "a", SHARED + [1])
    b = queue(state, "b", SHARED + [2], order=1)  # arrives with a: waits for a's blocks
    plan = plan_step(state)
    assert plan.admitted == [a] and b.deferred and state.waiting == [b]
    assert plan_step(state).admitted == []  # a's prompt is planned, its rank has not reported
    first_token(state, a)
    plan = plan_step(state)
    assert plan.admitted == [b] and b.num_cached == 3 * BLOCK


def test_a_request_waits_for_blocks_only_while_their_request_computes_them() -> None:
    state = make_state()
    queue(state, "a", SHARED + [1])
    plan_step(state)
    b = queue(state, "b", SHARED + [2], order=1)
    other = queue(state, "c", [4] * 40, order=2)  # shares nothing: not held back
    assert plan_step(state).admitted == [other]
    finish(state, "a")  # a ended before its first token (cancelled, say)
    plan = plan_step(state)
    assert plan.admitted == [b] and b.num_cached == 0 and not b.deferred


def test_a_slot_written_over_forgets_its_blocks() -> None:
    state = make_state(slots=1)
    served(state, "a", SHARED + [1])
    finish(state, "a")
    served(state, "x", [9] * (2 * BLOCK), order=1)  # takes the only slot
    finish(state, "x")
    b = queue(state, "b", SHARED + [2], order=2)
    plan_step(state)
    assert b.num_cached == 0


def test_a_new_request_takes_a_slot_holding_nothing_then_the_least_recently_freed() -> None:
    state = make_state(slots=3)
    a = served(state, "a", SHARED + [1])
    c = served(state, "c", [5] * (2 * BLOCK), order=1)
    finish(state, "a")
    finish(state, "c")  # slots: a's (freed first), c's, one holding nothing
    x = queue(state, "x", [8] * 40, order=2)
    plan_step(state)
    assert x.slot not in (a.slot, c.slot)
    y = queue(state, "y", [7] * 40, order=3)
    plan_step(state)
    assert y.slot == a.slot  # the least recently freed holder goes first
    z = queue(state, "z", [5] * (2 * BLOCK) + [1], order=4)
    plan_step(state)
    assert (z.slot, z.num_cached) == (c.slot, 2 * BLOCK)  # c's blocks were kept


def test_the_rank_holding_the_prefix_is_chosen_and_a_lost_rank_holds_nothing() -> None:
    state = make_state(ranks=2)
    a = served(state, "a", SHARED + [1])
    other = 1 - a.rank
    b = queue(state, "b", SHARED + [2], order=1)  # the other rank has more free slots
    plan_step(state)
    assert (b.rank, b.num_cached) == (a.rank, 3 * BLOCK)
    lose_rank(state, a.rank)
    join_rank(state, a.rank)
    c = queue(state, "c", SHARED + [3], order=2)
    plan_step(state)
    assert c.num_cached == 0
    assert c.rank in (a.rank, other)


def test_nothing_is_cached_with_prefix_caching_off() -> None:
    state = make_state(prefix_caching=False)
    served(state, "a", SHARED + [1])
    finish(state, "a")
    b = queue(state, "b", SHARED + [2], order=1)
    plan_step(state)
    assert (b.num_cached, b.num_prefilled, b.cached_from) == (0, len(SHARED) + 1, -1)


def test_a_stale_outcome_registers_nothing() -> None:
    state = make_state()
    a = queue(state, "a", SHARED + [1])
    plan_step(state)
    outcome = RequestOutcome("a", a.admission + 1, 1)  # not the admission running
    apply_result(state, StepResult(epoch=1, step=1, rank=a.rank, outcomes=[outcome]))
    assert state.prefix.blocks_held() == 0
    first_token(state, a)
    assert state.prefix.blocks_held() == 3


def test_a_burst_sharing_a_prompt_computes_it_once_a_rank_and_the_rest_wait() -> None:
    state = make_state(ranks=2)
    burst = [queue(state, f"b{i}", SHARED + [i], order=i) for i in range(5)]
    plan = plan_step(state)
    assert [s.request_id for s in plan.admitted] == ["b0", "b1"]
    assert {burst[0].rank, burst[1].rank} == {0, 1}
    assert all(s.deferred for s in burst[2:])
    first_token(state, burst[0])
    plan = plan_step(state)
    assert {s.request_id for s in plan.admitted} == {"b2", "b3", "b4"}
    assert all(s.num_cached == 3 * BLOCK for s in burst[2:])


def test_in_blocks_a_burst_shares_a_prompt_from_the_step_after_its_blocks_are_planned() -> None:
    """In a cache of blocks a prompt's full blocks are keyed as the step computing them is
    planned (its rank runs its steps in order): the requests waiting for them are admitted
    to the next step, sharing them, with no first token back yet."""
    state = make_state(paged=True, max_kv_len=256, prefill_slots=1)  # 32 tokens a step
    join_rank(state, 0, 64)
    burst = [queue(state, f"b{i}", SHARED + [i], order=i) for i in range(3)]
    plan_step(state)  # b0's first 32 tokens: blocks 0 and 1
    assert burst[0].is_admitted and all(s.deferred for s in burst[1:])
    assert state.pools[0].cached(burst[1].block_keys) == burst[0].blocks[:2]
    plan_step(state)  # the rest of its prompt, block 2 with it; the others wait for it
    assert all(s.deferred for s in burst[1:])
    plan = plan_step(state)
    assert {s.request_id for s in plan.admitted} == {"b1", "b2"}
    for seq in burst[1:]:
        assert seq.num_cached == 3 * BLOCK and seq.blocks[:3] == burst[0].blocks[:3]


def test_in_blocks_a_burst_spreads_over_the_ranks_computing_its_prompt() -> None:
    """A burst whose prompt one rank started computing a step before the other: the other
    computes it too, and the rest of the burst is shared out between the two by the share
    of their blocks free, a request waiting a step for the rank still computing, rather
    than all going to the rank that finished first."""
    state = make_state(ranks=2, slots=8, paged=True, max_kv_len=256, prefill_slots=1)
    join_rank(state, 0, 64)
    join_rank(state, 1, 64)
    burst = [queue(state, "b0", SHARED + [0])]
    plan_step(state)
    burst += [queue(state, f"b{i}", SHARED + [i], order=i) for i in range(1, 9)]
    for _ in range(4):
        plan_step(state)
    assert all(s.is_admitted for s in burst)
    cold = [s for s in burst if not s.num_cached]
    assert {s.rank for s in cold} == {0, 1} and len(cold) == 2  # once a rank
    on = [sum(s.rank == rank for s in burst) for rank in (0, 1)]
    assert abs(on[0] - on[1]) <= 1, on
    assert all(s.num_cached == 3 * BLOCK for s in burst if s not in cold)


def test_with_marks_a_prompts_blocks_are_keyed_once_its_first_token_is_back() -> None:
    """Where a block's boundary needs a mark, copied in the launch that ends there, its
    key waits for the first token, as the mark's copy is only known taken then."""
    state = make_state(paged=True, max_kv_len=256)
    join_rank(state, 0, 64, 4)
    a = queue(state, "a", SHARED + [1])
    b = queue(state, "b", SHARED + [2], order=1)
    plan_step(state)
    plan_step(state)
    assert a.is_prefilled and b.deferred and not state.pools[0].cached(b.block_keys)
    first_token(state, a)
    plan = plan_step(state)
    assert plan.admitted == [b] and b.num_cached == 3 * BLOCK


def test_ranks_of_slightly_different_sizes_take_new_requests_in_turn() -> None:
    """Ranks sized from a share of their host's free memory differ by a few blocks; new
    requests still alternate between them (by the share of blocks free, not the count)."""
    state = make_state(ranks=2, slots=16, paged=True, max_kv_len=256)
    join_rank(state, 0, 1000)
    join_rank(state, 1, 990)
    for i in range(12):
        queue(state, f"r{i}", [i + 2] * 20, order=i)
    plan = plan_step(state)
    ranks = [s.rank for s in plan.admitted]
    assert len(ranks) == 12 and ranks.count(0) == ranks.count(1) == 6


def marked_state(marks: int) -> PoolState:
    """One rank with a cache of 64 blocks and `marks` marks (a model whose state is not all
    in blocks, as DeepSeek-V4's rings are not)."""
    state = make_state(paged=True, max_kv_len=256)
    join_rank(state, 0, 64, marks)
    return state


def segments(state: PoolState) -> list[tuple[int, int, int]]:
    """The step's prefill segments on rank 0: (start, tokens, mark)."""
    plan = plan_step(state)
    return [(c.start, c.num_tokens, c.mark) for launch in plan.prefill[0] for c in launch]


def test_with_marks_a_segment_ends_on_its_last_keyed_block_and_a_hit_restores_that_mark() -> None:
    state = marked_state(marks=2)
    a = queue(state, "a", SHARED + [1] * 5)  # three keyed blocks, 53 tokens
    # 32 tokens end on block 2; the next segment is cut where block 3 ends, so its mark is
    # taken there; the rest carries none
    got = segments(state)
    assert [(s, n) for s, n, _ in got] == [(0, 32), (32, 16), (48, 5)]
    pool = state.pools[0]
    assert got[2][2] == -1 and pool.mark_of == {a.blocks[1]: got[0][2], a.blocks[2]: got[1][2]}
    first_token(state, a)
    b = queue(state, "b", SHARED + [7] * 3, order=1)
    plan_step(state)
    assert b.num_cached == 3 * BLOCK and b.restore_mark == got[1][2]
    assert b.blocks[:3] == a.blocks[:3]


def test_with_marks_a_hit_stops_at_the_last_block_that_kept_its_mark() -> None:
    state = marked_state(marks=1)  # one mark: the second block's is taken by the third's
    a = queue(state, "a", SHARED + [1] * 5)
    plan_step(state)
    pool = state.pools[0]
    assert list(pool.mark_of) == [a.blocks[2]]
    first_token(state, a)
    c = queue(state, "c", SHARED + [8], order=1)
    plan_step(state)
    assert c.num_cached == 3 * BLOCK and c.restore_mark == pool.mark_of[a.blocks[2]]
    b = queue(state, "b", SHARED[: 2 * BLOCK] + [9] * 20, order=2)  # shares two blocks
    plan_step(state)
    assert b.num_cached == 0 and b.restore_mark == -1  # the mark at their end is gone


def test_a_block_handed_out_again_loses_its_mark() -> None:
    pool = BlockPool(2, num_marks=2)
    [first, second] = pool.take(2)
    marks = {pool.mark_for(first), pool.mark_for(second)}
    assert marks == {0, 1} and pool.mark_for(first) == pool.mark_of[first]
    pool.release([first, second])
    [taken] = pool.take(1)
    [kept] = {first, second} - {taken}
    assert taken not in pool.mark_of and pool.use_mark(taken) == -1
    assert pool.use_mark(kept) >= 0
    assert pool.mark_for(taken) != pool.mark_of[kept]  # the freed mark, not the kept one
