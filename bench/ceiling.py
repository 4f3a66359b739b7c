"""The ceilings the pool is measured against: the kernel ceiling (its launches back to back
in a process of their own, `bench.kernels`) and the workload ceiling (the launches a
level's requests need, timed back to back at the kernel ceiling's speeds, as tokens per
second). The pool can only approach them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.loadgen import Workload
from schemas.config import Settings


def workload_ceiling(kernels: dict[str, Any], workload: Workload, settings: Settings) -> dict:
    """Output tokens/s of `workload` if its prefill and decode launches ran back to back:
    full B1S`prefill_chunk` launches for its prompt tokens (packed), or one per prompt
    chunk (unpacked), and full decode launches for every token after each request's first
    (which its last prefill chunk samples)."""
    requests = workload.requests()
    chunk, batch = settings.prefill_chunk, settings.decode_batch
    if settings.pack_prefill:
        prefill_launches = math.ceil(sum(len(prompt) for prompt, _ in requests) / chunk)
    else:
        prefill_launches = sum(math.ceil(len(prompt) / chunk) for prompt, _ in requests)
    output_tokens = sum(max_tokens for _, max_tokens in requests)
    decode_launches = (output_tokens - len(requests)) / batch
    prefill_ms = min(
        row["p50_ms"] for row in kernels["launches"] if row["launch"] == f"prefill B1S{chunk}"
    )
    seconds = (prefill_launches * prefill_ms + decode_launches * kernels["ms_per_launch"]) / 1000
    return {
        "output_tokens_per_s": output_tokens / seconds * settings.ranks,
        "decode_only_tokens_per_s": kernels["output_tokens_per_s"],
        "prefill_launches": prefill_launches,
        "decode_launches": round(decode_launches, 1),
        "prefill_share": prefill_launches * prefill_ms / 1000 / seconds,
    }


def burst_ideal_ms(kernels: dict[str, Any], workload: Workload, settings: Settings) -> float:
    """The prefill-bound ideal of a burst: its prompt tokens at the prefill launches' token
    rate (full B1S`prefill_chunk` launches back to back on every rank)."""
    chunk = settings.prefill_chunk
    prefill_ms = min(
        row["p50_ms"] for row in kernels["launches"] if row["launch"] == f"prefill B1S{chunk}"
    )
    prompt_tokens = sum(len(prompt) for prompt, _ in workload.requests())
    return prompt_tokens / chunk * prefill_ms / settings.ranks


def worker_threads(settings: Settings) -> int:
    """Torch threads a rank (and so each peer) gets: `(cores - 1) / ranks` unless set."""
    cores = len(os.sched_getaffinity(0))
    return settings.threads_per_rank or max(1, (cores - 1) // settings.ranks)


def kernel_ceiling(settings: Settings) -> dict[str, Any]:
    """The same launches back to back in a process of their own (`bench.kernels`)."""
    out = Path(tempfile.mkdtemp()) / "kernels.json"
    flags = [a for a in settings.service_args() if a != "--mtp"] + ["--no-mtp"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.kernels",
            "--json",
            str(out),
            "--iters",
            "100",
            *flags,
            "--threads-per-rank",
            str(worker_threads(settings)),
        ],
        check=True,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    ceiling = result["ceiling"]
    return {
        "output_tokens_per_s_per_rank": ceiling["tokens_per_s"],
        "output_tokens_per_s": ceiling["tokens_per_s"] * settings.ranks,
        "ms_per_launch": ceiling["ms_per_launch"],
        "launches": result["launches"],
    }
