"""`npu-pool bench`: benchmarks. `--kernels` runs the fixed launches back-to-back in a
separate process (this one never imports torch)."""

from __future__ import annotations

import subprocess
import sys


def main(argv: list[str]) -> int:
    """Dispatch to the kernel microbenchmark; the serving benchmark comes with its own flags."""
    if "--kernels" in argv:
        rest = [a for a in argv if a != "--kernels"]
        return subprocess.call([sys.executable, "-m", "npu_worker.kernel_bench", *rest])
    print(
        "npu-pool bench: only the kernel microbenchmark is available: npu-pool bench "
        "--kernels [--json out.json] [--iters N] [settings flags]",
        file=sys.stderr,
    )
    return 2
