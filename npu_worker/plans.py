"""Reading a rank's plan stream ahead of the model thread, on a thread and connection of
its own: while a step runs, the next plans arrive and are decoded, so the model thread
finds them waiting instead of asking Redis between steps."""

from __future__ import annotations

import logging
import queue
import threading
import time

import redis

from schemas.connection import connect, reset_connections, stream_entries
from schemas.control import RankStepPlan
from schemas.keys import FIELD

log = logging.getLogger("npu_pool.worker")


class PlanReader:
    """A blocking XREAD loop over one plan stream, feeding a local queue."""

    def __init__(self, redis_url: str | None, plan_key: str) -> None:
        self.redis = connect(redis_url)
        self.plan_key = plan_key
        self.plans: queue.Queue[tuple[int, RankStepPlan]] = queue.Queue()
        self.lock = threading.Lock()
        self.cursor = b"$"
        self.generation = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="plans", daemon=True)
        self.thread.start()

    def restart(self, cursor: bytes) -> None:
        """Read from after `cursor` on; plans read before are dropped."""
        with self.lock:
            self.cursor = cursor
            self.generation += 1

    def next(self, timeout_s: float) -> tuple[RankStepPlan | None, float]:
        """The next plan (None after `timeout_s`), and the seconds spent waiting for it."""
        began = time.perf_counter()
        while True:
            left = timeout_s - (time.perf_counter() - began)
            try:
                generation, plan = self.plans.get(timeout=max(0.0, left))
            except queue.Empty:
                return None, time.perf_counter() - began
            if generation == self.generation:
                return plan, time.perf_counter() - began

    def close(self) -> None:
        """Stop reading."""
        self.stopped.set()
        self.thread.join(timeout=5)
        self.redis.close()

    def _loop(self) -> None:
        while not self.stopped.is_set():
            with self.lock:
                cursor, generation = self.cursor, self.generation
            try:
                reply = self.redis.xread({self.plan_key: cursor}, count=16, block=200)
            except redis.RedisError as exc:
                log.warning("reading plans failed (%s); retrying", exc)
                reset_connections(self.redis)
                time.sleep(0.5)
                continue
            entries = stream_entries(reply)
            with self.lock:
                if generation != self.generation:  # restarted meanwhile: read again
                    continue
                if entries:
                    self.cursor = entries[-1][0]
            for entry_id, fields in entries:
                try:
                    plan = RankStepPlan.decode(fields[FIELD.encode()])
                except (ValueError, KeyError) as exc:
                    log.error("unreadable plan %s: %s", entry_id, exc)
                    continue
                self.plans.put((generation, plan))
