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
  first `first_k_dense_replace` layers dense (`moe.py`: fixed shapes, expert parallelism).
- The MTP layer (`model.layers.{num_hidden_layers}` in a checkpoint): `enorm`, `hnorm`,
  `eh_proj`, one decoder block and `shared_head`, loaded as `mtp.*`.

Module names follow the checkpoint, so its state dict loads as it is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from npu_worker.models.config import UnsupportedModel, eos_ids
from npu_worker.models.launch import KVCache, LaunchInputs, LaunchModel, LaunchOutput
from npu_worker.models.layers import (
    RMSNorm,
    attend,
    cached_keys,
    causal_mask,
    rotate_half,
    rotate_interleaved,
)
from npu_worker.models.moe import ExpertGroup, GatedMLP, LocalExperts, routed_output

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
)


@dataclass(frozen=True, slots=True)
class DeepseekV3Config:
    """Architecture hyper-parameters of a DeepSeek-V3 decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    rope_theta: float
    rope_interleave: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    rope: dict[str, float] = field(default_factory=dict)  # YaRN parameters, if any
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    mtp_layers: int = 0
    architecture: str = ARCHITECTURE

    @property
    def qk_head_dim(self) -> int:
        """Query/key channels per head: the non-rotary part plus the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cache channels per token and layer: the KV latent plus the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim) squared."""
        scale = self.qk_head_dim**-0.5
        mscale_all_dim = self.rope.get("mscale_all_dim", 0.0)
        if self.rope and mscale_all_dim:
            scale *= yarn_mscale(self.rope["factor"], mscale_all_dim) ** 2
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        """Layers from `first_k_dense_replace` on route through experts."""
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_dir(cls, path: Path) -> DeepseekV3Config:
        """Parse `config.json` (+ `generation_config.json` for EOS ids)."""
        raw: dict[str, Any] = json.loads((path / "config.json").read_text())
        missing = [k for k in REQUIRED if k not in raw]
        if missing:
            raise UnsupportedModel(f"{path}/config.json lacks {', '.join(missing)}")
        for key, wanted in (("hidden_act", "silu"), ("scoring_func", "sigmoid")):
            if raw.get(key, wanted) != wanted:
                raise UnsupportedModel(
                    f"{path}: {key} {raw[key]!r} not supported by DeepSeek-V3 (only {wanted!r})"
                )
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = str(rope.pop("rope_type", None) or rope.pop("type", None) or "default")
        if rope_type not in ("default", "yarn"):
            raise UnsupportedModel(f"{path}: RoPE type {rope_type!r} not supported (yarn, default)")
        rope_theta = float(rope.pop("rope_theta", None) or raw.get("rope_theta", 10000.0))
        yarn = {k: float(v) for k, v in rope.items() if isinstance(v, int | float)}
        if rope_type == "yarn" and "factor" not in yarn:
            yarn["factor"] = (
                float(raw["max_position_embeddings"]) / yarn["original_max_position_embeddings"]
            )
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            n_routed_experts=int(raw["n_routed_experts"]),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_interleave=bool(raw.get("rope_interleave", True)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            rope=yarn if rope_type == "yarn" else {},
            eos_token_ids=eos_ids(path, raw),
            mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
        )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(config: DeepseekV3Config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, qk_rope_head_dim] (both halves alike), YaRN applied: the
    frequencies blended between extrapolation and interpolation over the correction range,
    and cos/sin scaled by the attention factor."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / base**exponents
    attention_factor = 1.0
    if config.rope:
        yarn = config.rope
        factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
        fast, slow = yarn.get("beta_fast") or 32.0, yarn.get("beta_slow") or 1.0

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(fast)), 0)
        high = min(math.ceil(correction_dim(slow)), dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)
        keep = 1 - ramp.clamp(0, 1)  # 1: extrapolate (high frequencies), 0: interpolate
        inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
        mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    freqs = torch.outer(torch.arange(max_positions + 1, dtype=torch.float32), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


class LatentAttention(nn.Module):
    """MLA over a latent cache, `kv_b_proj` absorbed into the query and the output."""

    def __init__(self, config: DeepseekV3Config, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        hidden, heads, bias = config.hidden_size, config.num_heads, config.attention_bias
        q_out = heads * config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, 1e-6)
        kv_b_out = heads * (config.qk_nope_head_dim + config.v_head_dim)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, kv_b_out, bias=False)
        self.o_proj = nn.Linear(heads * config.v_head_dim, hidden, bias=bias)

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
        w_kv = self.kv_b_proj.weight.view(c.num_heads, -1, c.kv_lora_rank)
        w_uk, w_uv = w_kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
        q_latent = torch.einsum("bshn,hnc->bshc", q_nope, w_uk)
        query = torch.cat((q_latent, q_rope), dim=-1)
        key = torch.cat((latent[:, :, None, :], k_rope), dim=-1)
        if cache is None:  # fitting an MTP layer: whole sequences, no cache
            keys = key.transpose(1, 2)
            values, visible = keys[..., : c.kv_lora_rank], causal_mask(launch.positions, seq)
        else:
            keys, values, visible = cached_keys(
                cache.k[self.layer], cache.v[self.layer], key, key[..., : c.kv_lora_rank], launch
            )
        out = attend(query, keys, values, visible, num_kv_heads=1, scale=c.softmax_scale)
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

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Dense routing weights [T, E]: each valid token's top-k experts, zero elsewhere
        (padding tokens route nowhere)."""
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
        weights = weights * c.routed_scaling_factor * valid[:, None]
        return torch.zeros_like(scores).scatter_(1, top, weights)


