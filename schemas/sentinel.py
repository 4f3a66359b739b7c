"""Redis behind Sentinels (docs/architecture.md §7): the URL that names a deployment, and
clients that follow its primary — to the promoted replica after a failover, and away from a
stale primary that a pause or a partition left serving its old connections.

redis-py's `Sentinel` finds the primary when a connection opens; a connection opened before
a failover keeps talking to the old primary until a write is refused, and reads from it
never fail once it is a replica. Three changes here close that:
- the Sentinel answer with the highest `config-epoch` wins, so a Sentinel that has not yet
  heard of a promotion cannot send a client back to the old primary;
- a pool asks the Sentinels again at most every `PRIMARY_CHECK_S` when it hands out a
  connection, and closes its idle connections to any other server;
- `still_primary` says whether the server the calling thread (or task) last wrote to is
  the primary now: an admission acknowledged by a stale primary (and by a replica that
  has not yet been moved to the new one) is not an acknowledgement;
- while any Sentinel runs a failover, no primary is named at all, and the newest epoch is
  the newest any Sentinel reports, even one that (as a failover's leader does until it
  ends) still marks the old primary down: a paused old primary that answers again during
  a failover is not taken for the primary, whichever Sentinels have heard of it yet.
"""

from __future__ import annotations

import contextvars
import logging
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.asyncio.sentinel import SentinelManagedConnection as AsyncSentinelConnection
from redis.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
)

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
SENTINEL_PORT = 26379
# Behind Sentinels a read gives up after this long (every blocking read here blocks for at
# most a few seconds), so a client of a primary that hangs (paused, partitioned) notices,
# asks the Sentinels again and finds the promoted replica.
SENTINEL_READ_TIMEOUT_S = 10.0
SENTINEL_TIMEOUT_S = 2.0  # a Sentinel that does not answer in this long is skipped
PRIMARY_CHECK_S = 1.0  # how stale a pool's idea of the primary may be

