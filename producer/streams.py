"""Many live result streams read through a few blocking XREADs (one per connection).

A `StreamMux` spreads subscriptions over up to `max_lanes` lanes. Each lane is one reader
task on one connection that loops `XREAD BLOCK ms STREAMS k1 … kn wake id1 … idn wake-id`
over every stream it serves and hands each stream's entries to that stream's subscription. A
stream that joins while the lane is blocked wakes it with an XADD to the lane's private
wake-up stream (also in the XREAD), so it is read at once rather than after the block.
Keys of one XREAD must share a hash slot on Redis Cluster: give the namespace a hash tag.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from schemas.keys import Keys

Entry = tuple[bytes, dict[bytes, bytes]]
WAKE_TTL_S = 3600
FINAL = b"final"


class Subscription:
    """One result stream's entries as they arrive, in order; close it when done."""

    def __init__(self, lane: _Lane, key: bytes, cursor: bytes) -> None:
        self.lane = lane
        self.key = key
        self.cursor = cursor
        self.closed = False
        self._entries: list[Entry] = []
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, entries: list[Entry] | BaseException) -> None:
        """Hand over entries read for this stream (or the error that ended the read)."""
        if isinstance(entries, BaseException):
            self._error = entries
        else:
            self._entries += entries
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self, timeout_s: float | None = None) -> list[Entry]:
        """Every entry that arrived since the last call (waiting for one if none has);
        TimeoutError after `timeout_s` with none."""
        if not self._entries and self._error is None:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        if self._entries:  # a backlog goes out at once: one write for several chunks
            entries, self._entries = self._entries, []
            return entries
        if self._error is not None:
            raise self._error
        raise TimeoutError(f"no entry on {self.key.decode()} in {timeout_s}s")

    def close(self) -> None:
        """Stop reading this stream (idempotent)."""
        if not self.closed:
            self.closed = True
            self.lane.remove(self)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _position(entry_id: bytes) -> tuple[int, int]:
    """A stream entry id as a comparable (milliseconds, sequence) pair."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


class _Lane:
    """One reader task and its connection, serving a set of streams. Several subscriptions
    of one stream (each with its own cursor) share one key of the read, from the earliest
    cursor; each gets only the entries after its own."""

    def __init__(self, mux: StreamMux, index: int) -> None:
        self.mux = mux
        self.streams: dict[bytes, list[Subscription]] = {}
        self.wake_key = mux.keys.wake(f"{mux.instance}:{index}").encode()
        self.wake_cursor = b"0-0"
        self.wake_pending = False
        self.blocked = False
        self.task = asyncio.get_running_loop().create_task(self._run())

    def add(self, sub: Subscription) -> None:
        """Serve `sub` from the next read, waking a read that is blocked now."""
        self.streams.setdefault(sub.key, []).append(sub)
        if self.blocked and not self.wake_pending:
            self.wake_pending = True
            self.mux.spawn(self._wake())

    def remove(self, sub: Subscription) -> None:
        """Stop serving `sub`."""
        subs = self.streams.get(sub.key, [])
        if sub in subs:
            subs.remove(sub)
        if not subs:
            self.streams.pop(sub.key, None)

    async def _wake(self) -> None:
        pipe = self.mux.redis.pipeline(transaction=False)
        pipe.xadd(self.wake_key, {"w": 1}, maxlen=1, approximate=False)
        pipe.expire(self.wake_key, WAKE_TTL_S)
        with contextlib.suppress(RedisError):  # the reader then sees the stream after its block
            await pipe.execute()

    async def _run(self) -> None:
        failures = 0
        while not self.mux.closing:
            self.wake_pending = False
            streams: dict[Any, Any] = {
                key: min((sub.cursor for sub in subs), key=_position)
                for key, subs in self.streams.items()
            }
            streams[self.wake_key] = self.wake_cursor
            self.blocked = True
            try:
                reply = await self.mux.reader.xread(
                    streams, count=self.mux.count, block=self.mux.block_ms
                )
                failures = 0
            except Exception as exc:  # any failed read: its streams raise it, the lane goes on
                self._fail(exc, streams)
                failures += 1
                await asyncio.sleep(min(2.0, 0.05 * 2**failures))
                continue
            finally:
                self.blocked = False
            self._deliver(cast(list[tuple[bytes, list[Entry]]], reply or []), streams)

    def _deliver(self, reply: list[tuple[bytes, list[Entry]]], read: dict[Any, Any]) -> None:
        """Hand each subscription the entries after its cursor. One that joined during the
        read from an earlier cursor is left for the next read, which starts there."""
        for key, entries in reply:
            if key == self.wake_key:
                self.wake_cursor = entries[-1][0]
                continue
            subs = self.streams.get(key)
            if not subs or not entries:
                continue
            read_from = _position(read[key])
            last = entries[-1][0]
            for sub in subs:
                after = _position(sub.cursor)
                if after < read_from:
                    continue
                fresh = (
                    entries
                    if after == read_from
                    else [e for e in entries if _position(e[0]) > after]
                )
                if fresh:
                    sub.cursor = last
                    sub.put(fresh)
            if entries[-1][1].get(FINAL) == b"1":  # nothing follows a final chunk
                self.streams[key] = [sub for sub in subs if sub.cursor != last]
                if not self.streams[key]:
                    del self.streams[key]

    def _fail(self, exc: BaseException, streams: dict[Any, Any]) -> None:
        """Hand a read's error to every stream that was in it; they raise it."""
        for key in streams:
            for sub in self.streams.pop(key, []):
                sub.put(exc)