class MoE(nn.Module):
    """Routed experts (this rank's share, `mlp.experts.{e}.*`) plus the shared experts."""

    def __init__(self, config: DeepseekV3Config, share: range) -> None:
        super().__init__()
        self.share = share
        self.gate = Router(config)
        size, inner = config.hidden_size, config.moe_intermediate_size
        self.experts = nn.ModuleDict({str(e): GatedMLP(size, inner) for e in share})
        self.shared_experts = (
            GatedMLP(size, inner * config.n_shared_experts) if config.n_shared_experts else None
        )
        self.group: ExpertGroup = LocalExperts()

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights = self.gate(flat, valid)
        out = routed_output(self.experts, self.share, flat, weights, self.group).view(x.shape)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV3Config, layer: int, share: range) -> None:
        super().__init__()
        self.self_attn = LatentAttention(config, layer)
        self.mlp: nn.Module = (
            MoE(config, share)
            if config.is_moe_layer(layer)
            else GatedMLP(config.hidden_size, config.intermediate_size)
        )
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
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            scratch = cache.scratch_position if cache is not None else launch.positions.max() + 1
            return x + self.mlp(h, (launch.positions < scratch).reshape(-1))
        return x + self.mlp(h)


class Backbone(nn.Module):
    def __init__(self, config: DeepseekV3Config, share: range) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, share) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class SharedHead(nn.Module):
    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(nn.Module):
    """The checkpoint's multi-token-prediction layer: from the final hidden state at
    position i and the embedding of token i+1, one decoder block predicts token i+2. Its
    block keeps its own cache layer (index `num_layers`)."""

    def __init__(self, config: DeepseekV3Config, share: range) -> None:
        super().__init__()
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.block = DecoderLayer(config, config.num_layers, share)
        self.shared_head = SharedHead(config)


class DeepseekV3CausalLM(LaunchModel):
    """Decoder + LM head (+ the MTP layer); each call runs one fixed-shape launch."""

    def __init__(
        self,
        config: DeepseekV3Config,
        max_positions: int,
        with_mtp: bool = False,
        experts: range | None = None,
    ) -> None:
        super().__init__()
        share = range(config.n_routed_experts) if experts is None else experts
        self.config = config
        self.model = Backbone(config, share)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = MTPLayer(config, share) if with_mtp else None
        cos, sin = rope_tables(config, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    mtp: MTPLayer | None
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def moe_layers(self) -> list[MoE]:
        """Every MoE block, the MTP layer's included."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def use_experts(self, group: ExpertGroup) -> None:
        """Split the routed experts over `group` (each rank holds its share)."""
        for moe in self.moe_layers():
            moe.group = group

    def tie_weights(self) -> None:
        """Share the embedding with the head, for tied checkpoints."""
        self.lm_head.weight = self.model.embed_tokens.weight

    def new_cache(self, num_slots: int, max_kv_len: int) -> KVCache:
        """The latent cache: one [slots, 1, positions + 1, kv_lora_rank + qk_rope_head_dim]
        buffer per layer (and the MTP block's), values a view of its first channels."""
        weight = self.lm_head.weight
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
        )

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every token's rotation, [B, S, 1, qk_rope_head_dim]."""
        return self.rope_cos[positions][:, :, None, :], self.rope_sin[positions][:, :, None, :]

    @torch.inference_mode()
    def forward(self, launch: LaunchInputs, cache: KVCache) -> LaunchOutput:
        cos, sin = self.rope(launch.positions)
        x = self.model.embed_tokens(launch.input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, launch, cache)
        hidden = self.model.norm(x)
        rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None]
        logits = self.lm_head(hidden[rows, launch.logit_index]).float()
        return LaunchOutput(logits, hidden)

    @torch.inference_mode()
    def draft(self, launch: LaunchInputs, hidden: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """MTP logits [B, K, vocab]: `launch.input_ids` hold token i+1 for each hidden state i."""
        if self.mtp is None:
            raise RuntimeError("this model has no MTP layer")
        mtp = self.mtp
        cos, sin = self.rope(launch.positions)
        embedded = self.model.embed_tokens(launch.input_ids)
        x = mtp.eh_proj(torch.cat((mtp.enorm(embedded), mtp.hnorm(hidden)), dim=-1))
        x = mtp.shared_head.norm(mtp.block(x, cos, sin, launch, cache))
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        return mtp.shared_head.head(x[rows, launch.logit_index]).float()


def checkpoint_name(key: str, config: DeepseekV3Config) -> str | None:
    """This model's name for a checkpoint tensor: the MTP layer `model.layers.{N}.*` as
    `mtp.*` (its block's parts as `mtp.block.*`); None for the copies it shares with the
    main model (`embed_tokens`)."""
    prefix = f"model.layers.{config.num_layers}."
    if not key.startswith(prefix):
        return key
    rest = key[len(prefix) :]
    if rest.startswith("embed_tokens."):
        return None
    if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head"):
        return "mtp." + rest
    return "mtp.block." + rest


def expert_of(key: str) -> int | None:
    """The routed expert a checkpoint tensor belongs to (`...mlp.experts.{e}....`), if any."""
    parts = key.split(".")
    for i in range(len(parts) - 2):
        if parts[i] == "mlp" and parts[i + 1] == "experts":
            return int(parts[i + 2])
    return None
