"""Load generation and serving metrics: closed-loop concurrency or Poisson arrivals, seeded
prompt and output lengths, per-request TTFT / TPOT / ITL / end-to-end latency."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from producer.client import AsyncClient


@dataclass(frozen=True, slots=True)
class Workload:
    """What to send: how many requests, their lengths, and how they arrive."""

    num_requests: int
    prompt_len: tuple[int, int]  # inclusive range of prompt tokens
    output_len: tuple[int, int]  # inclusive range of max_tokens (EOS ignored)
    concurrency: int | None = None  # closed loop: this many in flight
    rate: float | None = None  # open loop: Poisson arrivals per second
    seed: int = 0
    vocab_size: int = 512

    def requests(self) -> list[tuple[list[int], int]]:
        """The seeded (prompt token ids, max_tokens) of every request."""
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_requests):
            length = rng.randint(*self.prompt_len)
            prompt = [rng.randrange(2, self.vocab_size) for _ in range(length)]
            out.append((prompt, rng.randint(*self.output_len)))
        return out


@dataclass(slots=True)
class Trace:
    """Timing of one request, seconds on the monotonic clock."""

    submitted: float
    token_times: list[float] = field(default_factory=list)
    done: float = 0.0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


async def _one(client: AsyncClient, prompt: list[int], max_tokens: int) -> Trace:
    trace = Trace(time.monotonic())
    request_id = await client.submit(
        prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True
    )
    async for chunk in client.stream(request_id, timeout_s=600):
        now = time.monotonic()
        trace.token_times += [now] * len(chunk.token_ids)
    trace.done = time.monotonic()
    return trace


OneRequest = Callable[[list[int], int], Awaitable[Trace]]


async def drive(workload: Workload, one: OneRequest) -> tuple[list[Trace], float]:
    """Send the workload through `one(prompt, max_tokens)`; every trace and the wall time."""
    requests = workload.requests()
    rng = random.Random(workload.seed + 1)
    started = time.monotonic()
    if workload.rate:
        tasks: list[asyncio.Future[Trace]] = []
        for prompt, max_tokens in requests:
            tasks.append(asyncio.ensure_future(one(prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(workload.rate))
        traces = list(await asyncio.gather(*tasks))
    else:
        limit = asyncio.Semaphore(workload.concurrency or 1)

        async def bounded(prompt: list[int], max_tokens: int) -> Trace:
            async with limit:
                return await one(prompt, max_tokens)

        traces = list(await asyncio.gather(*(bounded(p, m) for p, m in requests)))
    return traces, time.monotonic() - started


@contextlib.asynccontextmanager
async def redis_requests(url: str, namespace: str) -> AsyncIterator[OneRequest]:
    """`one(prompt, max_tokens)` through one Redis client, closed on exit."""
    client = AsyncClient(url, namespace, max_queue=10**9)
    try:
        yield functools.partial(_one, client)
    finally:
        await client.close()


async def run_workload(url: str, namespace: str, workload: Workload) -> tuple[list[Trace], float]:
    """Send the workload with the Redis client; returns every request's trace and the wall time."""
    async with redis_requests(url, namespace) as one:
        return await drive(workload, one)


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 in milliseconds (empty: zeros)."""
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)
    cuts = (
        statistics.quantiles(ordered, n=100, method="inclusive")
        if len(ordered) > 1
        else (ordered * 99)
    )
    return {"p50": cuts[49] * 1000, "p90": cuts[89] * 1000, "p99": cuts[98] * 1000}


def summarise(
    traces: list[Trace], wall_s: float, slo_ttft_ms: float, slo_tpot_ms: float
) -> dict[str, Any]:
    """Throughput, latency percentiles and goodput of one run."""
    tokens = sum(len(t.token_times) for t in traces)
    gaps = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:])]
    tpots = [t.tpot for t in traces if t.tpot is not None]
    good = [
        t
        for t in traces
        if t.ttft * 1000 <= slo_ttft_ms and (t.tpot is None or t.tpot * 1000 <= slo_tpot_ms)
    ]
    return {
        "requests": len(traces),
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": tokens / wall_s,
        "requests_per_s": len(traces) / wall_s,
        "ttft_ms": percentiles([t.ttft for t in traces]),
        "tpot_ms": percentiles([v for v in tpots if v is not None]),
        "itl_ms": percentiles(gaps),
        "e2e_ms": percentiles([t.done - t.submitted for t in traces]),
        "goodput_requests_per_s": len(good) / wall_s,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
    }
