"""Kernel microbenchmark: latency of each fixed launch shape, and tokens/s of back-to-back
decode launches in one process with no queue (the pool's kernel ceiling).

    npu-pool bench --kernels [--json out.json] [--iters N] [settings flags]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from npu_worker.kernels.cpu.layers import CpuKit
from npu_worker.models.launch import Kit, KVCache
from npu_worker.runner import LaunchRunner
from npu_worker.weights.presets import load_for
from schemas.config import Settings, add_settings_flags, settings_from_args
from schemas.control import PrefillChunk

BUDGET_S = 5.0  # per measurement: a large model on a CPU takes fewer than `iters` samples


def _timed(fn: Callable[[], Any], device: torch.device, iters: int) -> list[float]:
    """Milliseconds per call (at most `iters` calls or BUDGET_S), synchronising around each."""
    samples: list[float] = []
    deadline = time.perf_counter() + BUDGET_S
    while len(samples) < iters and (not samples or time.perf_counter() < deadline):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "npu":
        torch.npu.synchronize()  # type: ignore[attr-defined]


def _prefill_call(runner: LaunchRunner, prompt: list[int], start: int) -> Callable[[], Any]:
    chunks = [PrefillChunk(slot=0, start=start, num_tokens=len(prompt))]
    return lambda: runner.prefill(chunks, [prompt])


def _decode_call(runner: LaunchRunner, position: int) -> Callable[[], Any]:
    """A full decode launch (every row real) followed by the greedy pick."""
    batch = runner.decode_batch
    slots, tokens, positions = list(range(batch)), [5] * batch, [position] * batch
    return lambda: runner.decode(slots, tokens, positions).argmax(-1)


def _verify_call(runner: LaunchRunner, position: int) -> Callable[[], Any]:
    """A full MTP verify launch, greedy acceptance, and the draft launch after it."""
    batch = runner.decode_batch
    slots = list(range(batch))

    def call() -> None:
        for slot in slots:
            runner.set_tail(slot, 5, position, 6)
        verify = runner.verify(slots, position)
        first = verify.logits[:, 0].argmax(-1)
        runner.commit(verify, first, verify.logits[:, 1].argmax(-1), first == verify.drafts)

    return call


def attention_bandwidth(
    runner: LaunchRunner, kit: Kit, num_heads: int, context: int, iters: int
) -> dict[str, Any] | None:
    """Bytes per second of one layer's decode attention (every row at `context`) through
    the CPU kernels (the model's `kit`), against a plain sum streaming the same cache bytes;
    None without the kernels or without per-layer K/V buffers (DeepSeek-V4's per-slot state
    has none)."""
    kernel = kit.library if isinstance(kit, CpuKit) else None
    state = runner.state
    if kernel is None or not isinstance(state, KVCache):
        return None
    k, v = state.k[0], state.v[0]
    if not kernel.supports(k):
        return None
    batch, head_dim = runner.decode_batch, k.shape[-1]
    q = torch.randn(batch, 1, num_heads, head_dim).to(k.dtype)
    slots = torch.arange(batch)
    positions = torch.full((batch, 1), context - 1)
    span = runner.span_for(context)
    scale = head_dim**-0.5
    tables = None
    if state.paged:  # each row its own run of blocks, in order: the blocks it reads
        width = -(-context // state.block_size)
        if batch * width > state.num_blocks or span > width * state.block_size:
            return None
        tables = torch.arange(batch * width).view(batch, width)
        k_live, v_live = k[: batch * width], v[: batch * width]
    else:
        k_live, v_live = k[:batch, :, :context], v[:batch, :, :context]
    # the same bytes as float32 words (a bfloat16 pair is one word), so the sum streams them
    # at float32 speed whatever the cache's dtype
    words_k, words_v = k_live.view(torch.float32), v_live.view(torch.float32)
    live_bytes = 2 * words_k.numel() * 4
    attention_ms = _timed(
        lambda: kernel(q, k, v, slots, positions, span, scale, tables=tables), k.device, iters
    )
    sum_ms = _timed(lambda: (words_k.sum(), words_v.sum()), k.device, iters)
    attention = live_bytes / (statistics.median(attention_ms) / 1000) / 1e9
    streaming = live_bytes / (statistics.median(sum_ms) / 1000) / 1e9
    return {
        "rows": batch,
        "context": context,
        "bytes": live_bytes,
        "kernel_ms": statistics.median(attention_ms),
        "kernel_gb_per_s": attention,
        "sum_gb_per_s": streaming,
        "ratio": attention / streaming,
    }


def prefill_attention(
    runner: LaunchRunner, kit: Kit, num_heads: int, context: int, iters: int
) -> dict[str, Any] | None:
    """Milliseconds of one layer's attention for one request's last `prefill_chunk` tokens
    at the end of `context` positions (each token a row, as a prefill launch passes them),
    through the CPU kernels over a cache of blocks; None without them."""
    kernel = kit.library if isinstance(kit, CpuKit) else None
    state = runner.state
    if kernel is None or not isinstance(state, KVCache) or not state.paged:
        return None
    k, v = state.k[0], state.v[0]
    chunk, span = runner.prefill_chunk, runner.span_for(context)
    width = -(-span // state.block_size)
    if not kernel.supports(k) or width > state.num_blocks or context < chunk:
        return None
    head_dim = k.shape[-1]
    q = torch.randn(chunk, 1, num_heads, head_dim).to(k.dtype)
    tables = torch.arange(width).repeat(chunk, 1)  # one request's blocks, every token
    positions = torch.arange(context - chunk, context)[:, None]
    slots = torch.zeros(chunk, dtype=torch.long)
    ms = _timed(
        lambda: kernel(q, k, v, slots, positions, span, head_dim**-0.5, tables=tables),
        k.device,
        iters,
    )
    return {"tokens": chunk, "context": context, "kernel_ms": statistics.median(ms)}


def measure(settings: Settings, iters: int) -> dict[str, Any]:
    """Launch latencies and the back-to-back decode ceiling for one configuration."""
    loaded = load_for(settings)
    device = loaded.device
    batch, chunk = settings.decode_batch, settings.prefill_chunk
    shapes = settings.launch_shapes()
    runner = LaunchRunner(loaded.model, replace(shapes, num_slots=max(shapes.num_slots, batch)))
    runner.warm_up()
    prompt = [5] * chunk
    launches: list[dict[str, Any]] = []
    for span in sorted({chunk, settings.max_kv_len}):
        ms = _timed(_prefill_call(runner, prompt, span - chunk), device, iters)
        launches.append(
            {
                "launch": f"prefill B1S{chunk}",
                "span": span,
                "p50_ms": statistics.median(ms),
                "min_ms": min(ms),
            }
        )
        if runner.mtp:
            ms = _timed(_verify_call(runner, span - 2), device, iters)
            launches.append(
                {
                    "launch": f"verify+draft B{batch}S2",
                    "span": span,
                    "p50_ms": statistics.median(ms),
                    "min_ms": min(ms),
                }
            )
        ms = _timed(_decode_call(runner, span - 1), device, iters)
        launches.append(
            {
                "launch": f"decode B{batch}S1",
                "span": span,
                "p50_ms": statistics.median(ms),
                "min_ms": min(ms),
                "tokens_per_s": batch / (statistics.median(ms) / 1000),
            }
        )
    context = min(settings.max_kv_len, 2 * chunk)
    _sync(device)
    started = time.perf_counter()
    step = _decode_call(runner, context - 1)
    count = 0
    while count < iters and (not count or time.perf_counter() - started < BUDGET_S):
        step()
        count += 1
    _sync(device)
    elapsed = time.perf_counter() - started
    num_heads = getattr(loaded.config, "num_heads", None)
    attention = (
        [
            attention_bandwidth(runner, loaded.model.kit, num_heads, c, iters)
            for c in sorted({chunk, context})
        ]
        if isinstance(num_heads, int)
        else []
    )
    prefill = (
        prefill_attention(runner, loaded.model.kit, num_heads, settings.max_kv_len, iters)
        if isinstance(num_heads, int)
        else None
    )
    return {
        "attention": [row for row in attention if row is not None],
        "prefill_attention": prefill,
        "model": str(loaded.path.name),
        "device": str(device),
        "backend": runner.backend.name,
        "dtype": str(loaded.dtype).split(".")[-1],
        "threads": torch.get_num_threads(),
        "launches": launches,
        "ceiling": {
            "decode_shape": f"B{batch}S1",
            "context": context,
            "launches": count,
            "tokens_per_s": count * batch / elapsed,
            "ms_per_launch": elapsed * 1000 / count,
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Print the launch table and ceiling; optionally write them as JSON."""
    parser = argparse.ArgumentParser(
        prog="npu-pool bench --kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--iters", type=int, default=50, help="timed runs of each launch shape")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    add_settings_flags(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"npu-pool bench: {exc}", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    result = measure(settings, args.iters)
    print(
        f"{result['model']} on {result['device']} ({result['backend']}, {result['dtype']}, "
        f"{result['threads']} threads)"
    )
    print(f"{'launch':<20}{'span':>6}{'p50 ms':>10}{'min ms':>10}{'tokens/s':>12}")
    for row in result["launches"]:
        rate = f"{row['tokens_per_s']:.0f}" if "tokens_per_s" in row else ""
        print(
            f"{row['launch']:<20}{row['span']:>6}{row['p50_ms']:>10.3f}{row['min_ms']:>10.3f}"
            f"{rate:>12}"
        )
    ceiling = result["ceiling"]
    print(
        f"ceiling: {ceiling['tokens_per_s']:.0f} tokens/s back-to-back "
        f"{ceiling['decode_shape']} at context {ceiling['context']}"
    )
    for row in result["attention"]:
        print(
            f"decode attention, one layer, {row['rows']} rows at context {row['context']}: "
            f"{row['kernel_gb_per_s']:.1f} GB/s ({row['kernel_ms']:.3f} ms); a plain sum of the "
            f"same bytes {row['sum_gb_per_s']:.1f} GB/s; ratio {row['ratio']:.2f}"
        )
    prefill = result["prefill_attention"]
    if prefill is not None:
        print(
            f"prefill attention, one layer, {prefill['tokens']} tokens of one request at the "
            f"end of context {prefill['context']}: {prefill['kernel_ms']:.3f} ms"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
