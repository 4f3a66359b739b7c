"""The workload ceiling: the launches a level's requests need, timed back to back at the
kernel ceiling's speeds, as tokens per second. The pool can only approach it."""

from __future__ import annotations

import math
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
