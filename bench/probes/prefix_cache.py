"""Prefix caching: the goals of bench/RESULTS.md ("Prefix caching").

Requests sharing one long system prompt, each with its own question, `--concurrency` at a
time (a new one as each ends), run twice on the same pool settings: with
`--no-prefix-caching` (every request cold) and with prefix caching on. Reported per run:
output tokens/s over the whole run, TTFT p50/p90 of the requests whose prompt came from
the cache (`usage.cached_tokens` > 0) and of the others, of the requests sent after the
first burst (each as an earlier one ended), and the share of prompt tokens served from
the cache. The two runs alternate `--rounds` times; the pool restarts between
them. With `--vllm-python PATH` (and `--model DIR`, a directory vLLM reads), each round
ends with a fresh vLLM OpenAI server serving the same prompts at the same concurrency with
its prefix caching on (paired with the pool's runs of that round),
as many model threads as the pool's ranks have, streamed over HTTP (the pool is driven
through its Redis client). The pool's cache is blocks in its default share of the free
memory, or of `--kv-cache-memory SIZE` a rank.
Not part of CI:

    python -m bench.probes.prefix_cache --model smollm2 --json bench/out/prefix_cache.json
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.peers.vllm_bench import SERVED_NAME, start_server
from bench.peers.vllm_env import check_vllm_peer
from npu_pool.embedded import EmbeddedRedis
from npu_pool.launcher import PoolProcesses
from producer.client import Client
from producer.status import collect_status
from schemas.config import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.probes.prefix_cache", description=__doc__
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--system-len", type=int, default=1024, help="shared prompt tokens")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--modes", nargs="+", choices=("off", "on"), default=["off", "on"], help="pool runs"
    )
    parser.add_argument("--decode-batch", type=int, default=8, help="the pool's decode rows")
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument(
        "--kv-cache-memory", default=None, help="the pool's cache of blocks, bytes a rank"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--vllm-python", default=None, help="vLLM's Python, to run it too")
    parser.add_argument("--vllm-dtype", default=None, help="vLLM's dtype (default: the pool's)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="npupool-prefix-"))
    server = EmbeddedRedis(data_dir=workdir / "redis")
    url = server.start()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    rng = random.Random(1)
    system = [rng.randrange(100, 20000) for _ in range(args.system_len)]
    prompts = [
        system + [rng.randrange(100, 20000) for _ in range(rng.randrange(16, 64))]
        for _ in range(args.requests)
    ]
    if args.vllm_python:
        runs["vllm_on"] = []
    try:
        for round_ in range(args.rounds):  # each round: the pool's runs, then vLLM's
            for mode in args.modes:
                result = run(url, workdir / f"{mode}{round_}", args, prompts, mode == "on")
                runs[mode].append(result)
                print(f"{mode}: {json.dumps(result)}", file=sys.stderr)
            if args.vllm_python:  # a fresh server each round, as the pool's are fresh
                runs["vllm_on"].append(run_vllm(workdir, args, prompts))
                print(f"vllm_on: {json.dumps(runs['vllm_on'][-1])}", file=sys.stderr)
    finally:
        server.stop()
    report = {"settings": vars(args) | {"json": str(args.json)}, "runs": runs}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


# what the pool's status counts of its launches: how full its prefill launches ran
LAUNCH_COUNTS = (
    "steps",
    "prefill_launches",
    "prefill_tokens",
    "decode_launches",
    "padding_rows",
    "rank_time_us",
)


def pool_settings(url: str, args: argparse.Namespace, caching: bool) -> Settings:
    return Settings(
        redis_url=url,
        model=args.model,
        dtype=args.dtype,
        ranks=args.ranks,
        threads_per_rank=args.threads_per_rank,
        decode_batch=args.decode_batch,
        max_num_seqs=args.concurrency,
        kv_slots_per_rank=-(-args.concurrency // args.ranks),
        max_model_len=args.system_len + 128 + args.output_len,
        prefix_caching=caching,
        kv_cache_memory=args.kv_cache_memory,
        pool="prefix-on" if caching else "prefix-off",
    )


def run(
    url: str, logs: Path, args: argparse.Namespace, prompts: list[list[int]], caching: bool
) -> dict[str, Any]:
    """One run of the workload on a fresh pool."""
    settings = pool_settings(url, args, caching)
    processes = PoolProcesses(settings, url, log_dir=logs)
    processes.start()
    try:
        with Client(url) as client:
            client.wait_ready(timeout_s=900, pool=settings.pool)
            result = measure(prompts, args, functools.partial(RedisSender, url))
            [pool] = [
                p
                for p in collect_status(client.redis, client.keys)["pools"]
                if p["pool"] == settings.pool
            ]
            result["launches"] = {name: pool[name] for name in LAUNCH_COUNTS if name in pool}
        return result
    finally:
        processes.stop(timeout_s=30)


def run_vllm(workdir: Path, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """The workload on vLLM's server with its prefix caching on."""
    settings = pool_settings("redis://unused", args, True)
    peer = check_vllm_peer(
        args.vllm_python, settings, args.ranks * args.threads_per_rank, args.vllm_dtype
    )
    engine = {
        "max_model_len": settings.max_model_len,
        "max_num_seqs": args.concurrency,
        "seed": 0,
        "prefix_caching": True,
    }
    server = start_server(peer, engine, workdir / "vllm-server.log")
    try:
        result = measure(prompts, args, functools.partial(HttpSender, server.base_url))
    finally:
        server.stop()
    return peer.describe() | {"startup_s": server.startup_s} | result


