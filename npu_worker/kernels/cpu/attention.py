"""Attention over the KV cache through the CPU kernels: every query reads its own slot's keys
up to its own position, in place, so a prefill token's output is computed exactly as a decode
of it would be, and the rotation of queries and keys with the K/V writes is one call
(docs/architecture.md §2). Where the kernels cannot take a launch's tensors (a dtype or a
layout they do not read) it runs the plain torch path, which keeps the same contract."""

from __future__ import annotations

import torch

from npu_worker.kernels.cpu.library import CpuKernels, token_stride
from npu_worker.models.kit import CacheAttention, RotaryAttention
from npu_worker.models.launch import KVCache, LaunchInputs
from npu_worker.models.layers import rotate_half, write_cache

# Launches of at most this many tokens a row (decode S1, MTP verify and draft S2) pass the
# attention kernel their rows as they are (a row's queries share one pass over its keys);
# longer ones (prefill chunks) pass it every token as a row of its own.
DECODE_KERNEL_MAX_SEQ = 4


class KernelAttention(RotaryAttention):
    """`RotaryAttention` through the CPU kernels: `rope_store` rotates and writes K/V, then
    the kernel's attention reads each query's own keys."""

    def __init__(self, num_kv_heads: int, library: CpuKernels) -> None:
        super().__init__(num_kv_heads)
        self.library = library

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
        """As `RotaryAttention`; the rotation and K/V writes in one call where q, k and v
        are in the cache's dtype and token-major, else rotated in torch first."""
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        library = self.library
        if not (library.supports(k_cache) and library.supports(v_cache)):
            return super().__call__(q, k, v, cos, sin, cache, layer, launch)
        if not (
            q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
            and token_major(q)
            and token_major(k)
            and token_major(v)
        ):
            q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
            if launch.packed:
                rows, at = cache.locate_tokens(launch)
                k_cache[rows, :, at] = k[0].to(k_cache.dtype)
                v_cache[rows, :, at] = v[0].to(v_cache.dtype)
            else:
                write_cache(cache, layer, k, v, launch)
            return kernel_attention(library, q, cache, layer, launch)
        batch, seq, heads, dim = q.shape
        tokens = batch * seq
        slots, positions = cache.locate_tokens(launch)
        library.rope_store(
            q.view(tokens, heads, dim),
            k.view(tokens, self.num_kv_heads, dim),
            v.view(tokens, self.num_kv_heads, -1),
            cos.reshape(tokens, dim),
            sin.reshape(tokens, dim),
            k_cache,
            v_cache,
            slots,
            positions,
        )
        return kernel_attention(library, q, cache, layer, launch)


class KernelCacheAttention(CacheAttention):
    """`CacheAttention` through the CPU kernels: the launch's keys (and values, unless they
    are the keys' first channels) written in torch, then the kernel's attention, each query
    reading its own keys, so a token's output does not depend on what shares its launch."""

    def __init__(self, num_kv_heads: int, scale: float, library: CpuKernels) -> None:
        super().__init__(num_kv_heads, scale)
        self.library = library

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        layer: int,
        launch: LaunchInputs,
    ) -> torch.Tensor:
        """As `CacheAttention`."""
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        if not (self.library.supports(k_cache) and self.library.supports(v_cache)):
            return super().__call__(q, k, v, cache, layer, launch)
        values_in_keys = v_cache.data_ptr() == k_cache.data_ptr()
        if launch.packed:
            rows, at = cache.locate_tokens(launch)
            k_cache[rows, :, at] = k[0].to(k_cache.dtype)
            if not values_in_keys:
                v_cache[rows, :, at] = v[0].to(v_cache.dtype)
        else:
            rows, at = cache.locate(launch.slot_ids[:, None], launch.positions)
            k_cache[rows, :, at] = k.to(k_cache.dtype)
            if not values_in_keys:
                v_cache[rows, :, at] = v.to(v_cache.dtype)
        return kernel_attention(self.library, q, cache, layer, launch, self.scale)


def token_major(x: torch.Tensor) -> bool:
    """Whether x [B, S, H, D] is one run of heads and channels per token, tokens a fixed
    stride apart (contiguous, or a slice of one fused projection's output)."""
    return token_stride(x) is not None


def kernel_attention(
    library: CpuKernels,
    q: torch.Tensor,
    cache: KVCache,
    layer: int,
    launch: LaunchInputs,
    scale: float | None = None,
) -> torch.Tensor:
    """The kernel's attention of q [B, S, H, D] over a cache layer that holds the launch's
    K/V, scores scaled by `scale` (default D^-0.5); in a cache of blocks each row reads
    its own blocks in its table's order."""
    batch, seq, heads, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    by_row = not launch.packed and seq <= DECODE_KERNEL_MAX_SEQ  # a row's queries share keys
    slots, positions = (launch.slot_ids, launch.positions) if by_row else launch.token_rows()
    tables = None
    if cache.paged:  # the rows' tables, once a launch
        if launch.tables is None:
            launch.tables = cache.tables[slots]
        tables = launch.tables
    if by_row:
        return library(q, k_cache, v_cache, slots, positions, launch.span, scale, tables)
    # prefill: each token a row of its own, so it sees exactly its own prefix
    rows = q.reshape(batch * seq, 1, heads, head_dim)
    out = library(rows, k_cache, v_cache, slots, positions[:, None], launch.span, scale, tables)
    return out.view(batch, seq, heads, -1)
