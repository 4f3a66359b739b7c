"""The planner's other half (docs/architecture.md §3): what a rank's step result does to the
pool state. Exact unit cases without Redis or a model, then a simulation of ranks that
report every step's outcomes, lose requests and send stale reports."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batcher.outcomes import Applied, apply_result
from batcher.scheduler import PlannerConfig, PoolState, Sequence, plan_step, stop
from schemas.control import PREEMPTED, RequestOutcome, StepResult
from tests.test_scheduler import make_state, place, submit
from tests.test_scheduler_properties import Arrival, configs, step_bound, urgency_of, workloads

pytestmark = pytest.mark.fast


def result(rank: int, *outcomes: RequestOutcome) -> StepResult:
    """Rank `rank`'s report of one step."""
    return StepResult(epoch=1, step=7, rank=rank, outcomes=list(outcomes))


def two_rank_pool() -> PoolState:
    """Rank 0 runs a0 (slot 0) and a1 (slot 2), rank 1 runs b0 (slot 1); all in admission 1."""
    state = make_state(num_ranks=2, kv_slots_per_rank=4)
    for name, rank, slot in [("a0", 0, 0), ("a1", 0, 2), ("b0", 1, 1)]:
        place(state, name, rank, slot).admission = 1
    return state


def test_tokens_are_counted_per_request_and_nothing_else_changes() -> None:
    state = two_rank_pool()
    outcomes = [RequestOutcome("a0", 1, 2), RequestOutcome("a1", 1, 1), RequestOutcome("a0", 1, 1)]
    applied = apply_result(state, result(0, *outcomes))
    assert applied == Applied(num_new_tokens={"a0": 3, "a1": 1})
    assert sorted(state.running) == ["a0", "a1", "b0"]
    assert state.free_slots == [[1, 3], [0, 2, 3]]


def test_outcomes_of_another_rank_an_earlier_admission_or_an_unknown_request_are_ignored() -> None:
    state = two_rank_pool()
    stale = [
        RequestOutcome("b0", 1, 3, "stop"),  # b0 runs on rank 1
        RequestOutcome("a0", 0, 4, "length"),  # a0 re-entered the queue since
        RequestOutcome("a1", 2, 1, lost=True),  # not an admission a1 has had
        RequestOutcome("zz", 1, 5, "stop"),  # not in the pool
    ]
    assert apply_result(state, result(0, *stale)) == Applied()
    assert sorted(state.running) == ["a0", "a1", "b0"]
    assert state.free_slots == [[1, 3], [0, 2, 3]]


def test_a_lost_request_leaves_the_pool_and_a_late_outcome_of_it_is_ignored() -> None:
    state = two_rank_pool()
    applied = apply_result(state, result(0, RequestOutcome("a1", 1, 0, lost=True)))
    assert applied == Applied(lost=["a1"])
    assert (sorted(state.running), state.free_slots) == (["a0", "b0"], [[1, 2, 3], [0, 2, 3]])
    # the book re-queues it, one admission on; it lands on rank 0's slot 1 this time
    state.waiting.append(Sequence("a1", 10, 16, order=5, admission=2))
    assert [(s.rank, s.slot) for s in plan_step(state).admitted] == [(0, 1)]
    late = apply_result(state, result(0, RequestOutcome("a1", 1, 2, "stop")))
    assert late == Applied() and state.running["a1"].admission == 2
    assert state.free_slots == [[2, 3], [0, 2, 3]]


def test_a_released_request_counts_a_preemption_only_if_it_was_preempted() -> None:
    state = make_state(kv_slots_per_rank=2, max_num_seqs=2, preempt_margin=1.0)
    submit(state, 10, 10, urgency=0.0)
    plan_step(state)
    submit(state, 10, first=2, urgency=5.0)
    assert [s.request_id for s in plan_step(state).preempted] == ["r1"]
    released = [
        RequestOutcome("r1", 0, 0, released=True),
        RequestOutcome("r0", 0, 0, released=True),
    ]
    applied = apply_result(state, result(0, *released))
    assert applied == Applied(released=["r1", "r0"], num_preempted=1)
    assert (state.running, state.free_slots, state.stops) == ({}, [[0, 1]], [])


def test_finished_requests_are_reported_with_their_last_tokens_and_free_their_slots() -> None:
    state = two_rank_pool()
    stop(state, "a0", "cancelled")  # planned, but the rank finished it first
    outcomes = [RequestOutcome("a0", 1, 1, "length"), RequestOutcome("a1", 1, 2)]
    applied = apply_result(state, result(0, *outcomes))
    assert applied == Applied(num_new_tokens={"a0": 1, "a1": 2}, finished=["a0"])
    assert (sorted(state.running), state.free_slots) == (["a1", "b0"], [[0, 1, 3], [0, 2, 3]])
    assert state.stops == []
    second = apply_result(state, result(1, RequestOutcome("b0", 1, 0, "stop")))
    assert second == Applied(finished=["b0"])
    assert (sorted(state.running), state.free_slots) == (["a1"], [[0, 1, 3], [0, 1, 2, 3]])


