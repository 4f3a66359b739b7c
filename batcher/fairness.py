"""Fair shares between tenants (docs/architecture.md §3a): pure functions of what the
planner already holds, no clock.

The rule, *weighted fair occupancy*: each tenant running or waiting has a share of the
pool's capacity, `capacity * weight / total weight` (capped by its `max_running`, what a
cap leaves spread over the others). Requests are served (admitted to a slot, or delivered
from the queue) by repeating: the most urgent remaining request fixes a priority class c
(so priority across classes and aging are as without tenants); of the tenants whose most
urgent remaining request is of class c, the one furthest below its share (`share - held`
largest; ties: the more urgent head, then the older) gives its most urgent request.
`held` is what the tenant holds already, counted again with every request served. Handing
out slots one at a time to the tenant furthest below its share keeps every tenant within
one slot of its share once the pool is full. A tenant with nothing waiting takes nothing,
so its share goes to the others (work-conserving). While every slot is taken, a tenant
under its share takes a slot from the tenant most over its own when the two distances add
up to more than a slot, of the same priority class or lower (the planner's
`_preempt_for_share`); where no such pair is left, every tenant is within one slot of its
share.

A rank's prefill launches go to its admitted prompts by the class rule, then by *virtual
time*: the tenant with the fewest prefilled tokens over its weight first (`prefill_order`;
the planner keeps the times). Every prompt served advances its tenant's time, so no
admitted prompt waits for ever.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batcher.scheduler import Sequence

# Shares are fractions of slots: a tenant at its share within this is at its share.
EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class TenantShare:
    """What the planner knows of a tenant: its weight and how many may run at once."""

    weight: float = 1.0
    max_running: int | None = None


DEFAULT_SHARE = TenantShare()


def share_of(tenants: Mapping[str, TenantShare], name: str) -> TenantShare:
    """A tenant's settings (a tenant not configured: weight 1, no cap)."""
    return tenants.get(name, DEFAULT_SHARE)


def at_cap(tenants: Mapping[str, TenantShare], name: str, held: Mapping[str, int]) -> bool:
    """True when the tenant runs as many requests as its `max_running` allows."""
    cap = share_of(tenants, name).max_running
    return cap is not None and held.get(name, 0) >= cap


def fair_order(
    seqs: list[Sequence],
    held: Mapping[str, int],
    tenants: Mapping[str, TenantShare],
    capacity: int,
) -> list[Sequence]:
    """`seqs` (most urgent first, then oldest) in the order the rule above serves them,
    each tenant starting from what it holds in `held` (not changed), shares taken of
    `capacity` slots."""
    queues = _queues(seqs)
    if len(queues) <= 1:
        return list(seqs)
    active = {name for name, n in held.items() if n > 0} | queues.keys()
    shares = fair_shares(active, capacity, tenants)
    standing = {name: held.get(name, 0) - shares[name] for name in queues}
    return _serve(queues, standing, lambda seq: 1.0)


def prefill_order(
    seqs: list[Sequence],
    served: Mapping[str, float],
    tenants: Mapping[str, TenantShare],
    most_tokens: int,
) -> list[Sequence]:
    """Prompts waiting for prefill on a rank (most urgent first, then oldest) in the order
    that shares prefill tokens by weight: the class rule above, then the tenant with the
    least virtual time (`served`: tokens prefilled over weight, not changed), which each
    prompt served advances by its remaining tokens (at most `most_tokens`, what a step could
    prefill) over the weight. Every tenant's time advances as it is served, so no prompt
    waits for ever, whatever its requests do after."""
    queues = _queues(seqs)
    if len(queues) <= 1:
        return list(seqs)

    def cost(seq: Sequence) -> float:
        tokens = min(seq.num_prompt_tokens - seq.num_prefilled, most_tokens)
        return tokens / share_of(tenants, seq.tenant).weight

    return _serve(queues, {name: served.get(name, 0.0) for name in queues}, cost)


def _queues(seqs: list[Sequence]) -> dict[str, deque[Sequence]]:
    queues: dict[str, deque[Sequence]] = {}
    for seq in seqs:
        queues.setdefault(seq.tenant, deque()).append(seq)
    return queues


def _serve(
    queues: dict[str, deque[Sequence]],
    standing: dict[str, float],
    cost: Callable[[Sequence], float],
) -> list[Sequence]:
    """Serve the tenants' queues by the class rule, lowest standing first within the class
    (ties: the more urgent head, then the older); serving a request adds its cost to its
    tenant's standing."""
    # each tenant's head sits in two heaps: by urgency (which class goes next) and in its
    # class's heap by standing; an entry of an older head is skipped
    version = dict.fromkeys(queues, 0)
    by_urgency: list[tuple[float, int, str, int]] = []
    by_class: dict[int, list[tuple[float, float, int, str, int]]] = {}

    def push(name: str) -> None:
        head = queues[name][0]
        ver = version[name]
        heapq.heappush(by_urgency, (-head.urgency, head.order, name, ver))
        entry = (standing[name], -head.urgency, head.order, name, ver)
        heapq.heappush(by_class.setdefault(head.priority, []), entry)

    for name in queues:
        push(name)
    served: list[Sequence] = []
    while len(queues) > 1:
        while by_urgency[0][3] != version[by_urgency[0][2]]:
            heapq.heappop(by_urgency)
        heap = by_class[queues[by_urgency[0][2]][0].priority]
        while heap[0][4] != version[heap[0][3]]:
            heapq.heappop(heap)
        name = heapq.heappop(heap)[3]
        queue = queues[name]
        seq = queue.popleft()
        served.append(seq)
        standing[name] += cost(seq)
        version[name] += 1
        if queue:
            push(name)
        else:
            del queues[name]
    for queue in queues.values():
        served.extend(queue)
    return served


def fair_shares(
    active: Iterable[str], capacity: int, tenants: Mapping[str, TenantShare]
) -> dict[str, float]:
    """Each active tenant's share of `capacity` slots: in proportion to the weights, none
    over its `max_running`, what a cap leaves spread over the others."""
    found = {name: tenants.get(name, DEFAULT_SHARE) for name in active}
    weights = {name: t.weight for name, t in found.items()}
    caps = {name: t.max_running for name, t in found.items() if t.max_running is not None}
    shares: dict[str, float] = {}
    room = float(capacity)
    while weights:
        scale = room / sum(weights.values())
        fair = {name: scale * w for name, w in weights.items()}
        capped = {name: float(cap) for name, cap in caps.items() if cap < fair[name]}
        if not capped:
            shares.update(fair)
            break
        shares.update(capped)
        room -= sum(capped.values())
        for name in capped:
            del weights[name], caps[name]
    return shares
