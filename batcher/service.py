"""One pool's batcher: reads requests, plans steps, dispatches them to ranks, applies results."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from typing import cast

import redis
from tokenizers import Tokenizer

from batcher.dispatch import rank_plans
from batcher.intake import ModelFacts, Tracked, parse_entry, reject, to_sequence, write_dead_letter
from batcher.scheduler import PlannerConfig, PoolState, StepPlan, finish, plan_step
from schemas.codec import CodecError, DeadLetter, Rejected, decode, encode
from schemas.config import Settings, add_settings_flags, settings_from_args
from schemas.connection import connect, hash_fields, last_entry_id, stream_entries
from schemas.control import StepResult
from schemas.keys import FIELD, GROUP, Keys

log = logging.getLogger("npu_pool.batcher")


class Batcher:
    """Holds a pool's planner state and its Redis connection; `run()` is the service loop."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.redis = connect(settings.redis_url)
        self.state = PoolState(
            PlannerConfig(
                num_ranks=settings.ranks,
                max_num_seqs=settings.max_num_seqs,
                kv_slots_per_rank=settings.kv_slots_per_rank,
                decode_batch=settings.decode_batch,
                prefill_chunk=settings.prefill_chunk,
                prefill_slots=settings.prefill_slots,
                lockstep=settings.lockstep,
            )
        )
        self.tracked: dict[str, Tracked] = {}
        self.inflight: dict[int, set[int]] = {}
        self.epoch = 0
        self.step = 0
        self.order = 0
        self.results_cursor = b"0-0"
        self.stopping = False
        self.stats = {"steps": 0, "tokens": 0, "finished": 0, "rejected": 0, "dead": 0}
        self.last_heartbeat = 0.0
        self.tokenizer: Tokenizer | None = None
        self.facts: ModelFacts | None = None

    def run(self) -> None:
        """Serve until stopped; on stop, admit nothing more and finish what is in flight."""
        try:
            self._bootstrap()
            drain_deadline: float | None = None
            while True:
                if self.stopping and drain_deadline is None:
                    drain_deadline = time.monotonic() + self.settings.drain_timeout_s
                    self._set_state("draining")
                    log.info("draining %d running requests", len(self.state.running))
                if drain_deadline is not None and (
                    not self.state.running or time.monotonic() > drain_deadline
                ):
                    break
                self._tick()
        finally:
            self.close()

    def close(self) -> None:
        """Mark the pool stopped and drop the connection."""
        with contextlib.suppress(redis.RedisError):
            self._set_state("stopped")
        self.redis.close()

    def _tick(self) -> None:
        self._heartbeat()
        busy = bool(self.inflight or self.state.running)
        if not self.stopping:
            self._intake(block_ms=0 if busy else 100)
        while len(self.inflight) < self.settings.max_inflight_steps:
            plan = plan_step(self.state)
            if plan.is_empty:
                break
            self._dispatch(plan)
        if self.inflight:
            self._collect(block_ms=500)

    def _bootstrap(self) -> None:
        try:
            self.redis.xgroup_create(self.keys.requests, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        pool_key = self.keys.pool(self.settings.pool)
        self.epoch = int(self.redis.hincrby(pool_key, "epoch", 1))
        self.results_cursor = last_entry_id(self.redis, self.keys.step_results(self.settings.pool))
        self.redis.sadd(self.keys.pools, self.settings.pool)
        self.redis.hset(
            pool_key,
            mapping={
                "batcher_pid": os.getpid(),
                "batcher_host": socket.gethostname(),
                "ranks": self.settings.ranks,
                "started_ms": int(time.time() * 1000),
            },
        )
        self._set_state("starting")
        self._wait_for_ranks()
        self._set_state("ready")
        log.info(
            "pool %s ready: epoch %d, %d ranks", self.settings.pool, self.epoch, self.settings.ranks
        )

    def _wait_for_ranks(self) -> None:
        while not self.stopping:
            infos = [
                hash_fields(self.redis.hgetall(self.keys.rank(self.settings.pool, r)))
                for r in range(self.settings.ranks)
            ]
            now_ms = time.time() * 1000
            if all(
                i.get(b"state") == b"ready"
                and now_ms - float(i.get(b"hb_ms", 0)) < self.settings.rank_timeout_s * 1000
                for i in infos
            ):
                raw = self.redis.get(self.keys.tokenizer(self.settings.pool))
                if raw is not None:
                    self.tokenizer = Tokenizer.from_str(cast(bytes, raw).decode())
                    self.facts = ModelFacts(
                        int(infos[0][b"vocab_size"]), self.settings.max_model_len
                    )
                    return
            time.sleep(0.1)
        raise SystemExit(0)

    def _intake(self, block_ms: int) -> None:
        """Read as many new entries as could be admitted, parse them, reject the bad ones."""
        wanted = self.state.room() - len(self.state.waiting)
        if wanted <= 0:
            if block_ms:
                time.sleep(block_ms / 1000)
            return
        reply = self.redis.xreadgroup(
            GROUP,
            self.settings.pool,
            {self.keys.requests: ">"},
            count=wanted,
            block=block_ms or None,
        )
        if not reply:
            return
        assert self.tokenizer is not None and self.facts is not None
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, fields in stream_entries(reply):
            try:
                request, prompt_ids = parse_entry(
                    fields.get(FIELD.encode()),
                    self.tokenizer,
                    self.facts,
                    self.settings.max_request_bytes,
                )
            except DeadLetter as exc:
                write_dead_letter(pipe, self.keys, entry_id, fields, str(exc))
                self.stats["dead"] += 1
                log.warning("dead letter %s: %s", entry_id, exc)
                continue
            except Rejected as exc:
                reject(pipe, self.keys, entry_id, exc, self.settings.result_ttl_s)
                self.stats["rejected"] += 1
                log.info("rejected %s: %s", exc.request_id, exc.message)
                continue
            if request.id in self.tracked:
                duplicate = Rejected(
                    request.id, "duplicate_id", f"field `id`: {request.id!r} is already running"
                )
                write_dead_letter(pipe, self.keys, entry_id, fields, duplicate.message)
                continue
            self.order += 1
            seq = to_sequence(request, prompt_ids, self.order, self.settings.max_model_len)
            self.tracked[request.id] = Tracked(entry_id, request, prompt_ids, seq)
            self.state.waiting.append(seq)
        pipe.execute()

    def _dispatch(self, plan: StepPlan) -> None:
        """Send each rank its share of the step in one pipelined round trip."""
        self.step += 1
        now = time.monotonic()
        for seq in plan.admitted:
            self.tracked[seq.request_id].admitted_at = now
        plans = rank_plans(plan, self.tracked, self.epoch, self.step, self.settings)
        pipe = self.redis.pipeline(transaction=False)
        for rank_plan in plans:
            pipe.xadd(
                self.keys.plan(self.settings.pool, rank_plan.rank),
                {FIELD: encode(rank_plan)},
                maxlen=1000,
                approximate=True,
            )
        pipe.execute()
        self.inflight[self.step] = {p.rank for p in plans}
        self.stats["steps"] += 1

    def _collect(self, block_ms: int) -> None:
        """Wait for step results and apply them: free slots, ack and delete finished entries."""
        key = self.keys.step_results(self.settings.pool)
        reply = self.redis.xread({key: self.results_cursor}, count=64, block=block_ms)
        if not reply:
            return
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, fields in stream_entries(reply):
            self.results_cursor = entry_id
            try:
                result = decode(StepResult, fields[FIELD.encode()])
            except (CodecError, KeyError) as exc:
                log.error("unreadable step result %s: %s", entry_id, exc)
                continue
            if result.epoch == self.epoch:
                self._apply(result, pipe)
        pipe.execute()

    def _apply(self, result: StepResult, pipe: redis.client.Pipeline) -> None:
        for outcome in result.outcomes:
            tracked = self.tracked.get(outcome.request_id)
            if tracked is None:
                continue
            tracked.num_published += outcome.num_new_tokens
            self.stats["tokens"] += outcome.num_new_tokens
            if outcome.finish_reason is not None:
                finish(self.state, outcome.request_id)
                del self.tracked[outcome.request_id]
                pipe.xack(self.keys.requests, GROUP, tracked.entry_id)
                pipe.xdel(self.keys.requests, tracked.entry_id)
                self.stats["finished"] += 1
        waiting = self.inflight.get(result.step)
        if waiting is not None:
            waiting.discard(result.rank)
            if not waiting:
                del self.inflight[result.step]

    def _heartbeat(self) -> None:
        now = time.time()
        if now - self.last_heartbeat < self.settings.heartbeat_s:
            return
        self.last_heartbeat = now
        fields: dict[str, int] = {
            "hb_ms": int(now * 1000),
            "running": len(self.state.running),
            "waiting": len(self.state.waiting),
            **self.stats,
        }
        self.redis.hset(self.keys.pool(self.settings.pool), mapping=fields)  # type: ignore[arg-type]

    def _set_state(self, state: str) -> None:
        self.redis.hset(self.keys.pool(self.settings.pool), "state", state)

    def request_stop(self, *_: object) -> None:
        """Signal handler: stop admitting and drain."""
        self.stopping = True


def main(argv: list[str]) -> int:
    """`npu-pool batcher`: run one pool's batcher until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="npu-pool batcher", description=__doc__)
    add_settings_flags(parser)
    args = parser.parse_args(argv)
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
