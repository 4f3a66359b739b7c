"""`npu-pool bench --http`: the same workload through an OpenAI-compatible HTTP server.

The load client speaks only the OpenAI protocol (streamed `/v1/completions` with token-id
prompts, vLLM's `ignore_eos` and `continuous_usage_stats` to count tokens per chunk), so it
measures the pool's own gateway and another server, such as vLLM's, the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import OneRequest, Trace, Workload, drive, summarise

HEALTH_TIMEOUT_S = 60.0


async def _one_http(
    http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
) -> Trace:
    trace = Trace(time.monotonic())
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    counted = 0
    async with http.stream("POST", "/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:500]
            raise RuntimeError(f"HTTP {response.status_code} from {response.url}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = chunk.get("usage") or {}
            total = usage.get("completion_tokens")
            new = (total - counted) if total is not None else (1 if chunk.get("choices") else 0)
            counted += max(0, new)
            trace.token_times += [time.monotonic()] * max(0, new)
    trace.done = time.monotonic()
    return trace


async def run_http_workload(
    base_url: str,
    model: str,
    workload: Workload,
    api_key: str | None = None,
    warm_up: Workload | None = None,
) -> tuple[list[Trace], float]:
    """Send the workload to `base_url` (ending in /v1); every trace and the wall time.
    `warm_up` runs first, untimed, so the client's connections are open when it starts."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"), headers=headers, limits=limits, timeout=600
    ) as http:
        one: OneRequest = functools.partial(_one_http, http, model)
        if warm_up is not None:
            await drive(warm_up, one)
        return await drive(workload, one)


@dataclass
class GatewayProcess:
    """An `npu-pool gateway` child process and its base URL."""

    process: subprocess.Popen[bytes]
    base_url: str

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL)."""
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_gateway(
    redis_url: str, namespace: str, log_path: Path, niceness: int = 0
) -> GatewayProcess:
    """Start a gateway on a free loopback port (`niceness` added to its scheduling niceness,
    as `nice -n` would) and wait until it sees a ready pool."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            (["nice", "-n", str(niceness)] if niceness else [])
            + [sys.executable, "-m", "npu_pool.cli", "gateway", "--port", str(port)]
            + ["--redis-url", redis_url, "--namespace", namespace],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    gateway = GatewayProcess(process, f"http://127.0.0.1:{port}/v1")
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return gateway
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    gateway.stop()
    raise RuntimeError(f"the gateway did not become ready; see {log_path}")


def overhead(direct: dict[str, Any], http: dict[str, Any]) -> dict[str, float]:
    """What going through HTTP adds to the Redis client's figures at one load level."""
    return {
        "ttft_p50_ms": http["ttft_ms"]["p50"] - direct["ttft_ms"]["p50"],
        "itl_p50_ms": http["itl_ms"]["p50"] - direct["itl_ms"]["p50"],
        "e2e_p50_ms": http["e2e_ms"]["p50"] - direct["e2e_ms"]["p50"],
        "throughput_ratio": http["output_tokens_per_s"] / direct["output_tokens_per_s"],
    }


def http_level(
    args: argparse.Namespace,
    model: str,
    gateway: GatewayProcess | None,
    workload: Workload,
    direct: dict[str, Any],
) -> dict[str, Any]:
    """The same workload through the gateway and through --http-url, if asked for."""
    out: dict[str, Any] = {}
    slos = (args.slo_ttft_ms, args.slo_tpot_ms)
    if gateway is not None:
        traces, wall = asyncio.run(run_http_workload(gateway.base_url, model, workload))
        out["gateway"] = summarise(traces, wall, *slos)
        out["gateway_overhead"] = overhead(direct, out["gateway"])
    if args.http_url:
        model = args.http_model or model
        traces, wall = asyncio.run(
            run_http_workload(args.http_url, model, workload, args.http_api_key)
        )
        out["http_peer"] = summarise(traces, wall, *slos) | {"url": args.http_url, "model": model}
    return out


def print_http(report: dict[str, Any]) -> None:
    """The HTTP rows next to the Redis client's, per load level."""
    print(f"{'conc':>5} {'client':<10}{'tok/s':>9}{'TTFT p50':>10}{'ITL p50':>9}{'e2e p50':>9}")
    for level in report["levels"]:
        rows = [("redis", level)] + [
            (name, level[name]) for name in ("gateway", "http_peer") if name in level
        ]
        for name, row in rows:
            print(
                f"{level['concurrency']:>5} {name:<10}{row['output_tokens_per_s']:>9.0f}"
                f"{row['ttft_ms']['p50']:>10.1f}{row['itl_ms']['p50']:>9.2f}"
                f"{row['e2e_ms']['p50']:>9.0f}"
            )
        if "gateway_overhead" in level:
            o = level["gateway_overhead"]
            print(
                f"      gateway adds TTFT {o['ttft_p50_ms']:+.1f} ms, e2e {o['e2e_p50_ms']:+.1f} ms"
                f" at p50; throughput x{o['throughput_ratio']:.2f}"
            )
