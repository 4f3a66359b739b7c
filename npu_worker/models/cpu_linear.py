"""bfloat16 linear layers on the CPU with their weights laid out once for oneDNN.

A bfloat16 `F.linear` on the CPU runs through oneDNN, which first reorders the weight into
its blocked layout, on every call: for a decode launch that is a second pass over every
weight's bytes. `pack_linears` does that reorder once, at start, and has each linear layer
call oneDNN on the packed copy. The products are the same bits as `F.linear`'s for every
number of rows (tests/test_cpu_linear.py), so every exactness guarantee of the eager path
holds. Measured on SmolLM2's 210 decoder projections at 32 rows, weights streaming from
memory: 30 ms unpacked, 23 ms packed (bench/RESULTS.md).

Linear layers that read the same input (an attention's q, k and v projections) are packed
as one weight and computed in one call (`fused_outputs`): on a small model every oneDNN call
costs tens of microseconds before it multiplies anything. A launch always passes the same
number of rows, so a row's products still depend on nothing but its own input.

Only bfloat16 weights are packed (float32 products come from MKL, whose packed form gives
other bits). The plain weight stays (other code reads it: tied heads, MLA's absorbed
projections), so packing costs a second copy of the linear weights in memory.
"""

from __future__ import annotations

import functools
import types
from typing import Any, cast

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
        if getattr(module, "fused_into", False):
            count += 1
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
    for module in model.modules():
        _fuse(module, FUSED_PROJECTIONS)
    return count


FUSED_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def fused_outputs(owner: nn.Module, x: torch.Tensor) -> list[torch.Tensor] | None:
    """The outputs of `owner`'s fused projections for input x, as slices of one product
    (their tokens a row of the product apart), in `FUSED_PROJECTIONS` order; None where
    `owner` has none or x is not bfloat16 (then the caller runs the layers one by one)."""
    packed = getattr(owner, "fused_weight", None)
    if packed is None or x.dtype != torch.bfloat16:
        return None
    bias = owner.fused_bias
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return list(out.split(owner.fused_sizes, dim=-1))


def _fuse(owner: nn.Module, names: tuple[str, ...]) -> None:
    """Pack `owner`'s linear layers `names`, each already packed and reading the same input,
    as one weight (each layer then keeps only its plain weight, for every other use)."""
    layers = [getattr(owner, name, None) for name in names]
    if not all(isinstance(layer, nn.Linear) for layer in layers):
        return
    linears = cast(list[nn.Linear], layers)
    if any(getattr(layer, "packed_weight", None) is None for layer in linears):
        return
    if len({layer.in_features for layer in linears}) != 1:
        return
    biases = [layer.bias for layer in linears]
    if any(bias is None for bias in biases) != all(bias is None for bias in biases):
        return
    with torch.no_grad():
        weight = torch.cat([layer.weight.detach() for layer in linears])
        owner.fused_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        owner.fused_bias = (
            None if biases[0] is None else torch.cat([cast(Any, b).detach() for b in biases])
        )
    owner.fused_sizes = [layer.out_features for layer in linears]  # type: ignore[assignment]
    for layer in linears:  # one packed copy of each weight, not two
        del layer.packed_weight
        del layer.forward
        layer.fused_into = True  # type: ignore[assignment]


def gated_product(gate: nn.Linear, up: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate(x)) * up(x), a gated MLP's hidden state, with the activation and the product
    done inside oneDNN's products (its swish and mul post-ops, on float32 sums, rounded
    once): two calls instead of four. None where the weights are not packed or the fused
    form was not proven, on this machine, to keep a row's bits as the plain products do
    (`gated_fusion_safe`; then the caller runs the plain layers)."""
    packed_gate = getattr(gate, "packed_weight", None)
    packed_up = getattr(up, "packed_weight", None)
    if (
        packed_gate is None
        or packed_up is None
        or gate.bias is not None
        or up.bias is not None
        or x.dtype != torch.bfloat16
        or not gated_fusion_safe(gate.in_features, gate.out_features, gate.max_rows)
    ):
        return None
    x = x.contiguous()
    hidden = torch.ops.mkldnn._linear_pointwise(x, packed_gate, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, hidden, packed_up, None, "mul")


@functools.cache
def gated_fusion_safe(in_features: int, out_features: int, max_rows: int) -> bool:
    """Whether the fused gated product of this shape keeps what the plain products give a
    row: where they give it the same bits for every number of rows from 1 to `max_rows`,
    the fused form must too (oneDNN picks its kernels by shape, and on some CPUs one of its
    fused forms sums one row apart from several). Where the plain products do not either
    (AMX kernels block their sums by the row count), what keeps a row's bits apart from its
    neighbours' is the launch's fixed number of rows, which the fused form keeps as well."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) * in_features**-0.5
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16(), None)
    x = torch.randn(max_rows, in_features, generator=generator).bfloat16()

    def fused(rows: torch.Tensor) -> Any:
        hidden = torch.ops.mkldnn._linear_pointwise(rows, packed, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(rows, hidden, packed, None, "mul")

    def plain(rows: torch.Tensor) -> Any:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")

    def row_count_invariant(product: Any) -> bool:
        every_row = product(x)
        return all(
            torch.equal(product(x[:rows].contiguous()), every_row[:rows])
            for rows in range(1, max_rows)
        )

    with torch.no_grad():
        return row_count_invariant(fused) or not row_count_invariant(plain)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> Any:
    if x.dtype != torch.bfloat16:  # as F.linear would refuse it
        return nn.functional.linear(x, self.weight, self.bias)
    bias = None if self.bias is None else self.bias.detach()
    return torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), self.packed_weight, bias, "none", [], ""
    )
