"""Which pools are ready and what they serve, watched in the background for the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import cast

import redis

from producer.gateway.render import TokenText, token_id_text
from producer.status import pool_status
from schemas.connection import connect, hash_fields
from schemas.keys import Keys
from schemas.registry import BatcherState, PoolField, RankField, RankState

log = logging.getLogger("npu_pool.gateway")


@dataclass(frozen=True, slots=True)
class ServedPool:
    """A ready pool: its name, its model's id and context length, when it started."""

    name: str
    model: str
    max_model_len: int
    created: int


class PoolWatch:
    """The ready pools, re-read every `refresh_s` in a thread (the registry reads are sync)."""

    def __init__(self, redis_url: str, keys: Keys, refresh_s: float) -> None:
        self.redis = connect(redis_url, timeout_s=5, read_timeout_s=5)
        self.keys = keys
        self.refresh_s = refresh_s
        self.problem: str | None = "not checked yet"
        self._ready: list[ServedPool] = []
        self._token_texts: dict[str, TokenText] = {}
        self._task: asyncio.Task[None] | None = None

    def ready(self) -> list[ServedPool]:
        """Pools whose batcher and every rank are ready, as of the last refresh."""
        return self._ready

    async def start(self) -> None:
        """Read the registry once, then keep re-reading it in the background."""
        await self._refresh()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop watching and drop the connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.redis.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            self._ready = await asyncio.to_thread(self._read)
            self.problem = None if self._ready else "no pool is ready"
        except redis.RedisError as exc:
            if self.problem is None:
                log.warning("cannot read the pool registry: %s", exc)
            self._ready, self.problem = [], f"Redis: {exc}"

    def _read(self) -> list[ServedPool]:
        now_ms = int(time.time() * 1000)
        names = sorted(
            bytes(p).decode() for p in cast(set[bytes], self.redis.smembers(self.keys.pools))
        )
        served = []
        for name in names:
            status = pool_status(self.redis, self.keys, name, now_ms)
            ranks = status["ranks"]
            if status["state"] != BatcherState.READY.value or not ranks:
                continue
            if any(r["state"] != RankState.READY.value for r in ranks):
                continue
            info = hash_fields(self.redis.hgetall(self.keys.pool(name)))
            model = info.get(PoolField.MODEL.encode()) or self.redis.hget(
                self.keys.rank(name, 0), RankField.MODEL
            )
            served.append(
                ServedPool(
                    name=name,
                    model=cast(bytes, model or b"default").decode(),
                    max_model_len=int(info.get(PoolField.MAX_MODEL_LEN.encode(), b"1024")),
                    created=int(info.get(PoolField.STARTED_MS.encode(), b"0")) // 1000,
                )
            )
        return served

    async def token_text(self, pool: str) -> TokenText:
        """Token id to text with the pool's tokenizer if `tokenizers` is installed."""
        if pool not in self._token_texts:
            self._token_texts[pool] = await asyncio.to_thread(self._load_token_text, pool)
        return self._token_texts[pool]

    def _load_token_text(self, pool: str) -> TokenText:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return token_id_text
        raw = self.redis.get(self.keys.tokenizer(pool))
        if raw is None:
            return token_id_text
        tokenizer = Tokenizer.from_str(cast(bytes, raw).decode())
        return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
