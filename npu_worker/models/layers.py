"""The pieces architectures share: RMSNorm, RoPE frequencies and rotation, and attention over
the static KV cache, where masked positions add exactly zero whatever the span (so a row's
logits do not depend on its launch: docs/architecture.md §2)."""

from __future__ import annotations

import math
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
from torch import nn

from npu_worker.models.config import ModelConfig
from npu_worker.models.launch import KVCache, LaunchInputs

if TYPE_CHECKING:
    from npu_worker.models.cpu_kernels import CpuKernels

# Launches of at most this many tokens a row (decode S1, MTP verify and draft S2) pass the
# attention kernel their rows as they are (a row's queries share one pass over its keys);
# longer ones (prefill chunks) pass it every token as a row of its own.
DECODE_KERNEL_MAX_SEQ = 4


# The CPU kernels of the launch running in this context: set by the eager backend around
# each launch where the cache has them, so layers without the cache (RMSNorm) use them too.
CPU_KERNELS: ContextVar[CpuKernels | None] = ContextVar("cpu_kernels", default=None)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = CPU_KERNELS.get()
        if (
            kernel is not None
            and kernel.supports(x)
            and x.is_contiguous()
            and x.dtype == self.weight.dtype
        ):
            return kernel.rms_norm(x, self.weight.detach(), self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def cached_keys(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    launch: LaunchInputs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write a launch's K/V [B, S, Hkv, D] into one layer's cache [slots, Hkv, positions, D]
    and return the keys and values its queries attend over, [B, Hkv, span, D], with which
    of them each query sees, [B, S, span]: the rows' slots read in place (a window of
    consecutive slots) or gathered, up to the launch's span; packed launches per segment."""
    if launch.packed:
        return packed_keys(k_cache, v_cache, k, v, launch)
    write_cache(k_cache, v_cache, k, v, launch)
    if launch.window_start is not None:
        window = slice(launch.window_start, launch.window_start + k.shape[0])
        keys = k_cache[window, :, : launch.span]
        values = v_cache[window, :, : launch.span]
    else:
        keys = k_cache[launch.slot_ids, :, : launch.span]
        values = v_cache[launch.slot_ids, :, : launch.span]
    return keys, values, causal_mask(launch.positions, launch.span)


def write_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    launch: LaunchInputs,
) -> None:
    """Write an unpacked launch's K/V [B, S, Hkv, D] at its rows' slots and positions."""
    rows = launch.slot_ids[:, None]
    k_cache[rows, :, launch.positions] = k.to(k_cache.dtype)
    v_cache[rows, :, launch.positions] = v.to(v_cache.dtype)


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    layer: int,
    launch: LaunchInputs,
    num_kv_heads: int,
) -> torch.Tensor:
    """One layer's attention of a launch's queries q [B, S, H, D] over the cache, after
    writing its K/V: through the cache's attention kernel where it has one (every query
    reads its own slot's keys up to its own position, in place, so a prefill token's
    output is computed exactly as a decode of it would be), else masked over the span."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    kernel = cache.decode_kernel
    if kernel is None or not (kernel.supports(k_cache) and kernel.supports(v_cache)):
        keys, values, visible = cached_keys(k_cache, v_cache, k, v, launch)
        return attend(q, keys, values, visible, num_kv_heads)
    if launch.packed:
        slots, positions = launch.token_rows()
        k_cache[slots, :, positions] = k[0].to(k_cache.dtype)
        v_cache[slots, :, positions] = v[0].to(v_cache.dtype)
    else:
        write_cache(k_cache, v_cache, k, v, launch)
    return kernel_attention(kernel, q, k_cache, v_cache, launch)


def rotary_cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    layer: int,
    launch: LaunchInputs,
    num_kv_heads: int,
) -> torch.Tensor:
    """`cached_attention` of queries and keys rotated by `rotate_half`: where the cache has
    the CPU kernel, the rotations and the K/V writes are one call of it (the same bits)."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    kernel = cache.decode_kernel
    if (
        kernel is None
        or not (kernel.supports(k_cache) and kernel.supports(v_cache))
        or not q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
        or not (token_major(q) and token_major(k) and token_major(v))
    ):
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        return cached_attention(q, k, v, cache, layer, launch, num_kv_heads)
    batch, seq, heads, dim = q.shape
    tokens = batch * seq
    slots, positions = launch.token_rows()
    kernel.rope_store(
        q.view(tokens, heads, dim),
        k.view(tokens, num_kv_heads, dim),
        v.view(tokens, num_kv_heads, -1),
        cos.reshape(tokens, dim),
        sin.reshape(tokens, dim),
        k_cache,
        v_cache,
        slots,
        positions,
    )
    return kernel_attention(kernel, q, k_cache, v_cache, launch)


