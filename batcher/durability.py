"""At-least-once intake across crashes (DESIGN §7): own pending entries, leases, claims.

A pool reads entries as consumer `{pool}` of group `pools` and acknowledges one only after
its final chunk is written. A restarted batcher claims its own pending entries back; a
live batcher keeps its entries' idle time near zero and its lease fresh; entries idle for
longer than a lease belong to a pool that is gone, and any other pool claims them
(XAUTOCLAIM). Every claim counts a delivery; past `max_deliveries` an entry is dead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import redis

from schemas.keys import GROUP, Keys


@dataclass(slots=True)
class Delivery:
    """A request entry this pool now holds, with how often it has been delivered."""

    entry_id: bytes
    fields: dict[bytes, bytes] | None  # None: the entry was deleted meanwhile
    times_delivered: int


def claim_own_pending(
    client: redis.Redis, keys: Keys, pool: str, batch: int = 500
) -> list[Delivery]:
    """Every entry still pending for this pool's consumer, claimed back (counting a delivery)."""
    deliveries: list[Delivery] = []
    start = "-"
    while True:
        pending = cast(
            list[dict[str, Any]],
            client.xpending_range(
                keys.requests, GROUP, min=start, max="+", count=batch, consumername=pool
            ),
        )
        if not pending:
            return deliveries
        ids = [p["message_id"] for p in pending]
        counts = {p["message_id"]: int(p["times_delivered"]) for p in pending}
        claimed = cast(list[Any], client.xclaim(keys.requests, GROUP, pool, 0, ids))
        found = {entry_id: fields for entry_id, fields in claimed}
        deliveries += [Delivery(i, found.get(i), counts[i] + 1) for i in ids]
        if len(pending) < batch:
            return deliveries
        start = "(" + ids[-1].decode()


def keep_alive(
    client: redis.Redis, keys: Keys, pool: str, instance: str, lease_ms: int, entry_ids: list[bytes]
) -> None:
    """Renew this pool's lease and reset the idle time of every entry it holds."""
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.lease(pool), instance, px=lease_ms)
    for i in range(0, len(entry_ids), 500):
        batch: list[Any] = list(entry_ids[i : i + 500])
        pipe.xclaim(keys.requests, GROUP, pool, 0, batch, justid=True)
    pipe.execute()


def orphaned_pools(client: redis.Redis, keys: Keys, pool: str) -> list[str]:
    """Registered pools other than this one whose lease has expired."""
    others = sorted(bytes(p).decode() for p in cast(set[bytes], client.smembers(keys.pools)))
    others = [p for p in others if p != pool]
    if not others:
        return []
    pipe = client.pipeline(transaction=False)
    for other in others:
        pipe.exists(keys.lease(other))
    return [p for p, alive in zip(others, pipe.execute()) if not alive]


def claim_orphans(
    client: redis.Redis, keys: Keys, pool: str, min_idle_ms: int, count: int
) -> list[Delivery]:
    """Claim up to `count` entries idle longer than a lease, from pools that are gone."""
    reply = cast(
        list[Any],
        client.xautoclaim(keys.requests, GROUP, pool, min_idle_ms, start_id="0-0", count=count),
    )
    claimed = [(entry_id, fields) for entry_id, fields in reply[1] if entry_id]
    if not claimed:
        return []
    pipe = client.pipeline(transaction=False)
    for entry_id, _ in claimed:
        pipe.xpending_range(keys.requests, GROUP, min=entry_id, max=entry_id, count=1)
    counts = [int(p[0]["times_delivered"]) if p else 1 for p in pipe.execute()]
    return [Delivery(i, f, n) for (i, f), n in zip(claimed, counts)]
