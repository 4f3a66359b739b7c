"""The step planner in hypothesis-driven pool simulations: every plan respects capacity,
chunking and launch shape; every request finishes, however many more urgent ones keep
arriving; admission follows effective priority, FIFO among equals; preempted requests
resume where they were."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batcher.scheduler import (
    PlannerConfig,
    PoolState,
    Sequence,
    StepPlan,
    finish,
    join_rank,
    plan_step,
)
from tests.test_scheduler import DUMMY, ids

pytestmark = pytest.mark.fast


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
    num_preempted: int = 0


AGING_STEPS = 4  # steps of waiting that raise a simulated request's priority by one


def urgency_of(priority: int, step: int) -> float:
    """The planner's order key for a request of `priority` arriving at `step`."""
    return priority - step / AGING_STEPS


Before = dict[str, tuple[int, int]]  # request_id -> (num_prefilled, num_planned_tokens) pre-plan
Check = Callable[[PoolState, StepPlan, Before], None]

configs = st.builds(
    PlannerConfig,
    preempt_margin=st.none() | st.floats(0.0, 4.0),
    pack_prefill=st.booleans(),
    prefill_segments=st.integers(1, 6),
    num_ranks=st.integers(1, 8),
    max_num_seqs=st.integers(1, 64),
    kv_slots_per_rank=st.integers(1, 16),
    decode_batch=st.integers(1, 8),
    prefill_chunk=st.integers(1, 256),
    prefill_slots=st.integers(1, 4),
    lockstep=st.booleans(),
    decode_stall_steps=st.integers(0, 3),
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


def simulate(
    config: PlannerConfig,
    arrivals: list[Arrival],
    *checks: Check,
    max_steps: int | None = None,
    blocks: int = 0,
) -> Trace:
    """Run the pool until every request has finished (or `max_steps`), calling `checks` on
    every plan. A preempted request gives its slot back at the next step and re-enters with
    its prompt plus what it generated, as the batcher resumes it. With `blocks`, a cache of
    that many blocks a rank."""
    state = PoolState(config)
    for rank in range(config.num_ranks) if blocks else ():
        join_rank(state, rank, blocks)
    pending = sorted(enumerate(arrivals), key=lambda item: (item[1].step, item[0]))
    ends: dict[str, int] = {}  # completion tokens at which each request is finished
    done: dict[str, int] = {}  # completion tokens produced before the current admission
    releasing: list[Sequence] = []
    trace = Trace(admitted=[], finished={}, num_steps=0)
    bound = step_bound(config, arrivals) if max_steps is None else max_steps
    while pending or state.waiting or state.running:
        if trace.num_steps >= bound:
            assert max_steps is not None, f"starvation: {len(trace.finished)}/{len(arrivals)}"
            break
        for seq in releasing:
            finish(state, seq.request_id)
            done[seq.request_id] += seq.num_planned_tokens
            state.waiting.append(resumed(seq))
        releasing = []
        while pending and pending[0][1].step <= trace.num_steps:
            index, a = pending.pop(0)
            request_id = f"r{index}"
            urgency = urgency_of(a.priority, a.step)
            seq = Sequence(
                request_id, a.num_prompt_tokens, a.max_new_tokens, len(ends), urgency, a.priority
            )
            state.waiting.append(seq)
            ends[request_id] = a.max_new_tokens if a.stop_at is None else a.stop_at
            done[request_id] = 0
        before = {
            s.request_id: (s.num_prefilled, s.num_planned_tokens)
            for s in [*state.waiting, *state.running.values()]
        }
        plan = plan_step(state)
        assert state.leaving == sum(s.stopping for s in state.running.values())
        assert sum(state.occupancy.values()) == len(state.running) - state.leaving
        for check in checks:
            check(state, plan, before)
        trace.admitted += plan.admitted
        releasing += plan.preempted
        trace.num_preempted += len(plan.preempted)
        for seq in list(state.running.values()):
            produced = done[seq.request_id] + seq.num_planned_tokens
            if seq.preempting:
                continue
            if seq.num_planned_tokens >= seq.max_new_tokens or produced >= ends[seq.request_id]:
                finish(state, seq.request_id)
                trace.finished[seq.request_id] = seq
        trace.num_steps += 1
    return trace


def resumed(seq: Sequence) -> Sequence:
    """A preempted request as it re-enters: its generated tokens join its prompt."""
    return Sequence(
        seq.request_id,
        seq.num_prompt_tokens + seq.num_planned_tokens,
        seq.max_new_tokens - seq.num_planned_tokens,
        seq.order,
        seq.urgency,
        seq.priority,
    )


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
    per_launch = config.prefill_segments if config.pack_prefill else 1
    for rank, launches in plan.prefill.items():
        assert len(launches) <= config.prefill_slots
        ends: dict[str, int] = {}
        for i, launch in enumerate(launches):
            if config.lockstep and launch == DUMMY:
                continue
            assert 1 <= len(launch) <= per_launch
            assert sum(w.num_tokens for w in launch) <= config.prefill_chunk
            last = i == len(launches) - 1 or launches[i + 1] == DUMMY
            if config.pack_prefill and not last:  # packed: only a rank's last launch has room
                full = sum(w.num_tokens for w in launch) == config.prefill_chunk
                assert full or len(launch) == per_launch
            for work in launch:  # a request's segments continue each other, launch by launch
                seq = state.running[work.request_id]
                assert (seq.rank, seq.slot) == (rank, work.slot)
                assert work.num_tokens >= 1
                assert work.start == ends.get(work.request_id, before[work.request_id][0])
                ends[work.request_id] = work.start + work.num_tokens
        for request_id, end in ends.items():
            assert state.running[request_id].num_prefilled == end
        seen += list(ends)
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
    """max over decoding ranks of ceil(rows / decode_batch) launches; a rank decodes all its
    rows or, while its prefill backlog fills every prefill launch, none; lockstep pads,
    otherwise no padding."""

    def decodes(seq: Sequence) -> bool:  # a preempted request (stopping) decodes no more
        prefilled, planned = before[seq.request_id]
        was_decoding = prefilled >= seq.num_prompt_tokens and planned < seq.max_new_tokens
        return was_decoding and not seq.stopping

    config = state.config
    planned = {r: 0 for r in range(config.num_ranks)}
    for launch in plan.decode_launches:
        for rank, rows in launch.items():
            planned[rank] += len(rows)
    for rank in range(config.num_ranks):
        wanted = sum(1 for s in state.running.values() if s.rank == rank and decodes(s))
        assert planned[rank] in (0, wanted)
        if wanted and not planned[rank]:  # its decode waits: every prefill launch is used
            assert config.decode_stall_steps > 0
            assert state.room() > 0 and not state.waiting, "a full pool's decode waited"
            assert len(plan.prefill[rank]) == config.prefill_slots
            assert all(plan.prefill[rank]), "a waiting rank's prefill launch is a dummy"
            rows = [s.priority for s in state.running.values() if s.rank == rank and decodes(s)]
            prompts = [
                s.priority
                for s in state.running.values()
                if s.rank == rank and before[s.request_id][0] < s.num_prompt_tokens
            ]
            assert max(rows) <= max(prompts), "a lower class's burst held back a higher's decode"
    launches = max(-(-n // config.decode_batch) for n in planned.values())
    assert len(plan.decode_launches) == launches
    if config.lockstep:
        ranks = set(range(config.num_ranks))
        assert all(set(launch) == ranks for launch in plan.decode_launches)
        assert not plan.prefill or (
            set(plan.prefill) == ranks and len({len(c) for c in plan.prefill.values()}) == 1
        )
    else:
        assert all(all(launch.values()) for launch in plan.decode_launches)
        assert all(DUMMY not in launches and launches for launches in plan.prefill.values())


class StallBound:
    """A rank's decoding rows wait at most `decode_stall_steps` steps in a row."""

    def __init__(self) -> None:
        self.waited: dict[int, int] = {}

    def __call__(self, state: PoolState, plan: StepPlan, before: Before) -> None:
        decoding = {
            rank for launch in plan.decode_launches for rank, rows in launch.items() if rows
        }
        for rank in range(state.config.num_ranks):
            wants = any(
                s.rank == rank
                and before[s.request_id][0] >= s.num_prompt_tokens
                and before[s.request_id][1] < s.max_new_tokens
                and not s.stopping
                for s in state.running.values()
            )
            self.waited[rank] = (
                self.waited.get(rank, 0) + 1 if wants and rank not in decoding else 0
            )
            assert self.waited[rank] <= state.config.decode_stall_steps


def check_admission_order(state: PoolState, plan: StepPlan, before: Before) -> None:
    """Whatever still waits ranks after every request admitted this step."""
    for seq in plan.admitted:
        assert all((-w.urgency, w.order) > (-seq.urgency, seq.order) for w in state.waiting), (
            "a request was admitted ahead of an older one of equal or higher priority"
        )


@settings(max_examples=200, deadline=None)
@given(config=configs, arrivals=workloads)
def test_every_plan_respects_capacity_chunking_and_launch_shape(
    config: PlannerConfig, arrivals: list[Arrival]
) -> None:
    simulate(config, arrivals, check_capacity_and_chunks, check_launch_shape, StallBound())


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
            # with every resumption, prompt + planned tokens add up to the whole request
            assert seq.num_prefilled == seq.num_prompt_tokens
            assert seq.num_prompt_tokens + seq.num_planned_tokens == (
                a.num_prompt_tokens + a.max_new_tokens
            )


@settings(max_examples=200, deadline=None)
@given(config=configs, arrivals=workloads)
def test_admission_follows_priority_then_arrival_order(
    config: PlannerConfig, arrivals: list[Arrival]
) -> None:
    trace = simulate(config, arrivals, check_admission_order)
    first = {}
    for seq in trace.admitted:
        first.setdefault(seq.request_id, seq)
    for priority in range(3):  # FIFO within a priority: equal aging keeps their order
        orders = [
            s.order for s in first.values() if arrivals[int(s.request_id[1:])].priority == priority
        ]
        assert orders == sorted(orders)


@settings(max_examples=100, deadline=None)
@given(
    priority=st.integers(-9, 8),
    gap=st.integers(1, 3),
    margin=st.none() | st.floats(0.0, 6.0),
    victim_tokens=st.integers(1, 12),
    arrival_tokens=st.integers(1, 6),
)
def test_a_request_finishes_within_its_bound_however_many_more_urgent_ones_arrive(
    priority: int, gap: int, margin: float | None, victim_tokens: int, arrival_tokens: int
) -> None:
    config = PlannerConfig(1, 1, 1, 1, 128, 1, preempt_margin=margin)
    victim = Arrival(0, 8, victim_tokens, priority, None)
    window = (9 - priority) * AGING_STEPS  # after this, a fresh priority-9 arrival ranks lower
    service = 2 + arrival_tokens + 1  # prefill (resumed ones too) + decode + slack, one slot
    ahead = window // gap + 2  # arrivals that can rank above the victim or preempt it
    bound = window + (ahead + 1) * (service + 2 * victim_tokens)
    flood = [Arrival(step, 4, arrival_tokens, 9, None) for step in range(1, bound, gap)]
    trace = simulate(config, [victim, *flood], max_steps=bound)
    assert "r0" in trace.finished, f"priority {priority} starved for {bound} steps"
    assert trace.finished["r0"].num_prompt_tokens + trace.finished["r0"].num_planned_tokens == (
        8 + victim_tokens
    )


def check_blocks(state: PoolState, plan: StepPlan, before: Before) -> None:
    """A cache of blocks: held and free partition every rank's blocks, the running requests
    hold exactly the held ones (shared ones once each), each holds its whole prompt's, and
    every decode row the block of each position it feeds."""
    config = state.config
    for rank, pool in state.pools.items():
        assert not set(pool.held) & set(pool.free)
        assert all(block < pool.fresh for block in [*pool.held, *pool.free])
        assert len(pool.held) + pool.num_free == pool.total
        holding: dict[int, int] = {}
        for seq in state.running.values():
            if seq.rank == rank:
                assert len(set(seq.blocks)) == len(seq.blocks)
                for block in seq.blocks:
                    holding[block] = holding.get(block, 0) + 1
        assert holding == pool.held
    for seq in state.running.values():
        if not seq.stopping:
            assert len(seq.blocks) >= state.blocks_needed(seq, seq.num_prompt_tokens)
    for launch in plan.decode_launches:
        for rows in launch.values():
            for seq in rows:
                # the token it feeds (planned before this step) lies one past the prompt's
                # end for the first, and so on
                fed = seq.num_prompt_tokens + seq.num_planned_tokens - 2
                assert len(seq.blocks) * config.block_size > min(fed, config.max_kv_len - 1)


paged_configs = st.builds(
    PlannerConfig,
    preempt_margin=st.none() | st.floats(0.0, 4.0),
    pack_prefill=st.just(True),
    prefill_segments=st.integers(1, 6),
    num_ranks=st.integers(1, 3),
    max_num_seqs=st.integers(1, 64),
    kv_slots_per_rank=st.integers(1, 16),
    decode_batch=st.integers(1, 8),
    prefill_chunk=st.sampled_from([32, 64, 128]),
    prefill_slots=st.integers(1, 4),
    decode_stall_steps=st.integers(0, 3),
    paged=st.just(True),
    block_size=st.sampled_from([16, 32]),
    max_kv_len=st.just(704),
)


@settings(max_examples=150, deadline=None)
@given(config=paged_configs, arrivals=workloads, spare=st.integers(0, 60))
def test_a_cache_of_blocks_never_holds_a_block_twice_and_every_request_finishes(
    config: PlannerConfig, arrivals: list[Arrival], spare: int
) -> None:
    """Blocks for the largest request alone (its 640 tokens, the watermark) and `spare` more:
    requests outgrow the pool, are preempted and resume, and all finish."""
    blocks = -(-640 // config.block_size) + 2 + spare
    trace = simulate(
        config,
        arrivals,
        check_blocks,
        check_capacity_and_chunks,
        max_steps=20 * step_bound(config, arrivals),
        blocks=blocks,
    )
    assert sorted(trace.finished) == sorted(f"r{i}" for i in range(len(arrivals)))