class RedisSender:
    """Sends a prompt through the pool's Redis client: TTFT s, output tokens, cached tokens."""

    def __init__(self, url: str) -> None:
        self.client = Client(url)

    def __call__(self, prompt: list[int], max_tokens: int) -> tuple[float, int, int]:
        sent = time.perf_counter()
        request_id = self.client.submit(
            prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True
        )
        first, tokens, cached = None, 0, 0
        for chunk in self.client.stream(request_id, timeout_s=900):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - sent
            tokens += len(chunk.token_ids)
            if chunk.usage is not None:
                cached = chunk.usage.cached_tokens
        return first or 0.0, tokens, cached

    def close(self) -> None:
        self.client.close()


class HttpSender:
    """The same through an OpenAI-compatible server's streamed `/completions`."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=900)

    def __call__(self, prompt: list[int], max_tokens: int) -> tuple[float, int, int]:
        body = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        first, tokens, cached = None, 0, 0
        with self.http.stream("POST", "/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk.get("choices") and first is None:
                    first = time.perf_counter() - sent
                usage = chunk.get("usage") or {}
                if usage:
                    tokens = usage.get("completion_tokens", tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens") or 0
        return first or 0.0, tokens, cached

    def close(self) -> None:
        self.http.close()


def measure(
    prompts: list[list[int]],
    args: argparse.Namespace,
    sender: Callable[[], RedisSender | HttpSender],
) -> dict[str, Any]:
    """Each prompt's TTFT and cached tokens, `concurrency` requests in flight, each thread
    with a sender of its own."""
    # ttft s, cached, prompt tokens, output tokens, whether it came after the first burst
    results: list[tuple[float, int, int, int, bool]] = []
    lock = threading.Lock()
    todo = list(enumerate(prompts))

    def worker() -> None:
        send = sender()
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    i, prompt = todo.pop(0)
                first, tokens, cached = send(prompt, args.output_len)
                with lock:
                    later = i >= args.concurrency
                    results.append((first, cached, len(prompt), tokens, later))
        finally:
            send.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    hits = [r[0] for r in results if r[1] > 0]
    cold = [r[0] for r in results if r[1] == 0]
    steady = [r[0] for r in results if r[4]]  # sent as earlier ones ended, not in the burst
    return {
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(sum(r[3] for r in results) / wall, 1),
        "requests": len(results),
        "hits": len(hits),
        "ttft_hit_p50_s": _quantile(hits, 0.5),
        "ttft_hit_p90_s": _quantile(hits, 0.9),
        "ttft_cold_p50_s": _quantile(cold, 0.5),
        "ttft_cold_p90_s": _quantile(cold, 0.9),
        "ttft_after_burst_p50_s": _quantile(steady, 0.5),
        "ttft_after_burst_p90_s": _quantile(steady, 0.9),
        "prompt_tokens_from_cache": round(
            sum(r[1] for r in results) / sum(r[2] for r in results), 3
        ),
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 3)
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1], 3)


if __name__ == "__main__":
    raise SystemExit(main())
