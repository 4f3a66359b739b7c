"""The batcher's side of the step streams: plans out to each rank, step results and cancels
in, and the steps in flight between the two (docs/architecture.md §3).

How far ahead the batcher plans is a trade. A rank with no plan queued idles for a whole
Redis round trip; a rank with many queued makes every newly admitted request wait behind
them. So two steps are always kept in flight (one running, one waiting on the rank), and
more, up to `max_inflight_steps`, only while the launches in flight would take less than
`PLAN_AHEAD_MS` at the ranks' recent speed: a rank whose launches take a millisecond or
two gets steps planned further ahead, one whose launches take ten gets two, so a burst
that arrives just after a step went out waits behind one step, not four.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, cast

import redis

from batcher.ranks import RankRegistry
from schemas.connection import last_entry_id
from schemas.control import RankStepPlan, StepResult
from schemas.keys import FIELD, PLAN_STREAM_MAXLEN, Keys

log = logging.getLogger("npu_pool.batcher")

MIN_STEPS_AHEAD = 2
PLAN_AHEAD_MS = 8.0  # beyond two steps, plan further only while less work than this is queued
LAUNCH_MS_WEIGHT = 0.2  # weight of the latest step in the running milliseconds per launch


@dataclass(slots=True)
class InFlight:
    """A dispatched step: the ranks it still waits for, its longest rank's launches, and
    when it went out."""

    ranks: set[int]
    num_launches: int
    sent_at: float


class StepChannel:
    """Sends rank plans and receives step results and cancels for one pool and epoch."""

    def __init__(
        self, client: redis.Redis, keys: Keys, pool: str, registry: RankRegistry, max_steps: int
    ) -> None:
        self.redis = client
        self.keys = keys
        self.pool = pool
        self.registry = registry
        self.max_steps = max_steps
        self.inflight: dict[int, InFlight] = {}
        self.ms_per_launch: float | None = None  # running average over the ranks' steps
        self.results_cursor: Any = "0-0"
        self.cancel_cursor: Any = "0-0"

    def open(self) -> None:
        """Read only what is written from now on (a new epoch)."""
        self.results_cursor = last_entry_id(self.redis, self.keys.step_results(self.pool))
        self.cancel_cursor = last_entry_id(self.redis, self.keys.cancel)

    def room(self) -> bool:
        """Whether to plan another step now (see the module's docstring)."""
        if len(self.inflight) >= self.max_steps:
            return False
        if len(self.inflight) < MIN_STEPS_AHEAD:
            return True
        if self.ms_per_launch is None:
            return False
        queued = sum(s.num_launches for s in self.inflight.values())
        return queued * self.ms_per_launch < PLAN_AHEAD_MS

    def send(self, step: int, plans: dict[int, RankStepPlan]) -> None:
        """Each rank's plan, addressed to its incarnation, in one pipelined round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for rank, rank_plan in sorted(plans.items()):
            rank_plan.incarnation = self.registry.incarnation(rank)
            pipe.xadd(
                self.keys.plan(self.pool, rank),
                {FIELD: rank_plan.encode()},
                maxlen=PLAN_STREAM_MAXLEN,
                approximate=True,
            )
        pipe.execute()
        if plans:
            launches = max(len(p.decode_launches) + len(p.prefill) for p in plans.values())
            self.inflight[step] = InFlight(set(plans), launches, time.monotonic())

    def receive(self, block_ms: int, epoch: int) -> tuple[list[StepResult], list[str]]:
        """Step results of this epoch from the ranks' current incarnations, and the ids of
        requests cancelled since the last call; waits up to `block_ms` for either."""
        streams: dict[Any, Any] = {
            self.keys.step_results(self.pool): self.results_cursor,
            self.keys.cancel: self.cancel_cursor,
        }
        reply = self.redis.xread(streams, count=256, block=block_ms)
        results: list[StepResult] = []
        cancelled: list[str] = []
        for key, entries in cast(list, reply or []):
            is_cancel = key.decode() == self.keys.cancel
            for entry_id, fields in entries:
                if is_cancel:
                    self.cancel_cursor = entry_id
                    cancelled.append(fields.get(b"id", b"").decode())
                    continue
                self.results_cursor = entry_id
                try:
                    result = StepResult.decode(fields[FIELD.encode()])
                except (ValueError, KeyError) as exc:
                    log.error("unreadable step result %s: %s", entry_id, exc)
                    continue
                if result.epoch == epoch and (
                    result.incarnation == self.registry.incarnation(result.rank)
                ):
                    results.append(result)
        return results, cancelled

    def answered(self, result: StepResult) -> float | None:
        """Mark `result`'s rank done with its step; the step's seconds in flight once every
        rank it went to has answered."""
        counts = result.counts
        launches = counts.num_decode_launches + counts.num_prefill_launches
        if launches:
            ms = counts.exec_ms / launches
            last = self.ms_per_launch
            self.ms_per_launch = ms if last is None else last + LAUNCH_MS_WEIGHT * (ms - last)
        step = self.inflight.get(result.step)
        if step is None:
            return None
        step.ranks.discard(result.rank)
        if step.ranks:
            return None
        del self.inflight[result.step]
        return time.monotonic() - step.sent_at

    def lose_rank(self, rank: int) -> None:
        """A lost rank answers nothing more: stop waiting for it."""
        for step in self.inflight.values():
            step.ranks.discard(rank)
        self.inflight = {n: s for n, s in self.inflight.items() if s.ranks}
