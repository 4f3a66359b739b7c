"""Stored weights on a CUDA device: each form's layer (FP8 blocks, MXFP4, W8A8) moved to the
GPU keeps its stored dtypes, gives the bits of the same arithmetic done by hand there, keeps
rows apart where it should (W8A8's integer sums at any row count; every form at one shape),
runs inside a captured CUDA graph with the eager bits, and what widening at each call costs
against the products at V4-Flash's expert size (4096 x 2048):

    python -m bench.probes.stored_cuda [--json FILE]

Needs only torch (and this package) on a machine with a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from npu_worker.models.stored import (
    Fp8Blocks,
    Int8Channels,
    Mxfp4,
    StoredLinear,
    StoredWeight,
    quantize_tokens,
)

HIDDEN, INNER = 4096, 2048


def forms(out: int, inp: int, generator: torch.Generator) -> dict[str, StoredWeight]:
    """One weight [out, in] in each stored form, random."""
    weight = torch.randn(out, inp, generator=generator) / inp**0.5
    blocks = weight.view(-(-out // 128), 128, -(-inp // 128), 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    fp8 = (blocks / scale[:, None, :, None]).view(out, inp).to(torch.float8_e4m3fn)
    packed = torch.randint(0, 256, (out, inp // 2), generator=generator, dtype=torch.uint8)
    exponents = torch.randint(120, 128, (out, inp // 32), generator=generator, dtype=torch.uint8)
    int8 = torch.randint(-127, 128, (out, inp), generator=generator, dtype=torch.int8)
    return {
        "fp8": Fp8Blocks(fp8, scale, (128, 128)),
        "mxfp4": Mxfp4(packed, exponents),
        "w8a8": Int8Channels(int8, weight.abs().amax(dim=1) / 127.0),
    }


def layer_of(stored: StoredWeight, device: torch.device, dtype: torch.dtype) -> StoredLinear:
    out, inp = stored.shape
    layer = StoredLinear(inp, out, bias=False)
    layer.keep_stored(stored)
    return layer.to(device=device, dtype=dtype)


def by_hand(stored: StoredWeight, x: torch.Tensor) -> torch.Tensor:
    """The same arithmetic written out here."""
    if isinstance(stored, Int8Channels):
        q, scale = quantize_tokens(x)
        sums = (q.double() @ stored.weight.double().t()).float()  # exact: integers
        return (sums * scale * stored.scale.float()).to(x.dtype)
    return F.linear(x, stored.dequantize().to(x.dtype))


def timed_ms(fn: Any, rounds: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.stored_cuda", description=__doc__)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    cuda, dtype = torch.device("cuda"), torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, stored in forms(INNER, HIDDEN, generator).items():
        layer = layer_of(stored, cuda, dtype)
        held = {k: str(t.dtype) for k, t in layer.stored.tensors().items()}  # type: ignore[union-attr]
        on_gpu = all(t.is_cuda for t in layer.stored.tensors().values())  # type: ignore[union-attr]
        x = torch.randn(40, HIDDEN, generator=generator).to(cuda, dtype)
        got = layer(x)
        want = by_hand(layer.stored, x)  # type: ignore[arg-type]
        alone = torch.cat([layer(x[i : i + 1]) for i in range(8)])
        static = torch.zeros(8, HIDDEN, device=cuda, dtype=dtype)
        graph = torch.cuda.CUDAGraph()
        layer(static)  # warm (allocations) before the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = layer(static)
        static.copy_(x[:8])
        graph.replay()
        torch.cuda.synchronize()
        eager8 = layer(x[:8])
        report[name] = {
            "held": held,
            "on_gpu": on_gpu,
            "equal_by_hand": bool(torch.equal(got, want)),
            "row_alone_equal_in_40": bool(torch.equal(alone, got[:8])),
            "graph_equal_eager": bool(torch.equal(captured, eager8)),
            "ms_b8": timed_ms(lambda layer=layer, x=x: layer(x[:8])),
            "ms_b128": timed_ms(
                lambda layer=layer: layer(torch.ones(128, HIDDEN, device=cuda, dtype=dtype))
            ),
        }
    wide = torch.randn(INNER, HIDDEN, device=cuda, dtype=dtype)
    x8 = torch.randn(8, HIDDEN, device=cuda, dtype=dtype)
    report["bf16_product_ms_b8"] = timed_ms(lambda: F.linear(x8, wide))
    try:
        w8 = wide.to(torch.float8_e4m3fn)
        x16 = torch.randn(16, HIDDEN, device=cuda, dtype=dtype).to(torch.float8_e4m3fn)
        one = torch.ones((), device=cuda)
        report["scaled_mm_fp8_ms_b16"] = timed_ms(
            lambda: torch._scaled_mm(x16, w8.t(), scale_a=one, scale_b=one, out_dtype=dtype)
        )
    except Exception as exc:  # noqa: BLE001 (a figure, not a requirement)
        report["scaled_mm_fp8_ms_b16"] = f"unavailable: {exc}"[:200]
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
