"""Opening Redis connections the same way in every process."""

from __future__ import annotations

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
