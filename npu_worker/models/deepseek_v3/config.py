"""DeepSeek-V3's checkpoint as the model reads it: `config.json` (with YaRN), the rotary
tables it implies, and the names of its tensors (the MTP layer, each routed expert)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from npu_worker.models.config import UnsupportedModel, eos_ids

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
