"""A Llama-family decoder (Llama, Mistral, Qwen2) that reads and writes a static KV cache.

Module names follow Hugging Face checkpoints, so a state dict loads as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from npu_worker.model_config import ModelConfig


@dataclass(slots=True)
class LaunchInputs:
    """One launch at a fixed shape [B, S].

    Rows read their cache in place from slots [window_start, window_start + B) when
    `window_start` is set (row i is slot window_start + i), else gathered by `slot_ids`.
    Only the first `span` cache positions are read; later ones are masked by position anyway.

    A *packed* launch (B = 1) carries several requests' segments back to back: token i
    belongs to segment `token_segments[i]`, whose request holds slot `segment_slots[j]`, and
    sees only that slot's keys up to its own position (causal within its own request).
    Eager backends also pass `packed_keys`: the slot, position and segment of exactly the
    keys the segments see, so attention spans their own tokens rather than every segment's
    whole `span`; graph backends, which need fixed shapes, lay whole spans side by side.
    """

    input_ids: torch.Tensor  # [B, S]
    positions: torch.Tensor  # [B, S], where each token's K/V is written and which keys it sees
    slot_ids: torch.Tensor  # [B]
    logit_index: torch.Tensor  # [B, K], the positions within S whose logits are returned
    span: int
    window_start: int | None
    segment_slots: torch.Tensor | None = None  # [segments], packed launches only
    token_segments: torch.Tensor | None = None  # [S], packed launches only
    packed_keys: torch.Tensor | None = None  # [3, K]: key slots, positions, segments (eager)

    @property
    def packed(self) -> bool:
        """True for a launch carrying several requests' segments."""
        return self.segment_slots is not None


@dataclass(slots=True)
class LaunchOutput:
    """Logits at the requested positions and the final hidden states of every position."""

    logits: torch.Tensor  # [B, K, vocab], float32
    hidden: torch.Tensor  # [B, S, hidden], after the final norm


class KVCache:
    """Per-layer K and V buffers [slots, kv_heads, positions + 1, head_dim], allocated once.

    The extra last position is scratch: padding rows write there, and no query reads it.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_kv_len: int,
        dtype: torch.dtype,
        device: torch.device,
        num_layers: int | None = None,
    ) -> None:
        shape = (num_slots, config.num_kv_heads, max_kv_len + 1, config.head_dim)
        layers = config.num_layers if num_layers is None else num_layers
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.num_slots = num_slots
        self.max_kv_len = max_kv_len

    @property
    def scratch_position(self) -> int:
        """The position padding rows write to."""
        return self.max_kv_len


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        launch: LaunchInputs,
        cache: KVCache | None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is None:  # training: whole sequences, no cache
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
            visible = _causal(launch.positions, seq)
            out = _attend(q, keys, values, visible, self.num_kv_heads)
            return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))
        k_cache, v_cache = cache.k[self.layer], cache.v[self.layer]
        if launch.packed:
            keys, values, visible = _packed_keys(k_cache, v_cache, k, v, launch)
        else:
            rows = launch.slot_ids[:, None]
            k_cache[rows, :, launch.positions] = k.to(k_cache.dtype)
            v_cache[rows, :, launch.positions] = v.to(v_cache.dtype)
            if launch.window_start is not None:
                window = slice(launch.window_start, launch.window_start + batch)
                keys = k_cache[window, :, : launch.span]
                values = v_cache[window, :, : launch.span]
            else:
                keys = k_cache[launch.slot_ids, :, : launch.span]
                values = v_cache[launch.slot_ids, :, : launch.span]
            visible = _causal(launch.positions, launch.span)
        out = _attend(q, keys, values, visible, self.num_kv_heads)
        return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))


def _causal(positions: torch.Tensor, span: int) -> torch.Tensor:
    """[B, S, span]: each token sees its row's keys up to its own position."""
    key_positions = torch.arange(span, device=positions.device)
    return key_positions[None, None, :] <= positions[:, :, None]


def _packed_keys(
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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half layout; cos/sin are [B, S, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    num_kv_heads: int,
) -> torch.Tensor:
    """Masked attention of q [B, S, H, D] over keys/values [B, Hkv, span, D], where
    `visible` [B, S, span] says which keys each query sees.

    Query heads are grouped over their shared KV head (no K/V copy for GQA). Masked
    scores are -inf, so they add exactly zero whatever the span.
    """
    batch, seq, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    span = keys.shape[2]
    qg = q.permute(0, 2, 1, 3).reshape(batch, num_kv_heads, group * seq, head_dim)
    scores = torch.matmul(qg.float(), keys.float().transpose(-1, -2)) * head_dim**-0.5
    scores = scores.view(batch, num_kv_heads, group, seq, span)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, num_kv_heads, group * seq, span)
    out = torch.matmul(probs, values.float()).to(q.dtype)
    return out.view(batch, num_heads, seq, head_dim).permute(0, 2, 1, 3)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        launch: LaunchInputs,
        cache: KVCache | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, launch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


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


class MTPModule(nn.Module):
    """DeepSeek-style multi-token prediction (K=1): from the final hidden state at position i
    and the embedding of token i+1, one transformer block predicts token i+2 through the
    shared head. Its block keeps its own KV cache layer (index `num_layers`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = DecoderLayer(config, config.num_layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        launch: LaunchInputs,
        cache: KVCache,
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        return self.norm(self.layer(x, cos, sin, launch, cache))


class CausalLM(nn.Module):
    """Decoder + LM head (+ the optional MTP module); each call runs one fixed-shape launch."""

    def __init__(self, config: ModelConfig, max_positions: int, with_mtp: bool = False) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = MTPModule(config) if with_mtp else None
        inv_freq = rope_inv_freq(config)
        freqs = torch.outer(torch.arange(max_positions + 1, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def tie_weights(self) -> None:
        """Share the embedding with the head, for tied checkpoints."""
        self.lm_head.weight = self.model.embed_tokens.weight

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every token's rotation, [B, S, 1, head_dim]."""
        return self.rope_cos[positions][:, :, None, :], self.rope_sin[positions][:, :, None, :]

    def logits_at(self, hidden: torch.Tensor, logit_index: torch.Tensor) -> torch.Tensor:
        """[B, K, vocab] float32 logits of the hidden states at `logit_index` [B, K]."""
        rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None]
        return self.lm_head(hidden[rows, logit_index]).float()

    @torch.inference_mode()
    def forward(self, launch: LaunchInputs, cache: KVCache) -> LaunchOutput:
        cos, sin = self.rope(launch.positions)
        x = self.model.embed_tokens(launch.input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, launch, cache)
        hidden = self.model.norm(x)
        return LaunchOutput(self.logits_at(hidden, launch.logit_index), hidden)

    @torch.inference_mode()
    def draft(self, launch: LaunchInputs, hidden: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """MTP logits [B, K, vocab]: `launch.input_ids` hold token i+1 for each hidden state i."""
        if self.mtp is None:
            raise RuntimeError("this model has no MTP module")
        cos, sin = self.rope(launch.positions)
        embedded = self.model.embed_tokens(launch.input_ids)
        out = self.mtp(hidden, embedded, cos, sin, launch, cache)
        return self.logits_at(out, launch.logit_index)
