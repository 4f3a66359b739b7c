"""Many live result streams from one process: N concurrent `AsyncClient.stream()` readers on
a `tiny` pool, short outputs. Reports the wall time, the most Redis connections the client
process held at once (sampled from the server), whether every stream came whole and in
order, and what decoding the chunks through pydantic costs against the process's CPU time.
Not part of CI; `tests/test_streams.py` runs it at full size.

    python -m bench.probes.many_streams --streams 10000 --json bench/out/many_streams.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from npu_pool.embedded import EmbeddedRedis
from npu_pool.launcher import PoolProcesses
from producer.client import AsyncClient, Client
from schemas.codec import decode
from schemas.config import Settings
from schemas.keys import FIELD, Keys
from schemas.messages import ResultChunk

# A pool that admits many short requests at once: wide decode launches, many KV slots,
# short prefill chunks and many of them per step.
POOL = {
    "model": "tiny",
    "device": "cpu",
    "pool": "fanout",
    "max_num_seqs": 512,
    "kv_slots_per_rank": 512,
    "decode_batch": 64,
    "max_model_len": 32,
    "prefill_chunk": 16,
    "prefill_slots": 32,
    "threads_per_rank": 1,
}


def stream_fault(chunks: list[ResultChunk], max_tokens: int) -> str | None:
    """Why a stream is not whole and in order, or None."""
    tokens = 0
    for seq, chunk in enumerate(chunks):
        if chunk.seq != seq or chunk.index != tokens:
            return f"chunk {seq}: seq {chunk.seq}, index {chunk.index} after {tokens} tokens"
        tokens += len(chunk.token_ids)
    if not chunks or chunks[-1].finish_reason != "length" or tokens != max_tokens:
        return f"ended {chunks[-1].finish_reason if chunks else None} after {tokens} tokens"
    if any(c.finish_reason is not None for c in chunks[:-1]):
        return "a final chunk before the end"
    return None


async def fan_out(url: str, num_streams: int, max_tokens: int, seed: int) -> dict[str, Any]:
    """Open every stream first, then submit the requests; wait for all of them."""
    monitor = redis.Redis.from_url(url)
    samples: list[int] = []
    name = "fanout-client"  # every connection of the client is named, so the server counts them
    client = AsyncClient(f"{url}?client_name={name}", max_queue=10**9)
    rng = random.Random(seed)
    ids = [f"fan-{i}" for i in range(num_streams)]
    cpu0, started = time.process_time(), time.monotonic()

    async def read(request_id: str) -> list[ResultChunk]:
        return [c async for c in client.stream(request_id, timeout_s=1800)]

    async def sample() -> None:
        while True:
            clients = await asyncio.to_thread(monitor.client_list)
            samples.append(sum(1 for c in clients if c.get("name") == name))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    readers = [asyncio.create_task(read(rid)) for rid in ids]
    limit = asyncio.Semaphore(32)

    async def submit(request_id: str) -> None:
        prompt = [rng.randrange(2, 500) for _ in range(3)]
        async with limit:
            await client.submit(
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                ignore_eos=True,
                request_id=request_id,
            )

    try:
        await asyncio.gather(*(submit(rid) for rid in ids))
        streams = await asyncio.gather(*readers)
    finally:
        sampler.cancel()
        await client.close()
        monitor.close()
    wall, cpu = time.monotonic() - started, time.process_time() - cpu0
    faults = [f for f in (stream_fault(s, max_tokens) for s in streams) if f]
    return {
        "streams": num_streams,
        "max_tokens": max_tokens,
        "complete_in_order": num_streams - len(faults),
        "faults": faults[:5],
        "chunks": sum(len(s) for s in streams),
        "wall_s": round(wall, 2),
        "client_cpu_s": round(cpu, 2),
        "max_client_connections": max(samples, default=0),
    }


def decode_cost(url: str, num_streams: int) -> float:
    """Seconds to decode every chunk of every stream once with pydantic (`decode`)."""
    client = redis.Redis.from_url(url)
    keys = Keys()
    pipe = client.pipeline(transaction=False)
    for i in range(num_streams):
        pipe.xrange(keys.result(f"fan-{i}"))
    raws = [fields[FIELD.encode()] for entries in pipe.execute() for _, fields in entries]
    client.close()
    started = time.process_time()
    for raw in raws:
        decode(ResultChunk, raw)
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="npupool-fanout-"))
    server = EmbeddedRedis(data_dir=workdir / "redis")
    url = server.start()
    settings = Settings(redis_url=url, **POOL)  # type: ignore[arg-type]
    processes = PoolProcesses(settings, url, log_dir=workdir / "logs")
    try:
        processes.start()
        with Client(url) as waiter:
            waiter.wait_ready(timeout_s=300, pool=settings.pool)
        report = asyncio.run(fan_out(url, args.streams, args.max_tokens, seed=0))
        report["decode_s"] = round(decode_cost(url, args.streams), 3)
        report["pool"] = POOL
    finally:
        processes.stop(timeout_s=30)
        server.stop()
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