def token_major(x: torch.Tensor) -> bool:
    """Whether x [B, S, H, D] is one run of heads and channels per token, tokens a fixed
    stride apart (contiguous, or a slice of one fused projection's output)."""
    batch, seq, heads, dim = x.shape
    if x.stride(3) != 1 or x.stride(2) != dim:
        return False
    if batch == 1 or seq == 1:  # a dimension of one may have any stride
        step = x.stride(1) if batch == 1 and seq > 1 else x.stride(0)
        return batch * seq == 1 or step >= heads * dim
    return x.stride(1) >= heads * dim and x.stride(0) == seq * x.stride(1)


def kernel_attention(
    kernel: CpuKernels,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    launch: LaunchInputs,
) -> torch.Tensor:
    """The kernel's attention of q [B, S, H, D] over a cache that holds the launch's K/V."""
    batch, seq, heads, head_dim = q.shape
    scale = head_dim**-0.5
    if not launch.packed and seq <= DECODE_KERNEL_MAX_SEQ:  # a row's queries share its keys
        return kernel(q, k_cache, v_cache, launch.slot_ids, launch.positions, launch.span, scale)
    # prefill: each token a row of its own, so it sees exactly its own prefix
    slots, positions = launch.token_rows()
    rows = q.reshape(batch * seq, 1, heads, head_dim)
    out = kernel(rows, k_cache, v_cache, slots, positions[:, None], launch.span, scale)
    return out.view(batch, seq, heads, -1)


def causal_mask(positions: torch.Tensor, span: int) -> torch.Tensor:
    """[B, S, span]: each token sees its row's keys up to its own position."""
    key_positions = torch.arange(span, device=positions.device)
    return key_positions[None, None, :] <= positions[:, :, None]


def packed_keys(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    launch: LaunchInputs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write a packed launch's K/V into each token's own slot, then lay every segment's
    slot side by side as one row of keys, visible only to that segment's tokens."""
    assert launch.segment_slots is not None and launch.token_segments is not None
    segments, span = launch.segment_slots, launch.span
    token_slots = segments[launch.token_segments]
    positions = launch.positions[0]
    k_cache[token_slots, :, positions] = k[0].to(k_cache.dtype)
    v_cache[token_slots, :, positions] = v[0].to(v_cache.dtype)
    if launch.packed_keys is not None:  # exactly the keys the segments see
        key_slots, key_positions, key_segments = launch.packed_keys
        keys = k_cache[key_slots, :, key_positions].transpose(0, 1)
        values = v_cache[key_slots, :, key_positions].transpose(0, 1)
    else:  # every segment's slot over the whole span, side by side (fixed shapes)
        num_segments, num_kv_heads, head_dim = len(segments), k_cache.shape[1], k_cache.shape[3]
        keys = k_cache[segments, :, :span].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
        values = v_cache[segments, :, :span].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
        key_positions = torch.arange(span, device=k.device).repeat(num_segments)
        key_segments = torch.arange(num_segments, device=k.device).repeat_interleave(span)
    visible = (key_segments[None, :] == launch.token_segments[:, None]) & (
        key_positions[None, :] <= positions[:, None]
    )
    return keys[None], values[None], visible[None]


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half layout; cos/sin are [B, S, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    num_kv_heads: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Masked attention of q [B, S, H, D] over keys [B, Hkv, span, D] and values
    [B, Hkv, span, Dv], where `visible` [B, S, span] says which keys each query sees;
    scores scaled by `scale` (default D^-0.5). Returns [B, S, H, Dv].

    Query heads are grouped over their shared KV head (no K/V copy for GQA). Masked
    scores are -inf, so they add exactly zero whatever the span.
    """
    batch, seq, num_heads, head_dim = q.shape
    value_dim = values.shape[-1]
    group = num_heads // num_kv_heads
    span = keys.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    qg = q.permute(0, 2, 1, 3).reshape(batch, num_kv_heads, group * seq, head_dim)
    scores = torch.matmul(qg.float(), keys.float().transpose(-1, -2)) * scale
    scores = scores.view(batch, num_kv_heads, group, seq, span)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, num_kv_heads, group * seq, span)
    out = torch.matmul(probs, values.float()).to(q.dtype)
    return out.view(batch, num_heads, seq, value_dim).permute(0, 2, 1, 3)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout),
    returned de-interleaved as [rotated evens, rotated odds]: a fixed permutation of the
    channels, the same for queries and keys, so their dot products are those of the pairs.
    cos/sin are [B, S, 1, D/2], one angle per pair."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1).to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with `linear` or Llama 3 (`llama3`) scaling applied."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if config.rope_type == "linear":
        return inv_freq / scaling["factor"]
    if config.rope_type != "llama3":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, smoothed, scaled)
