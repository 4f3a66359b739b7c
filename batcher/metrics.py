"""The batcher's Prometheus registry: its counts, step latency, and the request latencies it
observes (queue time, time to first token, inter-token latency) from each entry's enqueue
time (its stream id) and the step results."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

from batcher.intake import Tracked
from batcher.scheduler import Sequence
from schemas.metrics import CountsCollector

STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def enqueued_at(tracked: Tracked) -> float:
    """Epoch seconds at which the request entered the stream (its entry id's milliseconds)."""
    return int(tracked.entry_id.split(b"-")[0]) / 1000


class BatcherMetrics:
    """Counts read at scrape time (`gauges` among them), `npupool_step_seconds`, and
    `npupool_queue_seconds`, `npupool_ttft_seconds`, `npupool_itl_seconds`.

    The request latencies are observed once per request (per token for ITL) on its first
    run: a request that resumes after a failure is not counted again for queue time or TTFT."""

    def __init__(self, pool: str, counts: Callable[[], dict[str, float]], gauges: set[str]) -> None:
        self.registry = registry = CollectorRegistry()
        registry.register(CountsCollector(counts, {"pool": pool}, gauges))

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = BUCKETS) -> Histogram:
            return Histogram(name, doc, ["pool"], registry=registry, buckets=buckets)

        self.step_seconds = histogram(
            "npupool_step_seconds", "dispatch to the last rank's result, per step", STEP_BUCKETS
        ).labels(pool)

        self.queue = histogram("npupool_queue_seconds", "enqueue to admission into a slot").labels(
            pool
        )
        self.ttft = histogram("npupool_ttft_seconds", "enqueue to first token").labels(pool)
        self.itl = histogram("npupool_itl_seconds", "between a request's tokens").labels(pool)
        self.admitted_ids: set[str] = set()
        self.last_token_at: dict[str, float] = {}

    def admitted(self, sequences: list[Sequence], tracked: dict[str, Tracked]) -> None:
        """Requests took slots (a request's first time only counts)."""
        now = time.time()
        for seq in sequences:
            request = tracked.get(seq.request_id)
            if request is None or seq.request_id in self.admitted_ids or request.resumed_ids:
                continue
            self.admitted_ids.add(seq.request_id)
            self.queue.observe(max(0.0, now - enqueued_at(request)))

    def tokens(self, tracked: Tracked, num_new: int) -> None:
        """A step result brought `num_new` tokens of a request (before they are counted)."""
        if num_new <= 0:
            return
        now = time.time()
        last = self.last_token_at.get(tracked.request_id)
        if last is not None:
            for _ in range(num_new):  # tokens of one step share its latency evenly
                self.itl.observe((now - last) / num_new)
        elif tracked.num_published == 0 and not tracked.resumed_ids:
            self.ttft.observe(max(0.0, now - enqueued_at(tracked)))
            for _ in range(num_new - 1):  # MTP: the step's second token came at once
                self.itl.observe(0.0)
        self.last_token_at[tracked.request_id] = now

    def forget(self, request_id: str) -> None:
        """The request is over."""
        self.admitted_ids.discard(request_id)
        self.last_token_at.pop(request_id, None)
