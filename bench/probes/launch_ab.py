"""Decode (and B1S128 prefill) launches under several settings, interleaved in one process:
float32 with batched matrix products (the path before the decode kernel), float32 with the
kernel, bfloat16 with the kernel on unpacked linear weights, bfloat16 with the kernel on
weights packed for oneDNN, and bfloat16 with the kernel and the kernels' own products (on a
CPU with AVX-512; the default where the start-up probe finds them faster). Rounds alternate
between them so a noisy machine slows each alike; speed-ups are medians of the per-round
ratios to the first.

    python -m bench.probes.launch_ab --model smollm2 --decode-batch 64 --contexts 256 1024

A launch's rows sit at contexts spread evenly over [context / 2, context], as a live
launch's rows differ in length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from typing import Literal

import torch

from npu_worker.kernels.cpu.layers import CpuKit
from npu_worker.kernels.cpu.library import has_kernel_linear, load_cpu_kernels
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import load_model
from npu_worker.weights.presets import resolve_model_dir
from schemas.config import Settings
from schemas.control import PrefillChunk

DType = Literal["float32", "bfloat16"]
# dtype, decode kernel, packed linears, the kernels' products
VARIANTS: list[tuple[DType, bool, bool, bool]] = [
    ("float32", False, False, False),
    ("float32", True, False, False),
    ("bfloat16", True, False, False),
    ("bfloat16", True, True, False),
    ("bfloat16", True, True, True),
]


def runners(model: str, batch: int, max_model_len: int) -> dict[str, LaunchRunner]:
    """One runner (its own cache) per variant; one model per dtype."""
    out = {}
    kernels = load_cpu_kernels()
    for dtype, kernel, packed, products in VARIANTS:
        if products and (kernels is None or not has_kernel_linear()):
            continue
        settings = Settings(
            model=model,
            device="cpu",
            dtype=dtype,
            decode_batch=batch,
            kv_slots_per_rank=batch,
            max_model_len=max_model_len,
        )
        # each variant's kit chosen here, so the start-up probe does not choose the products
        kit = CpuKit(kernels if kernel else None, packed, kernel_products=products)
        loaded = load_model(
            resolve_model_dir(model), dtype, torch.device("cpu"), settings.max_kv_len, kit=kit
        )
        shapes = replace(settings.launch_shapes(), num_slots=batch)
        name = f"{dtype} {'kernel' if kernel else 'matmul'}{' packed' if packed else ''}"
        name += " own-products" if products else ""
        out[name] = LaunchRunner(loaded.model, shapes)
    return out


def summary(times: dict[str, list[float]]) -> str:
    """Each variant's median ms and the median of its per-round speed-ups over the first."""
    base = next(iter(times.values()))
    cells = []
    for name, ms in times.items():
        ratio = statistics.median(b / a for a, b in zip(ms, base))
        cells.append(f"{name} {statistics.median(ms):.1f} ms (x{ratio:.2f})")
    return "; ".join(cells)


def main(argv: list[str] | None = None) -> int:
    """Print each variant's median ms per launch and its speed-up over the first."""
    parser = argparse.ArgumentParser(prog="python -m bench.probes.launch_ab", description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rank's)")
    parser.add_argument("--prefill", action="store_true", help="also time B1S128 prefill")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    batch = args.decode_batch
    by_name = runners(args.model, batch, max(args.contexts))
    slots = list(range(batch))
    for context in args.contexts:
        half = context // 2
        positions = [half - 1 + half * i // max(batch - 1, 1) for i in range(batch)]
        times: dict[str, list[float]] = {name: [] for name in by_name}
        for runner in by_name.values():  # warm
            runner.decode(slots, [5] * batch, positions).argmax(-1)
        for _ in range(args.rounds):
            for name, runner in by_name.items():
                began = time.perf_counter()
                for _ in range(2):
                    runner.decode(slots, [5] * batch, positions).argmax(-1)
                times[name].append((time.perf_counter() - began) / 2 * 1000)
        print(f"{args.model} B{batch}S1, rows at {half}-{context}: " + summary(times))
    if args.prefill:
        chunk = [5] * 128
        times = {name: [] for name in by_name}
        for _ in range(args.rounds):
            for name, runner in by_name.items():
                began = time.perf_counter()
                runner.prefill([PrefillChunk(0, 0, len(chunk))], [chunk])
                times[name].append((time.perf_counter() - began) * 1000)
        print(f"{args.model} B1S128 prefill: " + summary(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
