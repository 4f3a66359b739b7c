"""The metrics contract: what the batcher and every rank expose to Prometheus scrapers, each
from its own registry over HTTP (prometheus-client), under `npupool_*` names labelled with
the pool (and rank), as the README lists them.

Counters are read from the counts a service already keeps, at scrape time, so nothing is
counted twice; latencies are histograms observed where they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class CountsCollector(Collector):
    """Exposes a dict of running counts (and gauges) under `npupool_*` names."""

    def __init__(
        self, counts: Callable[[], dict[str, float]], labels: dict[str, str], gauges: set[str]
    ) -> None:
        self.counts = counts
        self.labels = labels
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        for name, value in sorted(self.counts().items()):
            family: GaugeMetricFamily | CounterMetricFamily
            if name in self.gauges:
                family = GaugeMetricFamily(f"npupool_{name}", name, labels=names)
            else:
                family = CounterMetricFamily(f"npupool_{name}", name, labels=names)
            family.add_metric(values, float(value))
            yield family


def serve_metrics(port: int, registry: CollectorRegistry) -> None:
    """Serve `registry` on http://0.0.0.0:`port`/metrics, from a daemon thread."""
    start_http_server(port, registry=registry)
