"""`npu-pool bench --vllm-python PATH`: vLLM's CPU build as a peer, measured after the pool in
the same run, on the same checkpoint, the same seeded workloads and as many model threads.

- `vllm_offline`: vLLM's offline engine (`bench/peers/vllm_offline.py` under that Python) on
  the workload of the reference level (64 concurrent, or the highest level below it), at
  most that many requests at once: tokens/s of the whole workload and of its decode alone.
- `vllm_http`: vLLM's OpenAI server under that Python, driven at every level by the client
  that drives the pool's gateway (`bench_http`), then stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.http_load import run_http_workload
from bench.loadgen import Workload, summarise
from bench.peers.vllm_env import VllmPeer
from schemas.config import Settings

OFFLINE_SCRIPT = Path(__file__).with_name("vllm_offline.py")
OFFLINE_TIMEOUT_S = 3600.0
SERVER_START_TIMEOUT_S = 900.0
SERVED_NAME = "vllm-peer"
REFERENCE_CONCURRENCY = 64
SEED = 0


class VllmFailed(RuntimeError):
    """vLLM's engine or server did not run to the end, with where its log is."""


def reference_level(levels: list[int]) -> int:
    """The level the peer is compared at: 64 when the bench runs it, else its highest."""
    return REFERENCE_CONCURRENCY if REFERENCE_CONCURRENCY in levels else max(levels)


def level_workload(args: argparse.Namespace, per_level: int, level: int) -> Workload:
    """The seeded workload of one load level, the one `bench.run` sends the pool."""
    return Workload(
        per_level, tuple(args.prompt_len), tuple(args.output_len), concurrency=level, seed=level
    )


def burst_workload(args: argparse.Namespace) -> Workload:
    """`--burst N`: N seeded requests that all arrive at once."""
    lengths = (tuple(args.prompt_len), tuple(args.output_len))
    return Workload(args.burst, *lengths, concurrency=args.burst, seed=4242)


def burst_warm_up(args: argparse.Namespace) -> Workload:
    """Run untimed before a burst, by the same client: N one-token requests at once, so the
    burst meets open connections (as a service's burst does) and times the server alone."""
    return Workload(args.burst, tuple(args.prompt_len), (1, 1), concurrency=args.burst, seed=4243)


def vllm_peer(
    peer: VllmPeer,
    settings: Settings,
    args: argparse.Namespace,
    levels: list[int],
    per_level: int,
    workdir: Path,
) -> dict[str, Any]:
    """`vllm_offline` and `vllm_http` entries for the report; a part that fails says why."""
    out: dict[str, Any] = {}
    reference = reference_level(levels)
    engine = {"max_model_len": settings.max_model_len, "seed": SEED, "prefix_caching": False}
    offline_engine = engine | {"max_num_seqs": min(settings.max_num_seqs, reference)}
    try:
        out["vllm_offline"] = peer.describe() | run_offline(
            peer, level_workload(args, per_level, reference), offline_engine, workdir
        )
    except VllmFailed as exc:
        out["vllm_offline"] = peer.describe() | {"error": str(exc)}
    out["vllm_offline"]["concurrency"] = reference
    server_engine = engine | {"max_num_seqs": settings.max_num_seqs}
    slos = (args.slo_ttft_ms, args.slo_tpot_ms)
    entry: dict[str, Any] = peer.describe() | {"engine": server_engine, "levels": []}
    try:
        server = start_server(peer, server_engine, workdir / "vllm-server.log")
    except VllmFailed as exc:
        out["vllm_http"] = entry | {"error": str(exc)}
        return out
    try:
        entry["startup_s"] = server.startup_s
        warm_up = Workload(8, tuple(args.prompt_len), (8, 8), concurrency=8, seed=10**6)
        asyncio.run(run_http_workload(server.base_url, SERVED_NAME, warm_up))
        for level in levels:
            workload = level_workload(args, per_level, level)
            traces, wall = asyncio.run(run_http_workload(server.base_url, SERVED_NAME, workload))
            entry["levels"].append(summarise(traces, wall, *slos) | {"concurrency": level})
        if args.burst:
            traces, wall = asyncio.run(
                run_http_workload(
                    server.base_url, SERVED_NAME, burst_workload(args), warm_up=burst_warm_up(args)
                )
            )
            entry["burst"] = {"requests": args.burst} | summarise(traces, wall, *slos)
    except (RuntimeError, httpx.HTTPError) as exc:
        entry["error"] = f"vLLM's server failed under load ({exc}); its log: {server.log_path}"
    finally:
        server.stop()
    out["vllm_http"] = entry
    return out


