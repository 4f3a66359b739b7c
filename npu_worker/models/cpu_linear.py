"""bfloat16 linear layers on the CPU with their weights laid out once, for oneDNN or for the
CPU kernels' own product.

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

On some CPUs without AMX, oneDNN's bfloat16 products run below what the CPU's float32
multiply-adds reach (an Intel one: 66-75 GFLOP/s against 110, bench/RESULTS.md). Where the
CPU kernels are built, a start-up probe times both once per machine (the choice kept beside
the built library, so every rank and every restart makes the same one) and, where it wins,
the layers call the kernels' `linear` instead (cpu_matmul.c): another layout, other bits
than oneDNN's, but each row's sums in one fixed order, so a row's bits still depend on
nothing but the row, in prefill and decode alike.

Only bfloat16 weights are packed (float32 products come from MKL, whose packed form gives
other bits). The plain weight stays (other code reads it: tied heads, MLA's absorbed
projections), so packing costs a second copy of the linear weights in memory.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
import types
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from npu_worker.models.cpu_kernels import CpuKernels


def packing_available() -> bool:
    """Whether this torch build has oneDNN and its linear-weight reorder."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def pack_linears(
    model: nn.Module,
    max_rows: int = 128,
    kernels: CpuKernels | None = None,
    kernel_products: bool | None = None,
) -> int:
    """Give every bfloat16 `nn.Linear` of `model` on the CPU a packed weight and a forward
    that uses it; returns how many it packed (0 where neither oneDNN nor `kernels` can).
    `max_rows` is the most rows a launch passes a layer (its fused forms are proven up to
    that). With `kernels`, the products are theirs where `kernel_products` says so, or
    where it is None and `kernel_products_win`."""
    if kernel_products is None:
        kernel_products = kernels is not None and kernel_products_win(kernels)
    own = kernels if kernel_products else None
    if own is None and not packing_available():
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
        module.packed_weight = _pack(own, weight)
        module.packed_by = own  # type: ignore[assignment]
        module.max_rows = max_rows  # type: ignore[assignment]
        module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]
        count += 1
    for module in model.modules():
        _fuse(module, FUSED_PROJECTIONS)
        if own is not None:
            _fuse(module, GATED_PAIR, own)
    return count


def _pack(kernels: CpuKernels | None, weight: torch.Tensor) -> torch.Tensor:
    """`weight` laid out once for oneDNN (kernels None) or for the kernels' `linear`."""
    with torch.no_grad():
        if kernels is None:
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        return kernels.pack_linear(weight)


