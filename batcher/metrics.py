"""The batcher's Prometheus registry: its counts, step latency, and the request latencies it
observes (queue time, time to first token, inter-token latency) from each entry's enqueue
time (its stream id) and the step results; with them, per tenant, the queue, the running
and waiting requests, tokens and time to first token."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batcher.intake import Tracked
from batcher.scheduler import PoolState, Sequence
from schemas.keys import Keys
from schemas.metrics import CountsCollector
from schemas.tenants import stream_owners

STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# gauge name -> tenant -> value, read at scrape time
TenantGauges = dict[str, dict[str, float]]


def enqueued_at(tracked: Tracked) -> float:
    """Epoch seconds at which the request entered the stream (its entry id's milliseconds)."""
    return int(tracked.entry_id.split(b"-")[0]) / 1000


def tenant_load(state: PoolState) -> dict[str, dict[str, int]]:
    """Running and waiting requests of each tenant the pool holds work of."""
    load: dict[str, dict[str, int]] = {}
    for kind, sequences in (("running", state.running.values()), ("waiting", state.waiting)):
        for seq in sequences:
            counts = load.setdefault(seq.tenant, {"running": 0, "waiting": 0})
            counts[kind] += 1
    return load


def kv_blocks(state: PoolState, max_model_len: int) -> dict[str, int]:
    """The pool's cache in blocks: over its live ranks' slots (`kv_blocks_total`), those
    its running requests' tokens fill (`kv_blocks_used`), and the distinct prefix blocks its
    slots hold for reuse (`cached_blocks`); in a cache of blocks, the ranks' blocks, those
    requests hold, and those keyed by the prefix they hold."""
    if state.config.paged:
        pools = [state.pools[r] for r in state.ranks if r in state.pools]
        return {
            "kv_blocks_total": sum(p.total for p in pools),
            "kv_blocks_used": sum(p.num_used for p in pools),
            "cached_blocks": sum(p.num_cached for p in pools),
        }
    block = state.config.block_size
    per_slot = -(-max_model_len // block)
    total = len(state.ranks) * state.config.kv_slots_per_rank * per_slot
    used = sum(
        -(-min(s.num_prompt_tokens + s.num_planned_tokens, max_model_len) // block)
        for s in state.running.values()
    )
    return {
        "kv_blocks_total": total,
        "kv_blocks_used": used,
        "cached_blocks": state.prefix.blocks_held(),
    }


def tenant_queue_depths(client: redis.Redis, keys: Keys) -> dict[str, int]:
    """Entries on each tenant's request streams, delivered or not (as `queue_depth` counts)."""
    owners = stream_owners(client, keys)
    pipe = client.pipeline(transaction=False)
    for stream in owners:
        pipe.xlen(stream)
    depths: dict[str, int] = {}
    for tenant, depth in zip(owners.values(), pipe.execute()):
        depths[tenant] = depths.get(tenant, 0) + int(depth)
    return depths


def tenant_gauges(load: dict[str, dict[str, int]], client: redis.Redis, keys: Keys) -> TenantGauges:
    """`tenant_queue_depth` read now, `tenant_running` and `tenant_waiting` from `load` (the
    last heartbeat's), each over every tenant with streams or work (0 where it has none)."""
    depths: dict[str, int] = {}
    # read from the metrics server's thread (a redis-py client may be shared); with Redis
    # away the scrape still shows what the pool holds
    with contextlib.suppress(redis.RedisError):
        depths = tenant_queue_depths(client, keys)
    gauges: TenantGauges = {"tenant_queue_depth": {t: float(n) for t, n in depths.items()}}
    tenants = sorted({*load, *depths})
    for kind in ("running", "waiting"):
        gauges[f"tenant_{kind}"] = {t: float(load.get(t, {}).get(kind, 0)) for t in tenants}
    return gauges


class TenantGaugesCollector(Collector):
    """Exposes `npupool_{name}{pool, tenant}` gauges from a callback's values."""

    def __init__(self, gauges: Callable[[], TenantGauges], pool: str) -> None:
        self.gauges = gauges
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        for name, by_tenant in sorted(self.gauges().items()):
            family = GaugeMetricFamily(f"npupool_{name}", name, labels=["pool", "tenant"])
            for tenant, value in sorted(by_tenant.items()):
                family.add_metric([self.pool, tenant], float(value))
            yield family


class BatcherMetrics:
    """Counts read at scrape time (`gauges` among them), `npupool_step_seconds`, and
    `npupool_queue_seconds`, `npupool_ttft_seconds`, `npupool_itl_seconds`; per tenant,
    the gauges `tenant_gauges` gives and `npupool_tenant_tokens_total`,
    `npupool_tenant_ttft_seconds` (new series: the pool-wide ones keep their labels).

    The request latencies are observed once per request (per token for ITL) on its first
    run: a request that resumes after a failure is not counted again for queue time or TTFT."""

    def __init__(
        self,
        pool: str,
        counts: Callable[[], dict[str, float]],
        gauges: set[str],
        tenant_gauges: Callable[[], TenantGauges] = dict,
    ) -> None:
        self.registry = registry = CollectorRegistry()
        registry.register(CountsCollector(counts, {"pool": pool}, gauges))
        registry.register(TenantGaugesCollector(tenant_gauges, pool))

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...] = BUCKETS, by_tenant: bool = False
        ) -> Histogram:
            labels = ["pool", "tenant"] if by_tenant else ["pool"]
            return Histogram(name, doc, labels, registry=registry, buckets=buckets)

        self.step_seconds = histogram(
            "npupool_step_seconds", "dispatch to the last rank's result, per step", STEP_BUCKETS
        ).labels(pool)

        self.queue = histogram("npupool_queue_seconds", "enqueue to admission into a slot").labels(
            pool
        )
        self.ttft = histogram("npupool_ttft_seconds", "enqueue to first token").labels(pool)
        self.itl = histogram("npupool_itl_seconds", "between a request's tokens").labels(pool)
        self.pool = pool
        self.tenant_ttft = histogram(
            "npupool_tenant_ttft_seconds", "enqueue to first token, by tenant", by_tenant=True
        )
        self.tenant_tokens = Counter(
            "npupool_tenant_tokens", "tokens, by tenant", ["pool", "tenant"], registry=registry
        )
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
        tenant = tracked.request.tenant
        self.tenant_tokens.labels(self.pool, tenant).inc(num_new)
        last = self.last_token_at.get(tracked.request_id)
        if last is not None:
            for _ in range(num_new):  # tokens of one step share its latency evenly
                self.itl.observe((now - last) / num_new)
        elif tracked.num_published == 0 and not tracked.resumed_ids:
            ttft = max(0.0, now - enqueued_at(tracked))
            self.ttft.observe(ttft)
            self.tenant_ttft.labels(self.pool, tenant).observe(ttft)
            for _ in range(num_new - 1):  # MTP: the step's second token came at once
                self.itl.observe(0.0)
        self.last_token_at[tracked.request_id] = now

    def forget(self, request_id: str) -> None:
        """The request is over."""
        self.admitted_ids.discard(request_id)
        self.last_token_at.pop(request_id, None)
