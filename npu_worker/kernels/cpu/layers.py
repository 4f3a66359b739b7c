"""The CPU's layer kit: linear layers on bfloat16 weights laid out once (products.py), an
attention's q, k and v in one product, a gated MLP in fewer products, and RMSNorm and the
attention through the CPU kernels where they are built (library.py, attention.py).

Each layer keeps the contract of its plain torch form (models/kit.py): a row's result
depends on nothing but that row. Where a launch's tensors are not what a fast path takes
(float32 weights, another dtype, no library) the layer computes the plain form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from npu_worker.kernels.cpu.attention import KernelAttention, KernelCacheAttention
from npu_worker.kernels.cpu.library import CpuKernels
from npu_worker.kernels.cpu.products import (
    KernelProduct,
    OneDnnProduct,
    Product,
    TileProduct,
    choose_product,
    gated_fusion_safe,
)
from npu_worker.models.kit import CacheAttention, Gated, Projections, RotaryAttention
from npu_worker.models.layers import RMSNorm
from npu_worker.models.stored import MX_BLOCK, Fp8Blocks, Mxfp4, StoredLinear


@dataclass(frozen=True, slots=True)
class KernelPacked:
    """A bfloat16 weight [out, in] held only in the kernels' packed layout (matmul.c: blocks
    of 16 outputs by pairs of inputs), once its plain tensor is let go."""

    packed: torch.Tensor
    outputs: int
    inputs: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.outputs, self.inputs

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> KernelPacked:
        return KernelPacked(tensors["packed"], self.outputs, self.inputs)

    def dequantize(self) -> torch.Tensor:
        """The weight laid out plainly again, in float32."""
        blocks, pairs = -(-self.outputs // 16), -(-self.inputs // 2)
        plain = self.packed.view(blocks, pairs, 16, 2).permute(0, 2, 1, 3)
        return plain.reshape(blocks * 16, pairs * 2)[: self.outputs, : self.inputs].float()


@dataclass(frozen=True, slots=True)
class PackedRows:
    """A bfloat16 weight [outputs, inputs] held only as rows start..start+outputs of a
    weight of `total` outputs that `product` laid out (its own, or its group's in one
    product: q, k and v, or gate and up), once its plain tensor is let go."""

    packed: torch.Tensor
    product: Product
    start: int
    outputs: int
    inputs: int
    total: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.outputs, self.inputs

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> PackedRows:
        return PackedRows(
            tensors["packed"], self.product, self.start, self.outputs, self.inputs, self.total
        )

    def dequantize(self) -> torch.Tensor:
        """The weight laid out plainly again, in float32."""
        plain = self.product.unpack(self.packed, self.total, self.inputs)
        return plain[self.start : self.start + self.outputs].float()


@dataclass(frozen=True, slots=True)
class KernelMxfp4:
    """An MXFP4 weight [out, in] in the kernels' layout (matmul.c, `linear_mxfp4`): its
    bytes by blocks of 16 outputs, `packed` [blocks, in / 2, 16] and `scales` [blocks,
    in / 32, 16], padded with zeros past the last output; the same bytes as stored."""

    packed: torch.Tensor
    scales: torch.Tensor
    outputs: int

    @classmethod
    def of(cls, stored: Mxfp4) -> KernelMxfp4:
        outputs, inputs = stored.shape
        blocks = -(-outputs // 16)
        pad = blocks * 16 - outputs
        packed = F.pad(stored.packed, (0, 0, 0, pad)).view(blocks, 16, inputs // 2)
        scales = F.pad(stored.scale, (0, 0, 0, pad)).view(blocks, 16, -(-inputs // MX_BLOCK))
        return cls(
            packed.transpose(1, 2).contiguous(), scales.transpose(1, 2).contiguous(), outputs
        )

    def as_stored(self) -> Mxfp4:
        """The checkpoint's layout again."""
        blocks, pairs, _ = self.packed.shape
        packed = self.packed.transpose(1, 2).reshape(blocks * 16, pairs)[: self.outputs]
        scales = self.scales.transpose(1, 2).reshape(blocks * 16, -1)[: self.outputs]
        return Mxfp4(packed, scales)

    @property
    def shape(self) -> tuple[int, int]:
        return self.outputs, int(self.packed.shape[1]) * 2

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scales": self.scales}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> KernelMxfp4:
        return KernelMxfp4(tensors["packed"], tensors["scales"], self.outputs)

    def dequantize(self) -> torch.Tensor:
        return self.as_stored().dequantize()


