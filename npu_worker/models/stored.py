"""Weights kept in the form the checkpoint stores them, and the linear layer that reads them
(docs/architecture.md §8).

Three stored forms, each resident as the checkpoint has it:

- `Fp8Blocks`: float8 e4m3 [out, in] with a float32 scale per block of `block` (128 x 128
  in DeepSeek's releases; scales written as float32 `weight_scale_inv` or as UE8M0 powers of
  two, `X.scale`, both held as float32 here: one float per 16,384 weights).
- `Mxfp4`: MXFP4 as DeepSeek-V4's release stores its routed experts: e2m1 values two a byte
  [out, in / 2] (the even input in the low nibble, torch's `float4_e2m1fn_x2`), and a UE8M0
  power of two per 32 inputs [out, in / 32].
- `Int8Channels`: W8A8 as compressed-tensors writes it: int8 weights [out, in], a float
  scale per output channel; activations are quantized per token to int8 at each call
  (symmetric, scale = max |x| / 127, rounded half to even), the products summed exactly in
  int32 (`torch._int_mm`), then scaled. Where oneDNN's int8 product is not exact (on CPUs
  without VNNI it adds pairs of byte products in int16, which saturates), the sums come
  from float32 products of at most 1,024 inputs, exact integers all (`int_sums`).

A `StoredLinear` is an `nn.Linear` that may hold one of these in place of its float weight
(`keep_stored`). FP8 and MXFP4 layers widen the weight to the input's dtype at each call,
through float32 exactly as a dequantized copy of the checkpoint would be widened at load, so
their outputs are a dequantized copy's; reading `.weight` gives that widened copy too (the
few places that use a weight as a tensor: MLA's absorbed `kv_b_proj`, and V4's grouped
output projection where no kit's product reads its slices, `grouped`). The CPU kit reads
FP8 and MXFP4 through the kernels' own products instead (kernels/cpu/layers.py). W8A8
layers compute in integers. Every form keeps a row's result apart from the others': the
widened weight is the same for every call, and integer sums are exact.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes; bit 3 is the sign
MX_BLOCK = 32  # inputs per MXFP4 scale


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 exponents (float8 e8m0, or their bytes) as float32 powers of two, 2^(e - 127)
    (255, the format's NaN, stays NaN)."""
    bits = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    return (bits.to(torch.int32) << 23).view(torch.float32).where(bits != 255, float("nan"))


_BYTE_VALUES: dict[torch.device, torch.Tensor] = {}


def byte_values(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the two e2m1 values of each byte, the low nibble's first."""
    if device not in _BYTE_VALUES:
        table = torch.tensor(FP4_VALUES)
        table = torch.cat((table, -table))
        codes = torch.arange(256)
        pairs = torch.stack((table[codes & 0xF], table[codes >> 4]), dim=-1)
        _BYTE_VALUES[device] = pairs.to(device)
    return _BYTE_VALUES[device]


@dataclass(frozen=True, slots=True)
class Fp8Blocks:
    """A float8 e4m3 weight [out, in] and its float32 block scales [ceil(out/b0), ceil(in/b1)]."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.weight.shape[0]), int(self.weight.shape[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scale": self.scale}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> Fp8Blocks:
        return Fp8Blocks(tensors["weight"], tensors["scale"], self.block)

    def dequantize(self) -> torch.Tensor:
        """The weight in float32."""
        rows, cols = self.shape
        scales = self.scale.float().repeat_interleave(self.block[0], 0)[:rows]
        scales = scales.repeat_interleave(self.block[1], 1)[:, :cols]
        return self.weight.float() * scales


@dataclass(frozen=True, slots=True)
class Mxfp4:
    """e2m1 pairs [out, in / 2] (uint8 bytes, the even input in the low nibble) and UE8M0
    scales [out, in / 32] (uint8 bytes)."""

    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.packed.shape[0]), int(self.packed.shape[1]) * 2

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scale": self.scale}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> Mxfp4:
        return Mxfp4(tensors["packed"], tensors["scale"])

    def dequantize(self) -> torch.Tensor:
        """The weight in float32: each value times its block's power of two (a byte's two
        values looked up at once, the scales broadcast over their 32 inputs)."""
        rows, cols = self.shape
        values = F.embedding(self.packed.to(torch.int32), byte_values(self.packed.device))
        blocks = values.view(rows, -1, MX_BLOCK) if cols % MX_BLOCK == 0 else None
        if blocks is not None:
            return (blocks * e8m0_to_float(self.scale)[..., None]).view(rows, cols)
        scales = e8m0_to_float(self.scale).repeat_interleave(MX_BLOCK, 1)[:, :cols]
        return values.view(rows, cols) * scales


@dataclass(frozen=True, slots=True)
class Int8Channels:
    """W8A8: int8 weights [out, in] and a float32 scale per output [out]."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.weight.shape[0]), int(self.weight.shape[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scale": self.scale}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> Int8Channels:
        return Int8Channels(tensors["weight"], tensors["scale"])

    def dequantize(self) -> torch.Tensor:
        """The weight in float32 (for the few uses of a weight as a tensor)."""
        return self.weight.float() * self.scale.float()[:, None]


