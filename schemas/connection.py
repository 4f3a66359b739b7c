"""Finding Redis and opening connections to it the same way in every process: the URL given,
else `REDIS_URL`, else the one a running `npu-pool up` recorded in the cache directory."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.asyncio.sentinel import SentinelManagedConnection as AsyncSentinelConnection
from redis.sentinel import Sentinel, SentinelManagedConnection

from schemas.config import cache_dir

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
SENTINEL_PORT = 26379
# Behind Sentinels a read gives up after this long (every blocking read here blocks for at
# most a few seconds), so a client of a primary that hangs (paused, partitioned) notices,
# asks the Sentinels again and finds the promoted replica.
SENTINEL_READ_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class SentinelAddress:
    """A `redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]` URL
    (`rediss+sentinel://` for TLS): the Sentinels to ask, and the primary they name. The
    password is the primary's; Sentinels are asked without one."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False

    def primary_kwargs(self) -> dict[str, Any]:
        """Connection settings for the primary (and its replicas)."""
        return {
            "db": self.db,
            "username": self.username,
            "password": self.password,
            "ssl": self.ssl,
        }


def sentinel_address(url: str) -> SentinelAddress | None:
    """The Sentinel deployment a URL names; None for a plain `redis://` or `rediss://` URL.
    Raises ValueError naming what is wrong with a malformed Sentinel URL."""
    scheme, _, rest = url.partition("://")
    if scheme not in SENTINEL_SCHEMES:
        return None
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    sentinels = []
    for part in hosts.split(","):
        host, _, port = part.strip().rpartition(":") if ":" in part else (part.strip(), "", "")
        if not host or (port and not port.isdigit()):
            raise ValueError(f"{redacted_url(url)}: {part!r} is not HOST:PORT of a Sentinel")
        sentinels.append((host, int(port) if port else SENTINEL_PORT))
    names = [p for p in path.split("?")[0].split("/") if p]
    if not names or len(names) > 2 or (len(names) == 2 and not names[1].isdigit()):
        raise ValueError(
            f"{redacted_url(url)}: a Sentinel URL ends in /MASTER_NAME or /MASTER_NAME/DB"
        )
    return SentinelAddress(
        sentinels=tuple(sentinels),
        service=urllib.parse.unquote(names[0]),
        db=int(names[1]) if len(names) == 2 else 0,
        username=urllib.parse.unquote(username) or None,
        password=urllib.parse.unquote(password) or None,
        ssl=SENTINEL_SCHEMES[scheme],
    )


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
    sentinel = Sentinel(
        list(address.sentinels),
        socket_connect_timeout=timeout_s,
        sentinel_kwargs={"socket_connect_timeout": timeout_s, "ssl": address.ssl},
    )
    return sentinel.master_for(
        address.service,
        socket_connect_timeout=timeout_s,
        socket_timeout=read_timeout_s or SENTINEL_READ_TIMEOUT_S,
        health_check_interval=30,
        decode_responses=False,
        connection_class=_PrimarySSLConnection if address.ssl else _PrimaryConnection,
        **address.primary_kwargs(),
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
    sentinel = AsyncSentinel(list(address.sentinels), sentinel_kwargs={"ssl": address.ssl})
    return sentinel.master_for(
        address.service,
        connection_pool_class=_BlockingSentinelPool,
        max_connections=max_connections,
        socket_timeout=SENTINEL_READ_TIMEOUT_S,
        connection_class=_AsyncPrimarySSLConnection if address.ssl else _AsyncPrimaryConnection,
        **address.primary_kwargs(),
    )


class _BlockingSentinelPool(AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool of connections to the current primary, waiting for a free one."""


def _demoted(exc: redis.ResponseError) -> bool:
    """Whether an error says the server is no primary any more: redis-py turns a plain
    READONLY into a reconnect, but one a script's write met arrives as a script error."""
    return "READONLY" in str(exc)


class _PrimaryConnection(SentinelManagedConnection):
    """A connection to the Sentinels' primary that asks them again when a script's write
    is refused as READONLY (the server it reached has been demoted)."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if not (self.connection_pool.is_master and _demoted(exc)):
                raise
            self.disconnect()
            raise redis.ConnectionError(f"the primary was demoted: {exc}") from exc


class _PrimarySSLConnection(_PrimaryConnection, redis.SSLConnection):
    """_PrimaryConnection over TLS."""


class _AsyncPrimaryConnection(AsyncSentinelConnection):
    """The asyncio _PrimaryConnection."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if not (self.connection_pool.is_master and _demoted(exc)):
                raise
            await self.disconnect()
            raise redis.ConnectionError(f"the primary was demoted: {exc}") from exc


class _AsyncPrimarySSLConnection(_AsyncPrimaryConnection, aioredis.SSLConnection):
    """_AsyncPrimaryConnection over TLS."""


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
