"""Choosing the device a rank runs on, and sizing torch's CPU threads."""

from __future__ import annotations

import os

import torch


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
