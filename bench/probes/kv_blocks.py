"""A cache of blocks: the memory goal of bench/RESULTS.md ("A cache of blocks").

The same cache bytes run twice: as `--slots` slots that each reserve `--max-model-len`
tokens (`--kv-cache-fraction 0`), then as a pool of blocks of those bytes
(`--kv-cache-memory`, with `--kv-slots-per-rank` raised to the requests' count). Each run
sends `--requests` requests at once, each `--prompt-len` tokens asking for `--output-len`,
and reports: the most requests running at once (as `npu-pool status` shows them, polled),
output tokens/s over the run, TTFT p50/p90 and the blocks' gauges. Not part of CI:

    python -m bench.probes.kv_blocks --model bench/out/smollm2 --json bench/out/kv_blocks.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import ByteSize

from bench.probes.prefix_cache import RedisSender, _quantile
from npu_pool.embedded import EmbeddedRedis
from npu_pool.launcher import PoolProcesses
from npu_worker.weights.loader import load_model
from npu_worker.weights.presets import resolve_model_dir
from producer.client import Client
from producer.status import collect_status
from schemas.config import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.kv_blocks", description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--threads-per-rank", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8, help="full-length slots, a rank")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=100)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    loaded = load_model(resolve_model_dir(args.model), args.dtype, torch.device("cpu"), 128)
    per_token = loaded.model.new_state(1, 128, 128, 1).bytes_per_token
    memory = args.slots * args.max_model_len * per_token
    del loaded
    workdir = Path(tempfile.mkdtemp(prefix="npupool-blocks-"))
    server = EmbeddedRedis(data_dir=workdir / "redis")
    url = server.start()
    rng = random.Random(2)
    prompts = [
        [rng.randrange(100, 20000) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    runs: dict[str, Any] = {"cache_bytes_per_rank": memory, "bytes_per_token": per_token}
    try:
        for mode in ("slots", "blocks"):
            runs[mode] = run(url, workdir / mode, args, prompts, memory if mode == "blocks" else 0)
            print(f"{mode}: {json.dumps(runs[mode])}", file=sys.stderr)
    finally:
        server.stop()
    report = {"settings": vars(args) | {"json": str(args.json)}, "runs": runs}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


def run(
    url: str, logs: Path, args: argparse.Namespace, prompts: list[list[int]], memory: int
) -> dict[str, Any]:
    """Every prompt at once on a fresh pool: slots reserving, or `memory` bytes of blocks."""
    per_rank = -(-len(prompts) // args.ranks)
    settings = Settings(
        redis_url=url,
        model=args.model,
        dtype=args.dtype,
        ranks=args.ranks,
        threads_per_rank=args.threads_per_rank,
        max_num_seqs=len(prompts),
        kv_slots_per_rank=per_rank if memory else args.slots,
        kv_cache_memory=ByteSize(memory) if memory else None,
        kv_cache_fraction=0.9 if memory else 0.0,
        max_model_len=args.max_model_len,
        pool="blocks" if memory else "slots",
    )
    processes = PoolProcesses(settings, url, log_dir=logs)
    processes.start()
    try:
        with Client(url) as client:
            client.wait_ready(timeout_s=900, pool=settings.pool)
            return measure(client, settings.pool, url, prompts, args.output_len)
    finally:
        processes.stop(timeout_s=30)


def measure(
    client: Client, pool: str, url: str, prompts: list[list[int]], output_len: int
) -> dict[str, Any]:
    """Send every prompt at once (a thread each); poll the pool's status meanwhile."""
    results: list[tuple[float, int]] = []
    lock = threading.Lock()
    done = threading.Event()
    most = {"running": 0, "kv_blocks_used": 0, "kv_blocks_total": 0}

    def poll() -> None:
        while not done.wait(0.2):
            found = [p for p in collect_status(client.redis, client.keys)["pools"]]
            for entry in found:
                if entry["pool"] == pool:
                    for name in most:
                        most[name] = max(most[name], int(entry.get(name) or 0))

    def send(prompt: list[int]) -> None:
        sender = RedisSender(url)
        try:
            first, tokens, _ = sender(prompt, output_len)
        finally:
            sender.close()
        with lock:
            results.append((first, tokens))

    poller = threading.Thread(target=poll)
    poller.start()
    started = time.perf_counter()
    threads = [threading.Thread(target=send, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    done.set()
    poller.join()
    ttfts = [r[0] for r in results]
    return {
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(sum(r[1] for r in results) / wall, 1),
        "most_running": most["running"],
        "most_kv_blocks_used": most["kv_blocks_used"],
        "kv_blocks_total": most["kv_blocks_total"],
        "ttft_p50_s": _quantile(ttfts, 0.5),
        "ttft_p90_s": _quantile(ttfts, 0.9),
    }


if __name__ == "__main__":
    raise SystemExit(main())
