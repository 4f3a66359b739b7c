"""The step planner (DESIGN §3): exact unit cases, then hypothesis-driven pool simulations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batcher.scheduler import (
    PlannerConfig,
    PoolState,
    PrefillWork,
    Sequence,
    StepPlan,
    finish,
    plan_step,
)

DUMMY = PrefillWork("", -1, 0, 0)


def make_config(**overrides: int | bool) -> PlannerConfig:
    """A one-rank pool with room to spare, unless told otherwise."""
    values: dict[str, int | bool] = dict(
        num_ranks=1,
        max_num_seqs=64,
        kv_slots_per_rank=8,
        decode_batch=8,
        prefill_chunk=128,
        prefill_slots=4,
    )
    return PlannerConfig(**{**values, **overrides})  # type: ignore[arg-type]


def make_state(**overrides: int | bool) -> PoolState:
    return PoolState(make_config(**overrides))


def submit(
    state: PoolState, *prompt_lens: int, first: int = 0, max_new_tokens: int = 16, priority: int = 0
) -> list[Sequence]:
    """Queue one request per prompt length, named r<order> with order counting from `first`."""
    seqs = [
        Sequence(f"r{first + i}", n, max_new_tokens, order=first + i, priority=priority)
        for i, n in enumerate(prompt_lens)
    ]
    state.waiting.extend(seqs)
    return seqs


def place(
    state: PoolState,
    request_id: str,
    rank: int,
    slot: int,
    *,
    prefilled: bool = True,
    order: int = 0,
) -> Sequence:
    """Put a 10-token request straight onto (rank, slot), already prefilled or not."""
    seq = Sequence(
        request_id, 10, 16, order=order, rank=rank, slot=slot, num_prefilled=10 if prefilled else 0
    )
    state.free_slots[rank].remove(slot)
    state.running[request_id] = seq
    return seq


def ids(rows: list[Sequence]) -> list[str]:
    return [s.request_id for s in rows]


def launch_ids(plan: StepPlan) -> list[dict[int, list[str]]]:
    return [{rank: ids(rows) for rank, rows in launch.items()} for launch in plan.decode_launches]


def test_admission_stops_at_max_num_seqs() -> None:
    state = make_state(num_ranks=2, max_num_seqs=3, kv_slots_per_rank=4)
    submit(state, 10, 10, 10, 10, 10)
    plan = plan_step(state)
    assert ids(plan.admitted) == ["r0", "r1", "r2"]
    assert ids(state.waiting) == ["r3", "r4"]


def test_admission_stops_when_every_rank_is_out_of_kv_slots() -> None:
    state = make_state(num_ranks=2, kv_slots_per_rank=2)
    submit(state, 10, 10, 10, 10, 10, 10)
    plan = plan_step(state)
    assert [(s.request_id, s.rank, s.slot) for s in plan.admitted] == [
        ("r0", 0, 0),
        ("r1", 1, 0),
        ("r2", 0, 1),
        ("r3", 1, 1),
    ]
    assert ids(state.waiting) == ["r4", "r5"]
    assert state.free_slots == [[], []]


def test_rank_with_most_free_slots_wins_and_ties_go_round_robin() -> None:
    state = make_state(num_ranks=3, kv_slots_per_rank=2)
    submit(state, 10, 10, 10)
    assert [s.rank for s in plan_step(state).admitted] == [0, 1, 2]
    finish(state, "r1")  # rank 1 now has 2 free slots, ranks 0 and 2 have 1
    submit(state, 10, 10, 10, first=3)
    # most free first (rank 1), then the 1-1-1 tie resumes round-robin after rank 1
    assert [s.rank for s in plan_step(state).admitted] == [1, 2, 0]


def test_finish_frees_the_slot_and_a_waiting_request_takes_the_lowest_free_one() -> None:
    state = make_state(kv_slots_per_rank=4)
    submit(state, 10, 10, 10, 10, 10, 10)
    assert [s.slot for s in plan_step(state).admitted] == [0, 1, 2, 3]
    assert ids(state.waiting) == ["r4", "r5"]
    freed = finish(state, "r2")
    assert freed is not None and (freed.request_id, freed.rank, freed.slot) == ("r2", 0, 2)
    finish(state, "r0")
    assert state.free_slots == [[0, 2]]
    assert [(s.request_id, s.slot) for s in plan_step(state).admitted] == [("r4", 0), ("r5", 2)]
    assert sorted(state.running) == ["r1", "r3", "r4", "r5"]


def test_higher_priority_is_admitted_first_then_arrival_order() -> None:
    state = make_state(kv_slots_per_rank=2)
    arrivals = [("a", 0), ("b", 2), ("c", 1), ("d", 2)]
    state.waiting = [Sequence(n, 10, 4, order, p) for order, (n, p) in enumerate(arrivals)]
    assert ids(plan_step(state).admitted) == ["b", "d"]
    assert ids(state.waiting) == ["c", "a"]
    finish(state, "d")
    assert ids(plan_step(state).admitted) == ["c"]


def test_request_completing_its_prompt_does_not_decode_in_the_same_step() -> None:
    state = make_state()
    (seq,) = submit(state, 100)
    first = plan_step(state)
    assert (first.decode_launches, first.prefill) == ([], {0: [PrefillWork("r0", 0, 0, 100)]})
    assert seq.num_planned_tokens == 1
    second = plan_step(state)
    assert (launch_ids(second), second.prefill, seq.num_planned_tokens) == ([{0: ["r0"]}], {}, 2)


def test_decode_beyond_one_launch_splits_into_partition_safe_microbatches() -> None:
    state = make_state(num_ranks=2, decode_batch=2)
    for name, slot in [("a4", 4), ("a0", 0), ("a3", 3), ("a1", 1), ("a2", 2)]:
        place(state, name, rank=0, slot=slot)
    place(state, "b1", rank=1, slot=1)
    place(state, "b0", rank=1, slot=0)
    plan = plan_step(state)
    assert launch_ids(plan) == [{0: ["a0", "a1"], 1: ["b0", "b1"]}, {0: ["a2", "a3"]}, {0: ["a4"]}]
    assert all(s.num_planned_tokens == 1 for s in state.running.values())


def test_long_prompt_is_prefilled_in_chunks_over_several_steps() -> None:
    state = make_state(prefill_chunk=128)
    (seq,) = submit(state, 300)
    chunks = []
    for _ in range(3):
        plan = plan_step(state)
        assert plan.decode_launches == []
        chunks += plan.prefill[0]
    assert chunks == [
        PrefillWork("r0", 0, 0, 128),
        PrefillWork("r0", 0, 128, 128),
        PrefillWork("r0", 0, 256, 44),
    ]
    assert (seq.num_prefilled, seq.num_planned_tokens) == (300, 1)


def test_prefill_takes_at_most_prefill_slots_chunks_per_rank_oldest_first() -> None:
    state = make_state(prefill_slots=2)
    for slot, order in [(0, 3), (1, 2), (2, 0), (3, 1)]:
        place(state, f"o{order}", rank=0, slot=slot, prefilled=False, order=order)
    first = plan_step(state)
    assert first.prefill == {0: [PrefillWork("o0", 2, 0, 10), PrefillWork("o1", 3, 0, 10)]}
    plan = plan_step(state)
    assert launch_ids(plan) == [{0: ["o0", "o1"]}]
    assert plan.prefill == {0: [PrefillWork("o2", 1, 0, 10), PrefillWork("o3", 0, 0, 10)]}


def test_decode_stops_once_planned_tokens_reach_max_new_tokens() -> None:
    state = make_state()
    (three,) = submit(state, 10, max_new_tokens=3)
    (one,) = submit(state, 10, first=1, max_new_tokens=1)
    planned = []
    for _ in range(4):
        plan = plan_step(state)
        planned.append((launch_ids(plan), three.num_planned_tokens, one.num_planned_tokens))
    assert planned == [([], 1, 1), ([{0: ["r0"]}], 2, 1), ([{0: ["r0"]}], 3, 1), ([], 3, 1)]
    assert plan.is_empty


def make_mixed_pool(*, lockstep: bool) -> PoolState:
    """Rank 0: two decoding rows; rank 1: two prompts to prefill; rank 2: one prompt."""
    state = make_state(num_ranks=3, decode_batch=1, prefill_slots=2, lockstep=lockstep)
    for name, rank, slot, order in [("p0", 1, 0, 0), ("p1", 1, 1, 1), ("p2", 2, 0, 2)]:
        place(state, name, rank, slot, prefilled=False, order=order)
    place(state, "d0", rank=0, slot=0)
    place(state, "d1", rank=0, slot=1)
    return state


PREFILL_P0 = PrefillWork("p0", 0, 0, 10)
PREFILL_P1 = PrefillWork("p1", 1, 0, 10)
PREFILL_P2 = PrefillWork("p2", 0, 0, 10)


def test_without_lockstep_idle_ranks_get_no_launches() -> None:
    plan = plan_step(make_mixed_pool(lockstep=False))
    assert launch_ids(plan) == [{0: ["d0"]}, {0: ["d1"]}]
    assert plan.prefill == {1: [PREFILL_P0, PREFILL_P1], 2: [PREFILL_P2]}


def test_lockstep_pads_every_rank_to_the_same_number_of_launches() -> None:
    plan = plan_step(make_mixed_pool(lockstep=True))
    assert launch_ids(plan) == [{0: ["d0"], 1: [], 2: []}, {0: ["d1"], 1: [], 2: []}]
    assert plan.prefill == {0: [DUMMY, DUMMY], 1: [PREFILL_P0, PREFILL_P1], 2: [PREFILL_P2, DUMMY]}


@pytest.mark.parametrize("name", [f.name for f in fields(PlannerConfig) if f.name != "lockstep"])
@pytest.mark.parametrize("value", [0, -1])
def test_config_rejects_limits_below_one(name: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"{name} must be >= 1, got {value}"):
        make_config(**{name: value})


@dataclass(frozen=True)
class Arrival:
    step: int
    num_prompt_tokens: int
    max_new_tokens: int
    priority: int
    stop_at: int | None  # planned-token count at which it ends early (EOS), if any


@dataclass
class Trace:
    admitted: list[Sequence]
    finished: dict[str, Sequence]
    num_steps: int


Before = dict[str, tuple[int, int]]  # request_id -> (num_prefilled, num_planned_tokens) pre-plan
Check = Callable[[PoolState, StepPlan, Before], None]

configs = st.builds(
    PlannerConfig,
    num_ranks=st.integers(1, 8),
    max_num_seqs=st.integers(1, 64),
    kv_slots_per_rank=st.integers(1, 16),
    decode_batch=st.integers(1, 8),
    prefill_chunk=st.integers(1, 256),
    prefill_slots=st.integers(1, 4),
    lockstep=st.booleans(),
)
arrivals = st.builds(
    Arrival,
    step=st.integers(0, 20),
    num_prompt_tokens=st.integers(1, 600),
    max_new_tokens=st.integers(1, 40),
    priority=st.integers(0, 2),
    stop_at=st.none() | st.integers(0, 40),
)
# draw the size first: plain st.lists leans to a handful of requests and the pool never fills
workloads = st.integers(0, 40).flatmap(lambda n: st.lists(arrivals, min_size=n, max_size=n))


def step_bound(config: PlannerConfig, arrivals: list[Arrival]) -> int:
    """Steps a fully serial pool would need: each step advances at least one request."""
    work = sum(-(-a.num_prompt_tokens // config.prefill_chunk) + a.max_new_tokens for a in arrivals)
    return max((a.step for a in arrivals), default=0) + work + 2


def simulate(config: PlannerConfig, arrivals: list[Arrival], *checks: Check) -> Trace:
    """Run the pool until every request has finished, calling `checks` on every plan."""
    state = PoolState(config)
    pending = sorted(enumerate(arrivals), key=lambda item: (item[1].step, item[0]))
    ends: dict[str, int] = {}  # planned-token count at which each request is finished
    trace = Trace(admitted=[], finished={}, num_steps=0)
    bound = step_bound(config, arrivals)
    while pending or state.waiting or state.running:
        assert trace.num_steps < bound, f"starvation: {len(trace.finished)}/{len(arrivals)} done"
        while pending and pending[0][1].step <= trace.num_steps:
            index, a = pending.pop(0)
            request_id = f"r{index}"
            seq = Sequence(request_id, a.num_prompt_tokens, a.max_new_tokens, len(ends), a.priority)
            state.waiting.append(seq)
            ends[request_id] = a.max_new_tokens if a.stop_at is None else a.stop_at
        before = {
            s.request_id: (s.num_prefilled, s.num_planned_tokens)
            for s in [*state.waiting, *state.running.values()]
        }
        plan = plan_step(state)
        for check in checks:
            check(state, plan, before)
        trace.admitted += plan.admitted
        for seq in list(state.running.values()):
            if seq.num_planned_tokens >= min(seq.max_new_tokens, ends[seq.request_id]):
                finish(state, seq.request_id)
                trace.finished[seq.request_id] = seq
        trace.num_steps += 1
    return trace


def check_capacity_and_chunks(state: PoolState, plan: StepPlan, before: Before) -> None:
    """Launch sizes, chunk contiguity, one appearance per request, and KV slot bookkeeping."""
    config = state.config
    seen: list[str] = []
    for launch in plan.decode_launches:
        for rank, rows in launch.items():
            assert len(rows) <= config.decode_batch
            for seq in rows:
                prefilled, planned = before[seq.request_id]
                assert seq.rank == rank
                assert prefilled >= seq.num_prompt_tokens, "decoded before fully prefilled"
                assert planned < seq.max_new_tokens and seq.num_planned_tokens == planned + 1
            seen += ids(rows)
    for rank, chunks in plan.prefill.items():
        assert len(chunks) <= config.prefill_slots
        for work in chunks:
            if config.lockstep and work == DUMMY:
                continue
            seq = state.running[work.request_id]
            assert (seq.rank, seq.slot) == (rank, work.slot)
            assert 1 <= work.num_tokens <= config.prefill_chunk
            assert work.start == before[work.request_id][0]
            assert seq.num_prefilled == work.start + work.num_tokens <= seq.num_prompt_tokens
            seen.append(work.request_id)
    assert len(seen) == len(set(seen)), "a request planned twice in one step"
    assert len(state.running) <= config.max_num_seqs
    assert all(s.num_planned_tokens <= s.max_new_tokens for s in state.running.values())
    held = [(s.rank, s.slot) for s in state.running.values()]
    assert len(set(held)) == len(held), "two running requests share a KV slot"
    for rank, free in enumerate(state.free_slots):  # held and free partition every rank's slots
        slots = [slot for r, slot in held if r == rank]
        assert len(slots) <= config.kv_slots_per_rank
        assert sorted(slots + free) == list(range(config.kv_slots_per_rank))


def check_launch_shape(state: PoolState, plan: StepPlan, before: Before) -> None:
    """max over ranks of ceil(rows / decode_batch) launches; lockstep pads, otherwise no padding."""

    def decodes(seq: Sequence) -> bool:
        prefilled, planned = before[seq.request_id]
        return prefilled >= seq.num_prompt_tokens and planned < seq.max_new_tokens

    per_rank = [
        sum(1 for s in state.running.values() if s.rank == r and decodes(s))
        for r in range(state.config.num_ranks)
    ]
    assert len(plan.decode_launches) == max(-(-n // state.config.decode_batch) for n in per_rank)
    if state.config.lockstep:
        ranks = set(range(state.config.num_ranks))
        assert all(set(launch) == ranks for launch in plan.decode_launches)
        assert not plan.prefill or (
            set(plan.prefill) == ranks and len({len(c) for c in plan.prefill.values()}) == 1
        )
    else:
        assert all(all(launch.values()) for launch in plan.decode_launches)
        assert all(DUMMY not in chunks and chunks for chunks in plan.prefill.values())


def check_admission_order(state: PoolState, plan: StepPlan, before: Before) -> None:
    """Whatever still waits ranks after every request admitted this step."""
    for seq in plan.admitted:
        assert all((-w.priority, w.order) > (-seq.priority, seq.order) for w in state.waiting), (
            "a request was admitted ahead of an older one of equal or higher priority"
        )


@settings(max_examples=200, deadline=None)
@given(config=configs, arrivals=workloads)
def test_every_plan_respects_capacity_chunking_and_launch_shape(
    config: PlannerConfig, arrivals: list[Arrival]
) -> None:
    simulate(config, arrivals, check_capacity_and_chunks, check_launch_shape)


@settings(max_examples=200, deadline=None)
@given(config=configs, arrivals=workloads)
def test_every_request_finishes_within_a_bounded_number_of_steps(
    config: PlannerConfig, arrivals: list[Arrival]
) -> None:
    trace = simulate(config, arrivals)
    assert sorted(trace.finished) == sorted(f"r{i}" for i in range(len(arrivals)))
    for i, a in enumerate(arrivals):
        seq = trace.finished[f"r{i}"]
        if a.stop_at is None or a.stop_at >= a.max_new_tokens:  # ran to its limit, not to EOS
            assert seq.num_prefilled == a.num_prompt_tokens
            assert seq.num_planned_tokens == a.max_new_tokens


@settings(max_examples=200, deadline=None)
@given(config=configs, arrivals=workloads)
def test_admission_follows_priority_then_arrival_order(
    config: PlannerConfig, arrivals: list[Arrival]
) -> None:
    trace = simulate(config, arrivals, check_admission_order)
    for priority in range(3):
        orders = [s.order for s in trace.admitted if s.priority == priority]
        assert orders == sorted(orders)
