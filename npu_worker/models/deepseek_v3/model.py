"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, `model_type: deepseek_v3`; DeepSeek-V3/R1 and the
checkpoints built on its architecture) reading and writing a static latent KV cache.

- Multi-head latent attention: queries through a low-rank `q_a_proj` / `q_b_proj` (or one
  `q_proj` when `q_lora_rank` is null, the V2-Lite form); keys and values compressed to a
  `kv_lora_rank` latent plus one shared `qk_rope_head_dim` rotary key. The cache keeps that
  latent and rotary key per token and layer, never expanded K and V: `kv_b_proj` is absorbed
  into the queries (its key half) and the output (its value half), so attention runs on the
  latent, as multi-query attention with one key/value head.
- YaRN RoPE, with its attention factor on cos/sin and its `mscale_all_dim` on the softmax
  scale; interleaved rotary channels (`rope_interleave`, the default).
- Mixture of experts: sigmoid scores plus `e_score_correction_bias`, grouped top-k
  (`n_group`, `topk_group`), `norm_topk_prob`, `routed_scaling_factor`, shared experts, the
  first `first_k_dense_replace` layers dense (`moe.py`: each expert over its routed rows,
  expert parallelism).
- The MTP layer (`model.layers.{num_hidden_layers}` in a checkpoint): `enorm`, `hnorm`,
  `eh_proj`, one decoder block and `shared_head`, loaded as `mtp.*`.