def _product(
    kernels: CpuKernels | None,
    x: torch.Tensor,
    packed: torch.Tensor,
    outputs: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x times a weight packed by `_pack` with the same `kernels`, plus bias."""
    if kernels is None:
        return cast(
            torch.Tensor,
            torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], ""),
        )
    return kernels.linear(x, packed, outputs, bias)


FUSED_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
GATED_PAIR = ("gate_proj", "up_proj")  # fused for the kernels' products (silu after)


def fused_outputs(owner: nn.Module, x: torch.Tensor) -> list[torch.Tensor] | None:
    """The outputs of `owner`'s fused projections for input x, as slices of one product
    (their tokens a row of the product apart), in `FUSED_PROJECTIONS` order; None where
    `owner` has none or x is not bfloat16 (then the caller runs the layers one by one)."""
    fused = getattr(owner, "fused", None)
    if fused is None or x.dtype != torch.bfloat16:
        return None
    kernels, packed, bias, sizes = fused
    return list(_product(kernels, x, packed, sum(sizes), bias).split(sizes, dim=-1))


def _fuse(owner: nn.Module, names: tuple[str, ...], only: CpuKernels | None = None) -> None:
    """Pack `owner`'s linear layers `names`, each already packed alike (by `only`, where
    given) and reading the same input, as one weight, `owner.fused` (each layer then keeps
    only its plain weight, for every other use)."""
    layers = [getattr(owner, name, None) for name in names]
    if not all(isinstance(layer, nn.Linear) for layer in layers):
        return
    linears = cast(list[nn.Linear], layers)
    if any(getattr(layer, "packed_weight", None) is None for layer in linears):
        return
    kernels = cast(Any, linears[0]).packed_by
    if any(cast(Any, layer).packed_by is not kernels for layer in linears):
        return
    if only is not None and kernels is not only:
        return
    if len({layer.in_features for layer in linears}) != 1:
        return
    biases = [layer.bias for layer in linears]
    if any(bias is None for bias in biases) != all(bias is None for bias in biases):
        return
    with torch.no_grad():
        packed = _pack(kernels, torch.cat([layer.weight.detach() for layer in linears]))
        bias = None if biases[0] is None else torch.cat([cast(Any, b).detach() for b in biases])
    sizes = [layer.out_features for layer in linears]
    owner.fused = (kernels, packed, bias, sizes)  # type: ignore[assignment]
    for layer in linears:  # one packed copy of each weight, not two
        del layer.packed_weight
        del layer.packed_by
        del layer.forward
        layer.fused_into = True  # type: ignore[assignment]


def gated_product(
    owner: nn.Module, gate: nn.Linear, up: nn.Linear, x: torch.Tensor
) -> torch.Tensor | None:
    """silu(gate(x)) * up(x), a gated MLP's hidden state: with the kernels' products, gate
    and up in one product (`owner.fused`); with oneDNN's, the activation and the product
    done inside its products (its swish and mul post-ops, on float32 sums, rounded once):
    two calls instead of four. None where the weights are not packed or oneDNN's fused form
    was not proven, on this machine, to keep a row's bits as the plain products do
    (`gated_fusion_safe`; then the caller runs the plain layers)."""
    pair = fused_outputs(owner, x)
    if pair is not None:
        return torch.nn.functional.silu(pair[0]) * pair[1]
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
    layer = cast(Any, self)
    return _product(layer.packed_by, x, layer.packed_weight, self.out_features, bias)


PROBE_SHAPE = (1536, 576)  # outputs, inputs: a small model's MLP projection
PROBE_ROWS = (8, 32, 128)  # decode and prefill launches' rows
PROBE_ROUNDS = 20  # alternated timings of each product at each row count (~0.1 s in all)


def kernel_products_win(kernels: CpuKernels) -> bool:
    """Whether the kernels' `linear` beats oneDNN's packed bfloat16 product on this machine
    (always where oneDNN is missing; never without AVX-512). Timed once per built library
    and kept beside it: the first process to finish the probe records its answer and every
    process, now and after restarts, reads that one, so ranks never differ in their bits."""
    from npu_worker.models.cpu_kernels import has_avx512

    if not has_avx512():
        return False
    if not packing_available():
        return True
    record = kernels.path.with_suffix(".products")
    if not record.exists():
        with tempfile.NamedTemporaryFile("w", dir=record.parent, delete=False) as draft:
            draft.write("kernels" if _kernels_faster(kernels) else "onednn")
        try:
            os.link(draft.name, record)  # fails where another process recorded first
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: the last writer wins
            os.replace(draft.name, record)
        finally:
            if os.path.exists(draft.name):
                os.unlink(draft.name)
    return record.read_text() == "kernels"


def _kernels_faster(kernels: CpuKernels) -> bool:
    """The kernels' product against oneDNN's at `PROBE_SHAPE`: the two alternated
    `PROBE_ROUNDS` times at each of `PROBE_ROWS` rows, the best time of each summed. A busy
    machine (ranks starting together, another program) only adds time, and alternating
    spreads it over both, so the best of many rounds is what each product can do."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(PROBE_SHAPE, generator=generator).bfloat16()
    sides = ((kernels, _pack(kernels, weight)), (None, _pack(None, weight)))
    totals = [0.0, 0.0]
    with torch.no_grad():
        for rows in PROBE_ROWS:
            x = torch.randn(rows, PROBE_SHAPE[1], generator=generator).bfloat16()
            best = [float("inf"), float("inf")]
            for _ in range(PROBE_ROUNDS):
                for side, (owner, packed) in enumerate(sides):
                    began = time.perf_counter()
                    _product(owner, x, packed, PROBE_SHAPE[0], None)
                    best[side] = min(best[side], time.perf_counter() - began)
            totals = [total + time_s for total, time_s in zip(totals, best, strict=True)]
    return totals[0] < totals[1]
