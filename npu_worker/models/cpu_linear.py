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

import functools
import types
from typing import Any

import torch
from torch import nn


def packing_available() -> bool:
    """Whether this torch build has oneDNN and its linear-weight reorder."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def pack_linears(model: nn.Module, max_rows: int = 128) -> int:
    """Give every bfloat16 `nn.Linear` of `model` on the CPU a packed weight and a forward
    that uses it; returns how many it packed (0 where oneDNN is not available). `max_rows`
    is the most rows a launch passes a layer (its fused forms are proven up to that)."""
    if not packing_available():
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        if getattr(module, "packed_weight", None) is not None:
            module.max_rows = max(module.__dict__["max_rows"], max_rows)  # type: ignore[assignment]
            continue
        weight = module.weight
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            continue
        with torch.no_grad():
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        module.max_rows = max_rows  # type: ignore[assignment]
        module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]
        count += 1
    return count


def gated_product(gate: nn.Linear, up: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate(x)) * up(x), a gated MLP's hidden state, with the activation and the product
    done inside oneDNN's products (its swish and mul post-ops, on float32 sums, rounded
    once): two calls instead of four. None where the weights are not packed or the fused
    form was not proven, on this machine, to give a row the same bits whatever the number
    of rows with it (then the caller runs the plain layers)."""
    packed_gate = getattr(gate, "packed_weight", None)
    packed_up = getattr(up, "packed_weight", None)
    if (
        packed_gate is None
        or packed_up is None
        or gate.bias is not None
        or up.bias is not None
        or x.dtype != torch.bfloat16
        or not gated_fusion_invariant(gate.in_features, gate.out_features, gate.max_rows)
    ):
        return None
    x = x.contiguous()
    hidden = torch.ops.mkldnn._linear_pointwise(x, packed_gate, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, hidden, packed_up, None, "mul")


@functools.cache
def gated_fusion_invariant(in_features: int, out_features: int, max_rows: int) -> bool:
    """Whether the fused gated product of this shape gives every row the same bits for
    every number of rows from 1 to `max_rows` (oneDNN picks its kernels by shape; some of
    its fused forms sum differently for one row than for several)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) * in_features**-0.5
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16(), None)
    x = torch.randn(max_rows, in_features, generator=generator).bfloat16()

    def fused(rows: torch.Tensor) -> Any:
        hidden = torch.ops.mkldnn._linear_pointwise(rows, packed, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(rows, hidden, packed, None, "mul")

    with torch.no_grad():
        every_row = fused(x)
        return all(
            torch.equal(fused(x[:rows].contiguous()), every_row[:rows])
            for rows in range(1, max_rows)
        )


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> Any:
    if x.dtype != torch.bfloat16:  # as F.linear would refuse it
        return nn.functional.linear(x, self.weight, self.bias)
    bias = None if self.bias is None else self.bias.detach()
    return torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), self.packed_weight, bias, "none", [], ""
    )