@dataclass(frozen=True, slots=True)
class KernelFp8:
    """An FP8 weight [out, in] in the kernels' layout (matmul.c, `linear_fp8`): its e4m3
    bytes laid out as the bfloat16 product's packed weight, `packed` [blocks, in / 2, 16, 2]
    (zeros past the edges), and `scales` [blocks, ceil(in / group)] float32, the scale of
    each block of 16 outputs by `group` inputs (the checkpoint's scales, one row per 16
    outputs: an eighth of a byte a weight at 128 x 128)."""

    packed: torch.Tensor
    scales: torch.Tensor
    outputs: int
    inputs: int
    block: tuple[int, int]

    @staticmethod
    def fits(stored: Fp8Blocks) -> bool:
        """Whether its scale blocks are whole blocks of 16 outputs and pairs of inputs."""
        return stored.block[0] % 16 == 0 and stored.block[1] % 2 == 0

    @classmethod
    def of(cls, stored: Fp8Blocks) -> KernelFp8:
        outputs, inputs = stored.shape
        blocks, pairs = -(-outputs // 16), -(-inputs // 2)
        padded = F.pad(
            stored.weight.view(torch.uint8), (0, pairs * 2 - inputs, 0, blocks * 16 - outputs)
        )
        packed = padded.view(blocks, 16, pairs, 2).permute(0, 2, 1, 3).contiguous()
        rows = torch.arange(blocks) * 16 // stored.block[0]
        return cls(packed, stored.scale.float()[rows].contiguous(), outputs, inputs, stored.block)

    def as_stored(self) -> Fp8Blocks:
        """The checkpoint's layout again."""
        blocks, pairs = self.packed.shape[:2]
        plain = self.packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)
        weight = plain[: self.outputs, : self.inputs].contiguous().view(torch.float8_e4m3fn)
        return Fp8Blocks(weight, self.scales[:: self.block[0] // 16].contiguous(), self.block)

    @property
    def shape(self) -> tuple[int, int]:
        return self.outputs, self.inputs

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scales": self.scales}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> KernelFp8:
        return KernelFp8(
            tensors["packed"], tensors["scales"], self.outputs, self.inputs, self.block
        )

    def dequantize(self) -> torch.Tensor:
        return self.as_stored().dequantize()


class PackedLinear(StoredLinear):
    """An `nn.Linear` whose bfloat16 CPU weight `product` lays out once (`pack`); a weight
    kept as the checkpoint stores it is never packed."""

    product: Product | None
    packed: torch.Tensor | None
    stored_library: CpuKernels  # with a `KernelMxfp4` or `KernelFp8`: the library reading it

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.product = None
        self.packed = None

    def packable(self) -> bool:
        """Whether its weight is one a product lays out: bfloat16, on the CPU."""
        if self.stored is not None:
            return False
        return self.weight.dtype == torch.bfloat16 and self.weight.device.type == "cpu"

    def pack(self, product: Product) -> None:
        """Lay the weight out for `product` (the plain weight stays until `let_go_of_plain`)."""
        self.product, self.packed = product, product.pack(self.weight)

    def keeps_rows_apart(self, kit_rows_apart: bool) -> bool:
        """The kernels' MXFP4 and FP8 products keep rows apart whatever the kit's other
        products."""
        return isinstance(self.stored, (KernelMxfp4, KernelFp8)) or super().keeps_rows_apart(
            kit_rows_apart
        )

    def read_stored(self, library: CpuKernels) -> None:
        """Lay a stored MXFP4 or FP8 weight out for the kernels' product of its form, which
        then reads it (bfloat16 inputs) with the bits of the bfloat16 product over its
        dequantized copy, whatever the number of rows."""
        stored = self.stored
        if isinstance(stored, Mxfp4) and library.has_mxfp4 and self.in_features % 32 == 0:
            self.keep_stored(KernelMxfp4.of(stored))
        elif isinstance(stored, Fp8Blocks) and library.has_fp8 and KernelFp8.fits(stored):
            self.keep_stored(KernelFp8.of(stored))
        else:
            return
        self.compute_dtype = torch.bfloat16
        self.stored_library = library

    def let_go_of_plain(self) -> None:
        """Keep the weight only as its product's packed layout (a weight no other parameter
        shares): reading `.weight`, or a call in another dtype, unpacks it."""
        if self.packed is None or self.product is None:
            return
        if isinstance(self.product, KernelProduct):  # its slices read by `grouped`
            self.keep_stored(KernelPacked(self.packed, self.out_features, self.in_features))
        elif self.read_grouped:  # oneDNN's layout has no slices: `grouped` reads the plain one
            return
        else:
            outputs, inputs = self.out_features, self.in_features
            self.keep_stored(PackedRows(self.packed, self.product, 0, outputs, inputs, outputs))
        self.compute_dtype = torch.bfloat16

    def held_in(self, packed: torch.Tensor, product: Product, start: int, total: int) -> None:
        """Keep the weight only as rows `start`.. of its group's packed weight."""
        outputs, inputs = self.out_features, self.in_features
        self.keep_stored(PackedRows(packed, product, start, outputs, inputs, total))
        self.compute_dtype = torch.bfloat16

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """Each group through the kernels' product over its slice of the weight's blocks of
        16 outputs, where the weight is held in their layout (bfloat16 or FP8): a group's
        rows then keep the product's bits, and an FP8 weight is never widened whole."""
        stored, groups = self.stored, x.shape[-2]
        size = self.out_features // groups
        if (
            x.dtype != torch.bfloat16
            or size % 16
            or not isinstance(stored, (KernelPacked, KernelFp8))
        ):
            return super().grouped(x)
        outs, blocks = [], size // 16
        for g in range(groups):
            rows = slice(g * blocks, (g + 1) * blocks)
            if isinstance(stored, KernelFp8):
                out = self.stored_library.linear_fp8(
                    x[..., g, :],
                    stored.packed[rows],
                    stored.scales[rows],
                    stored.block[1],
                    size,
                    None,
                )
            else:
                assert self.product is not None
                weight = stored.packed.view(groups * blocks, -1)[rows]
                out = self.product(x[..., g, :], weight, size, None)
            outs.append(out)
        return torch.stack(outs, dim=-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stored = self.stored
        if isinstance(stored, KernelMxfp4) and x.dtype == torch.bfloat16:
            bias = None if self.bias is None else self.bias.detach()
            return self.stored_library.linear_mxfp4(
                x, stored.packed, stored.scales, self.out_features, bias
            )
        if isinstance(stored, KernelFp8) and x.dtype == torch.bfloat16:
            bias = None if self.bias is None else self.bias.detach()
            return self.stored_library.linear_fp8(
                x, stored.packed, stored.scales, stored.block[1], self.out_features, bias
            )
        if self.product is None or self.packed is None or x.dtype != torch.bfloat16:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.detach()
        return self.product(x, self.packed, self.out_features, bias)


class PackedProjections(Projections):
    """Linear layers reading the same input as one packed weight: one product, its output
    split (their tokens a row of the product apart)."""

    def __init__(self, layers: tuple[nn.Linear, ...]) -> None:
        super().__init__(layers)
        self.product: Product | None = None
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.sizes = [layer.out_features for layer in layers]

    def packable(self) -> bool:
        """Whether the layers can be one weight: all packable, one input size, each with a
        bias or none with one."""
        layers = self.layers
        biases = [layer.bias is not None for layer in layers]
        return (
            all(isinstance(layer, PackedLinear) and layer.packable() for layer in layers)
            and len({layer.in_features for layer in layers}) == 1
            and len(set(biases)) == 1
        )

    def pack(self, product: Product) -> None:
        """Lay the layers' weights out as one for `product`."""
        with torch.no_grad():
            self.packed = product.pack(torch.cat([layer.weight.detach() for layer in self.layers]))
            biases = [layer.bias for layer in self.layers]
            self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])  # type: ignore[union-attr]
        self.product = product

    def let_go_of_plain(self, shared: frozenset[int]) -> None:
        """Each layer keeps its weight only as its rows of the packed one (unless another
        parameter shares it)."""
        if self.packed is None or self.product is None:
            return
        total, start = sum(self.sizes), 0
        for layer, size in zip(self.layers, self.sizes, strict=True):
            assert isinstance(layer, PackedLinear)  # `packable` said so
            if layer.weight.untyped_storage().data_ptr() not in shared:
                layer.held_in(self.packed, self.product, start, total)
            start += size

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.product is None or self.packed is None or x.dtype != torch.bfloat16:
            return super().__call__(x)
        out = self.product(x, self.packed, sum(self.sizes), self.bias)
        return list(out.split(self.sizes, dim=-1))


class PackedGated(Gated):
    """silu(gate(x)) * up(x): with the kernels' products, gate and up in one product (on
    their tiles, the activation and the product in the same call); with oneDNN's, the
    activation and the product done inside its two packed products, where a probe at start
    proved that form keeps a row's bits as the plain products do."""

    def __init__(self, gate: nn.Linear, up: nn.Linear, max_rows: int) -> None:
        super().__init__(gate, up)
        self.pair = PackedProjections((gate, up))
        self.max_rows = max_rows
        self.post_ops: tuple[OneDnnProduct, PackedLinear, PackedLinear] | None = None

    def pack(self, product: Product) -> bool:
        """Lay out what this product fuses; False where the layers stay apart (packed or
        not on their own)."""
        if isinstance(product, KernelProduct) and self.pair.packable():
            self.pair.pack(product)
            return True
        gate, up = self.gate, self.up
        if (
            isinstance(product, OneDnnProduct)
            and isinstance(gate, PackedLinear)
            and isinstance(up, PackedLinear)
            and gate.bias is None
            and up.bias is None
            and gated_fusion_safe(gate.in_features, gate.out_features, self.max_rows)
        ):
            self.post_ops = (product, gate, up)  # each packed on its own, fused in the call
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            pair = self.pair
            if pair.packed is not None:
                if isinstance(pair.product, TileProduct) and pair.bias is None:
                    fused = pair.product.gated_pair(x, pair.packed, sum(pair.sizes))
                    if fused is not None:
                        return fused
                gate, up = pair(x)
                return F.silu(gate) * up
            if self.post_ops is not None:
                product, gate_layer, up_layer = self.post_ops
                if gate_layer.packed is not None and up_layer.packed is not None:
                    return product.gated(x, gate_layer.packed, up_layer.packed)
        return super().__call__(x)


class KernelRMSNorm(RMSNorm):
    """RMSNorm in one call of the CPU kernels (in bfloat16 the bits of the torch form)."""

    def __init__(self, size: int, eps: float, library: CpuKernels) -> None:
        super().__init__(size, eps)
        self.library = library

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.library.supports(x) and x.is_contiguous() and x.dtype == weight.dtype:
            return self.library.rms_norm(x, weight.detach(), self.eps)
        return super().forward(x)


class CpuKit:
    """The CPU's layers: `library` (None: not built, or turned off) runs the attention and
    norms; `packed_linears` lays bfloat16 weights out once for the product this machine
    runs best (`kernel_products`: force the kernels' own multiply-adds, their tiles
    ("tiles"), or oneDNN's; None: the probe's
    choice, or the kernels' own in a model whose stored weights they read, `prepare`).
    `max_rows` is the most rows a launch passes a layer."""

    def __init__(
        self,
        library: CpuKernels | None,
        packed_linears: bool = True,
        max_rows: int = 128,
        kernel_products: bool | Literal["tiles"] | None = None,
    ) -> None:
        self.library = library
        self.packed_linears = packed_linears
        self.max_rows = max_rows
        self.kernel_products = kernel_products
        self.linears: list[PackedLinear] = []
        self.groups: list[PackedProjections | PackedGated] = []
        self.product: Product | None = None  # what `prepare` packed with, if anything

    @property
    def name(self) -> str:
        """`+decode-kernel`, `+packed-linears` and `+kernel-products` (or `+tile-products`),
        as they apply."""
        name = "+decode-kernel" if self.library is not None else ""
        if self.product is not None:
            name += "+packed-linears"
            if isinstance(self.product, TileProduct):
                name += "+tile-products"
            elif isinstance(self.product, KernelProduct):
                name += "+kernel-products"
        return name

    @property
    def rows_apart(self) -> bool:
        """With the kernels' own product every bfloat16 weight is packed for it, whose sums
        for a row follow one fixed order whatever the number of rows."""
        return isinstance(self.product, KernelProduct)

    def linear(self, in_features: int, out_features: int, bias: bool = False) -> StoredLinear:
        """A `PackedLinear`."""
        layer = PackedLinear(in_features, out_features, bias)
        self.linears.append(layer)
        return layer

    def projections(self, *layers: nn.Linear) -> Projections:
        """One packed product for every layer."""
        group = PackedProjections(layers)
        self.groups.append(group)
        return group

    def gated(self, gate: nn.Linear, up: nn.Linear) -> Gated:
        """A `PackedGated`."""
        group = PackedGated(gate, up, self.max_rows)
        self.groups.append(group)
        return group

    def rms_norm(self, size: int, eps: float, float32_weight: bool = False) -> RMSNorm:
        """Through the kernels where built; a float32-weight norm stays the torch form."""
        if self.library is None or float32_weight:
            return RMSNorm(size, eps, float32_weight)
        return KernelRMSNorm(size, eps, self.library)

    def rotary_attention(self, num_kv_heads: int) -> RotaryAttention:
        """Through the kernels where built."""
        if self.library is None:
            return RotaryAttention(num_kv_heads)
        return KernelAttention(num_kv_heads, self.library)

    def cache_attention(self, num_kv_heads: int, scale: float) -> CacheAttention:
        """Through the kernels where built."""
        if self.library is None:
            return CacheAttention(num_kv_heads, scale)
        return KernelCacheAttention(num_kv_heads, scale, self.library)

    def prepare(self, shared: frozenset[int] = frozenset()) -> None:
        """Pack every bfloat16 weight once: groups as one weight where they can be, then
        every other linear layer on its own. Nothing where no product is there. Each packed
        layer then lets go of its plain weight (a grouped one keeps its rows of the group's
        packed weight) unless another parameter shares it (`shared`: a tied head's), so it
        is held once, with either product.

        A model whose FP8 or MXFP4 weights the kernels read as stored runs the kernels'
        bfloat16 product for its other weights too, whatever the probe chose (unless
        `kernel_products` says otherwise): its stored products sum as that product does,
        and oneDNN's sums (its fused gated form above all: silu and the product on the
        float32 sums, rounded once) are others. So every product of the model is of one
        family, and in bfloat16 it has the bits of its dequantized copy run on that
        product."""
        reads_stored = False
        if self.library is not None and self.packed_linears:
            for layer in self.linears:
                if layer.dtype == torch.bfloat16 and layer.stored is not None:
                    layer.read_stored(self.library)
                    reads_stored |= isinstance(layer.stored, (KernelMxfp4, KernelFp8))
        linears = [layer for layer in self.linears if layer.packable()]
        if not self.packed_linears or not linears:
            return
        kernel_products = self.kernel_products
        if kernel_products is None and reads_stored:
            kernel_products = True
        product = choose_product(self.library, kernel_products)
        if product is None:
            return
        grouped: set[int] = set()
        for group in self.groups:
            if isinstance(group, PackedProjections) and group.packable():
                group.pack(product)
                group.let_go_of_plain(shared)
                grouped |= {id(layer) for layer in group.layers}
            elif isinstance(group, PackedGated) and group.pack(product):
                group.pair.let_go_of_plain(shared)
                grouped |= {id(group.gate), id(group.up)}
        for layer in linears:
            if id(layer) not in grouped:
                layer.pack(product)
                if layer.weight.untyped_storage().data_ptr() not in shared:
                    layer.let_go_of_plain()
        self.product = product
