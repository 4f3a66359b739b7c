"""FP8 weights on the CPU at DeepSeek-V4-Flash's attention shapes, read three ways:

    python -m bench.probes.stored_cpu [--rounds 5] [--threads 1] [--ue8m0]

the kernels' FP8 product reading the stored bytes (`linear_fp8`: each block of 16 outputs
widened once a call into the bfloat16 product's layout), the same weight widened whole at
each call then torch's product (what an FP8 layer did before), and the kernels' bfloat16
product over a bfloat16 copy (twice the bytes). Rows 8 (a B8S1 launch) and 128 (B1S128);
the median of `--rounds` calls each. Scales are random floats (as V3's `weight_scale_inv`),
or with `--ue8m0` powers of two (V4's release), whose products the kernel widens without
rounding.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from npu_worker.devices import cpu_flags
from npu_worker.kernels.cpu.layers import KernelFp8
from npu_worker.kernels.cpu.library import CpuKernels, load_cpu_kernels
from npu_worker.models.stored import Fp8Blocks

# V4-Flash: hidden 4096, q_lora 1024, 64 heads of 512, 8 output groups of rank 1024
SHAPES = {
    "wq_a": (1024, 4096),
    "wq_b": (32768, 1024),
    "wo_a (a group)": (1024, 4096),
    "wo_b": (4096, 8192),
}


def median_seconds(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def three_ways(
    library: CpuKernels, stored: Fp8Blocks, plain: torch.Tensor, x: torch.Tensor, rounds: int
) -> tuple[float, float, float]:
    """Seconds a call: the kernels' FP8 product, widened + torch, the kernels' bfloat16."""
    outputs = stored.shape[0]
    kernel = KernelFp8.of(stored)
    return (
        median_seconds(
            lambda: library.linear_fp8(x, kernel.packed, kernel.scales, 128, outputs, None),
            rounds,
        ),
        median_seconds(lambda: F.linear(x, stored.dequantize().to(torch.bfloat16)), rounds),
        median_seconds(lambda: library.linear(x, plain, outputs, None), rounds),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--ue8m0", action="store_true", help="power-of-two scales, as V4's release writes them"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    library = load_cpu_kernels()
    if library is None or not library.has_fp8:
        raise SystemExit("the kernels' FP8 product is not built here")
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "f16c", "fma")))
    print(f"CPU flags: {' '.join(flags)}; {args.threads} thread(s)")
    print("layer            rows  fp8 kernel ms  widened+torch ms  bf16 kernel ms  ratios")
    generator = torch.Generator().manual_seed(0)
    for name, (outputs, inputs) in SHAPES.items():
        codes = torch.randint(0, 126, (outputs, inputs), generator=generator).to(torch.uint8)
        grid = (-(-outputs // 128), -(-inputs // 128))
        scale = torch.rand(grid, generator=generator) * 1e-3
        if args.ue8m0:
            scale = torch.exp2(torch.randint(-14, -6, grid, generator=generator).float())
        stored = Fp8Blocks(codes.view(torch.float8_e4m3fn), scale, (128, 128))
        plain = library.pack_linear(stored.dequantize().bfloat16())
        for rows in (8, 128):
            x = torch.randn(rows, inputs, generator=generator).bfloat16()
            fp8, widened, bf16 = three_ways(library, stored, plain, x, args.rounds)
            print(
                f"{name:16} {rows:4}  {fp8 * 1e3:13.2f}  {widened * 1e3:16.2f}  "
                f"{bf16 * 1e3:14.2f}  widened/fp8 {widened / fp8:.1f}x, fp8/bf16 {fp8 / bf16:.2f}x"
            )


if __name__ == "__main__":
    main()
