"""A Llama-family decoder (Llama, Mistral, Qwen2) that reads and writes a static KV cache.

Module names follow Hugging Face checkpoints, so a state dict loads as it is.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from npu_worker.models.kit import LayerKit, TorchKit
from npu_worker.models.launch import KVCache, LaunchInputs, LaunchModel, LaunchOutput
from npu_worker.models.layers import attend, causal_mask, rotate_half
from npu_worker.models.llama.config import LlamaConfig


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int, kit: LayerKit) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = kit.linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = kit.linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = kit.linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = kit.linear(self.num_heads * self.head_dim, hidden)
        self.qkv = kit.projections(self.q_proj, self.k_proj, self.v_proj)
        self.attention = kit.rotary_attention(self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        launch: LaunchInputs,
        cache: KVCache | None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x)
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim)
        if cache is None:  # training: whole sequences, no cache
            q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
            visible = causal_mask(launch.positions, seq)
            out = attend(q, keys, values, visible, self.num_kv_heads)
            return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))
        out = self.attention(q, k, v, cos, sin, cache, self.layer, launch)
        return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, kit: LayerKit) -> None:
        super().__init__()
        self.gate_proj = kit.linear(config.hidden_size, config.intermediate_size)
        self.up_proj = kit.linear(config.hidden_size, config.intermediate_size)
        self.down_proj = kit.linear(config.intermediate_size, config.hidden_size)
        self.gated = kit.gated(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int, kit: LayerKit) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, kit)
        self.mlp = MLP(config, kit)
        self.input_layernorm = kit.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = kit.rms_norm(config.hidden_size, config.rms_norm_eps)

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
    def __init__(self, config: LlamaConfig, kit: LayerKit) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, kit) for i in range(config.num_layers))
        self.norm = kit.rms_norm(config.hidden_size, config.rms_norm_eps)


class MTPModule(nn.Module):
    """DeepSeek-style multi-token prediction (K=1): from the final hidden state at position i
    and the embedding of token i+1, one transformer block predicts token i+2 through the
    shared head. Its block keeps its own KV cache layer (index `num_layers`)."""

    def __init__(self, config: LlamaConfig, kit: LayerKit) -> None:
        super().__init__()
        self.enorm = kit.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = kit.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = kit.linear(2 * config.hidden_size, config.hidden_size)
        self.layer = DecoderLayer(config, config.num_layers, kit)
        self.norm = kit.rms_norm(config.hidden_size, config.rms_norm_eps)

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


class CausalLM(LaunchModel[KVCache]):
    """Decoder + LM head (+ the optional MTP module); each call runs one fixed-shape launch.
    Its layers come from `kit` (plain torch layers by default)."""

    decode_rows_pack = True

    def __init__(
        self,
        config: LlamaConfig,
        max_positions: int,
        with_mtp: bool = False,
        kit: LayerKit | None = None,
    ) -> None:
        super().__init__()
        kit = kit or TorchKit()
        self.config, self.kit = config, kit
        self.model = Backbone(config, kit)
        self.lm_head = kit.linear(config.hidden_size, config.vocab_size)
        self.mtp = MTPModule(config, kit) if with_mtp else None
        inv_freq = rope_inv_freq(config)
        freqs = torch.outer(torch.arange(max_positions + 1, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def new_state(
        self, num_slots: int, max_kv_len: int, block_size: int = 0, num_blocks: int = 0
    ) -> KVCache:
        """K/V for every layer (and the MTP block's), on the weights' device and dtype."""
        weight = self.input_embeddings().weight  # the model's dtype and device
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
            block_size=block_size,
            num_blocks=num_blocks,
        )

    def output_head(self) -> nn.Linear:
        """`lm_head`."""
        return self.lm_head

    def input_embeddings(self) -> nn.Embedding:
        """`model.embed_tokens`."""
        return self.model.embed_tokens

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move to `device` in `dtype`; the rotary tables back in float32."""
        self.to(device=device, dtype=dtype).eval()
        self.rope_cos, self.rope_sin = self.rope_cos.float(), self.rope_sin.float()

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
    def forward(self, launch: LaunchInputs, state: KVCache) -> LaunchOutput:
        cos, sin = self.rope(launch.positions)
        x = self.model.embed_tokens(launch.input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, launch, state)
        hidden = self.model.norm(x)
        return LaunchOutput(self.logits_at(hidden, launch.logit_index), hidden)

    @torch.inference_mode()
    def draft(self, launch: LaunchInputs, hidden: torch.Tensor, state: KVCache) -> torch.Tensor:
        """MTP logits [B, K, vocab]: `launch.input_ids` hold token i+1 for each hidden state i."""
        if self.mtp is None:
            raise RuntimeError("this model has no MTP module")
        cos, sin = self.rope(launch.positions)
        embedded = self.model.embed_tokens(launch.input_ids)
        out = self.mtp(hidden, embedded, cos, sin, launch, state)
        return self.logits_at(out, launch.logit_index)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
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
