"""One worker rank: loads the model, registers, then runs step plans and publishes tokens.

Each process registers under a fresh incarnation id and executes only plans addressed to
it. If the batcher declares it lost (it was hung, or lost Redis mid-step), it drops every
request and registers anew; the conditional append keeps a stale step from writing.
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
import threading
import time
import uuid

import redis
import torch
from prometheus_client import CollectorRegistry

from npu_worker.engine import RankEngine
from npu_worker.loader import load_for
from npu_worker.model_config import UnsupportedModel
from npu_worker.publisher import Publisher
from npu_worker.rank_metrics import RankMetrics
from npu_worker.runner import LaunchRunner
from npu_worker.startup import rank_hash_reporter
from schemas.codec import CodecError, decode
from schemas.config import EXIT_FAILED, Settings, add_settings_flags, settings_from_args
from schemas.connection import connect, last_entry_id, stream_entries
from schemas.control import RankStepPlan
from schemas.keys import FIELD, Keys
from schemas.metrics import CountsCollector, serve_metrics

log = logging.getLogger("npu_pool.worker")


class RankFailed(RuntimeError):
    """The rank cannot start, for a reason a restart does not fix."""


REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


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
        self.publisher: Publisher | None = None
        self.stop_event = threading.Event()
        self.fenced = threading.Event()
        self.incarnation = ""
        self.engine: RankEngine | None = None
        self.metrics: RankMetrics | None = None
        self.plan_cursor = b"0-0"

    def run(self) -> None:
        """Load, warm up, announce ready, then execute plans until stopped.

        A model that cannot load for a reason no restart fixes (configuration, missing
        files, unsupported architecture) marks the rank `failed` with the reason and raises
        RankFailed: its supervisor must not restart it."""
        heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True)
        final_state = "stopped"
        try:
            self._register("loading")
            heartbeat.start()
            try:
                self.engine = self._load()
            except (UnsupportedModel, ValueError) as exc:
                final_state = "failed"
                self.redis.hset(self.rank_key, mapping={"state": "failed", "reason": str(exc)})
                raise RankFailed(str(exc)) from exc
            if self.settings.metrics_port:
                self._serve_metrics(self.engine, self.settings.metrics_port + 1 + self.rank)
            self.publisher = Publisher(self.settings, self.keys)
            self._go_live()
            while not self.stop_event.is_set():
                try:
                    if self.publisher.failed.is_set():
                        self.fenced.set()
                    if self.fenced.is_set():
                        log.warning(
                            "rank %d lost by the batcher or by Redis; starting afresh", self.rank
                        )
                        self._go_live()
                    self._serve_once(self.engine, self.publisher)
                except REDIS_ERRORS as exc:
                    log.warning("Redis unavailable (%s); retrying", exc)
                    time.sleep(0.5)
                    self.fenced.set()  # a step may be half published: start afresh
        finally:
            self.stop_event.set()
            if self.publisher is not None:
                self.publisher.close()
            if final_state == "stopped":
                with contextlib.suppress(redis.RedisError):
                    self.redis.hset(self.rank_key, "state", "stopped")
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
        assert self.engine is not None and self.publisher is not None
        self.publisher.reset()
        self.engine.reset(-1)
        self.fenced.clear()
        self.incarnation = uuid.uuid4().hex[:12]
        self.plan_cursor = last_entry_id(self.redis, self.plan_key)
        self._register("ready")
        log.info(
            "rank %d ready on %s as %s", self.rank, self.engine.runner.device, self.incarnation
        )

    def _load(self) -> RankEngine:
        settings = self.settings
        progress = rank_hash_reporter(self.redis, self.rank_key)
        loaded = load_for(settings, progress)
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
                "device": str(device),
                "vocab_size": loaded.config.vocab_size,
                "dtype": str(loaded.dtype).split(".")[-1],
                "model": str(loaded.path),
            },
        )
        runner = LaunchRunner(
            loaded,
            settings.kv_slots_per_rank,
            settings.max_kv_len,
            settings.prefill_chunk,
            settings.decode_batch,
        )
        self.redis.hset(self.rank_key, "state", "warming")
        runner.warm_up(progress)
        return RankEngine(
            runner,
            loaded.tokenizer,
            loaded.config.eos_token_ids,
            settings.max_model_len,
            rank=self.rank,
            lockstep=settings.lockstep,
        )

    def _serve_once(self, engine: RankEngine, publisher: Publisher) -> None:
        reply = self.redis.xread({self.plan_key: self.plan_cursor}, count=8, block=500)
        for entry_id, fields in stream_entries(reply):
            self.plan_cursor = entry_id
            try:
                plan = decode(RankStepPlan, fields[FIELD.encode()])
            except (CodecError, KeyError) as exc:
                log.error("unreadable plan %s: %s", entry_id, exc)
                continue
            if plan.incarnation != self.incarnation or plan.epoch < engine.epoch:
                continue
            refused = publisher.take_refused()
            if refused:
                engine.drop(refused)
            publisher.submit(engine.execute(plan))
            if self.metrics is not None:
                self.metrics.step(engine.shapes, engine.launch_seconds)
            if publisher.failed.is_set():
                self.fenced.set()
            if self.fenced.is_set() or self.stop_event.is_set():
                return

    def _register(self, state: str) -> None:
        self.redis.hdel(self.rank_key, "reason")
        self.redis.hset(
            self.rank_key,
            mapping={
                "rank": self.rank,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "state": state,
                "incarnation": self.incarnation,
                "hb_ms": int(time.time() * 1000),
                "requests": "",  # a new incarnation holds nothing yet
            },
        )

    def _heartbeat_loop(self) -> None:
        """Beat (with the ids of the requests this rank holds, for operators), and notice
        when the batcher has declared this incarnation lost."""
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
                        mapping={"hb_ms": int(time.time() * 1000), "requests": ",".join(held)},
                    )
                    pipe.hmget(self.rank_key, ["state", "incarnation"])
                    state, incarnation = pipe.execute()[1]
                    if state == b"lost" and incarnation == self.incarnation.encode():
                        self.fenced.set()
                except redis.RedisError as exc:
                    log.warning("heartbeat failed: %s", exc)
        finally:
            client.close()

    def request_stop(self, *_: object) -> None:
        """Signal handler: finish the current step, then exit."""
        self.stop_event.set()


def build_parser() -> argparse.ArgumentParser:
    """The flags of `npu-pool worker`."""
    parser = argparse.ArgumentParser(prog="npu-pool worker", description=__doc__)
    parser.add_argument("--rank", type=int, required=True, help="this worker's rank")
    add_settings_flags(parser)
    return parser


def main(argv: list[str]) -> int:
    """`npu-pool worker --rank R`: run one rank until SIGTERM/SIGINT."""
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
        worker = Worker(settings, args.rank)
    except ValueError as exc:
        print(f"npu-pool worker: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(message)s")
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)
    torch.set_grad_enabled(False)
    sys.setswitchinterval(0.0002)  # the publisher thread must not hold up the model for 5 ms
    try:
        worker.run()
    except RankFailed as exc:
        log.error("rank %d cannot start: %s", args.rank, exc)
        return EXIT_FAILED
    return 0
