"""Publishing a rank's steps on its own thread and connection, in order, so the model never
waits on Redis: while step N's chunks and result travel, step N+1 already runs."""

from __future__ import annotations

import logging
import queue
import threading

import redis

from npu_worker.engine import StepOutput
from schemas.codec import encode
from schemas.config import Settings
from schemas.connection import connect
from schemas.keys import FIELD, STEP_RESULTS_MAXLEN, Keys
from schemas.results import APPENDED, ResultWriter

log = logging.getLogger("npu_pool.worker")


class Publisher:
    """An in-order outbox of step outputs, drained by one thread.

    A chunk the result stream refuses (another writer moved it on) turns its outcome into
    `lost`, and its (request id, admission) is handed back so the engine drops the request.
    A Redis failure sets `failed`: the rank must start afresh.
    """

    def __init__(self, settings: Settings, keys: Keys, max_pending: int = 2) -> None:
        self.keys = keys
        self.results_key = keys.step_results(settings.pool)
        self.redis = connect(settings.redis_url)
        self.writer = ResultWriter(self.redis, keys)
        self.outbox: queue.Queue[tuple[int, StepOutput] | None] = queue.Queue(max_pending)
        self.refused: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self.failed = threading.Event()
        self.generation = 0
        self.thread = threading.Thread(target=self._loop, name="publisher", daemon=True)
        self.thread.start()

    def submit(self, output: StepOutput) -> None:
        """Queue a step (blocks while `max_pending` steps are still unpublished)."""
        self.outbox.put((self.generation, output))

    def take_refused(self) -> set[tuple[str, int]]:
        """(request id, admission) pairs whose streams refused this rank since last asked."""
        pairs = set()
        while not self.refused.empty():
            pairs.add(self.refused.get())
        return pairs

    def reset(self) -> None:
        """Forget queued steps of the old incarnation and wait for the one in flight."""
        self.generation += 1
        self.outbox.join()
        self.failed.clear()

    def close(self) -> None:
        """Publish what is queued, then stop the thread."""
        self.outbox.put(None)
        self.thread.join(timeout=30)
        self.redis.close()

    def _loop(self) -> None:
        while True:
            item = self.outbox.get()
            try:
                if item is None:
                    return
                generation, output = item
                if generation == self.generation and not self.failed.is_set():
                    self._publish(output)
            except redis.RedisError as exc:
                log.warning("publishing failed (%s); the rank starts afresh", exc)
                self.failed.set()
            finally:
                self.outbox.task_done()

    def _append(self, output: StepOutput) -> list[object]:
        if not output.chunks:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for chunk, ttl_s in output.chunks:
            self.writer.append(pipe, chunk, ttl_s)
        return list(pipe.execute())

    def _publish(self, output: StepOutput) -> None:
        """Append the step's chunks (one round trip), then report the step."""
        try:
            replies = self._append(output)
        except redis.exceptions.NoScriptError:  # Redis restarted without its script cache
            self.writer.load()
            replies = self._append(output)
        refused = {c.id for (c, _), r in zip(output.chunks, replies) if r != APPENDED}
        if refused:
            log.warning("result streams moved on without this rank: %s", sorted(refused))
            for outcome in output.result.outcomes:
                if outcome.request_id in refused:
                    outcome.lost, outcome.finish_reason = True, None
                    self.refused.put((outcome.request_id, outcome.admission))
        self.redis.xadd(
            self.results_key,
            {FIELD: encode(output.result)},
            maxlen=STEP_RESULTS_MAXLEN,
            approximate=True,
        )
