"""bfloat16 linear layers on the CPU with their weights laid out once for oneDNN.

A bfloat16 `F.linear` on the CPU runs through oneDNN, which first reorders the weight into
its blocked layout, on every call: for a decode launch that is a second pass over every
weight's bytes. `pack_linears` does that reorder once, at start, and has each linear layer
call oneDNN on the packed copy. The products are the same bits as `F.linear`'s for every
number of rows (tests/test_cpu_linear.py), so every exactness guarantee of the eager path
holds. Measured on SmolLM2's 210 decoder projections at 32 rows, weights streaming from
memory: 30 ms unpacked, 23 ms packed (bench/RESULTS.md).

Only bfloat16 weights are packed (float32 products come from MKL, whose packed form gives
other bits). The plain weight stays (other code reads it: tied heads, MLA's absorbed
projections), so packing costs a second copy of the linear weights in memory.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn


def packing_available() -> bool:
    """Whether this torch build has oneDNN and its linear-weight reorder."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def pack_linears(model: nn.Module) -> int:
    """Give every bfloat16 `nn.Linear` of `model` on the CPU a packed weight and a forward
    that uses it; returns how many it packed (0 where oneDNN is not available)."""
    if not packing_available():
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or getattr(module, "packed_weight", None) is not None:
            continue
        weight = module.weight
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            continue
        with torch.no_grad():
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]
        count += 1
    return count


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> Any:
    if x.dtype != torch.bfloat16:  # as F.linear would refuse it
        return nn.functional.linear(x, self.weight, self.bias)
    bias = None if self.bias is None else self.bias.detach()
    return torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), self.packed_weight, bias, "none", [], ""
    )