Module names follow the checkpoint, so its state dict loads as it is; its config, YaRN
tables and tensor names are in `config.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from npu_worker.models.deepseek_v3.config import DeepseekV3Config, rope_tables
from npu_worker.models.kit import LayerKit, TorchKit
from npu_worker.models.launch import KVCache, LaunchInputs, LaunchModel, LaunchOutput
from npu_worker.models.layers import (
    attend,
    causal_mask,
    rotate_half,
    rotate_interleaved,
)
from npu_worker.models.moe import (
    ExpertBlock,
    ExpertGroup,
    ExpertModel,
    GatedMLP,
    LocalExperts,
    RoutedExperts,
    Routes,
    routes,
)
from npu_worker.models.stored import StoredLinear


class LatentAttention(nn.Module):
    """MLA over a latent cache, `kv_b_proj` absorbed into the query and the output."""

    def __init__(self, config: DeepseekV3Config, layer: int, kit: LayerKit) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        hidden, heads, bias = config.hidden_size, config.num_heads, config.attention_bias
        q_out = heads * config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = kit.linear(hidden, q_out)
        else:
            self.q_a_proj = kit.linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = kit.rms_norm(config.q_lora_rank, 1e-6)
            self.q_b_proj = kit.linear(config.q_lora_rank, q_out)
        self.kv_a_proj_with_mqa = kit.linear(hidden, config.latent_dim, bias=bias)
        self.kv_a_layernorm = kit.rms_norm(config.kv_lora_rank, 1e-6)
        kv_b_out = heads * (config.qk_nope_head_dim + config.v_head_dim)
        # absorbed into the queries and the output: only its weight is read, never a product
        # (a stored FP8 weight is widened once, at `place`: see `absorb`)
        self.kv_b_proj = StoredLinear(config.kv_lora_rank, kv_b_out, bias=False)
        self.absorbed: torch.Tensor | None = None
        self.o_proj = kit.linear(heads * config.v_head_dim, hidden, bias=bias)
        self.attention = kit.cache_attention(1, config.softmax_scale)

    def absorb(self) -> None:
        """Widen a stored (FP8) `kv_b_proj` once, in the dtype it is read in: the absorbed
        products read each head's slice of it transposed, which no stored product does, and
        it is small (V3: 1 of 671 B parameters), so the copy costs little memory and spares
        a widening per layer and launch. Same bits as widening at each read."""
        self.absorbed = self.kv_b_proj.weight if self.kv_b_proj.stored is not None else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        launch: LaunchInputs,
        cache: KVCache | None,
    ) -> torch.Tensor:
        c = self.config
        batch, seq, _ = x.shape
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, seq, c.num_heads, c.qk_head_dim)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [c.kv_lora_rank, c.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent)
        k_rope = k_rope[:, :, None, :]
        if c.rope_interleave:
            half = c.qk_rope_head_dim // 2
            q_rope = rotate_interleaved(q_rope, cos[..., :half], sin[..., :half])
            k_rope = rotate_interleaved(k_rope, cos[..., :half], sin[..., :half])
        else:
            q_rope, k_rope = rotate_half(q_rope, cos, sin), rotate_half(k_rope, cos, sin)
        w_kv = self.absorbed if self.absorbed is not None else self.kv_b_proj.weight
        w_kv = w_kv.view(c.num_heads, -1, c.kv_lora_rank)
        w_uk, w_uv = w_kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
        q_latent = torch.einsum("bshn,hnc->bshc", q_nope, w_uk)
        query = torch.cat((q_latent, q_rope), dim=-1)
        key = torch.cat((latent[:, :, None, :], k_rope), dim=-1)
        if cache is None:  # fitting an MTP layer: whole sequences, no cache
            keys = key.transpose(1, 2)
            values, visible = keys[..., : c.kv_lora_rank], causal_mask(launch.positions, seq)
            out = attend(query, keys, values, visible, num_kv_heads=1, scale=c.softmax_scale)
        else:
            values = key[..., : c.kv_lora_rank]
            out = self.attention(query, key, values, cache, self.layer, launch)
        out = torch.einsum("bshc,hvc->bshv", out, w_uv)
        return self.o_proj(out.reshape(batch, seq, c.num_heads * c.v_head_dim))


class Router(nn.Module):
    """Grouped top-k over sigmoid scores, in float32 (`mlp.gate.*`)."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    e_score_correction_bias: torch.Tensor

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> Routes:
        """Each token's top-k experts and weights (padding tokens route nowhere)."""
        c = self.config
        scores = torch.nn.functional.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        per_group = choice.view(-1, c.n_group, c.n_routed_experts // c.n_group)
        group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(c.topk_group, dim=-1, sorted=False)[1]
        in_group = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
        allowed = in_group[:, :, None].expand_as(per_group).reshape(-1, c.n_routed_experts)
        chosen = choice.masked_fill(~allowed, float("-inf"))
        top = chosen.topk(c.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, top)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return routes(top, weights * c.routed_scaling_factor, valid)


class MoE(ExpertBlock):
    """Routed experts (this rank's share, `mlp.experts.{e}.*`) plus the shared experts."""

    def __init__(self, config: DeepseekV3Config, share: range, kit: LayerKit) -> None:
        super().__init__()
        self.share = share
        self.gate = Router(config)
        size, inner = config.hidden_size, config.moe_intermediate_size
        self.experts = nn.ModuleDict({str(e): GatedMLP(size, inner, kit) for e in share})
        self.routed = RoutedExperts(self.experts, share, kit)
        self.shared_experts = (
            GatedMLP(size, inner * config.n_shared_experts, kit)
            if config.n_shared_experts
            else None
        )
        self.group: ExpertGroup = LocalExperts()

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        route = self.gate(flat, valid)
        out = self.routed(flat, route, self.group).view(x.shape)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV3Config, layer: int, share: range, kit: LayerKit) -> None:
        super().__init__()
        self.self_attn = LatentAttention(config, layer, kit)
        self.mlp: nn.Module = (
            MoE(config, share, kit)
            if config.is_moe_layer(layer)
            else GatedMLP(config.hidden_size, config.intermediate_size, kit)
        )
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
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            scratch = cache.scratch_position if cache is not None else launch.positions.max() + 1
            return x + self.mlp(h, (launch.positions < scratch).reshape(-1))
        return x + self.mlp(h)


class Backbone(nn.Module):
    def __init__(self, config: DeepseekV3Config, share: range, kit: LayerKit) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, share, kit) for i in range(config.num_layers)
        )
        self.norm = kit.rms_norm(config.hidden_size, config.rms_norm_eps)


class SharedHead(nn.Module):
    def __init__(self, config: DeepseekV3Config, kit: LayerKit) -> None:
        super().__init__()
        self.norm = kit.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.head = kit.linear(config.hidden_size, config.vocab_size)


class MTPLayer(nn.Module):
    """The checkpoint's multi-token-prediction layer: from the final hidden state at
    position i and the embedding of token i+1, one decoder block predicts token i+2. Its
    block keeps its own cache layer (index `num_layers`)."""

    def __init__(self, config: DeepseekV3Config, share: range, kit: LayerKit) -> None:
        super().__init__()
        self.enorm = kit.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = kit.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = kit.linear(2 * config.hidden_size, config.hidden_size)
        self.block = DecoderLayer(config, config.num_layers, share, kit)
        self.shared_head = SharedHead(config, kit)


class DeepseekV3CausalLM(LaunchModel[KVCache], ExpertModel):
    """Decoder + LM head (+ the MTP layer); each call runs one fixed-shape launch. Its
    layers come from `kit` (plain torch layers by default)."""

    decode_rows_pack = True

    def __init__(
        self,
        config: DeepseekV3Config,
        max_positions: int,
        with_mtp: bool = False,
        experts: range | None = None,
        kit: LayerKit | None = None,
    ) -> None:
        super().__init__()
        share = range(config.n_routed_experts) if experts is None else experts
        kit = kit or TorchKit()
        self.config, self.kit = config, kit
        self.model = Backbone(config, share, kit)
        self.lm_head = kit.linear(config.hidden_size, config.vocab_size)
        self.mtp = MTPLayer(config, share, kit) if with_mtp else None
        cos, sin = rope_tables(config, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    mtp: MTPLayer | None
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def moe_layers(self) -> list[MoE]:
        """Every MoE block, the MTP layer's included."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def output_head(self) -> nn.Linear:
        """`lm_head`."""
        return self.lm_head

    def input_embeddings(self) -> nn.Embedding:
        """`model.embed_tokens`."""
        return self.model.embed_tokens

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move to `device` in `dtype`; the rotary tables and the routers in float32."""
        self.to(device=device, dtype=dtype).eval()
        self.rope_cos, self.rope_sin = self.rope_cos.float(), self.rope_sin.float()
        for module in self.modules():
            if isinstance(module, LatentAttention):
                module.absorb()
        for moe in self.moe_layers():
            moe.gate.float()  # routing stays in float32 whatever the weights' dtype

    def new_state(
        self, num_slots: int, max_kv_len: int, block_size: int = 0, num_blocks: int = 0
    ) -> KVCache:
        """The latent cache: one [slots, 1, positions + 1, kv_lora_rank + qk_rope_head_dim]
        buffer per layer (and the MTP block's), values a view of its first channels."""
        weight = self.input_embeddings().weight  # the model's dtype and device
        layers = self.config.num_layers + (1 if self.mtp is not None else 0)
        c = self.config
        return KVCache(
            layers,
            num_slots,
            max_kv_len,
            1,
            c.latent_dim,
            weight.dtype,
            weight.device,
            value_dim=c.kv_lora_rank,
            values_in_keys=True,
            block_size=block_size,
            num_blocks=num_blocks,
        )

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every token's rotation, [B, S, 1, qk_rope_head_dim]."""
        return self.rope_cos[positions][:, :, None, :], self.rope_sin[positions][:, :, None, :]

    @torch.inference_mode()
    def forward(self, launch: LaunchInputs, state: KVCache) -> LaunchOutput:
        cos, sin = self.rope(launch.positions)
        x = self.model.embed_tokens(launch.input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, launch, state)
        hidden = self.model.norm(x)
        rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None]
        logits = self.lm_head(hidden[rows, launch.logit_index]).float()
        return LaunchOutput(logits, hidden)

    @torch.inference_mode()
    def draft(self, launch: LaunchInputs, hidden: torch.Tensor, state: KVCache) -> torch.Tensor:
        """MTP logits [B, K, vocab]: `launch.input_ids` hold token i+1 for each hidden state i."""
        if self.mtp is None:
            raise RuntimeError("this model has no MTP layer")
        mtp = self.mtp
        cos, sin = self.rope(launch.positions)
        embedded = self.model.embed_tokens(launch.input_ids)
        x = mtp.eh_proj(torch.cat((mtp.enorm(embedded), mtp.hnorm(hidden)), dim=-1))
        x = mtp.shared_head.norm(mtp.block(x, cos, sin, launch, state))
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        return mtp.shared_head.head(x[rows, launch.logit_index]).float()
