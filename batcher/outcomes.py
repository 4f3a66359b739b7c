"""The planner's other half (docs/architecture.md §3): what a rank's step result does to the
pool state, as pure as planning it: no I/O, no clock, no torch.

`apply_result` counts each outcome's tokens, puts a request's prompt blocks in the prefix
index once its first token shows they were computed, gives back the slots of the requests that
finished, were lost or were released, and says which; the request book then writes what
that means to Redis (settling entries, resuming requests after what they published).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batcher.scheduler import PoolState, finish
from schemas.control import StepResult


@dataclass(slots=True)
class Applied:
    """What a step result did: the new tokens of each request that brought any, and the
    requests it took out of the pool: finished, lost by their rank, or released unfinished
    (`num_preempted` of these were preempted)."""

    num_new_tokens: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    num_preempted: int = 0


def apply_result(state: PoolState, result: StepResult) -> Applied:
    """Apply a rank's outcomes to the requests it runs; finished, lost and released ones
    leave the pool and free their slots.

    An outcome counts only while its request is running on the result's rank in the
    admission it names (`Sequence.admission`): a request that has moved to another rank,
    or re-entered the queue since, is no longer that rank's to report on."""
    applied = Applied()
    for outcome in result.outcomes:
        seq = state.running.get(outcome.request_id)
        if seq is None or seq.rank != result.rank or seq.admission != outcome.admission:
            continue
        if outcome.num_new_tokens and seq.block_keys and not seq.registered:
            # its first token: every chunk of its prompt ran, so its slot holds its blocks
            seq.registered = True
            pool = state.pools.get(seq.rank)
            if pool is not None:  # a cache of blocks: its blocks hold them
                pool.register(seq.block_keys, seq.blocks)
                state.prefix.settle((seq.rank, seq.slot))
            else:
                state.prefix.register((seq.rank, seq.slot), seq.block_keys)
        if outcome.num_new_tokens:
            num_before = applied.num_new_tokens.get(seq.request_id, 0)
            applied.num_new_tokens[seq.request_id] = num_before + outcome.num_new_tokens
        if outcome.lost or outcome.released:
            finish(state, seq.request_id)
            (applied.released if outcome.released else applied.lost).append(seq.request_id)
            applied.num_preempted += int(seq.preempting)
        elif outcome.finish_reason is not None:
            finish(state, seq.request_id)
            applied.finished.append(seq.request_id)
    return applied