class StreamMux:
    """Reads many result streams on at most `max_lanes` connections (plus wake-ups)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        reader: aioredis.Redis,
        keys: Keys,
        max_lanes: int = 16,
        streams_per_lane: int = 256,
        block_ms: int = 1000,
        count: int = 256,
    ) -> None:
        if max_lanes < 1 or streams_per_lane < 1:
            raise ValueError(
                f"max_lanes={max_lanes} and streams_per_lane={streams_per_lane} must be >= 1"
            )
        self.redis = redis
        self.reader = reader
        self.keys = keys
        self.max_lanes = max_lanes
        self.streams_per_lane = streams_per_lane
        self.block_ms = block_ms
        self.count = count
        self.instance = uuid.uuid4().hex[:12]
        self.lanes: list[_Lane] = []
        self.closing = False
        self._tasks: set[asyncio.Task[None]] = set()

    def subscribe(self, key: str, cursor: bytes = b"0-0") -> Subscription:
        """Start reading stream `key` after entry `cursor` ("0-0": from the start)."""
        lane = self._pick_lane()
        sub = Subscription(lane, key.encode(), cursor)
        lane.add(sub)
        return sub

    @property
    def num_streams(self) -> int:
        """Subscriptions being served now."""
        return sum(len(subs) for lane in self.lanes for subs in lane.streams.values())

    def _pick_lane(self) -> _Lane:
        if self.lanes:
            lane = min(self.lanes, key=lambda ln: len(ln.streams))
            if len(lane.streams) < self.streams_per_lane or len(self.lanes) >= self.max_lanes:
                return lane
        self.lanes.append(_Lane(self, len(self.lanes)))
        return self.lanes[-1]

    def spawn(self, coro: Any) -> None:
        """Run a fire-and-forget coroutine, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop every lane and drop the wake-up streams."""
        self.closing = True
        tasks = {lane.task for lane in self.lanes} | self._tasks
        while tasks:  # a read that completes as it is cancelled may swallow the cancel
            for task in tasks:
                task.cancel()
            _, tasks = await asyncio.wait(tasks, timeout=0.1)
        wake_keys = [lane.wake_key for lane in self.lanes]
        self.lanes = []
        if wake_keys:
            with contextlib.suppress(RedisError):
                await self.redis.delete(*wake_keys)
