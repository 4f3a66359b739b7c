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
    """A submitted request's answer, whole or streamed: one choice per result stream (`n`
    of them); cancels them all if the client leaves."""

    def __init__(
        self,
        subs: list[Subscription],
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
        self.subs = subs
        self.renames = renames or {}
        self.renderer = renderer
        self.cancel = cancel
        self.stream = stream
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.cancel_on_disconnect = cancel_on_disconnect
        self.first_wait_s = first_wait_s
        self.keepalive_s = keepalive_s
        self.finals: dict[int, ResultChunk] = {}  # by choice

    @property
    def finished(self) -> bool:
        """True once every choice has its final chunk."""
        return len(self.finals) == len(self.subs)

    async def _next(self, timeout_s: float | None) -> list[tuple[int, ResultChunk]] | None:
        """(choice, chunk) pairs that arrived on any unfinished choice; None if none came
        within `timeout_s`."""
        waiting = {
            asyncio.ensure_future(sub.get(timeout_s)): i
            for i, sub in enumerate(self.subs)
            if i not in self.finals
        }
        done, rest = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        for task in rest:  # entries that arrive meanwhile stay in their subscription
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        out: list[tuple[int, ResultChunk]] = []
        for task in sorted(done, key=waiting.__getitem__):
            if isinstance(task.exception(), TimeoutError):
                continue
            index = waiting[task]
            for _, fields in task.result():
                chunk = decode(ResultChunk, fields[FIELD.encode()])
                out.append((index, chunk))
                if chunk.is_final:
                    self.finals[index] = chunk
        return out or None

    def _first_error(self) -> ApiError | None:
        for index in sorted(self.finals):
            error = from_final_chunk(self.finals[index], self.renames)
            if error is not None:
                return error
        return None

    async def respond(self, send: Send) -> None:
        if not self.stream:
            choices: list[list[ResultChunk]] = [[] for _ in self.subs]
            while not self.finished:
                for index, chunk in await self._next(None) or []:
                    choices[index].append(chunk)
            error = self._first_error()
            if error is not None:
                await send_error(send, error)
            else:
                await send_json(send, 200, self.renderer.whole(choices), {})
            return
        first = await self._next(self.first_wait_s)
        error = self._first_error()
        if error is not None:  # nothing sent yet: the status code can still say it
            await send_error(send, error)
            return
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        if self.renderer.kind == "chat":
            await self._write(send, sse(self.renderer.role_chunk(len(self.subs))))
        batch = first
        while True:
            if batch is None:
                await self._write(send, KEEPALIVE)
            else:
                body = b"".join(self._events(i, c) for i, c in batch)
                if self.finished:
                    if self.include_usage:
                        usages = [self.finals[i].usage for i in sorted(self.finals)]
                        body += sse(self.renderer.usage_chunk(usages))
                    await self._write(send, body + DONE, more=False)
                    return
                await self._write(send, body)
            batch = await self._next(self.keepalive_s)

    def _events(self, index: int, chunk: ResultChunk) -> bytes:
        if not chunk.is_final:
            return sse(self.renderer.chunk(chunk, self._usage_so_far(chunk), index))
        error = from_final_chunk(chunk, self.renames)
        out = b""
        if error is not None:
            if chunk.text:
                text_only = chunk.model_copy(update={"finish_reason": None})
                out += sse(self.renderer.chunk(text_only, self._usage_so_far(chunk), index))
            return out + sse(error.body())
        usage = self._usage_so_far(chunk)
        if self.continuous_usage and chunk.usage is not None:
            usage = self.renderer.usage_chunk(chunk.usage)["usage"]
        return sse(self.renderer.chunk(chunk, usage, index))

    def _usage_so_far(self, chunk: ResultChunk) -> dict[str, int] | None:
        if not self.continuous_usage:
            return None
        return {"completion_tokens": chunk.index + len(chunk.token_ids)}

    @staticmethod
    async def _write(send: Send, body: bytes, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": more})

    async def cleanup(self, client_left: bool) -> None:
        for sub in self.subs:
            sub.close()
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
