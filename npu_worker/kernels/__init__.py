"""Each backend's kernels and the layers that call them (docs/architecture.md §2): a model
asks for its layers through a kit (npu_worker/models/kit.py); `kit_for` picks the kit a
device runs."""

from __future__ import annotations

import torch

from npu_worker.models.kit import LayerKit, TorchKit


def kit_for(
    device: torch.device,
    decode_kernel: bool = True,
    packed_linears: bool = True,
    max_rows: int = 128,
) -> LayerKit:
    """The CPU's kit on the CPU (its kernels unless `decode_kernel` is off, its packed
    bfloat16 products unless `packed_linears` is), plain torch layers elsewhere (CUDA
    graphs and torch_npu's graphs capture those). `max_rows`: the most rows a launch
    passes a layer."""
    if device.type != "cpu":
        return TorchKit()
    from npu_worker.kernels.cpu.layers import CpuKit
    from npu_worker.kernels.cpu.library import load_cpu_kernels

    library = load_cpu_kernels() if decode_kernel else None
    return CpuKit(library, packed_linears, max_rows)
