"""What a model asks its backend for: the kinds of layer whose arithmetic a backend may
compute its own way, each chosen when the model is built (docs/architecture.md §2, §8).

A model builds its linear layers, its norms and its attention over the KV cache through a
`LayerKit`, and says which linear layers read the same input (`projections`: an
attention's q, k and v) and which pair forms a gated MLP (`gated`). `TorchKit` gives the
plain torch forms, used on every device; a backend's kit (npu_worker/kernels/) gives
layers of the same contract that compute faster where they can, and lays their weights
out once in `prepare`, after the checkpoint is loaded. Every kind keeps a row's result
apart from its neighbours': a layer's output for a row depends only on that row.

Linear layers and norms stay `nn.Module`s with the checkpoint's parameter names, so a
state dict loads as it is; the groups (`Projections`, `Gated`) and the attention are
plain objects over them, holding no weights of their own.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from npu_worker.models.launch import Kit, KVCache, LaunchInputs
from npu_worker.models.layers import RMSNorm, attend, cached_keys, rotate_half
from npu_worker.models.stored import StoredLinear


class Projections:
    """Linear layers that read the same input, computed one after another."""

    def __init__(self, layers: tuple[nn.Linear, ...]) -> None:
        self.layers = layers

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [layer(x) for layer in self.layers]


class Gated:
    """A gated MLP's hidden state: silu(gate(x)) * up(x)."""

    def __init__(self, gate: nn.Linear, up: nn.Linear) -> None:
        self.gate, self.up = gate, up

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.gate(x)) * self.up(x)


class RotaryAttention:
    """One layer's attention over the KV cache for queries and keys rotated by
    `rotate_half`: the launch's K/V written first, then masked attention over the span."""

    def __init__(self, num_kv_heads: int) -> None:
        self.num_kv_heads = num_kv_heads

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        layer: int,
        launch: LaunchInputs,
    ) -> torch.Tensor:
        """q [B, S, H, D], k and v [B, S, Hkv, D] before rotation; returns [B, S, H, D]."""
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        keys, values, visible = cached_keys(cache, layer, k, v, launch)
        return attend(q, keys, values, visible, self.num_kv_heads)


class CacheAttention:
    """One layer's attention over the cache for queries and keys already rotated (MLA's
    latent cache: values the keys' first channels): the launch's keys and values written
    first, then masked attention over the span, scores scaled by `scale`."""

    def __init__(self, num_kv_heads: int, scale: float) -> None:
        self.num_kv_heads = num_kv_heads
        self.scale = scale

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        layer: int,
        launch: LaunchInputs,
    ) -> torch.Tensor:
        """q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv]; returns [B, S, H, Dv]."""
        keys, values, visible = cached_keys(cache, layer, k, v, launch)
        return attend(q, keys, values, visible, self.num_kv_heads, scale=self.scale)


class LayerKit(Kit, Protocol):
    """The layers a backend supplies to the models it runs."""

    def linear(self, in_features: int, out_features: int, bias: bool = False) -> StoredLinear:
        """A linear layer (its parameters named `weight` and `bias`)."""
        ...

    def projections(self, *layers: nn.Linear) -> Projections:
        """`layers`, which read the same input, computed together where the kit can."""
        ...

    def gated(self, gate: nn.Linear, up: nn.Linear) -> Gated:
        """silu(gate(x)) * up(x), in fewer products where the kit can."""
        ...

    def rms_norm(self, size: int, eps: float, float32_weight: bool = False) -> RMSNorm:
        """An RMSNorm over the last dimension (see `layers.RMSNorm`)."""
        ...

    def rotary_attention(self, num_kv_heads: int) -> RotaryAttention:
        """Attention over the KV cache, queries and keys rotated by `rotate_half`."""
        ...

    def cache_attention(self, num_kv_heads: int, scale: float) -> CacheAttention:
        """Attention over the cache for queries and keys already rotated."""
        ...

    def prepare(self, shared: frozenset[int] = frozenset()) -> None:
        """Lay out the layers this kit made once their weights are loaded and placed;
        `shared`: the storages (data pointers) that more than one parameter uses (a tied
        head's), whose plain tensors must stay."""
        ...

    @property
    def rows_apart(self) -> bool:
        """Whether its linear layers give a row the same bits whatever the number of rows
        beside it (not only at one shape): routed experts then take any count (moe.py)."""
        ...


class TorchKit:
    """Plain torch layers: what every device runs unless its backend supplies others."""

    name = ""

    def linear(self, in_features: int, out_features: int, bias: bool = False) -> StoredLinear:
        """An `nn.Linear` that may keep a quantized weight as stored (`StoredLinear`)."""
        return StoredLinear(in_features, out_features, bias=bias)

    def projections(self, *layers: nn.Linear) -> Projections:
        """The layers one after another."""
        return Projections(layers)

    def gated(self, gate: nn.Linear, up: nn.Linear) -> Gated:
        """silu(gate(x)) * up(x) from the two products."""
        return Gated(gate, up)

    def rms_norm(self, size: int, eps: float, float32_weight: bool = False) -> RMSNorm:
        """The torch RMSNorm."""
        return RMSNorm(size, eps, float32_weight)

    def rotary_attention(self, num_kv_heads: int) -> RotaryAttention:
        """Rotation, cache writes and masked attention in torch."""
        return RotaryAttention(num_kv_heads)

    def cache_attention(self, num_kv_heads: int, scale: float) -> CacheAttention:
        """Cache writes and masked attention in torch."""
        return CacheAttention(num_kv_heads, scale)

    def prepare(self, shared: frozenset[int] = frozenset()) -> None:
        """Nothing to lay out."""

    rows_apart = False  # torch's products pick their kernels by the number of rows
