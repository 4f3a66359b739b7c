"""ASGI responses that watch their client: a generation's answer (whole, or as OpenAI's SSE
chunks) and a result stream as resumable events. A client that leaves is noticed at once,
not at the next write, so its request can be cancelled while it still waits in the queue."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
from starlette.types import Receive, Scope, Send

from producer.gateway.errors import ApiError, from_final_chunk
from producer.gateway.render import Renderer
from producer.streams import Entry, Subscription
from schemas.codec import decode
from schemas.keys import FIELD
from schemas.messages import ResultChunk

KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
JSON_HEADERS = [(b"content-type", b"application/json")]


def dumps(body: Any) -> str:
    """Compact JSON, UTF-8 kept as is."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


# Line ends to Python's str.splitlines (so to httpx's aiter_lines) that JSON need not escape:
# sent raw in a token's text, they would cut an event in two for such a client.
LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def sse(body: Any, event_id: int | None = None) -> bytes:
    """One server-sent event carrying `body` as JSON, on one line for any line splitter."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    data = dumps(body)
    for raw, escaped in LINE_BREAKS.items():
        if raw in data:
            data = data.replace(raw, escaped)
    return f"{head}data: {data}\n\n".encode()


async def send_json(send: Send, status: int, body: Any, headers: dict[str, str]) -> None:
    """A whole JSON response."""
    extra = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS + extra})
    await send({"type": "http.response.body", "body": dumps(body).encode()})


async def send_error(send: Send, error: ApiError) -> None:
    """An error response in OpenAI's format."""
    await send_json(send, error.status, error.body(), error.headers)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class WatchedResponse:
    """Runs `respond` while watching for the client to leave; then `cleanup(client_left)`."""

    async def respond(self, send: Send) -> None:
        """Send the whole answer."""
        raise NotImplementedError

    async def cleanup(self, client_left: bool) -> None:
        """Called once the answer is sent or the client has gone."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = asyncio.ensure_future(self.respond(send))
        watch = asyncio.ensure_future(_disconnected(receive))
        client_left = True
        try:
            done, _ = await asyncio.wait({answer, watch}, return_when=asyncio.FIRST_COMPLETED)
            if answer in done:
                client_left = False
                answer.result()
        except OSError:  # the connection broke while writing
            client_left = True
        finally:
            for task in (answer, watch):
                task.cancel()
            await asyncio.gather(answer, watch, return_exceptions=True)
            await self.cleanup(client_left)


class GenerationResponse(WatchedResponse):
    """A submitted request's answer, whole or streamed; cancels it if the client leaves."""

    def __init__(
        self,
        sub: Subscription,
        renderer: Renderer,
        cancel: Callable[[], Awaitable[None]],
        stream: bool,
        include_usage: bool = False,
        continuous_usage: bool = False,
        cancel_on_disconnect: bool = True,
        first_wait_s: float = 10.0,
        keepalive_s: float = 15.0,
        renames: dict[str, str] | None = None,
    ) -> None:
        self.sub = sub
        self.renames = renames or {}
        self.renderer = renderer
        self.cancel = cancel
        self.stream = stream
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.cancel_on_disconnect = cancel_on_disconnect
        self.first_wait_s = first_wait_s
        self.keepalive_s = keepalive_s
        self.finished = False

    async def _next(self, timeout_s: float | None) -> list[ResultChunk] | None:
        try:
            entries = await self.sub.get(timeout_s)
        except TimeoutError:
            return None
        chunks = [decode(ResultChunk, fields[FIELD.encode()]) for _, fields in entries]
        self.finished = self.finished or any(c.is_final for c in chunks)
        return chunks

    async def respond(self, send: Send) -> None:
        if not self.stream:
            chunks: list[ResultChunk] = []
            while not self.finished:
                chunks += await self._next(None) or []
            error = from_final_chunk(chunks[-1], self.renames)
            if error is not None:
                await send_error(send, error)
            else:
                await send_json(send, 200, self.renderer.whole(chunks), {})
            return
        first = await self._next(self.first_wait_s)
        if first and first[-1].is_final:
            error = from_final_chunk(first[-1], self.renames)
            if error is not None:  # nothing sent yet: the status code can still say it
                await send_error(send, error)
                return
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        if self.renderer.kind == "chat":
            await self._write(send, sse(self.renderer.role_chunk()))
        batch = first
        while True:
            if batch is None:
                await self._write(send, KEEPALIVE)
            else:
                body = b"".join(self._events(c) for c in batch)
                if batch[-1].is_final:
                    await self._write(send, body + DONE, more=False)
                    return
                await self._write(send, body)
            batch = await self._next(self.keepalive_s)

    def _events(self, chunk: ResultChunk) -> bytes:
        if not chunk.is_final:
            return sse(self.renderer.chunk(chunk, self._usage_so_far(chunk)))
        error = from_final_chunk(chunk, self.renames)
        out = b""
        if error is not None:
            if chunk.text:
                text_only = chunk.model_copy(update={"finish_reason": None})
                out += sse(self.renderer.chunk(text_only, self._usage_so_far(chunk)))
            return out + sse(error.body())
        usage = self._usage_so_far(chunk)
        if self.continuous_usage and chunk.usage is not None:
            usage = self.renderer.usage_chunk(chunk.usage)["usage"]
        out += sse(self.renderer.chunk(chunk, usage))
        if self.include_usage:
            out += sse(self.renderer.usage_chunk(chunk.usage))
        return out

    def _usage_so_far(self, chunk: ResultChunk) -> dict[str, int] | None:
        if not self.continuous_usage:
            return None
        return {"completion_tokens": chunk.index + len(chunk.token_ids)}

    @staticmethod
    async def _write(send: Send, body: bytes, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": more})

    async def cleanup(self, client_left: bool) -> None:
        self.sub.close()
        if not self.finished and self.cancel_on_disconnect:
            with contextlib.suppress(Exception):  # the pool may be unreachable; nothing to add
                await self.cancel()


class EventsResponse(WatchedResponse):
    """A result stream as SSE from after chunk `after_seq`: event id = seq, data = the chunk's
    wire map as JSON; it ends after the final chunk. Leaving cancels nothing."""

    def __init__(self, sub: Subscription, after_seq: int, keepalive_s: float = 15.0) -> None:
        self.sub = sub
        self.after_seq = after_seq
        self.keepalive_s = keepalive_s

    async def respond(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        while True:
            try:
                entries = await self.sub.get(self.keepalive_s)
            except TimeoutError:
                await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
                continue
            body, final = self._events(entries)
            await send({"type": "http.response.body", "body": body, "more_body": not final})
            if final:
                return

    def _events(self, entries: list[Entry]) -> tuple[bytes, bool]:
        out = []
        for _, fields in entries:
            data = msgpack.unpackb(fields[FIELD.encode()], raw=False)
            seq = int(data["seq"])
            if seq > self.after_seq:
                out.append(sse(data, event_id=seq))
            if data.get("finish_reason") is not None:
                return b"".join(out), True
        return b"".join(out), False

    async def cleanup(self, client_left: bool) -> None:
        self.sub.close()