def run_offline(
    peer: VllmPeer,
    workload: Workload,
    engine: dict[str, Any],
    workdir: Path,
    token_ids: bool = False,
) -> dict[str, Any]:
    """Run `vllm_offline.py` on `workload` with vLLM's Python; its JSON result (with every
    completion's token ids and a tokenizer round trip if `token_ids`)."""
    requests_path = workdir / "vllm-workload.json"
    requests_path.write_text(json.dumps({"requests": workload.requests()}))
    result_path, log_path = workdir / "vllm-offline.json", workdir / "vllm-offline.log"
    command = [peer.python, "-P", str(OFFLINE_SCRIPT), "--model", str(peer.model_dir)]
    command += ["--workload", str(requests_path), "--out", str(result_path)]
    command += ["--dtype", peer.dtype, "--max-model-len", str(engine["max_model_len"])]
    command += ["--max-num-seqs", str(engine["max_num_seqs"]), "--seed", str(engine["seed"])]
    command += ["--token-ids"] if token_ids else []
    with open(log_path, "wb") as log:
        try:
            done = subprocess.run(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=peer.env(),
                timeout=OFFLINE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as exc:
            raise VllmFailed(f"vLLM's offline engine ran past {OFFLINE_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0 or not result_path.exists():
        raise VllmFailed(
            f"vLLM's offline engine exited with {done.returncode}; its log: {log_path}\n"
            + _tail(log_path)
        )
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


@dataclass
class VllmServer:
    """vLLM's OpenAI server as a child process (its own process group), and its base URL."""

    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    startup_s: float = 0.0

    def stop(self) -> None:
        """SIGTERM (vLLM stops its engine processes), then SIGKILL to what is left of the
        group: a spinning engine process left behind would skew every later measurement."""
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):  # else the whole group is gone
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def start_server(peer: VllmPeer, engine: dict[str, Any], log_path: Path) -> VllmServer:
    """Start vLLM's server on a free loopback port; wait until it lists the model."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    command = [peer.python, "-P", "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(peer.model_dir), "--served-model-name", SERVED_NAME]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", peer.dtype]
    command += ["--max-model-len", str(engine["max_model_len"])]
    command += ["--max-num-seqs", str(engine["max_num_seqs"]), "--seed", str(engine["seed"])]
    caching = ("--" if engine["prefix_caching"] else "--no-") + "enable-prefix-caching"
    command += [caching, "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=peer.env(), start_new_session=True
        )
    server = VllmServer(process, f"http://127.0.0.1:{port}/v1", log_path)
    while time.monotonic() - started < SERVER_START_TIMEOUT_S:
        if process.poll() is not None:
            raise VllmFailed(
                f"vLLM's server exited with {process.returncode} while starting; its log: "
                f"{log_path}\n" + _tail(log_path)
            )
        try:
            if httpx.get(f"{server.base_url}/models", timeout=5).status_code == 200:
                server.startup_s = round(time.monotonic() - started, 1)
                return server
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    server.stop()
    raise VllmFailed(
        f"vLLM's server was not ready within {SERVER_START_TIMEOUT_S:.0f} s; its log: {log_path}"
    )


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def vllm_ratios(report: dict[str, Any]) -> dict[str, float | None]:
    """The pool at the reference level over vLLM's offline engine and its server there."""
    out: dict[str, float | None] = {}
    offline, http = report.get("vllm_offline"), report.get("vllm_http")
    if offline is None or http is None:
        return out
    level = offline["concurrency"]
    pool = _at(report["levels"], level)
    if pool is not None and "error" not in offline:
        out["pool_over_vllm_offline"] = pool["output_tokens_per_s"] / offline["output_tokens_per_s"]
        decode = offline.get("decode_tokens_per_s")
        if decode:
            out["ceiling_over_vllm_offline_decode"] = (
                report["ceiling"]["output_tokens_per_s"] / decode
            )
    if "burst" in report and "burst" in http:
        out["burst_ttft_p99_over_vllm_http"] = (
            report["burst"]["ttft_ms"]["p99"] / http["burst"]["ttft_ms"]["p99"]
        )
    server = _at(http["levels"], level)
    if pool is not None and server is not None:
        out["pool_over_vllm_http"] = pool["output_tokens_per_s"] / server["output_tokens_per_s"]
        if "gateway" in pool:
            out["pool_gateway_over_vllm_http"] = (
                pool["gateway"]["output_tokens_per_s"] / server["output_tokens_per_s"]
            )
    return out


def _at(levels: list[dict[str, Any]], concurrency: int) -> dict[str, Any] | None:
    return next((lv for lv in levels if lv["concurrency"] == concurrency), None)


def print_vllm(report: dict[str, Any]) -> None:
    """vLLM's versions, settings and figures (the ratios print with the others)."""
    offline, http = report["vllm_offline"], report["vllm_http"]
    env = " ".join(f"{k}={v}" for k, v in offline["env"].items() if k != "LD_PRELOAD")
    print(
        f"vLLM {offline['vllm_version']} (torch {offline['torch_version']}), {offline['dtype']},"
        f" {offline['model_threads']} model thread(s): {env}"
    )
    if "error" in offline:
        print(f"vllm offline: failed: {offline['error']}")
    else:
        decode = offline["decode_tokens_per_s"]
        print(
            f"vllm offline: {offline['output_tokens_per_s']:.0f} tokens/s whole workload"
            f" ({offline['requests']} requests, at most {offline['engine']['max_num_seqs']}"
            f" at once, {offline['wall_s']:.2f} s), "
            + (f"{decode:.0f} tokens/s decode alone" if decode else "decode alone: n/a")
        )
    for level in http["levels"]:
        print(
            f"vllm http {level['concurrency']:>4}: {level['output_tokens_per_s']:8.0f} tokens/s,"
            f" TTFT p50 {level['ttft_ms']['p50']:.0f} ms p99 {level['ttft_ms']['p99']:.0f} ms,"
            f" ITL p50 {level['itl_ms']['p50']:.1f} ms, e2e p50 {level['e2e_ms']['p50']:.0f} ms"
        )
    if "burst" in http:
        ttft = http["burst"]["ttft_ms"]
        print(
            f"vllm http burst of {http['burst']['requests']}: TTFT p50 {ttft['p50']:.0f} / "
            f"p90 {ttft['p90']:.0f} / p99 {ttft['p99']:.0f} ms"
        )
    if "error" in http:
        print(f"vllm http: failed: {http['error']}")


def plot_vllm(axis: Any, report: dict[str, Any]) -> None:
    """vLLM's offline engine as a line and its server as a curve on the throughput axis."""
    offline, http = report["vllm_offline"], report["vllm_http"]
    if "error" not in offline:
        axis.axhline(
            offline["output_tokens_per_s"], ls="--", c="tab:red", label="vLLM offline engine"
        )
    if http["levels"]:
        axis.plot(
            [lv["concurrency"] for lv in http["levels"]],
            [lv["output_tokens_per_s"] for lv in http["levels"]],
            "s-",
            c="tab:red",
            label="vLLM HTTP server",
        )
