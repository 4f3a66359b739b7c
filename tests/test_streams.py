"""Multiplexed result streams: many streams per blocking XREAD, a few connections in all."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import pytest
import redis

from producer.client import AsyncClient
from producer.streams import StreamMux, Subscription
from schemas.codec import encode
from schemas.keys import Keys
from schemas.messages import ResultChunk, Usage
from tests.helpers import check_stream


def write_chunk(pipe: redis.client.Pipeline, keys: Keys, chunk: ResultChunk) -> None:
    """Append a chunk the way the pool's append script lays it out."""
    final = "1" if chunk.is_final else "0"
    pipe.xadd(keys.result(chunk.id), {"m": encode(chunk), "seq": chunk.seq, "final": final})


def chunks_of(request_id: str, num_chunks: int) -> list[ResultChunk]:
    """A stream of `num_chunks` one-token chunks, the last one final."""
    out = []
    for seq in range(num_chunks):
        final = seq == num_chunks - 1
        out.append(
            ResultChunk(
                id=request_id,
                seq=seq,
                index=seq,
                token_ids=[seq + 2],
                text=f"<{seq}>",
                finish_reason="length" if final else None,
                usage=Usage(prompt_tokens=1, completion_tokens=num_chunks) if final else None,
            )
        )
    return out


def connected_clients(client: redis.Redis) -> int:
    return int(client.info("clients")["connected_clients"])


async def _collect(client: AsyncClient, request_id: str) -> list[ResultChunk]:
    return [c async for c in client.stream(request_id, timeout_s=120)]


def test_thousands_of_streams_arrive_whole_and_in_order_on_a_few_connections(
    redis_url: str, redis_client: redis.Redis
) -> None:
    keys = Keys()
    num_streams, num_chunks = 3000, 4
    ids = [f"mux-{i}" for i in range(num_streams)]
    baseline = connected_clients(redis_client)
    seen_connections = []

    async def main() -> list[list[ResultChunk]]:
        client = AsyncClient(redis_url, max_connections=8, max_stream_connections=12)
        try:
            readers = [asyncio.create_task(_collect(client, rid)) for rid in ids]
            await asyncio.sleep(0.2)
            rng = random.Random(7)
            pending = {rid: chunks_of(rid, num_chunks) for rid in ids}
            while pending:  # interleave the streams' chunks, a few hundred per round trip
                pipe = redis_client.pipeline(transaction=False)
                for rid in rng.sample(sorted(pending), min(300, len(pending))):
                    write_chunk(pipe, keys, pending[rid].pop(0))
                    if not pending[rid]:
                        del pending[rid]
                pipe.execute()
                seen_connections.append(connected_clients(redis_client) - baseline)
                await asyncio.sleep(0)
            return list(await asyncio.gather(*readers))
        finally:
            await client.close()

    streams = asyncio.run(main())
    for rid, chunks in zip(ids, streams):
        assert [c.id for c in chunks] == [rid] * num_chunks
        assert check_stream(chunks) == [seq + 2 for seq in range(num_chunks)]
    assert 0 < max(seen_connections) <= 8 + 12
    assert redis_client.keys("npupool:wake:*") == []  # close drops the wake-up streams


def test_a_stream_that_joins_a_blocked_read_is_served_without_waiting_out_the_block(
    redis_url: str, redis_client: redis.Redis
) -> None:
    keys = Keys()

    async def main() -> float:
        client = AsyncClient(redis_url)
        mux = StreamMux(client.redis, client._reader, keys, max_lanes=1, block_ms=60_000)
        try:
            first = mux.subscribe(keys.result("idle"))
            await asyncio.sleep(0.3)  # the lane is now blocked on `idle` for a minute
            second = mux.subscribe(keys.result("late"))
            pipe = redis_client.pipeline(transaction=False)
            write_chunk(pipe, keys, chunks_of("late", 1)[0])
            pipe.execute()
            loop = asyncio.get_running_loop()
            started = loop.time()
            entries = await second.get(timeout_s=20)
            assert len(entries) == 1 and len(mux.lanes) == 1
            first.close()
            return loop.time() - started
        finally:
            await mux.close()
            await client.close()

    assert asyncio.run(main()) < 20


@pytest.mark.fast
def test_a_stream_with_no_final_chunk_in_time_raises_timeout(redis_url: str) -> None:
    async def main() -> None:
        client = AsyncClient(redis_url)
        try:
            with pytest.raises(TimeoutError, match="no final chunk for never"):
                await _collect_with_timeout(client, "never", 0.3)
            assert client._mux is not None and client._mux.num_streams == 0
        finally:
            await client.close()

    asyncio.run(main())


async def _collect_with_timeout(client: AsyncClient, request_id: str, timeout_s: float) -> None:
    async for _ in client.stream(request_id, timeout_s=timeout_s):
        pass


@pytest.mark.fast
def test_subscriptions_of_one_stream_each_get_every_entry_after_their_own_cursor(
    redis_url: str, redis_client: redis.Redis
) -> None:
    keys = Keys()
    chunks = chunks_of("shared", 30)

    def write(part: list[ResultChunk]) -> list[bytes]:
        pipe = redis_client.pipeline(transaction=False)
        for chunk in part:
            write_chunk(pipe, keys, chunk)
        return list(pipe.execute())

    async def drain(sub: Subscription) -> list[int]:
        seqs: list[int] = []
        while not seqs or seqs[-1] != len(chunks) - 1:
            seqs += [int(fields[b"seq"]) for _, fields in await sub.get(timeout_s=20)]
        sub.close()
        return seqs

    async def main() -> list[list[int]]:
        client = AsyncClient(redis_url)
        mux = StreamMux(client.redis, client._reader, keys, max_lanes=1)
        try:
            ids = write(chunks[:5])
            first = mux.subscribe(keys.result("shared"))
            readers = [asyncio.create_task(drain(first))]
            for start in range(5, 30, 5):  # others join while the stream grows, one of them
                await asyncio.sleep(0.05)  # from the start, one after a given entry
                cursor = b"0-0" if start == 10 else ids[2]
                readers.append(
                    asyncio.create_task(drain(mux.subscribe(keys.result("shared"), cursor)))
                )
                ids += write(chunks[start : start + 5])
            return list(await asyncio.gather(*readers))
        finally:
            await mux.close()
            await client.close()

    got = asyncio.run(main())
    assert got[0] == list(range(30))
    assert got[2] == list(range(30))  # joined from the start
    assert all(seqs == list(range(3, 30)) for i, seqs in enumerate(got) if i not in (0, 2))


def test_ten_thousand_concurrent_streams_from_one_process_complete_in_order_on_48_connections(
    tmp_path,
) -> None:
    out = tmp_path / "many.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.probes.many_streams",
            "--streams",
            "10000",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["complete_in_order"] == 10_000, report["faults"]
    assert report["chunks"] >= 10_000
    # AsyncClient's defaults: 32 connections for commands, 16 for the streams' reads.
    assert 0 < report["max_client_connections"] <= 48
