"""At-least-once intake across crashes: own pending entries, leases, claims (see
docs/architecture.md §7).

A pool reads entries as consumer `{pool}` of group `pools` and acknowledges one only after
its final chunk is written. A restarted batcher claims its own pending entries back; a
live batcher keeps its entries' idle time near zero and its lease fresh; entries idle for
longer than a lease belong to a pool that is gone, and any other pool claims them
(XAUTOCLAIM). Every claim counts a delivery; past `max_deliveries` an entry is dead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, cast

import redis

from schemas.keys import GROUP, Keys
from schemas.tenants import request_streams


@dataclass(slots=True)
class Delivery:
    """A request entry this pool now holds, with how often it has been delivered."""

    entry_id: bytes
    fields: dict[bytes, bytes] | None  # None: the entry was deleted meanwhile
    times_delivered: int
    stream: str  # the request stream (priority class) it is on


def ensure_groups(client: redis.Redis, keys: Keys) -> None:
    """Create the consumer group on every request stream (and the stream)."""
    for stream in request_streams(client, keys):
        with contextlib.suppress(redis.ResponseError):  # BUSYGROUP: it exists already
            client.xgroup_create(stream, GROUP, id="0", mkstream=True)


def claim_own_pending(
    client: redis.Redis, keys: Keys, pool: str, batch: int = 500
) -> list[Delivery]:
    """Every entry still pending for this pool's consumer, claimed back (counting a delivery)."""
    deliveries: list[Delivery] = []
    for stream in request_streams(client, keys):
        start = "-"
        while True:
            pending = cast(
                list[dict[str, Any]],
                client.xpending_range(
                    stream, GROUP, min=start, max="+", count=batch, consumername=pool
                ),
            )
            if not pending:
                break
            ids = [p["message_id"] for p in pending]
            counts = {p["message_id"]: int(p["times_delivered"]) for p in pending}
            claimed = cast(list[Any], client.xclaim(stream, GROUP, pool, 0, ids))
            found = {entry_id: fields for entry_id, fields in claimed}
            deliveries += [Delivery(i, found.get(i), counts[i] + 1, stream) for i in ids]
            if len(pending) < batch:
                break
            start = "(" + ids[-1].decode()
    return deliveries


def keep_alive(
    client: redis.Redis,
    keys: Keys,
    pool: str,
    instance: str,
    lease_ms: int,
    held: list[tuple[str, bytes]],
) -> None:
    """Renew this pool's lease and reset the idle time of every (stream, entry) it holds."""
    by_stream: dict[str, list[bytes]] = {}
    for stream, entry_id in held:
        by_stream.setdefault(stream, []).append(entry_id)
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.lease(pool), instance, px=lease_ms)
    for stream, entry_ids in by_stream.items():
        for i in range(0, len(entry_ids), 500):
            batch: list[Any] = list(entry_ids[i : i + 500])
            pipe.xclaim(stream, GROUP, pool, 0, batch, justid=True)
    pipe.execute()


def count_delivery(pipe: redis.client.Pipeline, pool: str, stream: str, entry_id: bytes) -> None:
    """Count one more delivery of a held entry in Redis (a claim without JUSTID does)."""
    pipe.xclaim(stream, GROUP, pool, 0, [entry_id], justid=False)


def live_pools(client: redis.Redis, keys: Keys) -> set[str]:
    """Registered pools whose batcher holds its lease now."""
    names = sorted(bytes(p).decode() for p in cast(set[bytes], client.smembers(keys.pools)))
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.exists(keys.lease(name))
    return {name for name, alive in zip(names, pipe.execute()) if alive}


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
    """Claim up to `count` entries idle longer than a lease, from pools that are gone
    (highest priority class first)."""
    found: list[Delivery] = []
    for stream in request_streams(client, keys):
        if len(found) >= count:
            break
        reply = cast(
            list[Any],
            client.xautoclaim(
                stream, GROUP, pool, min_idle_ms, start_id="0-0", count=count - len(found)
            ),
        )
        claimed = [(entry_id, fields) for entry_id, fields in reply[1] if entry_id]
        if not claimed:
            continue
        pipe = client.pipeline(transaction=False)
        for entry_id, _ in claimed:
            pipe.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
        counts = [int(p[0]["times_delivered"]) if p else 1 for p in pipe.execute()]
        found += [Delivery(i, f, n, stream) for (i, f), n in zip(claimed, counts)]
    return found
