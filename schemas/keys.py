"""Every Redis key npu-pool uses, in one place (docs/architecture.md §5)."""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "pools"
FIELD = "m"
# Priority classes, highest first: each has its own request stream (class 0 is the
# documented `{ns}:requests`); a request's `priority` is clamped into this range.
MAX_PRIORITY = 9
MIN_PRIORITY = -9
PRIORITY_CLASSES = tuple(range(MAX_PRIORITY, MIN_PRIORITY - 1, -1))
DEFAULT_TENANT = "default"  # the tenant of a request that names none


def priority_class(priority: int) -> int:
    """The class (and so the request stream) of a priority: clamped to the class range."""
    return max(MIN_PRIORITY, min(MAX_PRIORITY, priority))


def stream_class(stream: str) -> int:
    """The priority class of a request stream, from its name (`...:p{c}`; none: class 0)."""
    head, _, tail = stream.rpartition(":p")
    try:
        return int(tail) if head else 0
    except ValueError:
        return 0


# Control streams are read as they arrive; these bound what they keep (approximately).
PLAN_STREAM_MAXLEN = 100
STEP_RESULTS_MAXLEN = 1000


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one namespace."""

    ns: str = "npupool"

    @property
    def requests(self) -> str:
        """Stream of request entries of priority class 0, consumer group `pools`."""
        return f"{self.ns}:requests"

    def request_stream(self, priority: int = 0) -> str:
        """The request stream of a priority's class: `{ns}:requests` or `{ns}:requests:p{c}`."""
        klass = priority_class(priority)
        return self.requests if klass == 0 else f"{self.ns}:requests:p{klass}"

    @property
    def request_streams(self) -> list[str]:
        """Every class's request stream, highest priority first."""
        return [self.request_stream(c) for c in PRIORITY_CLASSES]

    def tenant_stream(self, tenant: str, priority: int = 0) -> str:
        """The request stream of a tenant's priority class: the class's own stream for
        `default`, else `{ns}:tenant:{tenant}:requests:p{c}`."""
        if tenant == DEFAULT_TENANT:
            return self.request_stream(priority)
        return f"{self.ns}:tenant:{tenant}:requests:p{priority_class(priority)}"

    @property
    def queues(self) -> str:
        """Hash of the tenants' request streams in use: stream -> tenant (written by
        admission; `default`'s class streams are always in use and never listed)."""
        return f"{self.ns}:queues"

    @property
    def tenants(self) -> str:
        """Hash of the tenants a tenants file names: tenant -> its `max_queue` ("" for
        none), published by the batchers."""
        return f"{self.ns}:tenants"

    @property
    def limits(self) -> str:
        """Hash of the namespace's limits (`max_queue`, ...), published by its batchers."""
        return f"{self.ns}:limits"

    @property
    def cancel(self) -> str:
        """Stream of cancel entries (field `id`)."""
        return f"{self.ns}:cancel"

    @property
    def cancelled(self) -> str:
        """Sorted set of cancelled request ids (score: epoch ms), for entries not yet read."""
        return f"{self.ns}:cancelled"

    @property
    def dead(self) -> str:
        """Stream of entries that could not be served, with the reason."""
        return f"{self.ns}:dead"

    @property
    def pools(self) -> str:
        """Set of pool names that have registered."""
        return f"{self.ns}:pools"

    @property
    def batches(self) -> str:
        """Set of batch job ids not yet finished or failed."""
        return f"{self.ns}:batches"

    @property
    def batch_queue(self) -> str:
        """Name of the RQ queue batch jobs go on."""
        return f"{self.ns}-batch"

    def batch(self, batch_id: str) -> str:
        """Hash describing a batch job: input, output, window, total, sent, done, state."""
        return f"{self.ns}:batch:{batch_id}"

    def batch_lease(self, batch_id: str) -> str:
        """Lock held by the one run of a batch that may write its output."""
        return f"{self.ns}:batch:{batch_id}:lease"

    def result(self, request_id: str) -> str:
        """Result stream of one request."""
        return f"{self.ns}:result:{request_id}"

    def wake(self, name: str) -> str:
        """A subscriber's private stream, written to wake its own blocked XREAD."""
        return f"{self.ns}:wake:{name}"

    def pool(self, pool: str) -> str:
        """Hash describing a pool: state, batcher pid/host, ranks, model facts."""
        return f"{self.ns}:pool:{pool}:info"

    def rank(self, pool: str, rank: int) -> str:
        """Hash describing one rank: pid, host, device, state, heartbeat."""
        return f"{self.ns}:pool:{pool}:rank:{rank}"

    def plan(self, pool: str, rank: int) -> str:
        """Stream of step plans for one rank."""
        return f"{self.ns}:pool:{pool}:plan:{rank}"

    def step_results(self, pool: str) -> str:
        """Stream of step results from all ranks of a pool."""
        return f"{self.ns}:pool:{pool}:steps"

    def tokenizer(self, pool: str) -> str:
        """String holding the pool's tokenizer.json, published by rank 0."""
        return f"{self.ns}:pool:{pool}:tokenizer"

    def chat_template(self, pool: str) -> str:
        """String holding the model's chat template as JSON, published by rank 0."""
        return f"{self.ns}:pool:{pool}:chat_template"

    def rendezvous(self, pool: str) -> str:
        """Hash where rank 0 of an expert-parallel pool publishes its group's address."""
        return f"{self.ns}:pool:{pool}:rendezvous"

    def lease(self, pool: str) -> str:
        """The pool batcher's lease (string with a TTL)."""
        return f"{self.ns}:pool:{pool}:lease"
