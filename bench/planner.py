"""How long one `plan_step` takes for a full pool: 64 running and 64 waiting requests over
8 ranks (the planner's budget is 200 µs per step). Pure Python, no Redis, no torch."""

from __future__ import annotations

import timeit

from batcher.scheduler import PlannerConfig, PoolState, Sequence, plan_step


def full_pool() -> PoolState:
    """64 admitted decoding requests, 64 more waiting, 8 ranks of 8 slots, B8 decode."""
    config = PlannerConfig(
        num_ranks=8,
        max_num_seqs=64,
        kv_slots_per_rank=8,
        decode_batch=8,
        prefill_chunk=128,
        prefill_slots=4,
    )
    state = PoolState(config)
    for i in range(64):
        state.waiting.append(Sequence(f"r{i}", 100, 10**9, i))
    plan_step(state)
    for seq in state.running.values():
        seq.num_prefilled = seq.num_prompt_tokens
    state.waiting = [Sequence(f"w{i}", 300, 64, 64 + i) for i in range(64)]
    return state


def microseconds_per_step(repeat: int = 2000) -> float:
    """Median-of-5 time of `plan_step` on the full pool, in microseconds."""
    state = full_pool()
    runs = timeit.repeat(lambda: plan_step(state), number=repeat, repeat=5)
    return sorted(runs)[2] / repeat * 1e6
