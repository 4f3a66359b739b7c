"""Choosing the device a rank runs on, its weights' dtype, and sizing torch's CPU threads."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

# CPU features with bfloat16 arithmetic in hardware (dot products of bfloat16 pairs, or
# AMX tiles): there, bfloat16 weights run at twice float32's rate and move half its bytes
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def resolve_device(name: str) -> torch.device:
    """`auto` picks npu, then cuda, then cpu; an unavailable explicit choice is a ValueError
    (a configuration a restart cannot fix)."""
    if name in ("auto", "npu") and _npu_available():
        return torch.device("npu")
    if name == "npu":
        raise ValueError(
            "device npu requested but torch_npu is not installed or sees no NPU "
            "(install the `npu` extra: pip install 'npu-pool[npu]')"
        )
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda")
    if name == "cuda":
        raise ValueError("device cuda requested but torch sees no CUDA device")
    return torch.device("cpu")


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def set_cpu_threads(threads_per_rank: int, ranks: int) -> int:
    """Give each rank its share of the cores, leaving one for Redis and the batcher."""
    if threads_per_rank <= 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads_per_rank = max(1, ((cores or 1) - 1) // ranks)
    torch.set_num_threads(threads_per_rank)
    return threads_per_rank


# `NPUPOOL_CPU_ISA`: run the CPU paths of a smaller instruction set than the machine's, so
# each is tested and measured anywhere. The pool's own kernels are built for it, the flags
# every choice reads are cut to it, and oneDNN is capped to it (`ONEDNN_MAX_CPU_ISA`).
ISA_ENV = "NPUPOOL_CPU_ISA"
ISAS = ("native", "avx512", "avx2", "portable")
_ONEDNN_ISA = {"avx2": "AVX2", "portable": "SSE41"}
# flags above each forced instruction set, by prefix
_ABOVE = {
    "avx512": ("amx",),
    "avx2": ("avx512", "amx", "avx10"),
    "portable": ("avx", "fma", "f16c", "amx", "sse4", "ssse3", "bmi", "vaes", "vpclmul"),
}


def forced_isa() -> str:
    """The instruction set `NPUPOOL_CPU_ISA` names (`native` when unset); a ValueError for
    any other value, naming the ones there are."""
    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in ISAS:
        raise ValueError(f"{ISA_ENV}={isa!r}: not one of {', '.join(ISAS)}")
    return isa


def cap_onednn() -> None:
    """Cap oneDNN to the forced instruction set (before its first product reads the cap)."""
    onednn = _ONEDNN_ISA.get(forced_isa())
    if onednn is not None:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (empty where it does not), less
    those above `NPUPOOL_CPU_ISA`."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    above = _ABOVE.get(forced_isa(), ())
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = line.partition(":")[2].split()
            return frozenset(f for f in flags if not f.startswith(above))
    return frozenset()


with contextlib.suppress(ValueError):  # said where the flags are first read, with the reason
    cap_onednn()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True on a CPU that computes in bfloat16 natively (AVX512-BF16 or AMX)."""
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BF16_FLAGS)


def cpu_runs_kernel_product(flags: frozenset[str] | None = None) -> bool:
    """True on a CPU where the CPU kernels' own bfloat16 product runs (matmul.c): AVX-512 F
    and BW, or AVX2 with FMA (the same sums in the same order, 8 lanes at a time)."""
    flags = cpu_flags() if flags is None else flags
    return {"avx512f", "avx512bw"} <= flags or {"avx2", "fma"} <= flags


def cpu_prefers_bf16(flags: frozenset[str] | None = None) -> bool:
    """True on a CPU where bfloat16 weights run faster than float32: one with bfloat16
    arithmetic, or one where the kernels' own product widens them in registers. Launches
    there are bound by the products' multiply-adds and the weights' bytes, and bfloat16
    halves the bytes (on an AVX2-only EPYC: a SmolLM2 B32 decode launch 146 ms against
    float32's 202, bench/RESULTS.md)."""
    flags = cpu_flags() if flags is None else flags
    return cpu_has_native_bf16(flags) or cpu_runs_kernel_product(flags)


def auto_dtype(
    checkpoint_dtype: torch.dtype, device: torch.device, flags: frozenset[str] | None = None
) -> torch.dtype:
    """What `--dtype auto` runs: the checkpoint's dtype, except on a CPU, where bfloat16
    for a float32 checkpoint wherever the CPU runs bfloat16 faster (`cpu_prefers_bf16`),
    and float16 (slow there) becomes bfloat16 anyway."""
    if device.type != "cpu":
        return checkpoint_dtype
    if checkpoint_dtype == torch.float16 or (
        checkpoint_dtype == torch.float32 and cpu_prefers_bf16(flags)
    ):
        return torch.bfloat16
    return checkpoint_dtype


def free_memory(device: torch.device, meminfo: Path = Path("/proc/meminfo")) -> int:
    """Bytes free on `device` now: the accelerator's free memory, or the host's available
    memory (MemAvailable) for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "npu":
        return int(torch.npu.mem_get_info(device)[0])  # type: ignore[attr-defined]
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} names no MemAvailable")
