"""Reading the pool registry: which pools and ranks run where, and the queue."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, cast

import redis

from schemas.connection import hash_fields
from schemas.keys import DEFAULT_TENANT, GROUP, PRIORITY_CLASSES, Keys, stream_class
from schemas.registry import RESTING_STATES, BatcherState, PoolField, RankField, RankState
from schemas.tenants import stream_owners

STALE_AFTER_MS = 10_000


class PoolFailed(RuntimeError):
    """A pool cannot serve: one of its ranks failed to start, for a reason restarts don't fix."""


def _text(info: dict[bytes, bytes], field: str, default: str = "") -> str:
    value = info.get(field.encode())
    return value.decode() if value is not None else default


def _int(info: dict[bytes, bytes], field: str) -> int:
    value = info.get(field.encode())
    return int(float(value)) if value is not None else 0


def _liveness(state: str, hb_ms: int, now_ms: int) -> str:
    if state not in (*RESTING_STATES, "") and now_ms - hb_ms > STALE_AFTER_MS:
        return "unresponsive"
    return state or "unknown"


def pool_status(client: redis.Redis, keys: Keys, pool: str, now_ms: int) -> dict[str, Any]:
    """One pool's entry of `npu-pool status --json`."""
    info = hash_fields(client.hgetall(keys.pool(pool)))
    num_ranks = _int(info, PoolField.RANKS)
    planned = {int(r) for r in _text(info, PoolField.PLANNED).split(",") if r}
    ranks = []
    for rank in range(num_ranks):
        r = hash_fields(client.hgetall(keys.rank(pool, rank)))
        ranks.append(
            {
                "rank": rank,
                "pid": _int(r, RankField.PID),
                "host": _text(r, RankField.HOST),
                "device": _text(r, RankField.DEVICE),
                "state": _liveness(
                    _text(r, RankField.STATE), _int(r, RankField.HEARTBEAT_MS), now_ms
                ),
                "reason": _text(r, RankField.REASON) or None,
                "planned": rank in planned,  # the batcher plans work for it
                "requests": [i for i in _text(r, RankField.REQUESTS).split(",") if i],
                "weight_bytes": _int(r, RankField.WEIGHT_BYTES),
                "checkpoint_bytes": _int(r, RankField.CHECKPOINT_BYTES),
                "progress": {
                    "what": _text(r, RankField.PROGRESS),
                    "done": _int(r, RankField.PROGRESS_DONE),
                    "total": _int(r, RankField.PROGRESS_TOTAL),
                },
            }
        )
    return {
        "pool": pool,
        "state": _liveness(
            _text(info, PoolField.STATE), _int(info, PoolField.HEARTBEAT_MS), now_ms
        ),
        "epoch": _int(info, PoolField.EPOCH),
        "batcher": {
            "pid": _int(info, PoolField.BATCHER_PID),
            "host": _text(info, PoolField.BATCHER_HOST),
        },
        "ranks": ranks,
        "running": _int(info, PoolField.RUNNING),
        "waiting": _int(info, PoolField.WAITING),
        "steps": _int(info, "steps"),
        "tokens": _int(info, "tokens"),
        "finished": _int(info, "finished"),
        "rejected": _int(info, "rejected"),
        "decode_launches": _int(info, "decode_launches"),
        "padding_rows": _int(info, "padding_rows"),
        "preempted": _int(info, "preempted"),
        "prefill_launches": _int(info, "prefill_launches"),
        "prefill_tokens": _int(info, "prefill_tokens"),
        "kv_blocks_total": _int(info, PoolField.KV_BLOCKS_TOTAL),
        "kv_blocks_used": _int(info, PoolField.KV_BLOCKS_USED),
        "prefix_cache": {
            "cached_blocks": _int(info, PoolField.CACHED_BLOCKS),
            "queried_tokens": _int(info, "prefix_cache_queries"),
            "hit_tokens": _int(info, "prefix_cache_hits"),
        },
        "rank_time_us": {
            "exec": _int(info, "rank_exec_us"),
            "launch": _int(info, "rank_launch_us"),
            "idle": _int(info, "rank_idle_us"),
            "collective": _int(info, "rank_collective_us"),
        },
        "mtp": mtp_summary(_int(info, "mtp_proposed"), _int(info, "mtp_accepted")),
        "tenants": _tenant_load(info),
    }


def _tenant_load(info: dict[bytes, bytes]) -> dict[str, dict[str, int]]:
    """The pool's running and waiting requests by tenant, as its batcher last wrote them."""
    try:
        load = json.loads(info.get(b"tenants", b"{}"))
    except ValueError:
        return {}
    return load if isinstance(load, dict) else {}


def mtp_summary(proposed: int, accepted: int) -> dict[str, float]:
    """Draft counts, acceptance rate and tokens committed per verify row."""
    rate = accepted / proposed if proposed else 0.0
    return {
        "proposed": proposed,
        "accepted": accepted,
        "acceptance": round(rate, 4),
        "tokens_per_row": round(1 + rate, 4) if proposed else 0.0,
    }