@dataclass
class Ranks:
    """Simulated ranks: each step they report the planned tokens of their requests, finish
    those at their end, give back preempted ones, lose one request where told, and send
    stale outcomes (of an earlier admission, from the wrong rank) that must not count."""

    ends: dict[str, int]  # completion tokens at which each request finishes
    done: dict[str, int] = field(default_factory=dict)  # tokens of its earlier admissions
    published: dict[str, int] = field(default_factory=dict)  # tokens of its current one
    finished: set[str] = field(default_factory=set)

    def report(
        self, state: PoolState, planned: dict[str, int], preempted: set[str], lose: bool
    ) -> list[tuple[StepResult, Applied]]:
        """Every live rank's result of the step just planned, with what applying it must do
        (`planned`: each running request's planned tokens before the step)."""
        results = {r: (result(r), Applied()) for r in sorted(state.ranks)}
        running = sorted(state.running.values(), key=lambda s: s.order)
        lost = next((s for s in running if not s.stopping), None) if lose else None
        for seq in running:
            request_id, admission = seq.request_id, seq.admission
            outcomes, expected = results[seq.rank][0].outcomes, results[seq.rank][1]
            n = seq.num_planned_tokens - planned.get(request_id, 0)
            produced = self.done[request_id] + seq.num_planned_tokens
            if seq is lost:
                outcomes.append(RequestOutcome(request_id, admission, 0, lost=True))
                expected.lost.append(request_id)
                n = 0  # its rank lost this step's tokens with it
            elif request_id in preempted:
                outcomes.append(RequestOutcome(request_id, admission, 0, released=True))
                expected.released.append(request_id)
                expected.num_preempted += 1
            elif seq.num_planned_tokens >= seq.max_new_tokens or produced >= self.ends[request_id]:
                outcomes.append(RequestOutcome(request_id, admission, n, "length"))
                expected.finished.append(request_id)
            elif n:
                outcomes.append(RequestOutcome(request_id, admission, n))
            if n:
                expected.num_new_tokens[request_id] = n
                self.published[request_id] = self.published.get(request_id, 0) + n
            outcomes.append(RequestOutcome(request_id, admission - 1, 3, "stop"))
            if len(results) > 1:
                other = results[(seq.rank + 1) % len(results)][0]
                other.outcomes.append(RequestOutcome(request_id, admission, 3, "stop"))
        return list(results.values())

    def resume(self, state: PoolState, seq: Sequence) -> None:
        """A lost or given-back request re-enters after what it published, as the book does."""
        published = self.published.pop(seq.request_id, 0)
        self.done[seq.request_id] += published
        state.waiting.append(
            Sequence(
                seq.request_id,
                seq.num_prompt_tokens + published,
                seq.max_new_tokens - published,
                seq.order,
                seq.urgency,
                seq.priority,
                admission=seq.admission + 1,
            )
        )


def check_slots(state: PoolState) -> None:
    """On every live rank the free slots and the running requests' slots partition its slots."""
    config = state.config
    for rank in state.ranks:
        held = [s.slot for s in state.running.values() if s.rank == rank]
        assert sorted(held + state.free_slots[rank]) == list(range(config.kv_slots_per_rank))
    assert len(state.running) <= config.max_num_seqs


@settings(max_examples=150, deadline=None)
@given(
    config=configs,
    arrivals=workloads,
    losses=st.lists(st.integers(0, 30), max_size=3, unique=True),
)
def test_planning_then_applying_results_keeps_every_slot_free_or_held_and_finishes_all(
    config: PlannerConfig, arrivals: list[Arrival], losses: list[int]
) -> None:
    state = PoolState(config)
    ranks = Ranks(ends={})
    pending = sorted(enumerate(arrivals), key=lambda item: (item[1].step, item[0]))
    bound = step_bound(config, arrivals) * (2 + len(losses))
    for step in range(bound):
        if not (pending or state.waiting or state.running):
            break
        while pending and pending[0][1].step <= step:
            index, a = pending.pop(0)
            request_id = f"r{index}"
            urgency = urgency_of(a.priority, a.step)
            state.waiting.append(
                Sequence(
                    request_id,
                    a.num_prompt_tokens,
                    a.max_new_tokens,
                    index,
                    urgency,
                    a.priority,
                    admission=1,
                )
            )
            ranks.ends[request_id] = a.max_new_tokens if a.stop_at is None else a.stop_at
            ranks.done[request_id] = 0
        planned = {s.request_id: s.num_planned_tokens for s in state.running.values()}
        plan = plan_step(state)
        preempted = {s.seq.request_id for s in plan.stops if s.reason == PREEMPTED}
        check_slots(state)
        seqs = dict(state.running)
        for rank_result, expected in ranks.report(state, planned, preempted, step in losses):
            applied = apply_result(state, rank_result)
            assert applied == expected
            check_slots(state)
            ranks.finished.update(applied.finished)
            for request_id in applied.lost + applied.released:
                ranks.resume(state, seqs[request_id])
    assert ranks.finished == {f"r{i}" for i in range(len(arrivals))}