class StoredWeight(Protocol):
    """A weight held in some form other than its float tensor: the three above, or a layout
    a kit made for its own product (kernels/cpu/layers.py)."""

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in] of the weight it holds."""
        ...

    def tensors(self) -> dict[str, torch.Tensor]:
        """What it holds, by name (the layer's buffers)."""
        ...

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> StoredWeight:
        """The same form over `tensors` (moved)."""
        ...

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in float32."""
        ...


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `x` [N, in] as int8 with a float32 scale each: symmetric, scale max |x| / 127
    (1 for a row of zeros), values rounded half to even."""
    wide = x.float()
    scale = wide.abs().amax(dim=-1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(wide / scale).clamp(-128, 127).to(torch.int8), scale


def int8_linear(x: torch.Tensor, stored: Int8Channels) -> torch.Tensor:
    """x [N, in] times a W8A8 weight: activations quantized per token, int32 sums, then
    both scales; float32 [N, out]."""
    q, scale = quantize_tokens(x)
    return int_sums(q, stored.weight).float() * scale * stored.scale.float()


EXACT_INPUTS = 1024  # |a . b| <= 1024 * 128 * 127 < 2^24 for int8 a, b: exact in float32


def int_sums(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """q [N, in] int8 times weight [out, in] int8: the exact int32 sums [N, out]."""
    if q.device.type == "cpu" and not cpu_int_mm_exact():
        total = torch.zeros(q.shape[0], weight.shape[0], dtype=torch.float64)
        for start in range(0, q.shape[1], EXACT_INPUTS):  # each part's sums exact integers
            part = slice(start, start + EXACT_INPUTS)
            total += (q[:, part].float() @ weight[:, part].float().t()).double()
        return total.to(torch.int32)
    if q.device.type == "cpu" or q.shape[0] > 16:
        return torch._int_mm(q, weight.t())
    # CUDA's int8 product takes more than 16 rows: the sums are exact either way
    padded = q.new_zeros(17, q.shape[1])
    padded[: q.shape[0]] = q
    return torch._int_mm(padded, weight.t())[: q.shape[0]]


@functools.cache
def cpu_int_mm_exact() -> bool:
    """Whether `torch._int_mm` sums int8 products exactly on this CPU: on one without VNNI
    (or with oneDNN capped below it) oneDNN adds pairs of byte products in int16, and a
    pair of 127 * 127 products (255 * 127 after its shift to unsigned) saturates."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (8, 256), generator=generator, dtype=torch.int8)
    b = torch.randint(-127, 128, (256, 32), generator=generator, dtype=torch.int8)
    a[0], b[:, 0] = 127, 127  # the pairs that saturate
    a[1], b[:, 1] = -128, -127
    try:
        got = torch._int_mm(a, b)
    except RuntimeError:
        return False
    return torch.equal(got.long(), a.long() @ b.long())


_FROM_CHECKPOINT = ContextVar("from_checkpoint", default=False)


@contextmanager
def weights_from_checkpoint() -> Iterator[None]:
    """Build linear layers whose weights a checkpoint will fill: their float weights are
    allocated and never written (no random init), so a weight the checkpoint keeps as
    stored never occupies memory as floats (untouched pages are never mapped)."""
    token = _FROM_CHECKPOINT.set(True)
    try:
        yield
    finally:
        _FROM_CHECKPOINT.reset(token)


class StoredLinear(nn.Linear):
    """An `nn.Linear` that may keep its weight as the checkpoint stores it (`keep_stored`):
    its float `weight` parameter is then gone, the stored tensors are its buffers (moved by
    `.to(device)`, never converted by `.to(dtype)`), and `.weight` reads a widened copy."""

    stored: StoredWeight | None = None
    compute_dtype: torch.dtype = torch.float32
    read_grouped = False  # called through `grouped` (a kit keeps what that reads fast)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        if self.stored is None:
            weight = self._parameters.get("weight")
            if weight is None:  # not yet made (nn.Linear's own init asks)
                raise AttributeError("weight")
            return weight
        return self.stored.dequantize().to(self.compute_dtype)

    def reset_parameters(self) -> None:
        if not _FROM_CHECKPOINT.get():
            super().reset_parameters()

    @property
    def widens_per_call(self) -> bool:
        """Whether its product is torch's over a weight widened at each call (FP8, MXFP4):
        such a product keeps rows apart only at one shape."""
        return isinstance(self.stored, (Fp8Blocks, Mxfp4))

    def keeps_rows_apart(self, kit_rows_apart: bool) -> bool:
        """Whether a row's result depends on that row alone at every row count, in a model
        whose kit's products do so where `kit_rows_apart`."""
        return kit_rows_apart and not self.widens_per_call

    @property
    def dtype(self) -> torch.dtype:
        """What it computes in: its float weight's dtype, or with a stored weight the dtype
        the model was placed in."""
        return self.weight.dtype if self.stored is None else self.compute_dtype

    def keep_stored(self, stored: StoredWeight) -> None:
        """Hold `stored` in place of the float weight (whose shape it must have)."""
        if stored.shape != (self.out_features, self.in_features):
            raise ValueError(
                f"a stored weight of shape {stored.shape} for a linear layer of "
                f"{(self.out_features, self.in_features)}"
            )
        self._parameters.pop("weight", None)
        if self.stored is not None:  # a form that replaces another lets go of its tensors
            for name in self.stored.tensors():
                self._buffers.pop(f"stored_{name}", None)
        self.compute_dtype = torch.float32
        for name, tensor in stored.tensors().items():
            self.register_buffer(f"stored_{name}", tensor, persistent=False)
        self.stored = stored

    def _apply(self, fn: Any, recurse: bool = True) -> StoredLinear:
        if self.stored is None:
            return super()._apply(fn, recurse)  # type: ignore[no-any-return]
        bias = self.bias
        if bias is not None:  # a float like the model's: follows its dtype
            self.bias = nn.Parameter(fn(bias.data), requires_grad=False)
            self.compute_dtype = self.bias.dtype
        else:
            self.compute_dtype = fn(torch.zeros((), dtype=torch.float32)).dtype
        moved = {}
        for name, tensor in self.stored.tensors().items():
            device = fn(tensor.new_empty(0)).device  # only the device: the dtypes stay
            moved[name] = tensor.to(device)
            self.register_buffer(f"stored_{name}", moved[name], persistent=False)
        self.stored = self.stored.with_tensors(moved)
        return self

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """A grouped product (DeepSeek-V4's `wo_a`): x [..., G, in] with group g times the
        g-th of G equal slices of the weight's outputs; [..., G, out / G]."""
        weight = self.weight.view(x.shape[-2], -1, self.in_features)
        return torch.einsum("...gi,goi->...go", x, weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stored = self.stored
        if stored is None:
            return super().forward(x)
        if isinstance(stored, Int8Channels):
            rows = x.reshape(-1, x.shape[-1])
            out = int8_linear(rows, stored)
            if self.bias is not None:
                out = out + self.bias.float()
            return out.to(x.dtype).view(*x.shape[:-1], -1)
        return F.linear(x, stored.dequantize().to(x.dtype), self.bias)