def collect_status(client: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Every registered pool and the queue, as `npu-pool status --json` prints them."""
    now_ms = int(time.time() * 1000)
    pools = _pool_names(client, keys)
    streams = stream_depths(client, keys)
    by_class = _by_class(streams)
    return {
        "pools": [pool_status(client, keys, pool, now_ms) for pool in pools],
        "queue": {
            "outstanding": sum(depth for depth, _ in by_class.values()),
            "in_progress": sum(pending for _, pending in by_class.values()),
            "by_priority": {str(c): d for c, (d, _) in by_class.items() if d},
            "dead": int(client.xlen(keys.dead)),
            "tenants": tenant_queues(client, keys, streams),
        },
        "limits": namespace_limits(client, keys),
    }


def stream_depths(client: redis.Redis, keys: Keys) -> dict[str, tuple[str, int, int]]:
    """(tenant, entries, entries held by pools) of every request stream: each class's
    (`default`'s) and those the tenants' requests use (`{ns}:queues`)."""
    owners = stream_owners(client, keys)
    pipe = client.pipeline(transaction=False)
    for stream in owners:
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
    replies = pipe.execute(raise_on_error=False)
    found: dict[str, tuple[str, int, int]] = {}
    for i, (stream, tenant) in enumerate(owners.items()):
        depth, groups = replies[2 * i], replies[2 * i + 1]
        pending = 0
        if isinstance(groups, list):
            pending = sum(int(g["pending"]) for g in groups if g["name"] in (GROUP, GROUP.encode()))
        found[stream] = (tenant, int(depth) if isinstance(depth, int) else 0, pending)
    return found


def queue_depths(client: redis.Redis, keys: Keys) -> dict[int, tuple[int, int]]:
    """(entries, entries held by pools) of each priority class, over every tenant's stream."""
    return _by_class(stream_depths(client, keys))


def _by_class(streams: dict[str, tuple[str, int, int]]) -> dict[int, tuple[int, int]]:
    found = dict.fromkeys(PRIORITY_CLASSES, (0, 0))
    for stream, (_, depth, pending) in streams.items():
        klass = stream_class(stream)
        before = found.get(klass, (0, 0))
        found[klass] = (before[0] + depth, before[1] + pending)
    return found


def tenant_queues(
    client: redis.Redis, keys: Keys, streams: dict[str, tuple[str, int, int]]
) -> dict[str, dict[str, int | None]]:
    """Each tenant's entries not yet delivered to a pool (`queued`), those pools hold
    (`in_progress`) and its own `max_queue` (None: only the namespace's bound holds): every
    tenant with entries or named by a tenants file (`{ns}:tenants`), and `default`."""
    quotas = {
        bytes(t).decode(): bytes(q).decode()
        for t, q in cast(dict[bytes, bytes], client.hgetall(keys.tenants)).items()
    }
    counts: dict[str, tuple[int, int]] = {}
    for tenant, depth, pending in streams.values():
        queued, held = counts.get(tenant, (0, 0))
        counts[tenant] = (queued + max(0, depth - pending), held + pending)
    named = {DEFAULT_TENANT, *quotas, *(t for t, c in counts.items() if any(c))}
    found: dict[str, dict[str, int | None]] = {}
    for name in sorted(named):
        queued, held = counts.get(name, (0, 0))
        quota = quotas.get(name, "")
        found[name] = {
            "queued": queued,
            "in_progress": held,
            "max_queue": int(quota) if quota else None,
        }
    return found


def namespace_limits(client: redis.Redis, keys: Keys) -> dict[str, Any]:
    """The limits admission applies, and each pool's own (they may disagree)."""
    raw = hash_fields(client.hgetall(keys.limits))
    limits: dict[str, Any] = {"pools": {}}
    for field, value in raw.items():
        name = field.decode()
        if name.startswith("pool:"):
            with contextlib.suppress(ValueError):
                limits["pools"][name[5:]] = json.loads(value)
        else:
            limits[name] = int(value)
    return limits


def ready_pool(client: redis.Redis, keys: Keys, pool: str | None = None) -> str | None:
    """The name of a pool whose batcher is ready and plans for every rank, each ready, if
    any; PoolFailed when every pool asked about has a rank that cannot start."""
    now_ms = int(time.time() * 1000)
    names = [pool] if pool else _pool_names(client, keys)
    failures = []
    for name in names:
        status = pool_status(client, keys, name, now_ms)
        ready = RankState.READY.value
        if (
            status["state"] == BatcherState.READY.value
            and status["ranks"]
            and all(r["state"] == ready and r["planned"] for r in status["ranks"])
        ):
            return name
        failed = [r for r in status["ranks"] if r["state"] == RankState.FAILED.value]
        if failed:
            failures.append(
                f"pool {name}: "
                + "; ".join(f"rank {r['rank']} failed: {r['reason']}" for r in failed)
            )
    if names and len(failures) == len(names):
        raise PoolFailed(" | ".join(failures))
    return None


def _pool_names(client: redis.Redis, keys: Keys) -> list[str]:
    return sorted(bytes(p).decode() for p in cast(set[bytes], client.smembers(keys.pools)))
