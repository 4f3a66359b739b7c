"""The pieces architectures share: RMSNorm, RoPE frequencies and rotation, and attention over
the static KV cache, where masked positions add exactly zero whatever the span (so a row's
logits do not depend on its launch: docs/architecture.md §2). These are the plain torch
forms; a backend's kit may supply faster layers with the same contract (models/kit.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from npu_worker.models.launch import KVCache, LaunchInputs

WHOLE_VECTORS = 64  # elements: a multiple of every CPU loop's step (two AVX-512 vectors)
PIECE = 16384  # elements one call takes: a multiple of WHOLE_VECTORS, under torch's grain


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn` (an elementwise exp, sigmoid, softplus, ...) of `x`, each element's bits a
    function of its value alone. Torch's CPU loops take whole vectors, then the rest one by
    one, and vector and scalar exponentials round differently; a tensor's tail, and where a
    large one is split over threads, follow its shape. So on a CPU the elements go through
    in pieces of whole vectors, one piece a call (a row then gets the same bits in a decode
    launch of 4 rows as in a prefill chunk of 128)."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    count = flat.numel()
    padded = F.pad(flat, (0, -count % WHOLE_VECTORS))
    if padded.numel() <= PIECE:
        out = fn(padded)
    else:
        out = torch.cat([fn(piece) for piece in padded.split(PIECE)])
    return out[:count].view(x.shape)


def ordered_sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """The sum over a short `dim` (a few hyper-connection streams, a token's experts), its
    terms added in order whatever the tensor's shape (torch's reductions may group them by
    the shape and the threads)."""
    parts = x.unbind(dim)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total.unsqueeze(dim) if keepdim else total


def ordered_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over a short last dim, through `elementwise` and `ordered_sum`."""
    weights = elementwise(torch.exp, x - x.amax(dim=-1, keepdim=True))
    return weights / ordered_sum(weights, -1, keepdim=True)


class RMSNorm(nn.Module):
    """RMSNorm: float32 statistics, the normalised row rounded to x's dtype before the
    weight multiplies it (Llama's order), or, with `float32_weight`, the weight applied in
    float32 and the product rounded once (DeepSeek-V4's, whose norms stay in float32)."""

    def __init__(self, size: int, eps: float, float32_weight: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.float32_weight = float32_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_weight:
            return self.unrounded(x).to(x.dtype)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def unrounded(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 weight times the float32 normalised row: `forward` of a
        `float32_weight` norm before its one rounding."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * h


def cached_keys(
    cache: KVCache,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    launch: LaunchInputs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write a launch's K/V [B, S, Hkv, D] into one layer of the cache and return the keys
    and values its queries attend over, [B, Hkv, span, D], with which of them each query
    sees, [B, S, span]: the rows' slots read in place (a window of consecutive slots) or
    gathered (from their blocks, in a cache of blocks), up to the launch's span; packed
    launches per segment."""
    if launch.packed:
        return packed_keys(cache, layer, k, v, launch)
    write_cache(cache, layer, k, v, launch)
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    if launch.window_start is not None and not cache.paged:
        window = slice(launch.window_start, launch.window_start + k.shape[0])
        keys = k_cache[window, :, : launch.span]
        values = v_cache[window, :, : launch.span]
    else:
        keys = cache.spans(k_cache, launch.slot_ids, launch.span)
        values = cache.spans(v_cache, launch.slot_ids, launch.span)
    return keys, values, causal_mask(launch.positions, launch.span)


def write_cache(
    cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, launch: LaunchInputs
) -> None:
    """Write an unpacked launch's K/V [B, S, Hkv, D] at its rows' slots and positions."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    rows, at = cache.locate(launch.slot_ids[:, None], launch.positions)
    k_cache[rows, :, at] = k.to(k_cache.dtype)
    v_cache[rows, :, at] = v.to(v_cache.dtype)


def causal_mask(positions: torch.Tensor, span: int) -> torch.Tensor:
    """[B, S, span]: each token sees its row's keys up to its own position."""
    key_positions = torch.arange(span, device=positions.device)
    return key_positions[None, None, :] <= positions[:, :, None]


def packed_keys(
    cache: KVCache,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    launch: LaunchInputs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write a packed launch's K/V into each token's own slot, then lay every segment's
    slot side by side as one row of keys, visible only to that segment's tokens."""
    assert launch.segment_slots is not None and launch.token_segments is not None
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    segments, span = launch.segment_slots, launch.span
    positions = launch.positions[0]
    rows, at = cache.locate(segments[launch.token_segments], positions)
    k_cache[rows, :, at] = k[0].to(k_cache.dtype)
    v_cache[rows, :, at] = v[0].to(v_cache.dtype)
    if launch.packed_keys is not None:  # exactly the keys the segments see
        key_slots, key_positions, key_segments = launch.packed_keys
        key_rows, key_at = cache.locate(key_slots, key_positions)
        keys = k_cache[key_rows, :, key_at].transpose(0, 1)
        values = v_cache[key_rows, :, key_at].transpose(0, 1)
    else:  # every segment's slot over the whole span, side by side (fixed shapes)
        num_segments, num_kv_heads, head_dim = len(segments), k_cache.shape[1], k_cache.shape[3]
        keys = cache.spans(k_cache, segments, span).transpose(0, 1)
        values = cache.spans(v_cache, segments, span).transpose(0, 1)
        keys = keys.reshape(num_kv_heads, -1, head_dim)
        values = values.reshape(num_kv_heads, -1, values.shape[-1])
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