log = logging.getLogger("npu_pool.redis")
Address = tuple[str, int]
# The server the current thread or task last sent a command to.
_last_server: contextvars.ContextVar[Address | None] = contextvars.ContextVar(
    "npu_pool_last_server", default=None
)


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

    def sentinel_kwargs(self) -> dict[str, Any]:
        """Connection settings for the Sentinels themselves."""
        return {
            "socket_connect_timeout": SENTINEL_TIMEOUT_S,
            "socket_timeout": SENTINEL_TIMEOUT_S,
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


def redacted_url(url: str) -> str:
    """`url` with its password shown as `***`, for logs and `npu-pool status`."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _newest(
    states: list[dict[str, Any]], service: str, usable: Callable[[dict[str, Any]], bool]
) -> Address:
    """The primary named by the Sentinel answers of the highest configuration epoch that
    `usable` accepts (redis-py's check: a primary, not marked down, seen by enough
    Sentinels); none while any Sentinel runs a failover.

    The epoch is taken over every answer, usable or not. A failover's leader raises the
    epoch when it promotes a replica, but it still marks the old primary down until the
    failover ends, so its answer is not usable; a paused old primary that answers again
    meanwhile is no longer down for the Sentinels not yet told, which name it under the
    old epoch. Between its election and its end the leader names the old primary, so no
    primary is named while it runs: a write acknowledged then, by the old primary and a
    replica about to follow the promoted one, would be dropped at the replica's resync."""
    if any("failover_in_progress" in s["flags"] for s in states):
        raise MasterNotFoundError(f"a failover of {service!r} is under way")
    good = [s for s in states if usable(s)]
    if not good:
        raise MasterNotFoundError(f"no Sentinel names a primary for {service!r} now")
    newest = max(int(s.get("config-epoch", 0)) for s in states)
    settled = [s for s in good if int(s.get("config-epoch", 0)) == newest]
    if not settled:
        raise MasterNotFoundError(
            f"no Sentinel of the newest epoch names a primary for {service!r}"
        )
    return str(settled[0]["ip"]), int(settled[0]["port"])


class EpochSentinel(Sentinel):
    """redis-py's Sentinel, asking every Sentinel and believing the newest answer."""

    def discover_master(self, service_name: str) -> Address:
        states: list[dict[str, Any]] = []
        for sentinel in self.sentinels:
            try:
                state = cast(dict[str, Any], sentinel.sentinel_master(service_name))
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                continue
            if state:
                states.append(state)
        return _newest(states, service_name, lambda s: self.check_master_state(s, service_name))


class AsyncEpochSentinel(AsyncSentinel):
    """The asyncio EpochSentinel."""

    async def discover_master(self, service_name: str) -> Address:
        states: list[dict[str, Any]] = []
        for sentinel in self.sentinels:
            try:
                state = cast(dict[str, Any], await sentinel.sentinel_master(service_name))
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                continue
            if state:
                states.append(state)
        return _newest(states, service_name, lambda s: self.check_master_state(s, service_name))


class FollowingPool(SentinelConnectionPool):
    """Sentinel's pool of primary connections that checks, at most every PRIMARY_CHECK_S,
    which server the Sentinels name, closing its idle connections to any other."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)
        self.checked = 0.0

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        if now - self.checked >= PRIMARY_CHECK_S:
            self.checked = now
            before = self.proxy.master_address
            after = self.proxy.get_master_address()  # closes idle connections if it moved
            _log_move(before, after)
        return super().get_connection(*args, **kwargs)


class AsyncFollowingPool(AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """The asyncio FollowingPool, waiting for a free connection when all are in use."""

    def __init__(self, service_name: str, sentinel_manager: Any, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)
        self.checked = 0.0

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        if now - self.checked >= PRIMARY_CHECK_S:
            self.checked = now
            before = self.master_address
            _log_move(before, await self.get_master_address())
        return await super().get_connection(*args, **kwargs)


def _log_move(before: Address | None, after: Address) -> None:
    if before is not None and before != after:
        log.info("the Sentinels name %s:%d as the primary now (was %s:%d)", *after, *before)


def primary_of(client: redis.Redis) -> Address | None:
    """The primary a Sentinel client's pool last found (None for a plain URL's client): a
    process that sees it change knows that what it wrote before may be gone."""
    pool = client.connection_pool
    return pool.proxy.master_address if isinstance(pool, SentinelConnectionPool) else None


def still_primary(client: redis.Redis) -> bool:
    """Whether the server this thread last sent a command to through `client` is the one
    the Sentinels name as primary now (always true for a client of a plain URL)."""
    pool = client.connection_pool
    if not isinstance(pool, SentinelConnectionPool):
        return True
    try:
        return _last_server.get() == pool.proxy.get_master_address()
    except MasterNotFoundError:  # a failover under way: no server is confirmed as primary
        return False


async def still_primary_async(client: aioredis.Redis) -> bool:
    """still_primary for an asyncio client (per task)."""
    pool = client.connection_pool
    if not isinstance(pool, AsyncSentinelPool):
        return True
    try:
        return _last_server.get() == await pool.get_master_address()
    except MasterNotFoundError:
        return False


def _demoted(exc: redis.ResponseError) -> bool:
    """Whether an error says the server is no primary any more: redis-py turns a plain
    READONLY into a reconnect, but one a script's write met arrives as a script error; a
    primary configured with min-replicas-to-write that has lost its replicas says
    NOREPLICAS."""
    return "READONLY" in str(exc) or "NOREPLICAS" in str(exc)


class PrimaryConnection(SentinelManagedConnection):
    """A connection to the Sentinels' primary that records where each command went and
    asks the Sentinels again when a write is refused as READONLY or NOREPLICAS."""

    def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
        super().send_packed_command(*args, **kwargs)
        _last_server.set((str(self.host), int(self.port)))

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if not (self.connection_pool.is_master and _demoted(exc)):
                raise
            self.disconnect()
            raise redis.ConnectionError(f"the primary was demoted: {exc}") from exc


class PrimarySSLConnection(PrimaryConnection, redis.SSLConnection):
    """PrimaryConnection over TLS."""


class AsyncPrimaryConnection(AsyncSentinelConnection):
    """The asyncio PrimaryConnection."""

    async def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
        await super().send_packed_command(*args, **kwargs)
        _last_server.set((str(self.host), int(self.port)))

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if not (self.connection_pool.is_master and _demoted(exc)):
                raise
            await self.disconnect()
            raise redis.ConnectionError(f"the primary was demoted: {exc}") from exc


class AsyncPrimarySSLConnection(AsyncPrimaryConnection, aioredis.SSLConnection):
    """AsyncPrimaryConnection over TLS."""


def sentinel_client(address: SentinelAddress, **kwargs: Any) -> redis.Redis:
    """A client of the primary `address` names, following it across failovers."""
    sentinel = EpochSentinel(list(address.sentinels), sentinel_kwargs=address.sentinel_kwargs())
    return sentinel.master_for(
        address.service,
        connection_pool_class=FollowingPool,
        connection_class=PrimarySSLConnection if address.ssl else PrimaryConnection,
        **kwargs,
        **address.primary_kwargs(),
    )


def async_sentinel_client(address: SentinelAddress, **kwargs: Any) -> aioredis.Redis:
    """sentinel_client for asyncio."""
    sentinel = AsyncEpochSentinel(
        list(address.sentinels), sentinel_kwargs=address.sentinel_kwargs()
    )
    return sentinel.master_for(
        address.service,
        connection_pool_class=AsyncFollowingPool,
        connection_class=AsyncPrimarySSLConnection if address.ssl else AsyncPrimaryConnection,
        **kwargs,
        **address.primary_kwargs(),
    )
