"""Finding Redis and opening connections to it the same way in every process: the URL given,
else `REDIS_URL`, else the one a running `npu-pool up` recorded in the cache directory."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, cast

import redis
import redis.asyncio as aioredis

from schemas.config import cache_dir
from schemas.sentinel import (
    SENTINEL_READ_TIMEOUT_S,
    async_sentinel_client,
    redacted_url,
    sentinel_address,
    sentinel_client,
)

__all__ = ["redacted_url", "sentinel_address"]  # also found here, where URLs are resolved


def replicas_to_wait(url: str, min_replicas_ack: int | None) -> int:
    """Replicas a write must reach before it counts: as set, else 1 behind Sentinels (whose
    failovers promote a replica, losing what it had not received) and 0 otherwise."""
    if min_replicas_ack is not None:
        return min_replicas_ack
    return 1 if sentinel_address(url) is not None else 0


def connect(
    redis_url: str | None = None, *, timeout_s: float = 10.0, read_timeout_s: float | None = None
) -> redis.Redis:
    """A client for the resolved URL: redis://, rediss:// (with user/password if given), or
    a Sentinel URL, whose client finds the current primary through the Sentinels and, after
    a failover, the new one by itself (a command in flight then fails with ConnectionError)."""
    url = resolve_redis_url(redis_url)
    address = sentinel_address(url)
    if address is None:
        return redis.Redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_timeout=read_timeout_s,
            health_check_interval=30,
            decode_responses=False,
        )
    return sentinel_client(
        address,
        socket_connect_timeout=timeout_s,
        socket_timeout=read_timeout_s or SENTINEL_READ_TIMEOUT_S,
        health_check_interval=30,
        decode_responses=False,
    )


def reset_connections(client: redis.Redis) -> None:
    """Close every pooled connection after a Redis error, so each command from now on finds
    the primary afresh: behind Sentinels an idle connection may still reach a demoted or
    resumed old primary, whose writes a resync then drops."""
    with contextlib.suppress(redis.RedisError, OSError):
        client.connection_pool.disconnect()


def connect_async(url: str, max_connections: int) -> aioredis.Redis:
    """An asyncio client of `url` (resolved already) whose commands wait for one of
    `max_connections` connections; through the Sentinels for a Sentinel URL."""
    address = sentinel_address(url)
    if address is None:
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections)
        return aioredis.Redis(connection_pool=pool)
    return async_sentinel_client(
        address, max_connections=max_connections, socket_timeout=SENTINEL_READ_TIMEOUT_S
    )


Entry = tuple[bytes, dict[bytes, bytes]]


def stream_entries(reply: Any) -> list[Entry]:
    """The entries of the one stream an XREAD / XREADGROUP reply covers (none on timeout)."""
    if not reply:
        return []
    return cast(list[Entry], reply[0][1])


def hash_fields(reply: Any) -> dict[bytes, bytes]:
    """An HGETALL reply, typed as the bytes mapping it is on a non-decoding client."""
    return cast(dict[bytes, bytes], reply)


def last_entry_id(client: redis.Redis, key: str) -> bytes:
    """The id of a stream's newest entry ("0-0" when empty): read after it to miss nothing."""
    last = cast(list[Entry], client.xrevrange(key, count=1))
    return last[0][0] if last else b"0-0"


def redis_record_path() -> Path:
    """Where a running `npu-pool up` records its embedded Redis URL."""
    return cache_dir() / "redis.json"


def resolve_redis_url(redis_url: str | None) -> str:
    """The URL to use: the one given, REDIS_URL, or the local `npu-pool up`'s embedded Redis."""
    if redis_url:
        return redis_url
    env = os.environ.get("REDIS_URL") or os.environ.get("NPUPOOL_REDIS_URL")
    if env:
        return env
    record = redis_record_path()
    if record.exists():
        info = json.loads(record.read_text())
        if _pid_alive(int(info.get("pid", 0))):
            return str(info["url"])
    raise ConnectionError(
        "no Redis to talk to: pass --redis-url, set REDIS_URL, or start `npu-pool up` "
        f"(it records its embedded Redis in {record})"
    )


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
