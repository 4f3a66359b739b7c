"""Histograms a rank observes after each step: launch latency and launches per step, by
launch shape (B1S128 prefill, B8S1 decode or B4S2 verify)."""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry, Histogram

LAUNCH_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
COUNT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)


class RankMetrics:
    """`npupool_launch_seconds{shape}` (launch to sampled tokens on the host) and
    `npupool_launches_per_step{shape}`."""

    def __init__(self, registry: CollectorRegistry, pool: str, rank: int) -> None:
        labels = ["pool", "rank", "shape"]
        self.ids = (pool, str(rank))
        self.launch = Histogram(
            "npupool_launch_seconds",
            "one launch, from its start to its sampled tokens on the host",
            labels,
            registry=registry,
            buckets=LAUNCH_BUCKETS,
        )
        self.per_step = Histogram(
            "npupool_launches_per_step",
            "launches of a shape in one step of this rank",
            labels,
            registry=registry,
            buckets=COUNT_BUCKETS,
        )

    def step(self, shapes: tuple[str, ...], launch_seconds: list[tuple[str, float]]) -> None:
        """Observe one executed step."""
        counts = Counter(shape for shape, _ in launch_seconds)
        for shape in shapes:
            self.per_step.labels(*self.ids, shape).observe(counts[shape])
        for shape, seconds in launch_seconds:
            self.launch.labels(*self.ids, shape).observe(seconds)
