"""`npu-pool bench`: the serving benchmark, with the kernel ceiling and the peers measured in
the same run on the same model and machine (docs/architecture.md §10).

    npu-pool bench [--quick] [--json out.json] [--plot out.png] [settings flags]
    npu-pool bench --kernels [...]        the launch microbenchmark alone
    npu-pool bench --http [--http-url URL --http-model NAME]   also through HTTP (OpenAI protocol)
    npu-pool bench --model DIR --vllm-python PATH    vLLM's CPU build as a peer (bench_vllm)

The pool runs on a private embedded Redis. The ceiling and the peers run in their own
processes (this one never imports torch); the peers need the `bench` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.ceiling import burst_ideal_ms, kernel_ceiling, worker_threads, workload_ceiling
from bench.http_load import (
    GatewayProcess,
    http_level,
    print_http,
    run_http_workload,
    start_gateway,
)
from bench.loadgen import Trace, Workload, drive, redis_requests, run_workload, summarise
from bench.peers.transformers_peers import offline_peer, rq_peer
from bench.peers.vllm_bench import burst_warm_up, burst_workload, vllm_peer
from bench.peers.vllm_env import VllmPeer, VllmUnavailable, check_vllm_peer
from bench.report import plot, print_report, ratios
from npu_pool.embedded import EmbeddedRedis
from npu_pool.launcher import PoolProcesses
from producer.client import Client
from producer.status import PoolFailed, pool_status
from producer.status_view import wait_ready_live
from schemas.config import Settings, add_settings_flags, settings_from_args


def main(argv: list[str]) -> int:
    """Run the benchmark and print the report; `--kernels` runs the microbenchmark alone."""
    if "--kernels" in argv:
        rest = [a for a in argv if a != "--kernels"]
        return subprocess.call([sys.executable, "-m", "bench.kernels", *rest])
    parser = argparse.ArgumentParser(
        prog="npu-pool bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="run the launch microbenchmark alone (`npu-pool bench --kernels --help`: its flags)",
    )
    parser.add_argument("--quick", action="store_true", help="small run, a few minutes")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="load levels: requests in flight at once (default: 1 4 16 64 128; --quick: 1 8 64)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per load level (default: 160; --quick: 64)",
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        nargs=2,
        default=[32, 96],
        metavar=("MIN", "MAX"),
        help="prompt tokens, drawn uniformly (default: 32 96)",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=[48, 80],
        metavar=("MIN", "MAX"),
        help="completion tokens, drawn uniformly (default: 48 80)",
    )
    parser.add_argument(
        "--peer-requests",
        type=int,
        default=None,
        help="requests the queue-worker peer serves (default: 64; --quick: 16)",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    parser.add_argument(
        "--burst",
        type=int,
        default=64,
        help="after the levels, this many requests at once, for TTFT under a burst (0: none)",
    )
    parser.add_argument(
        "--slo-ttft-ms", type=float, default=1000.0, help="goodput: time to first token at most"
    )
    parser.add_argument(
        "--slo-tpot-ms", type=float, default=100.0, help="goodput: time per output token at most"
    )
    parser.add_argument(
        "--http", action="store_true", help="also drive each level through `npu-pool gateway`"
    )
    parser.add_argument(
        "--http-url", default=None, help="also drive this OpenAI-compatible server (…/v1)"
    )
    parser.add_argument("--http-model", default=None, help="model name at --http-url")
    parser.add_argument("--http-api-key", default=None, help="Bearer key for --http-url")
    parser.add_argument(
        "--gateway-nice",
        type=int,
        default=0,
        help="start the --http gateway this much nicer (as `nice -n N npu-pool gateway`), so "
        "ranks sharing its cores come first",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="a Python with vLLM: add vLLM as a peer (needs --model DIR)",
    )
    parser.add_argument(
        "--vllm-dtype",
        choices=["same", "float32", "bfloat16"],
        default="same",
        help="the dtype vLLM runs at (default: the pool's); on a CPU without native bfloat16 "
        "vLLM's best is float32, whatever the pool runs",
    )
    add_settings_flags(parser)
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(
            args, **{k: v for k, v in {"pool": "bench"}.items() if getattr(args, k) is None}
        )
    except ValueError as exc:
        print(f"npu-pool bench: {exc}", file=sys.stderr)
        return 2
    levels = args.concurrency or ([1, 8, 64] if args.quick else [1, 4, 16, 64, 128])
    per_level = args.requests or (64 if args.quick else 160)
    try:
        vllm = (
            check_vllm_peer(
                args.vllm_python,
                settings,
                worker_threads(settings) * settings.ranks,
                None if args.vllm_dtype == "same" else args.vllm_dtype,
            )
            if args.vllm_python
            else None
        )
    except VllmUnavailable as exc:
        print(f"npu-pool bench: {exc}", file=sys.stderr)
        return 2
    try:
        report = run(settings, args, levels, per_level, vllm)
    except PoolFailed as exc:
        print(f"npu-pool bench: {exc}", file=sys.stderr)
        return 1
    print_report(report)
    if args.http or args.http_url:
        print_http(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    return 1 if any("error" in report.get(k, {}) for k in ("vllm_offline", "vllm_http")) else 0


def run(
    settings: Settings,
    args: argparse.Namespace,
    levels: list[int],
    per_level: int,
    vllm: VllmPeer | None = None,
) -> dict[str, Any]:
    """Pool at each load level, then the ceiling and the peers, then the ratios."""
    workdir = Path(tempfile.mkdtemp(prefix="npupool-bench-"))
    server = EmbeddedRedis(data_dir=workdir / "redis")
    url = server.start()
    processes = PoolProcesses(
        settings.model_copy(update={"redis_url": url}), url, log_dir=workdir / "logs"
    )
    report: dict[str, Any] = {"settings": settings.model_dump(exclude={"redis_url"}), "levels": []}
    gateway = None
    try:
        processes.start()
        with Client(url, settings.namespace) as client:
            wait_ready_live(
                client.redis,
                client.keys,
                settings.pool,
                Console(stderr=True),
                600,
                processes.supervise,
            )
            if args.http:
                gateway = start_gateway(
                    url, settings.namespace, workdir / "gateway.log", args.gateway_nice
                )
            for level in levels:
                before = pool_status(client.redis, client.keys, settings.pool, 0)
                workload = Workload(
                    per_level,
                    tuple(args.prompt_len),
                    tuple(args.output_len),
                    concurrency=level,
                    seed=level,
                )
                traces, wall = asyncio.run(run_workload(url, settings.namespace, workload))
                summary = summarise(traces, wall, args.slo_ttft_ms, args.slo_tpot_ms)
                summary["concurrency"] = level
                summary |= _pool_counters(client, settings, before)
                summary |= http_level(args, settings.model, gateway, workload, summary)
                report["levels"].append(summary)
                print(
                    f"  concurrency {level:>4}: {summary['output_tokens_per_s']:8.0f} tokens/s,"
                    f" TTFT p50 {summary['ttft_ms']['p50']:.0f} ms",
                    file=sys.stderr,
                )
            if args.burst:
                report["burst"] = _burst(client, url, settings, args, gateway)
        processes.stop(timeout_s=30)
        report["ceiling"] = kernel_ceiling(settings)
        for level in report["levels"]:
            workload = Workload(
                per_level, tuple(args.prompt_len), tuple(args.output_len), seed=level["concurrency"]
            )
            level["workload_ceiling"] = workload_ceiling(report["ceiling"], workload, settings)
        if "burst" in report:
            ideal = burst_ideal_ms(report["ceiling"], burst_workload(args), settings)
            report["burst"]["prefill_bound_ideal_ms"] = ideal
            report["burst"]["ttft_p99_over_ideal"] = report["burst"]["ttft_ms"]["p99"] / ideal
        if not args.no_peers:
            peer_requests = args.peer_requests or (16 if args.quick else 64)
            report["rq_peer"] = rq_peer(url, settings, args, peer_requests)
            report["offline_peer"] = offline_peer(settings, args)
    finally:
        if gateway is not None:
            gateway.stop()
        processes.stop(timeout_s=30)
        server.stop()
    if vllm is not None:  # with the pool and its Redis stopped
        report |= vllm_peer(vllm, settings, args, levels, per_level, workdir)
    report["planner_us_per_step"] = _planner_us()
    report["ratios"] = ratios(report)
    return report


def _burst(
    client: Client,
    url: str,
    settings: Settings,
    args: argparse.Namespace,
    gateway: GatewayProcess | None,
) -> dict:
    """`--burst N` requests arriving at once: their TTFT percentiles and prefill efficiency
    (through the Redis client), and their TTFT percentiles through the gateway if it runs."""

    async def warm_then_burst() -> tuple[list[Trace], float, dict[str, Any]]:
        async with redis_requests(url, settings.namespace) as one:
            await drive(burst_warm_up(args), one)
            await asyncio.sleep(settings.heartbeat_s * 1.5)  # the warm-up's counters flushed
            before = pool_status(client.redis, client.keys, settings.pool, 0)
            return (*await drive(burst_workload(args), one), before)

    traces, wall, before = asyncio.run(warm_then_burst())
    summary = summarise(traces, wall, args.slo_ttft_ms, args.slo_tpot_ms)
    counters = _pool_counters(client, settings, before)
    print(f"  burst of {args.burst}: TTFT p99 {summary['ttft_ms']['p99']:.0f} ms", file=sys.stderr)
    return {
        "requests": args.burst,
        "ttft_ms": summary["ttft_ms"],
        "itl_ms": summary["itl_ms"],
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "prefill_efficiency": counters["prefill_efficiency"],
        "prefill_launches_per_request": counters["prefill_launches"] / args.burst,
    } | _gateway_burst(args, settings.model, gateway)


def _gateway_burst(
    args: argparse.Namespace, model: str, gateway: GatewayProcess | None
) -> dict[str, Any]:
    if gateway is None:
        return {}
    traces, wall = asyncio.run(
        run_http_workload(
            gateway.base_url, model, burst_workload(args), warm_up=burst_warm_up(args)
        )
    )
    summary = summarise(traces, wall, args.slo_ttft_ms, args.slo_tpot_ms)
    return {"gateway_ttft_ms": summary["ttft_ms"]}


def _planner_us() -> float:
    """Time the planner in a child process (the batcher's code, imported on its own)."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from bench.planner import microseconds_per_step as m; print(m())",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(done.stdout.strip())


def _pool_counters(client: Client, settings: Settings, before: dict[str, Any]) -> dict[str, Any]:
    time.sleep(settings.heartbeat_s * 1.5)  # counters flush once per heartbeat
    after = pool_status(client.redis, client.keys, settings.pool, 0)
    launches = after["decode_launches"] - before["decode_launches"]
    padding = after["padding_rows"] - before["padding_rows"]
    proposed = after["mtp"]["proposed"] - before["mtp"]["proposed"]
    accepted = after["mtp"]["accepted"] - before["mtp"]["accepted"]
    spent = {
        k: after["rank_time_us"][k] - before["rank_time_us"][k]
        for k in ("exec", "launch", "collective")
    }
    prefill_launches = after["prefill_launches"] - before["prefill_launches"]
    prefill_tokens = after["prefill_tokens"] - before["prefill_tokens"]
    idle = after["rank_time_us"]["idle"] - before["rank_time_us"]["idle"]
    return {
        # where the ranks' model threads spent the level: waiting for a plan, and the share
        # of their steps outside launches (host time)
        "rank_idle_share": idle / (idle + spent["exec"]) if idle + spent["exec"] else None,
        "rank_host_share": (spent["exec"] - spent["launch"]) / spent["exec"]
        if spent["exec"]
        else None,
        # expert parallelism: the share of the steps in the experts' collectives
        "rank_collective_share": spent["collective"] / spent["exec"] if spent["exec"] else None,
        "decode_launches": launches,
        "prefill_launches": prefill_launches,
        "prefill_efficiency": prefill_tokens / (prefill_launches * settings.prefill_chunk)
        if prefill_launches
        else None,
        "padding_waste": padding / (launches * settings.decode_batch) if launches else 0.0,
        "mtp_acceptance": accepted / proposed if proposed else None,
        "tokens_per_verify_launch": (proposed + accepted) / launches
        if proposed and launches
        else None,
    }
