"""`Client` and `AsyncClient`: submit requests, stream and collect results."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import redis

from producer.requests import (
    ADMIT_SCRIPT,
    NotReplicated,
    QueueFull,
    RequestFailed,
    RequestTooLarge,
    Schemas,
    UnknownTenant,
    admission_call,
    assemble,
    build_request,
    parse_admission,
)
from producer.status import PoolFailed, ready_pool
from producer.streams import StreamMux, Subscription
from schemas.codec import decode
from schemas.config import Settings
from schemas.connection import (
    connect,
    connect_async,
    replicas_to_wait,
    resolve_redis_url,
    stream_entries,
)
from schemas.keys import FIELD, Keys
from schemas.messages import ChatMessage, Completion, GenerateRequest, ResultChunk
from schemas.sentinel import still_primary, still_primary_async

__all__ = [
    "AsyncClient",
    "Client",
    "PoolFailed",
    "QueueFull",
    "RequestFailed",
    "RequestTooLarge",
    "UnknownTenant",
]

BLOCK_MS = 1000


class Client:
    """Synchronous client of a pool: `submit`, `stream`, `result`, `generate`, `cancel`."""

    def __init__(
        self,
        redis_url: str | None = None,
        namespace: str | None = None,
        max_queue: int | None = None,
        connection: redis.Redis | None = None,
        min_replicas_ack: int | None = None,
        tenant: str | None = None,
    ) -> None:
        settings = Settings()
        self.keys = Keys(namespace or settings.namespace)
        self.max_queue = max_queue  # a bound of this client's own, under the namespace's
        self.tenant = tenant  # the tenant of requests that name none
        if connection is not None:  # an open connection (an RQ job's): no URL to resolve
            self.url, self.redis = redis_url or "", connection
        else:
            self.url = resolve_redis_url(redis_url or settings.redis_url)
            self.redis = connect(self.url)
        wanted = settings.min_replicas_ack if min_replicas_ack is None else min_replicas_ack
        self.min_replicas_ack = replicas_to_wait(self.url, wanted)
        self.ack_timeout_ms = int(settings.replica_ack_timeout_s * 1000)
        self._admit = self.redis.register_script(ADMIT_SCRIPT)
        self.schemas = Schemas()

    def submit(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        **options: Any,
    ) -> str:
        """Enqueue a request; returns its id. Raises QueueFull when the queue (or the
        tenant's share of it) is at max_queue, UnknownTenant for a tenant the pool refuses."""
        if self.tenant is not None:
            options.setdefault("tenant", self.tenant)
        wanted = options.get("constraint")
        request_id = self.enqueue(build_request(prompt, prompt_token_ids, request_id, options))
        self.schemas.remember(request_id, wanted)
        return request_id

    def enqueue(
        self, request: GenerateRequest, mark: tuple[str, str, str | int] | None = None
    ) -> str:
        """Enqueue a built request; with `mark` (hash, field, value), set that hash field in
        the same atomic step. Raises QueueFull when the queue is at max_queue."""
        keys, args = admission_call(self.keys, request, self.max_queue, mark)
        if not self.min_replicas_ack:
            parse_admission(self._admit(keys=keys, args=args), request.tenant)
            return request.id
        pipe = self.redis.pipeline(transaction=False)  # WAIT counts this connection's writes
        self._admit(keys=keys, args=args, client=pipe)
        pipe.wait(self.min_replicas_ack, self.ack_timeout_ms)
        reply, acked = pipe.execute()
        parse_admission(reply, request.tenant)
        if acked < self.min_replicas_ack:
            raise NotReplicated(request.id, acked, self.min_replicas_ack)
        if not still_primary(self.redis):
            raise NotReplicated(request.id, acked, self.min_replicas_ack, stale=True)
        return request.id

    def stream(self, request_id: str, timeout_s: float | None = None) -> Iterator[ResultChunk]:
        """Chunks of a result stream from the start, live, until the final one."""
        key = self.keys.result(request_id)
        cursor = b"0-0"
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            block = _block_ms(deadline, request_id)
            reply = self.redis.xread({key: cursor}, count=256, block=block)
            for entry_id, fields in stream_entries(reply):
                cursor = entry_id
                chunk = decode(ResultChunk, fields[FIELD.encode()])
                yield chunk
                if chunk.is_final:
                    return

    def result(self, request_id: str, timeout_s: float | None = None) -> Completion:
        """Wait for the whole completion; `parsed` holds its JSON (validated by the model
        class given as its constraint) where this client submitted it asking for JSON."""
        return self.schemas.parse(assemble(request_id, list(self.stream(request_id, timeout_s))))

    def generate(
        self, prompt: str | None = None, *, timeout_s: float | None = None, **options: Any
    ) -> Completion:
        """Submit and wait for the completion."""
        return self.result(self.submit(prompt, **options), timeout_s=timeout_s)

    def chat(
        self,
        messages: list[dict[str, str]] | list[ChatMessage],
        *,
        timeout_s: float | None = None,
        **options: Any,
    ) -> Completion:
        """Submit `messages` (rendered with the model's chat template) and wait for the reply."""
        return self.result(self.submit(messages=messages, **options), timeout_s=timeout_s)

    def cancel(self, request_id: str) -> None:
        """Ask the pool to stop a request; its stream ends with `cancelled`."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.keys.cancelled, {request_id: int(time.time() * 1000)})
        pipe.xadd(self.keys.cancel, {"id": request_id}, maxlen=100_000, approximate=True)
        pipe.execute()

    def wait_ready(self, timeout_s: float = 60.0, pool: str | None = None) -> str:
        """Block until a pool (or the named one) has all ranks ready, and its batcher plans
        for each of them; returns its name.
        Raises PoolFailed with the reason when a rank cannot start (no restart would help)."""
        deadline = time.monotonic() + timeout_s
        while True:
            name = ready_pool(self.redis, self.keys, pool)
            if name is not None:
                return name
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no ready pool after {timeout_s:.0f}s "
                    "(is `npu-pool up` running? see `npu-pool status`)"
                )
            time.sleep(0.1)

    def close(self) -> None:
        """Drop the connection."""
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class AsyncClient:
    """The asyncio mirror of `Client`. Commands share `max_connections` connections (a
    command waits for a free one); live streams are read through `StreamMux`, many per
    blocking XREAD, on at most `max_stream_connections` more."""

    def __init__(
        self,
        redis_url: str | None = None,
        namespace: str | None = None,
        max_queue: int | None = None,
        max_connections: int = 32,
        max_stream_connections: int = 16,
        min_replicas_ack: int | None = None,
        tenant: str | None = None,
    ) -> None:
        settings = Settings()
        self.keys = Keys(namespace or settings.namespace)
        self.max_queue = max_queue  # a bound of this client's own, under the namespace's
        self.tenant = tenant  # the tenant of requests that name none
        self.url = resolve_redis_url(redis_url or settings.redis_url)
        wanted = settings.min_replicas_ack if min_replicas_ack is None else min_replicas_ack
        self.min_replicas_ack = replicas_to_wait(self.url, wanted)
        self.ack_timeout_ms = int(settings.replica_ack_timeout_s * 1000)
        self.redis = connect_async(self.url, max_connections)
        self._reader = connect_async(self.url, max_stream_connections)
        self.max_stream_connections = max_stream_connections
        self._mux: StreamMux | None = None
        self._admit = self.redis.register_script(ADMIT_SCRIPT)
        self.schemas = Schemas()

    async def submit(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        **options: Any,
    ) -> str:
        """Enqueue a request; returns its id. Raises QueueFull when the queue (or the
        tenant's share of it) is at max_queue, UnknownTenant for a tenant the pool refuses."""
        if self.tenant is not None:
            options.setdefault("tenant", self.tenant)
        wanted = options.get("constraint")
        request = build_request(prompt, prompt_token_ids, request_id, options)
        keys, args = admission_call(self.keys, request, self.max_queue)
        self.schemas.remember(request.id, wanted)
        if not self.min_replicas_ack:
            parse_admission(await self._admit(keys=keys, args=args), request.tenant)
            return request.id
        pipe = self.redis.pipeline(transaction=False)  # WAIT counts this connection's writes
        await self._admit(keys=keys, args=args, client=pipe)
        pipe.wait(self.min_replicas_ack, self.ack_timeout_ms)
        reply, acked = await pipe.execute()
        parse_admission(reply, request.tenant)
        if acked < self.min_replicas_ack:
            raise NotReplicated(request.id, acked, self.min_replicas_ack)
        if not await still_primary_async(self.redis):
            raise NotReplicated(request.id, acked, self.min_replicas_ack, stale=True)
        return request.id

    def subscribe(self, request_id: str, after: bytes = b"0-0") -> Subscription:
        """Raw entries of a result stream after entry id `after`, live; close it when done."""
        if self._mux is None:
            self._mux = StreamMux(
                self.redis, self._reader, self.keys, max_lanes=self.max_stream_connections
            )
        return self._mux.subscribe(self.keys.result(request_id), after)

    async def stream(
        self, request_id: str, timeout_s: float | None = None
    ) -> AsyncIterator[ResultChunk]:
        """Chunks of a result stream from the start, live, until the final one."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sub = self.subscribe(request_id)
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                try:
                    entries = await sub.get(left)
                except TimeoutError:
                    raise TimeoutError(f"no final chunk for {request_id} in time") from None
                for _, fields in entries:
                    chunk = decode(ResultChunk, fields[FIELD.encode()])
                    yield chunk
                    if chunk.is_final:
                        return
        finally:
            sub.close()

    async def result(self, request_id: str, timeout_s: float | None = None) -> Completion:
        """Wait for the whole completion."""
        chunks = [c async for c in self.stream(request_id, timeout_s)]
        return self.schemas.parse(assemble(request_id, chunks))

    async def generate(
        self, prompt: str | None = None, *, timeout_s: float | None = None, **options: Any
    ) -> Completion:
        """Submit and wait for the completion."""
        return await self.result(await self.submit(prompt, **options), timeout_s=timeout_s)

    async def chat(
        self,
        messages: list[dict[str, str]] | list[ChatMessage],
        *,
        timeout_s: float | None = None,
        **options: Any,
    ) -> Completion:
        """Submit `messages` (rendered with the model's chat template) and wait for the reply."""
        return await self.result(
            await self.submit(messages=messages, **options), timeout_s=timeout_s
        )

    async def cancel(self, request_id: str) -> None:
        """Ask the pool to stop a request; its stream ends with `cancelled`."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.keys.cancelled, {request_id: int(time.time() * 1000)})
        pipe.xadd(self.keys.cancel, {"id": request_id}, maxlen=100_000, approximate=True)
        await pipe.execute()

    async def wait_ready(self, timeout_s: float = 60.0, pool: str | None = None) -> str:
        """Wait until a pool (or the named one) has all ranks ready; returns its name."""
        with Client(self.url, self.keys.ns) as client:
            return await asyncio.to_thread(client.wait_ready, timeout_s, pool)

    async def close(self) -> None:
        """Stop reading streams and drop the connections."""
        if self._mux is not None:
            await self._mux.close()
            self._mux = None
        await self._reader.aclose()
        await self.redis.aclose()


def _block_ms(deadline: float | None, request_id: str) -> int:
    if deadline is None:
        return BLOCK_MS
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no final chunk for {request_id} in time")
    return max(1, min(BLOCK_MS, int(left * 1000)))
