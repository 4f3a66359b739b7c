"""One worker rank: loads the model, registers, then runs step plans on its model thread
while its output process publishes the tokens.

Each process registers under a fresh incarnation id and executes only plans addressed to
it. If the batcher declares it lost (it was hung, or lost Redis mid-step), it drops every
request and registers anew; the fenced step script keeps a stale step from writing.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import socket
import threading
import time
import uuid

import redis
from prometheus_client import CollectorRegistry

from npu_worker.constraints import Constraints
from npu_worker.engine import RankEngine
from npu_worker.expert_parallel import LOOPBACK, ExpertParallel, Rendezvous
from npu_worker.models.moe import ExpertModel
from npu_worker.output.process import OutputProcess
from npu_worker.plans import PlanReader
from npu_worker.rank_metrics import RankMetrics
from npu_worker.runner import LaunchRunner
from npu_worker.startup import rank_hash_reporter
from npu_worker.weights.presets import load_for
from schemas.config import Settings
from schemas.connection import connect, last_entry_id, reset_connections
from schemas.keys import Keys
from schemas.metrics import CountsCollector, serve_metrics
from schemas.registry import RankField, RankState

log = logging.getLogger("npu_pool.worker")
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class RankFailed(RuntimeError):
    """The rank cannot start, for a reason a restart does not fix."""


class Worker:
    """A rank's service object: its engine, its Redis connection and its run loop."""

    def __init__(self, settings: Settings, rank: int) -> None:
        if not 0 <= rank < settings.ranks:
            raise ValueError(f"rank {rank} is outside 0..{settings.ranks - 1}")
        self.settings = settings
        self.rank = rank
        self.keys = Keys(settings.namespace)
        self.rank_key = self.keys.rank(settings.pool, rank)
        self.plan_key = self.keys.plan(settings.pool, rank)
        self.redis = connect(settings.redis_url)
        self.output: OutputProcess | None = None
        self.plans: PlanReader | None = None
        self.stop_event = threading.Event()
        self.fenced = threading.Event()
        self.incarnation = ""
        self.engine: RankEngine | None = None
        self.metrics: RankMetrics | None = None
        self.refused: str | None = None  # the batcher's reason for refusing this rank
        self.experts: ExpertParallel | None = None
        self.failure: str | None = None  # why this rank gives up (no restart would help)
        self.registered = ""  # the incarnation whose registration was written

    def run(self) -> None:
        """Load, warm up, announce ready, then execute plans until stopped.

        A model that cannot be loaded or prepared (configuration, missing files, an
        unsupported architecture, packing or warm-up failing: the same again after a
        restart) marks the rank `failed` with the reason and raises RankFailed: its
        supervisor must not restart it. Only losing Redis is worth a restart."""
        heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True)
        final_state = RankState.STOPPED
        try:
            self._register(RankState.LOADING)
            heartbeat.start()
            try:
                self.engine = self._load()
            except REDIS_ERRORS:
                raise
            except Exception as exc:  # loading, packing or warming up: a restart fails alike
                final_state = RankState.FAILED
                reason = _reason(exc)
                if not isinstance(exc, ValueError):
                    log.exception("rank %d failed preparing its model", self.rank)
                self.redis.hset(
                    self.rank_key,
                    mapping={RankField.STATE: final_state.value, RankField.REASON: reason},
                )
                raise RankFailed(reason) from exc
            if self.settings.metrics_port:
                self._serve_metrics(self.engine, self.settings.metrics_port + 1 + self.rank)
            self.output = OutputProcess(self.settings, self.rank, self.tokenizer)
            self.plans = PlanReader(self.settings.redis_url, self.plan_key)
            self._go_live()
            while not self.stop_event.is_set():
                try:
                    if self.fenced.is_set():
                        log.warning(
                            "rank %d lost by the batcher or by Redis; starting afresh", self.rank
                        )
                        self._go_live()
                    self._serve_once(self.engine, self.output, self.plans)
                except REDIS_ERRORS as exc:
                    log.warning("Redis unavailable (%s); retrying", exc)
                    reset_connections(self.redis)
                    time.sleep(0.5)
                    self.fenced.set()  # a step may be half published: start afresh
            if self.refused is not None:
                final_state = RankState.FAILED
                raise RankFailed(f"the batcher refused this rank: {self.refused}")
            if self.failure is not None:
                final_state = RankState.FAILED
                self.redis.hset(
                    self.rank_key,
                    mapping={RankField.STATE: final_state.value, RankField.REASON: self.failure},
                )
                raise RankFailed(self.failure)
        finally:
            self.stop_event.set()
            if self.plans is not None:
                self.plans.close()
            if self.output is not None:
                self.output.close()
            if final_state == RankState.STOPPED:
                with contextlib.suppress(redis.RedisError):
                    self.redis.hset(self.rank_key, RankField.STATE, final_state.value)
            self.redis.close()

    def _serve_metrics(self, engine: RankEngine, port: int) -> None:
        registry = CollectorRegistry()
        registry.register(
            CountsCollector(
                lambda: {
                    **engine.totals,
                    **{f"{kind}_launches": n for kind, n in engine.runner.num_launches.items()},
                },
                {"pool": self.settings.pool, "rank": str(self.rank)},
                gauges=set(),
            )
        )
        self.metrics = RankMetrics(registry, self.settings.pool, self.rank)
        serve_metrics(port, registry)

    def _go_live(self) -> None:
        """Drop all requests, take a new incarnation, read plans from now on."""
        assert self.engine is not None and self.output is not None and self.plans is not None
        self.output.reset()  # every step of the old incarnation is published or refused
        self.engine.reset(-1)
        self.fenced.clear()
        self.incarnation = uuid.uuid4().hex[:12]
        self.plans.restart(last_entry_id(self.redis, self.plan_key))
        self._register(RankState.READY)
        log.info(
            "rank %d ready on %s as %s", self.rank, self.engine.runner.device, self.incarnation
        )

    def _load(self) -> RankEngine:
        settings = self.settings
        progress = rank_hash_reporter(self.redis, self.rank_key)
        expert_rank = (self.rank, settings.ranks) if settings.expert_parallel else None
        loaded = load_for(settings, progress, expert_rank)
        device = loaded.device
        if self.rank == 0:
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(self.keys.tokenizer(settings.pool), loaded.tokenizer.to_str())
            chat_key = self.keys.chat_template(settings.pool)
            if loaded.chat_template is not None:
                pipe.set(chat_key, json.dumps(loaded.chat_template))
            else:
                pipe.delete(chat_key)
            pipe.execute()
        self.redis.hset(
            self.rank_key,
            mapping={
                RankField.DEVICE: str(device),
                RankField.VOCAB_SIZE: loaded.config.vocab_size,
                RankField.DTYPE: str(loaded.dtype).split(".")[-1],
                RankField.MODEL: str(loaded.path),
                RankField.WEIGHT_BYTES: loaded.weight_bytes,
                RankField.CHECKPOINT_BYTES: loaded.checkpoint_bytes,
            },
        )
        log.info(
            "rank %d: weights take %.1f MiB on %s (%.1f MiB in the checkpoint)",
            self.rank,
            loaded.weight_bytes / 2**20,
            device,
            loaded.checkpoint_bytes / 2**20,
        )
        runner = LaunchRunner(loaded.model, settings.launch_shapes())
        if runner.kv_blocks:
            per_block = runner.state.bytes_per_token * settings.block_size
            log.info(
                "rank %d: cache of %d blocks of %d tokens (%.1f MiB, %s)",
                self.rank,
                runner.kv_blocks,
                settings.block_size,
                runner.kv_blocks * per_block / 2**20,
                f"--kv-cache-memory {settings.kv_cache_memory}"
                if settings.kv_cache_memory
                else f"{settings.kv_cache_fraction:g} of the free memory",
            )
        self.redis.hset(
            self.rank_key,
            mapping={
                RankField.STATE: RankState.WARMING.value,
                RankField.PACKS: int(runner.packs),
                RankField.MIXES: int(runner.mixes),
                RankField.PREFIX: int(runner.prefix_cacheable),
                RankField.KV_BLOCKS: runner.kv_blocks,
                RankField.KV_MARKS: runner.kv_marks,
                RankField.SHAPES: runner.shapes.encode(),
            },
        )
        runner.warm_up(progress)  # experts stay local until the first epoch forms the group
        # the model's modules, parameters and kernels' objects live as long as the rank: out
        # of the collector's sight, a collection between launches walks only what steps make
        gc.collect()
        gc.freeze()
        if settings.expert_parallel and isinstance(loaded.model, ExpertModel):
            rendezvous = Rendezvous(
                self.redis,
                self.keys,
                settings.pool,
                self.rank,
                settings.ranks,
                device,
                settings.collective_timeout_s,
                settings.rendezvous_host or LOOPBACK,
            )
            self.experts = ExpertParallel(rendezvous, loaded.model)
        self.tokenizer = loaded.tokenizer
        return RankEngine(
            runner,
            loaded.config.eos_token_ids,
            settings.max_model_len,
            rank=self.rank,
            lockstep=settings.lockstep,
            constraints=Constraints(
                loaded.tokenizer.to_str(), loaded.config.vocab_size, loaded.config.eos_token_ids
            ),
        )

    def _serve_once(self, engine: RankEngine, output: OutputProcess, plans: PlanReader) -> None:
        """Run the next plan for this incarnation, if one comes within half a second."""
        if not output.alive:
            raise RuntimeError("the rank's output process died")
        feedback = output.take_feedback()
        engine.drop(feedback.ended)
        if feedback.failed:
            self.fenced.set()
            return
        plan, waited_s = plans.next(timeout_s=0.5)
        if plan is None or plan.incarnation != self.incarnation or plan.epoch < engine.epoch:
            return
        if self.experts is None:
            output.send(engine.execute(plan, idle_ms=waited_s * 1000))
        else:
            try:
                self.experts.join(plan.epoch)
                record = engine.execute(plan, idle_ms=waited_s * 1000)
                record.counts.collective_ms = self.experts.take_ms()
            except RuntimeError as exc:  # a peer died or hung mid-collective
                self.experts.fail(exc)
                if self.experts.hopeless:
                    self.failure = str(exc)  # the group never formed, however often tried
                    self.stop_event.set()
                    return
                self.fenced.set()
                return
            output.send(record)
        if self.metrics is not None:
            self.metrics.step(engine.shapes, engine.runner.launch_seconds)

    def _register(self, state: RankState) -> None:
        self.registered = ""
        self.redis.hdel(self.rank_key, RankField.REASON)
        self.redis.hset(
            self.rank_key,
            mapping={
                RankField.RANK: self.rank,
                RankField.PID: os.getpid(),
                RankField.HOST: socket.gethostname(),
                RankField.STATE: state.value,
                RankField.INCARNATION: self.incarnation,
                RankField.HEARTBEAT_MS: int(time.time() * 1000),
                RankField.REQUESTS: "",  # a new incarnation holds nothing yet
            },
        )
        if state == RankState.READY:
            self.registered = self.incarnation

    def _heartbeat_loop(self) -> None:
        """Beat (with the ids of the requests this rank holds, for operators), and notice
        when the batcher has declared this incarnation lost, or refused it."""
        client = connect(self.settings.redis_url)
        try:
            while not self.stop_event.wait(self.settings.heartbeat_s):
                try:
                    pipe = client.pipeline(transaction=False)
                    held = (
                        [s.request_id for s in list(self.engine.slots.values())]
                        if (self.engine is not None)
                        else []
                    )
                    pipe.hset(
                        self.rank_key,
                        mapping={
                            RankField.HEARTBEAT_MS: int(time.time() * 1000),
                            RankField.REQUESTS: ",".join(held),
                        },
                    )
                    pipe.hmget(
                        self.rank_key, [RankField.STATE, RankField.INCARNATION, RankField.REASON]
                    )
                    state, incarnation, reason = pipe.execute()[1]
                    if incarnation != self.incarnation.encode():
                        if self.registered == self.incarnation:  # a failover dropped it
                            log.warning("rank %d: its registration is gone; anew", self.rank)
                            self.fenced.set()
                        continue
                    if state == RankState.LOST.value.encode():
                        self.fenced.set()
                    elif state == RankState.FAILED.value.encode() and self.engine is not None:
                        self.refused = (reason or b"").decode()
                        log.error("rank %d refused by the batcher: %s", self.rank, self.refused)
                        self.stop_event.set()
                        return
                except redis.RedisError as exc:
                    log.warning("heartbeat failed: %s", exc)
                    reset_connections(client)
        finally:
            client.close()

    def request_stop(self, *_: object) -> None:
        """Signal handler: finish the current step, then exit."""
        self.stop_event.set()


def _reason(exc: Exception) -> str:
    """What a rank that cannot prepare its model says: a configuration error's own message,
    anything else with its type (an AttributeError's message alone does not say much)."""
    if isinstance(exc, ValueError):  # UnsupportedModel included
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
