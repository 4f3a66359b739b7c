"""A Llama-family decoder (Llama, Mistral, Qwen2) that reads and writes a static KV cache.

Module names follow Hugging Face checkpoints, so a state dict loads as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from npu_worker.models.config import ModelConfig
from npu_worker.models.cpu_linear import fused_outputs, gated_product
from npu_worker.models.launch import KVCache, LaunchInputs, LaunchModel, LaunchOutput
from npu_worker.models.layers import (
    RMSNorm,
    attend,
    causal_mask,
    rope_inv_freq,
    rotary_cached_attention,
    rotate_half,
)


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
        fused = fused_outputs(self, x)
        q, k, v = fused or (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim)
        if cache is None:  # training: whole sequences, no cache
            q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
            visible = causal_mask(launch.positions, seq)
            out = attend(q, keys, values, visible, self.num_kv_heads)
            return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))
        out = rotary_cached_attention(
            q, k, v, cos, sin, cache, self.layer, launch, self.num_kv_heads
        )
        return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = gated_product(self, self.gate_proj, self.up_proj, x)
        if hidden is None:
            hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(hidden)


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


class CausalLM(LaunchModel):
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

    def new_cache(self, num_slots: int, max_kv_len: int) -> KVCache:
        """K/V for every layer (and the MTP block's), on the weights' device and dtype."""
        weight = self.lm_head.weight
        layers = self.config.num_layers + (1 if self.mtp is not None else 0)
        config = self.config
        return KVCache(
            layers,
            num_slots,
            max_kv_len,
            config.num_kv_heads,
            config.head_dim,
            weight.dtype,
            weight.device,
        )

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
