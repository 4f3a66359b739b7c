"""Opening Redis connections the same way in every process."""

from __future__ import annotations

from typing import Any, cast

import redis

from schemas.config import resolve_redis_url


def connect(redis_url: str | None = None, *, timeout_s: float = 10.0) -> redis.Redis:
    """A client for the resolved URL (redis://, rediss://, with user/password if given)."""
    url = resolve_redis_url(redis_url)
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        health_check_interval=30,
        decode_responses=False,
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
