"""One pool's batcher: reads requests, plans steps, dispatches them to ranks, applies results.

Each (re)start opens a new epoch: the ranks are fenced (they finish what an earlier epoch
sent, then drop it), and every entry still pending for this pool is resumed from what its
result stream already holds. Ranks that die are taken out of planning and their requests
resume elsewhere; entries of pools that die are claimed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import replace
from typing import Any, cast

import redis
from tokenizers import Tokenizer

from batcher.book import RequestBook
from batcher.channel import StepChannel
from batcher.chat import ChatTemplate
from batcher.dispatch import rank_plans
from batcher.durability import (
    claim_orphans,
    claim_own_pending,
    ensure_groups,
    keep_alive,
    live_pools,
    orphaned_pools,
)
from batcher.fairness import TenantShare
from batcher.limits import publish_limits, publish_tenants, withdraw_limits
from batcher.metrics import BatcherMetrics, kv_blocks, tenant_gauges, tenant_load
from batcher.queue import Holding, QueueReader
from batcher.ranks import RankRegistry
from batcher.scheduler import (
    PlannerConfig,
    PoolState,
    StepPlan,
    join_rank,
    lose_rank,
    plan_step,
    preempt_threshold,
)
from schemas.config import Settings, add_settings_flags, settings_from_args
from schemas.connection import connect, reset_connections
from schemas.control import StepResult
from schemas.keys import Keys
from schemas.messages import FinishReason
from schemas.metrics import serve_metrics
from schemas.registry import BatcherState, PoolField
from schemas.sentinel import primary_of
from schemas.tenants import request_streams

log = logging.getLogger("npu_pool.batcher")
GAUGES = ("running", "waiting", "queue_depth", "kv_blocks_total", "kv_blocks_used", "cached_blocks")
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
FULL_POOL_POLL_S = 0.02


class Batcher:
    """Holds a pool's planner state and its Redis connection; `run()` is the service loop."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pool = settings.pool
        self.keys = Keys(settings.namespace)
        self.redis = connect(settings.redis_url)
        self.instance = uuid.uuid4().hex[:12]
        self.lease_ms = int(settings.rank_timeout_s * 1000)
        self.stopping = False
        self.queue_depth = 0
        table = settings.tenant_table()
        self.tenant_table = table
        self.tenants = {
            name: TenantShare(t.weight, t.max_running)
            for name, t in (table.tenants.items() if table is not None else ())
        }
        self.tenant_load: dict[str, dict[str, int]] = {}  # as of the last heartbeat
        self.metrics = (
            BatcherMetrics(
                self.pool,
                self._gauges_and_counts,
                gauges=set(GAUGES),
                tenant_gauges=lambda: tenant_gauges(self.tenant_load, self.redis, self.keys),
            )
            if settings.metrics_port
            else None
        )
        self.state = self._new_state()
        self.book = RequestBook(self.redis, self.keys, settings, self.state, self.metrics)
        self.registry = self._new_registry()
        self.queue = QueueReader(self.redis, self.keys, self.pool, settings.priority_aging_s)
        self.channel = self._new_channel()
        self.epoch = 0
        self.primary: tuple[str, int] | None = None  # behind Sentinels: this epoch's primary
        self.step = 0
        self.regroup = False  # set when the expert-parallel group must re-form
        self.last_housekeeping = 0.0
        self.last_intake = 0.0
        if self.metrics is not None:
            serve_metrics(settings.metrics_port, self.metrics.registry)

    def _gauges_and_counts(self) -> dict[str, float]:
        return {
            **self.book.counts.as_dict(),
            "running": len(self.state.running),
            "waiting": len(self.state.waiting),
            "queue_depth": self.queue_depth,
            **kv_blocks(self.state, self.settings.max_model_len),
        }

    def _new_state(self) -> PoolState:
        s = self.settings
        config = PlannerConfig(
            num_ranks=s.ranks,
            max_num_seqs=s.max_num_seqs,
            kv_slots_per_rank=s.kv_slots_per_rank,
            decode_batch=s.decode_batch,
            prefill_chunk=s.prefill_chunk,
            prefill_slots=s.prefill_slots,
            lockstep=s.lockstep,
            preempt_margin=s.preempt_margin if s.preemption else None,
            prefill_segments=s.prefill_segments,
            decode_stall_steps=s.decode_stall_steps,
            tenants=self.tenants,
            block_size=s.block_size,
            mtp=s.mtp,
            max_kv_len=s.max_kv_len,
        )
        return PoolState(config, live_ranks=set())

    def _join(self, rank: int) -> None:
        """Plan for a (new) rank process: its slots free, and its blocks in a cache of
        blocks."""
        if not self.state.config.paged:
            join_rank(self.state, rank)
            return
        registry = self.registry
        join_rank(self.state, rank, registry.kv_blocks.get(rank, 0), registry.kv_marks.get(rank, 0))

    def _new_registry(self) -> RankRegistry:
        s = self.settings
        return RankRegistry(
            self.redis, self.keys, self.pool, s.ranks, s.rank_timeout_s, s.launch_shapes()
        )

    def _new_channel(self) -> StepChannel:
        return StepChannel(
            self.redis, self.keys, self.pool, self.registry, self.settings.max_inflight_steps
        )

    def _reset(self) -> None:
        """A new epoch's planner state, registry view, queue reader and step channel."""
        self.state = self._new_state()
        self.book.new_epoch(self.state)
        self.registry = self._new_registry()
        self.queue = QueueReader(self.redis, self.keys, self.pool, self.settings.priority_aging_s)
        self.channel = self._new_channel()
        self.epoch = 0
        self.primary = None
        self.step = 0
        self.regroup = False
        self.last_housekeeping = 0.0
        self.last_intake = 0.0

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until stopped; on stop, admit nothing more and finish what is in flight."""
        try:
            self._start_epoch()
            drain_deadline: float | None = None
            while True:
                if self.stopping and drain_deadline is None:
                    drain_deadline = time.monotonic() + self.settings.drain_timeout_s
                    self._set_state(BatcherState.DRAINING)
                    log.info("draining %d running requests", len(self.state.running))
                if drain_deadline is not None and (
                    not (self.state.running or self.channel.inflight)
                    or time.monotonic() > drain_deadline
                ):
                    break
                try:
                    self._tick()
                    if primary_of(self.redis) != self.primary:
                        # a failover without an error here: what was written to the old
                        # primary since its last replication (steps, plans) may be gone
                        log.warning("Redis failed over to %s; a new epoch", primary_of(self.redis))
                        self._start_epoch()
                except REDIS_ERRORS as exc:
                    log.warning("Redis unavailable (%s); waiting for it", exc)
                    self._wait_for_redis()
                    self._start_epoch()
        finally:
            self.close()

    def close(self) -> None:
        """Hand back held entries (drop the lease), mark the pool stopped, disconnect."""
        with contextlib.suppress(redis.RedisError):
            self.redis.delete(self.keys.lease(self.pool))
            self._set_state(BatcherState.STOPPED)
            withdraw_limits(self.redis, self.keys, self.pool, live_pools(self.redis, self.keys))
        self.redis.close()

    def request_stop(self, *_: object) -> None:
        """Signal handler: stop admitting and drain."""
        self.stopping = True

    def _tick(self) -> None:
        if self.regroup:  # expert parallelism: a rank left or came, the group must re-form
            self._start_epoch(regroup=True)
            return
        now = time.monotonic()
        if now - self.last_housekeeping >= self.settings.heartbeat_s:
            self.last_housekeeping = now
            self._housekeeping()
        self.book.expire_deadlines()
        busy = bool(self.channel.inflight or self.state.running)
        if not self.stopping:
            self._intake(block_ms=0 if busy else 100)
        while self.channel.room():
            plan = plan_step(self.state)
            if plan.is_idle:
                break
            self._dispatch(plan)
        if self.channel.inflight:
            self._collect(block_ms=200)

    def _wait_for_redis(self) -> None:
        reset_connections(self.redis)  # every connection finds the (new) primary afresh
        delay = 0.1
        while not self.stopping:
            with contextlib.suppress(*REDIS_ERRORS):
                if self.redis.ping():
                    return
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
        raise SystemExit(0)

    # -- epochs ---------------------------------------------------------------------------

    def _start_epoch(self, regroup: bool = False) -> None:
        """Register, wait for ranks, fence them, and resume every entry this pool holds.

        A regroup (expert parallelism: a rank left or came back) keeps the requests it
        holds: they give up their slots and resume from their streams once every rank is in
        the new epoch's group; only those of a rank that died are charged a delivery."""
        if regroup:
            self._requeue_all()
        else:
            self._reset()
        ensure_groups(self.redis, self.keys)
        self._publish_limits()
        publish_tenants(self.redis, self.keys, self.tenant_table)
        pool_key = self.keys.pool(self.pool)
        self.epoch = int(self.redis.hincrby(pool_key, PoolField.EPOCH, 1))
        self.primary = primary_of(self.redis)
        self.channel.open()
        self.redis.sadd(self.keys.pools, self.pool)
        self.redis.hset(
            pool_key,
            mapping={
                PoolField.BATCHER_PID: os.getpid(),
                PoolField.BATCHER_HOST: socket.gethostname(),
                PoolField.RANKS: self.settings.ranks,
                PoolField.MODEL: self.settings.model,
                PoolField.MAX_MODEL_LEN: self.settings.max_model_len,
                PoolField.STARTED_MS: int(time.time() * 1000),
                PoolField.PLANNED: "",  # none yet: the ranks join this epoch's plan anew
            },
        )
        self._set_state(BatcherState.STARTING)
        self._wait_for_ranks()
        self.regroup = False  # the ranks that joined while waiting form this epoch's group
        self._dispatch(StepPlan(fence=True))
        while self.channel.inflight and not self.stopping:
            self._collect(block_ms=200)
            self._poll_ranks()
        deliveries = [] if regroup else claim_own_pending(self.redis, self.keys, self.pool)
        self.book.resume_own(deliveries)
        self._set_state(BatcherState.READY)
        log.info(
            "pool %s ready: epoch %d, ranks %s, %d requests resumed",
            self.pool,
            self.epoch,
            sorted(self.state.ranks),
            len(deliveries),
        )

    def _requeue_all(self) -> None:
        """Every rank gives its requests back (they resume after what they published) and
        waits to be planned for again."""
        for rank in sorted(self.state.ranks):
            self.channel.lose_rank(rank)
            moved = lose_rank(self.state, rank)
            self.book.requeue([self.book.tracked[s.request_id] for s in moved])
        for rank in self.registry.live:
            self._join(rank)

    def _wait_for_ranks(self) -> None:
        """Until every rank is up, or at least one is and a rank timeout has passed."""
        started = beat = time.monotonic()
        while not self.stopping:
            self._poll_ranks()
            everyone = len(self.state.ranks) == self.settings.ranks
            # split experts need every rank: no partial pool serves
            waited = (
                time.monotonic() - started > self.settings.rank_timeout_s
                and not self.settings.expert_parallel
            )
            if self.state.ranks and (everyone or waited) and self._load_tokenizer():
                return
            if time.monotonic() - beat >= self.settings.heartbeat_s:
                beat = time.monotonic()
                self._set_state(BatcherState.STARTING)  # alive while its ranks load
            time.sleep(0.1)
        raise SystemExit(0)

    def _load_tokenizer(self) -> bool:
        raw = self.redis.get(self.keys.tokenizer(self.pool))
        if raw is None:
            return False
        tokenizer = Tokenizer.from_str(cast(bytes, raw).decode())
        template = self.redis.get(self.keys.chat_template(self.pool))
        chat = None
        if template is not None:
            try:
                chat = ChatTemplate.from_json(cast(bytes, template))
            except (ValueError, KeyError) as exc:
                log.error(
                    "the model's chat template is unusable (%s); chat requests are refused", exc
                )
        self.book.use_model(tokenizer, chat, self.registry.vocab_size)
        return True

    def _poll_ranks(self) -> None:
        changes = self.registry.poll()
        for rank, why in changes.refused:
            log.error("rank %d refused: %s", rank, why)
        for rank in changes.lost:
            log.warning("rank %d lost; moving its requests", rank)
            self.channel.lose_rank(rank)
            lost = lose_rank(self.state, rank)
            # expert parallelism: the ranks that re-registered after a failed collective
            # lost their requests through no fault of theirs
            died = not self.settings.expert_parallel or rank in changes.vanished
            self.book.requeue([self.book.tracked[s.request_id] for s in lost], rank_died=died)
        if changes.joined:
            ranks = self.state.ranks | set(changes.joined)
            packs = all(self.registry.packs.get(r, False) for r in ranks)
            mixes = all(self.registry.mixes.get(r, False) for r in ranks)
            prefix = all(self.registry.prefix.get(r, False) for r in ranks)
            paged = self.settings.blocks and all(
                self.registry.kv_blocks.get(r, 0) > 0 for r in ranks
            )
            if self.settings.blocks and not paged:
                log.warning("the model's state is not kept in blocks: each slot reserves it")
            self.state.config = replace(
                self.state.config,
                pack_prefill=self.settings.pack_prefill and packs,
                mix_decode=self.settings.mix_decode and mixes,  # the planner packs first
                prefix_caching=self.settings.prefix_caching and prefix,
                paged=paged,
            )
        for rank in changes.joined:
            log.info("rank %d joined (%s)", rank, self.registry.incarnation(rank))
            self._join(rank)
        if changes.lost or changes.joined:
            planned = ",".join(str(r) for r in sorted(self.state.ranks))
            self.redis.hset(self.keys.pool(self.pool), PoolField.PLANNED, planned)
        if self.settings.expert_parallel and (changes.lost or changes.joined):
            self.regroup = True

    def _publish_limits(self) -> None:
        live = live_pools(self.redis, self.keys)
        self.book.use_limits(publish_limits(self.redis, self.keys, self.pool, self.settings, live))

    def _housekeeping(self) -> None:
        self._poll_ranks()
        self._publish_limits()
        day_ago_ms = int(time.time() * 1000) - 86_400_000
        self.redis.zremrangebyscore(self.keys.cancelled, 0, day_ago_ms)
        keep_alive(
            self.redis,
            self.keys,
            self.pool,
            self.instance,
            self.lease_ms,
            [(t.stream, t.entry_id) for t in self.book.tracked.values()],
        )
        room = self.state.room() - len(self.state.waiting)
        if room > 0 and not self.stopping and orphaned_pools(self.redis, self.keys, self.pool):
            claimed = claim_orphans(self.redis, self.keys, self.pool, self.lease_ms, room)
            if claimed:
                log.info("claimed %d requests of pools that are gone", len(claimed))
                self.book.claim(claimed)
        self.tenant_load = tenant_load(self.state)
        fields: dict[str, int | str] = {
            PoolField.HEARTBEAT_MS: int(time.time() * 1000),
            PoolField.RUNNING: len(self.state.running),
            PoolField.WAITING: len(self.state.waiting),
            "tenants": json.dumps(self.tenant_load, sort_keys=True),
            **kv_blocks(self.state, self.settings.max_model_len),
            **self.book.counts.as_dict(),
        }
        self.redis.hset(self.keys.pool(self.pool), mapping=fields)  # type: ignore[arg-type]

    def _set_state(self, state: BatcherState) -> None:
        """Record the pool's state with a heartbeat (a state without one reads unresponsive)."""
        now_ms = int(time.time() * 1000)
        self.redis.hset(
            self.keys.pool(self.pool),
            mapping={PoolField.STATE: state.value, PoolField.HEARTBEAT_MS: now_ms},
        )

    # -- intake ---------------------------------------------------------------------------

    def _intake(self, block_ms: int) -> None:
        """Take the most urgent entries that could be admitted (and, with every slot taken,
        one that would preempt), end entries past the bound; wait a little when idle."""
        wanted = self.state.room() - len(self.state.waiting)
        now = time.monotonic()
        if wanted <= 0 and now - self.last_intake < FULL_POOL_POLL_S:
            return  # a full pool only looks for excess entries and preemptions now and then
        self.last_intake = now
        threshold = preempt_threshold(self.state)
        preempting = (float("inf"), 0) if threshold is None else (threshold, 1)
        reply = self.queue.read(
            max(0, wanted), self.book.limits["max_queue"], *preempting, self._holding()
        )
        self.queue_depth = reply.depth
        self.book.reject_excess(reply.excess)
        if reply.deliveries:
            self.book.accept(reply.deliveries, resume=False)
        elif block_ms and not reply.excess:
            queued = request_streams(self.redis, self.keys)
            streams: dict[Any, Any] = {stream: "$" for stream in queued}
            self.redis.xread(streams, count=1, block=block_ms)

    def _holding(self) -> Holding:
        """What the pool holds of each tenant's work, for the intake's fair order (with
        preemption off, no tenant is delivered more than there is room for)."""
        held: dict[str, int] = {}
        for seq in (*self.state.running.values(), *self.state.waiting):
            held[seq.tenant] = held.get(seq.tenant, 0) + 1
        return Holding(self.state.capacity(), held, self.tenants, self.settings.preemption)

    # -- steps ----------------------------------------------------------------------------

    def _dispatch(self, plan: StepPlan) -> None:
        """Send each live rank its share of the step in one pipelined round trip."""
        self.step += 1
        tracked, ranks = self.book.tracked, self.state.ranks
        plans = rank_plans(plan, tracked, self.epoch, self.step, self.settings, ranks)
        self.book.dispatched(plan)
        self.channel.send(self.step, {p.rank: p for p in plans})

    def _collect(self, block_ms: int) -> None:
        """Wait for step results and cancels; apply them."""
        results, cancelled = self.channel.receive(block_ms, self.epoch)
        for request_id in cancelled:
            self.book.stop(request_id, FinishReason.CANCELLED)
        pipe = self.redis.pipeline(transaction=False)
        for result in results:
            self._apply(result, pipe)
        pipe.execute()

    def _apply(self, result: StepResult, pipe: redis.client.Pipeline) -> None:
        self.book.apply(result, pipe)
        seconds = self.channel.answered(result)
        if seconds is not None and self.metrics is not None:
            self.metrics.step_seconds.observe(seconds)


def build_parser() -> argparse.ArgumentParser:
    """The flags of `npu-pool batcher`."""
    parser = argparse.ArgumentParser(prog="npu-pool batcher", description=__doc__)
    add_settings_flags(parser)
    return parser


def main(argv: list[str]) -> int:
    """`npu-pool batcher`: run one pool's batcher until SIGTERM/SIGINT."""
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"npu-pool batcher: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s batcher %(message)s")
    batcher = Batcher(settings)
    signal.signal(signal.SIGTERM, batcher.request_stop)
    signal.signal(signal.SIGINT, batcher.request_stop)
    batcher.run()
    return 0
