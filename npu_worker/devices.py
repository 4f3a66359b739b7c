"""Choosing the device a rank runs on, its weights' dtype, and sizing torch's CPU threads."""

from __future__ import annotations

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


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (empty where it does not)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True on a CPU that computes in bfloat16 natively (AVX512-BF16 or AMX)."""
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BF16_FLAGS)


def auto_dtype(
    checkpoint_dtype: torch.dtype, device: torch.device, flags: frozenset[str] | None = None
) -> torch.dtype:
    """What `--dtype auto` runs: the checkpoint's dtype, except on a CPU, where bfloat16
    whenever the CPU has it natively (as vLLM picks on such CPUs), and float16 (slow
    there) becomes bfloat16 anyway."""
    if device.type != "cpu":
        return checkpoint_dtype
    if checkpoint_dtype == torch.float16 or (
        checkpoint_dtype == torch.float32 and cpu_has_native_bf16(flags)
    ):
        return torch.bfloat16
    return checkpoint_dtype
