"""The step planner (docs/architecture.md §3): exact unit cases (the simulations are in
test_scheduler_properties)."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest

from batcher.scheduler import (
    PlannerConfig,
    PoolState,
    Sequence,
    StepPlan,
    finish,
    plan_step,
    preempt_threshold,
    stop,
)
from schemas.control import DECODE_ROW, PrefillChunk

pytestmark = pytest.mark.fast

DUMMY: list[PrefillChunk] = []  # a lockstep filler launch


def make_config(**overrides: float | bool | None) -> PlannerConfig:
    """A one-rank pool with room to spare, unless told otherwise."""
    values: dict[str, float | bool | None] = dict(
        num_ranks=1,
        max_num_seqs=64,
        kv_slots_per_rank=8,
        decode_batch=8,
        prefill_chunk=128,
        prefill_slots=4,
    )
    return PlannerConfig(**{**values, **overrides})  # type: ignore[arg-type]


def make_state(**overrides: float | bool | None) -> PoolState:
    return PoolState(make_config(**overrides))


def submit(
    state: PoolState,
    *prompt_lens: int,
    first: int = 0,
    max_new_tokens: int = 16,
    urgency: float = 0.0,
) -> list[Sequence]:
    """Queue one request per prompt length, named r<order> with order counting from `first`."""
    seqs = [
        Sequence(f"r{first + i}", n, max_new_tokens, order=first + i, urgency=urgency)
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
    state.add_running(seq)
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


def test_more_urgent_is_admitted_first_then_arrival_order() -> None:
    state = make_state(kv_slots_per_rank=2)
    arrivals = [("a", 0), ("b", 2), ("c", 1), ("d", 2)]
    state.waiting = [Sequence(n, 10, 4, order, p) for order, (n, p) in enumerate(arrivals)]
    assert ids(plan_step(state).admitted) == ["b", "d"]
    assert ids(state.waiting) == ["c", "a"]
    finish(state, "d")
    assert ids(plan_step(state).admitted) == ["c"]


def test_a_much_more_urgent_arrival_preempts_the_least_urgent_running_request() -> None:
    state = make_state(max_num_seqs=2, preempt_margin=3.0)
    submit(state, 10, urgency=1.0)
    submit(state, 10, first=1, urgency=0.5)
    plan_step(state)
    (late,) = submit(state, 10, first=2, urgency=3.6)
    plan = plan_step(state)
    assert (ids(plan.admitted), ids(plan.preempted)) == ([], ["r1"])
    assert state.running["r1"].stopping and state.running["r1"].preempting
    assert launch_ids(plan) == [{0: ["r0"]}]  # the preempted request gets no more work
    assert ids(plan_step(state).preempted) == []  # one preemption per waiting request
    finish(state, "r1")  # its rank gave the slot back
    assert ids(plan_step(state).admitted) == ["r2"] and late.slot == 1


def test_no_preemption_within_the_margin_or_when_disabled() -> None:
    for margin, urgency in ((3.0, 3.5), (None, 100.0)):
        state = make_state(max_num_seqs=1, preempt_margin=margin)
        submit(state, 10, urgency=0.5)
        plan_step(state)
        submit(state, 10, first=1, urgency=urgency)
        plan = plan_step(state)
        assert (plan.admitted, plan.preempted) == ([], [])


def full_pool(margin: float | None = 3.0) -> PoolState:
    """Two running requests (r0 at urgency 1.0, r1 at 0.5) and no room for a third."""
    state = make_state(max_num_seqs=2, preempt_margin=margin)
    submit(state, 10, urgency=1.0)
    submit(state, 10, first=1, urgency=0.5)
    plan_step(state)
    return state


def test_a_queued_request_preempts_exactly_when_it_is_over_the_preempt_threshold() -> None:
    assert preempt_threshold(full_pool()) == 3.5  # the least urgent running, plus the margin
    for urgency, preempted in [(3.5, []), (math.nextafter(3.5, math.inf), ["r1"])]:
        state = full_pool()
        submit(state, 10, first=2, urgency=urgency)
        assert ids(plan_step(state).preempted) == preempted


def test_no_preempt_threshold_with_room_something_waiting_no_victim_or_no_margin() -> None:
    roomy = make_state(max_num_seqs=3, preempt_margin=3.0)
    submit(roomy, 10, 10)
    plan_step(roomy)
    waiting = full_pool()
    submit(waiting, 10, first=2)
    stopping = full_pool()
    for request_id in ("r0", "r1"):
        stop(stopping, request_id, "cancelled")
    for state in (roomy, waiting, stopping, full_pool(margin=None)):
        assert preempt_threshold(state) is None
    one_left = full_pool()
    stop(one_left, "r1", "cancelled")
    assert preempt_threshold(one_left) == 4.0


def test_an_isolated_request_waits_for_an_empty_rank_and_then_runs_alone() -> None:
    state = make_state(num_ranks=2, kv_slots_per_rank=2)
    submit(state, 10, 10, 10)  # ranks 0 and 1 busy (two on rank 0)
    plan_step(state)
    (suspect,) = submit(state, 10, first=3)
    suspect.isolated = True
    submit(state, 10, first=4)
    assert plan_step(state).admitted == []  # no empty rank: it waits, and the queue with it
    finish(state, "r1")  # rank 1 empties
    assert ids(plan_step(state).admitted) == ["r3"] and suspect.rank == 1
    assert ids(plan_step(state).admitted) == []  # rank 1 is its own; rank 0 is full
    finish(state, "r0")
    assert [(s.request_id, s.rank) for s in plan_step(state).admitted] == [("r4", 0)]


def test_prefill_chunks_go_to_the_most_urgent_request_first() -> None:
    state = make_state(prefill_slots=1)
    submit(state, 300)
    submit(state, 300, first=1, urgency=2.0)
    assert [[w.request_id for w in launch] for launch in plan_step(state).prefill[0]] == [["r1"]]


def test_packed_prefill_fills_each_launch_with_the_next_prompts_back_to_back() -> None:
    state = make_state(pack_prefill=True, prefill_slots=2, prefill_segments=3)
    submit(state, 200, 40, 30, 20, 10)
    plan = plan_step(state)
    assert plan.prefill[0] == [
        [PrefillChunk(0, 0, 128, "r0")],
        [
            PrefillChunk(0, 128, 72, "r0"),
            PrefillChunk(1, 0, 40, "r1"),
            PrefillChunk(2, 0, 16, "r2"),
        ],
    ]
    assert [w for launch in plan_step(state).prefill[0] for w in launch] == [
        PrefillChunk(2, 16, 14, "r2"),
        PrefillChunk(3, 0, 20, "r3"),
        PrefillChunk(4, 0, 10, "r4"),
    ]
    assert all(s.is_prefilled and s.num_planned_tokens >= 1 for s in state.running.values())


def test_request_completing_its_prompt_does_not_decode_in_the_same_step() -> None:
    state = make_state()
    (seq,) = submit(state, 100)
    first = plan_step(state)
    assert (first.decode_launches, first.prefill) == ([], {0: [[PrefillChunk(0, 0, 100, "r0")]]})
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
        (launch,) = plan.prefill[0]
        chunks += launch
    assert chunks == [
        PrefillChunk(0, 0, 128, "r0"),
        PrefillChunk(0, 128, 128, "r0"),
        PrefillChunk(0, 256, 44, "r0"),
    ]
    assert (seq.num_prefilled, seq.num_planned_tokens) == (300, 1)


def test_prefill_takes_at_most_prefill_slots_chunks_per_rank_oldest_first() -> None:
    state = make_state(prefill_slots=2)
    for slot, order in [(0, 3), (1, 2), (2, 0), (3, 1)]:
        place(state, f"o{order}", rank=0, slot=slot, prefilled=False, order=order)
    first = plan_step(state)
    assert first.prefill == {0: [[PrefillChunk(2, 0, 10, "o0")], [PrefillChunk(3, 0, 10, "o1")]]}
    plan = plan_step(state)
    assert launch_ids(plan) == [{0: ["o0", "o1"]}]
    assert plan.prefill == {0: [[PrefillChunk(1, 0, 10, "o2")], [PrefillChunk(0, 0, 10, "o3")]]}


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


PREFILL_P0 = [PrefillChunk(0, 0, 10, "p0")]
PREFILL_P1 = [PrefillChunk(1, 0, 10, "p1")]
PREFILL_P2 = [PrefillChunk(0, 0, 10, "p2")]


def test_without_lockstep_idle_ranks_get_no_launches() -> None:
    plan = plan_step(make_mixed_pool(lockstep=False))
    assert launch_ids(plan) == [{0: ["d0"]}, {0: ["d1"]}]
    assert plan.prefill == {1: [PREFILL_P0, PREFILL_P1], 2: [PREFILL_P2]}


def test_lockstep_pads_every_rank_to_the_same_number_of_launches() -> None:
    plan = plan_step(make_mixed_pool(lockstep=True))
    assert launch_ids(plan) == [{0: ["d0"], 1: [], 2: []}, {0: ["d1"], 1: [], 2: []}]
    assert plan.prefill == {0: [DUMMY, DUMMY], 1: [PREFILL_P0, PREFILL_P1], 2: [PREFILL_P2, DUMMY]}


@pytest.mark.parametrize(
    "name",
    [
        f.name
        for f in fields(PlannerConfig)
        if f.name
        not in (
            "lockstep",
            "preempt_margin",
            "pack_prefill",
            "mix_decode",
            "decode_stall_steps",
            "tenants",
            "prefix_caching",
            "mtp",
            "paged",
            "max_kv_len",
        )
    ],
)
@pytest.mark.parametrize("value", [0, -1])
def test_config_rejects_limits_below_one(name: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"{name} must be >= 1, got {value}"):
        make_config(**{name: value})


def test_config_of_blocks_needs_the_positions_a_request_may_reach() -> None:
    with pytest.raises(ValueError, match="max_kv_len 0 holds no block of 128"):
        make_config(paged=True)


def test_config_rejects_a_negative_decode_stall() -> None:
    with pytest.raises(ValueError, match="decode_stall_steps must be >= 0, got -1"):
        make_config(decode_stall_steps=-1)


def burst_pool(stall: int, prompts: int) -> tuple[PoolState, Sequence]:
    """One decoding row, then `prompts` 100-token prompts arriving at once (packed prefill,
    4 launches of 128 tokens a step)."""
    state = make_state(kv_slots_per_rank=64, pack_prefill=True, decode_stall_steps=stall)
    row = place(state, "d", rank=0, slot=63)
    submit(state, *[100] * prompts)
    return state, row


def test_decode_waits_at_most_the_stall_budget_while_a_prefill_backlog_drains() -> None:
    state, row = burst_pool(stall=2, prompts=20)  # 2000 tokens: 16 launches, four steps
    decoded, prefill_launches = [], []
    for _ in range(6):
        plan = plan_step(state)
        decoded.append(bool(plan.decode_launches))
        assert decoded[-1] == any(
            "d" in rows for launch in launch_ids(plan) for rows in launch.values()
        )
        prefill_launches.append(len(plan.prefill.get(0, [])))
    # backlog over one step at steps 1-3: wait, wait, decode; then 16 - 12 = 4 launches left
    assert decoded == [False, False, True, True, True, True]
    assert prefill_launches == [4, 4, 4, 4, 0, 0]
    assert row.num_planned_tokens == 4


def test_decode_runs_every_step_with_no_stall_budget_or_no_backlog() -> None:
    for stall, prompts in [(0, 20), (4, 5)]:  # 5 prompts: 500 tokens fit one step
        state, _ = burst_pool(stall, prompts)
        plans = [plan_step(state) for _ in range(3)]
        for plan in plans:
            assert any("d" in rows for launch in launch_ids(plan) for rows in launch.values())


def test_a_full_pool_decodes_every_step_whatever_waits_to_be_prefilled() -> None:
    state = make_state(kv_slots_per_rank=21, pack_prefill=True, decode_stall_steps=1)
    place(state, "d", rank=0, slot=20)
    submit(state, *[100] * 20)  # 2000 tokens to prefill, and the pool now full
    plans = [plan_step(state) for _ in range(3)]
    assert state.room() == 0
    for plan in plans:
        assert any("d" in rows for launch in launch_ids(plan) for rows in launch.values())


def test_a_burst_of_a_lower_priority_class_never_holds_back_a_higher_ones_decode() -> None:
    state, row = burst_pool(stall=1, prompts=20)
    row.priority = 2
    plans = [plan_step(state) for _ in range(2)]
    assert all("d" in launch_ids(plan)[-1][0] for plan in plans)
    state, row = burst_pool(stall=1, prompts=20)
    for seq in state.waiting[:1]:
        seq.priority = 2  # one waiting prompt of the same class: the burst may stall it
    row.priority = 2
    plan = plan_step(state)
    assert plan.decode_launches == [] and len(plan.prefill[0]) == 4


def make_riding_pool(**overrides: float | bool | None) -> PoolState:
    """One packed rank: three decoding rows (micro-batches of two) and a 200-token prompt."""
    values: dict[str, float | bool | None] = dict(
        decode_batch=2, prefill_slots=2, pack_prefill=True, mix_decode=True
    )
    state = make_state(**{**values, **overrides})
    for slot, name in enumerate(["d0", "d1", "d2"]):
        place(state, name, rank=0, slot=slot)
    prompt = Sequence("p0", 200, 16, order=3, rank=0, slot=3)
    state.free_slots[0].remove(3)
    state.add_running(prompt)
    return state


def test_decode_micro_batches_ride_in_room_their_prefill_launches_keep() -> None:
    state = make_riding_pool()
    plan = plan_step(state)
    assert launch_ids(plan) == []  # both micro-batches rode: no decode launch
    assert plan.prefill == {
        0: [  # each launch keeps room for one micro-batch, the smallest first
            [PrefillChunk(3, 0, 127, "p0"), PrefillChunk(2, DECODE_ROW, 1, "d2")],
            [
                PrefillChunk(3, 127, 73, "p0"),
                PrefillChunk(0, DECODE_ROW, 1, "d0"),
                PrefillChunk(1, DECODE_ROW, 1, "d1"),
            ],
        ]
    }
    # every row is planned once, wherever it runs
    assert [state.running[n].num_planned_tokens for n in ("d0", "d1", "d2", "p0")] == [1, 1, 1, 1]


def test_micro_batches_beyond_the_prefill_launches_keep_their_decode_launches() -> None:
    state = make_riding_pool(prefill_slots=1)
    plan = plan_step(state)
    assert launch_ids(plan) == [{0: ["d0", "d1"]}]
    assert plan.prefill == {
        0: [[PrefillChunk(3, 0, 127, "p0"), PrefillChunk(2, DECODE_ROW, 1, "d2")]]
    }


def test_a_micro_batch_as_large_as_a_launch_never_rides() -> None:
    plan = plan_step(make_riding_pool(decode_batch=3, prefill_chunk=3))
    assert launch_ids(plan) == [{0: ["d0", "d1", "d2"]}]
    assert all(c.start != DECODE_ROW for launch in plan.prefill[0] for c in launch)


@pytest.mark.parametrize(
    "overrides", [{"mix_decode": False}, {"mtp": True}, {"lockstep": True}, {"pack_prefill": False}]
)
def test_rows_ride_only_where_the_pool_mixes(overrides: dict[str, bool]) -> None:
    plan = plan_step(make_riding_pool(**overrides))
    assert launch_ids(plan) == [{0: ["d0", "d1"]}, {0: ["d2"]}]
    assert all(c.start != DECODE_ROW for launch in plan.prefill[0] for c in launch)
