"""bfloat16 matrix products on the CPU with their weights laid out once: oneDNN's, or the CPU
kernels' own (multiply-adds, or AMX tiles), whichever a probe finds fastest on the machine.

A bfloat16 `F.linear` on the CPU runs through oneDNN, which first reorders the weight into
its blocked layout, on every call: for a decode launch that is a second pass over every
weight's bytes. `OneDnnProduct` does that reorder once, at start, and calls oneDNN on the
packed copy: the same bits as `F.linear`'s for every number of rows
(tests/test_cpu_linear.py), so every exactness guarantee of the eager path holds. Measured on
SmolLM2's 210 decoder projections at 32 rows, weights streaming from memory: 30 ms unpacked,
23 ms packed (bench/RESULTS.md).

On some CPUs without AMX, oneDNN's bfloat16 products run below what the CPU's float32
multiply-adds reach (an Intel one: 66-75 GFLOP/s against 110, bench/RESULTS.md). On CPUs
with AMX, the kernels' own tile product beats oneDNN's at every row count a launch passes
(less work around each call, the weight read once for all the rows), and its bits depend on
nothing but the row: oneDNN's AMX kernels block their sums by the number of rows. Where the
CPU kernels are built, a start-up probe times them once per machine (the choice kept beside
the built library, so every rank and every restart makes the same one) and, where one wins,
`KernelProduct` calls the kernels' `linear` (matmul.c) or `TileProduct` their `linear_tiles`
(matmul_amx.c) instead: another layout, other bits than oneDNN's, but each row's sums in
one fixed order, so a row's bits still depend on nothing but the row, in prefill and decode
alike.

Only bfloat16 weights are packed (float32 products come from MKL, whose packed form gives
other bits). Once packed, a layer lets go of its plain weight (layers.py: `PackedRows`),
unless another parameter shares it (a tied head's embedding): each product can lay its
packed weight out plainly again (`unpack`), bit for bit, for the rare reader of `.weight`.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from typing import Any, Literal, Protocol, cast

import torch

from npu_worker.kernels.cpu.library import CpuKernels, has_kernel_linear


class Product(Protocol):
    """A bfloat16 product on weights it laid out once."""

    name: str

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` [outputs, inputs] in this product's layout."""
        ...

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, outputs: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., inputs] times a weight `pack` laid out, plus bias: [..., outputs]."""
        ...

    def unpack(self, packed: torch.Tensor, outputs: int, inputs: int) -> torch.Tensor:
        """The weight `pack` laid out, [outputs, inputs] as it was."""
        ...


class OneDnnProduct:
    """oneDNN's packed bfloat16 product: the bits of `F.linear`, without its reorder."""

    name = "onednn"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """oneDNN's blocked layout of `weight`."""
        with torch.no_grad():
            return cast(
                torch.Tensor, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            )

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, outputs: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """oneDNN's product on the packed weight."""
        return cast(
            torch.Tensor,
            torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], ""),
        )

    def unpack(self, packed: torch.Tensor, outputs: int, inputs: int) -> torch.Tensor:
        """oneDNN's reorder back to the plain layout."""
        return packed.to_dense()

    def gated(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(x gate) * (x up) in two calls: the activation and the product done inside
        oneDNN's products (its swish and mul post-ops, on the float32 sums, rounded once)."""
        x = x.contiguous()
        hidden = torch.ops.mkldnn._linear_pointwise(x, gate, None, "swish", [], "")
        return cast(
            torch.Tensor, torch.ops.mkldnn._linear_pointwise.binary(x, hidden, up, None, "mul")
        )


class KernelProduct:
    """The CPU kernels' own bfloat16 product (matmul.c)."""

    name = "kernels"

    def __init__(self, library: CpuKernels) -> None:
        self.library = library

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """Blocks of 16 outputs by pairs of inputs."""
        with torch.no_grad():
            return self.library.pack_linear(weight)

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, outputs: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The kernels' product: each output's sum in one fixed order."""
        return self.library.linear(x, packed, outputs, bias)

    def unpack(self, packed: torch.Tensor, outputs: int, inputs: int) -> torch.Tensor:
        """Blocks of 16 outputs by pairs of inputs back to rows, the padding cut."""
        blocks, pairs = -(-outputs // 16), -(-inputs // 2)
        plain = packed.view(blocks, pairs, 16, 2).permute(0, 2, 1, 3)
        return plain.reshape(blocks * 16, pairs * 2)[:outputs, :inputs]


class TileProduct(KernelProduct):
    """The CPU kernels' bfloat16 product on AMX tiles (matmul_amx.c), on the same packed
    layout: each output's sum pair of inputs by pair in one fixed order, so a row's bits
    depend on nothing but the row. A weight whose inputs are not a multiple of 32 goes
    through `KernelProduct`'s multiply-adds instead, which keep the same contract."""

    name = "tiles"

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, outputs: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The tiles' product where a tile product takes the inputs whole."""
        if x.shape[-1] % 32:
            return self.library.linear(x, packed, outputs, bias)
        return self.library.linear_tiles(x, packed, outputs, bias)

    def gated_pair(
        self, x: torch.Tensor, packed: torch.Tensor, outputs: int
    ) -> torch.Tensor | None:
        """silu(x gate) * (x up) in one call, `packed` gate's weight and then up's as one
        (`outputs` in all): each step rounded as the unfused form rounds it (the activation
        the kernels' own, within a rounding of torch's). None where the tiles do not take
        the shapes whole."""
        if x.shape[-1] % 32 or outputs % 32:
            return None
        return self.library.gated_tiles(x, packed, outputs)


@functools.cache
def packing_available() -> bool:
    """Whether oneDNN packs bfloat16 linear weights here: this torch build has it and its
    reorder, and this CPU runs its bfloat16 path (it refuses one without AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT, as a forced `NPUPOOL_CPU_ISA=avx2` makes it)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        with torch.no_grad():
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def choose_product(
    library: CpuKernels | None, kernel_products: bool | Literal["tiles"] | None = None
) -> Product | None:
    """The product this machine runs: the kernels' multiply-adds where `kernel_products` is
    True, their tiles where it is "tiles" (the multiply-adds where the CPU or the kernel
    gives no tiles), oneDNN's where it is False; where it is None, whichever
    `fastest_product` found. None where none is there."""
    choice = "onednn"
    if kernel_products is None:
        choice = fastest_product(library) if library is not None else "onednn"
    elif kernel_products:
        choice = "tiles" if kernel_products == "tiles" else "kernels"
    if choice != "onednn" and library is not None and has_kernel_linear():
        if choice == "tiles" and library.has_tiles:
            return TileProduct(library)
        return KernelProduct(library)
    return OneDnnProduct() if packing_available() else None


@functools.cache
def gated_fusion_safe(in_features: int, out_features: int, max_rows: int) -> bool:
    """Whether oneDNN's fused gated product of this shape keeps what the plain products give
    a row: where they give it the same bits for every number of rows from 1 to `max_rows`,
    the fused form must too (oneDNN picks its kernels by shape, and on some CPUs one of its
    fused forms sums one row apart from several). Where the plain products do not either
    (AMX kernels block their sums by the row count), what keeps a row's bits apart from its
    neighbours' is the launch's fixed number of rows, which the fused form keeps as well."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) * in_features**-0.5
    onednn = OneDnnProduct()
    packed = onednn.pack(weight.bfloat16())
    x = torch.randn(max_rows, in_features, generator=generator).bfloat16()

    def fused(rows: torch.Tensor) -> Any:
        return onednn.gated(rows, packed, packed)

    def plain(rows: torch.Tensor) -> Any:
        return onednn(rows, packed, out_features, None)

    def row_count_invariant(product: Any) -> bool:
        every_row = product(x)
        return all(
            torch.equal(product(x[:rows].contiguous()), every_row[:rows])
            for rows in range(1, max_rows)
        )

    with torch.no_grad():
        return row_count_invariant(fused) or not row_count_invariant(plain)


PROBE_SHAPE = (1536, 576)  # outputs, inputs: a small model's MLP projection
PROBE_ROWS = (8, 32, 128)  # decode and prefill launches' rows
PROBE_ROUNDS = 20  # alternated timings of each product at each row count (~0.1 s in all)


def fastest_product(library: CpuKernels) -> str:
    """Which bfloat16 product runs fastest on this machine: "onednn", "kernels" (the
    kernels' multiply-adds) or "tiles" (theirs on AMX tiles, where the CPU and the kernel give
    them); the kernels' where oneDNN cannot pack bfloat16, oneDNN's where the kernels'
    `linear` cannot run. Timed once per built library and kept beside it: the first process
    to finish the probe records its answer and every process, now and after restarts, reads
    that one, so ranks never differ in their bits."""
    if not has_kernel_linear():
        return "onednn"
    if not packing_available():
        return "tiles" if library.has_tiles else "kernels"
    record = library.path.with_suffix(".products")
    if not record.exists():
        with tempfile.NamedTemporaryFile("w", dir=record.parent, delete=False) as draft:
            draft.write(_fastest(library))
        try:
            os.link(draft.name, record)  # fails where another process recorded first
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: the last writer wins
            os.replace(draft.name, record)
        finally:
            if os.path.exists(draft.name):
                os.unlink(draft.name)
    return record.read_text()


def _fastest(library: CpuKernels) -> str:
    """The products this machine has, timed at `PROBE_SHAPE`: alternated `PROBE_ROUNDS`
    times at each of `PROBE_ROWS` rows, the best time of each summed. A busy machine (ranks
    starting together, another program) only adds time, and alternating spreads it over
    them all, so the best of many rounds is what each product can do."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(PROBE_SHAPE, generator=generator).bfloat16()
    products: list[Product] = [OneDnnProduct(), KernelProduct(library)]
    if library.has_tiles:
        products.append(TileProduct(library))
    sides = [(product, product.pack(weight)) for product in products]
    totals = [0.0] * len(sides)
    with torch.no_grad():
        for rows in PROBE_ROWS:
            x = torch.randn(rows, PROBE_SHAPE[1], generator=generator).bfloat16()
            best = [float("inf")] * len(sides)
            for _ in range(PROBE_ROUNDS):
                for side, (product, packed) in enumerate(sides):
                    began = time.perf_counter()
                    product(x, packed, PROBE_SHAPE[0], None)
                    best[side] = min(best[side], time.perf_counter() - began)
            totals = [total + time_s for total, time_s in zip(totals, best, strict=True)]
    return products[totals.index(min(totals))].name
