"""Finding Redis and opening connections to it the same way in every process: the URL given,
else `REDIS_URL`, else the one a running `npu-pool up` recorded in the cache directory."""

from __future__ import annotations

import json
import os
import urllib.parse
from pathlib import Path
from typing import Any, cast

import redis

from schemas.config import cache_dir


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


def redacted_url(url: str) -> str:
    """`url` with its password shown as `***`, for logs and `npu-pool status`."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


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
