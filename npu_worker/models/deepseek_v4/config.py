"""DeepSeek-V4's checkpoint as the model reads it: `config.json` (layer types, compress rates,
the `main` and `compress` RoPE parameters), the rotary tables they imply, the names of its
tensors, and how many bytes of per-request state one KV slot takes."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from npu_worker.models.config import UnsupportedModel, eos_ids

ARCHITECTURE = "DeepseekV4ForCausalLM"
MODEL_TYPE = "deepseek_v4"
SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
LAYER_TYPES = (SLIDING, CSA, HCA)
SCORING = ("sqrtsoftplus", "sigmoid", "softmax")
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "n_routed_experts",
    "num_experts_per_tok",
    "sliding_window",
    "o_groups",
    "o_lora_rank",
)


@dataclass(frozen=True, slots=True)
class Rope:
    """One rotary table's parameters: base, YaRN (empty when plain) and cos/sin scale."""

    theta: float
    yarn: dict[str, float] = field(default_factory=dict)
    attention_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class DeepseekV4Config:
    """Architecture hyper-parameters of a DeepSeek-V4 decoder."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int  # the trailing channels of each head that rotate
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    hash_layers: tuple[bool, ...]  # per layer: experts chosen by token id (`hash_moe`)
    csa_rate: int
    hca_rate: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    rms_norm_eps: float
    main_rope: Rope
    compress_rope: Rope
    tie_word_embeddings: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    mtp_layers: int = 0
    architecture: str = ARCHITECTURE

    def layer_kind(self, layer: int) -> str:
        """A layer's attention type; the MTP block (layer `num_layers`) is sliding-window."""
        return self.layer_types[layer] if layer < self.num_layers else SLIDING

    def hashed(self, layer: int) -> bool:
        """Whether a layer's experts are chosen by token id; the MTP block's are scored."""
        return layer < self.num_layers and self.hash_layers[layer]

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of a layer (0 for sliding-window layers)."""
        kind = self.layer_kind(layer)
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[kind]

    @classmethod
    def from_dir(cls, path: Path) -> DeepseekV4Config:
        """Parse `config.json` (+ `generation_config.json` for EOS ids)."""
        raw: dict[str, Any] = json.loads((path / "config.json").read_text())
        missing = [k for k in REQUIRED if k not in raw]
        if missing:
            raise UnsupportedModel(f"{path}/config.json lacks {', '.join(missing)}")
        layers = int(raw["num_hidden_layers"])
        quant = raw.get("quantization_config") or {}
        expert_dtype = raw.get("expert_dtype") or quant.get("expert_dtype")
        if expert_dtype not in (None, "bf16", "bfloat16", "fp8", "fp4"):
            raise UnsupportedModel(
                f"{path}: routed experts stored as {expert_dtype!r} (expert_dtype) are not "
                "supported; supported: bfloat16, FP8 e4m3 blocks and MXFP4 (fp4) experts"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"{path}: hidden_act {raw['hidden_act']!r} (only 'silu')")
        scoring = str(raw.get("scoring_func", "sqrtsoftplus"))
        if scoring not in SCORING:
            raise UnsupportedModel(f"{path}: scoring_func {scoring!r} not one of {SCORING}")
        layer_types = tuple(raw.get("layer_types") or ())
        rates = {CSA: 4, HCA: 128, **(raw.get("compress_rates") or {})}
        if not layer_types and raw.get("compress_ratios"):
            layer_types, rates = _from_compress_ratios(path, raw["compress_ratios"][:layers], rates)
        bad = [t for t in layer_types if t not in LAYER_TYPES]
        if len(layer_types) != layers or bad:
            raise UnsupportedModel(
                f"{path}: layer_types must name {layers} layers from {LAYER_TYPES}, got "
                f"{list(layer_types)}"
            )
        mlp_types = list(raw.get("mlp_layer_types") or [])
        if not mlp_types:
            hashed = int(raw.get("num_hash_layers", 3))
            mlp_types = ["hash_moe"] * hashed + ["moe"] * (layers - hashed)
        head_dim = int(raw["head_dim"])
        rope_dim = raw.get("qk_rope_head_dim") or head_dim * float(
            raw.get("partial_rotary_factor") or 64 / 512
        )
        main, compress = rope_parameters(raw)
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            num_layers=layers,
            num_heads=int(raw["num_attention_heads"]),
            head_dim=head_dim,
            rope_dim=int(rope_dim),
            q_lora_rank=int(raw["q_lora_rank"]),
            o_groups=int(raw["o_groups"]),
            o_lora_rank=int(raw["o_lora_rank"]),
            layer_types=layer_types,
            hash_layers=tuple(t == "hash_moe" for t in mlp_types[:layers]),
            csa_rate=int(rates[CSA]),
            hca_rate=int(rates[HCA]),
            sliding_window=int(raw["sliding_window"]),
            index_n_heads=int(raw.get("index_n_heads", 64)),
            index_head_dim=int(raw.get("index_head_dim", 128)),
            index_topk=int(raw.get("index_topk", 512)),
            hc_mult=int(raw.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(raw.get("hc_eps", 1e-6)),
            n_routed_experts=int(raw["n_routed_experts"]),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            scoring_func=scoring,
            swiglu_limit=float(raw.get("swiglu_limit") or math.inf),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            main_rope=main,
            compress_rope=compress,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            eos_token_ids=eos_ids(path, raw),
            mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
        )


def _from_compress_ratios(
    path: Path, ratios: list[Any], rates: dict[str, int]
) -> tuple[tuple[str, ...], dict[str, int]]:
    """Layer types and rates from DeepSeek's release form, one `compress_ratios` entry per
    layer (the MTP block's trailing one dropped): 0 a sliding layer, the CSA rate (4) a CSA
    layer, any other rate an HCA layer, as DeepSeek's own inference code reads them."""
    try:
        values = [int(r) for r in ratios]
    except (TypeError, ValueError):
        raise UnsupportedModel(f"{path}: compress_ratios {ratios!r} are not integers") from None
    heavy = sorted({r for r in values if r not in (0, rates[CSA])})
    if len(heavy) > 1 or any(r < 0 for r in values):
        raise UnsupportedModel(
            f"{path}: compress_ratios {values} name rates {heavy}; one HCA rate besides the "
            f"CSA rate {rates[CSA]} is supported"
        )
    if heavy:
        rates = {**rates, HCA: heavy[0]}
    kinds = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
    return tuple(kinds[r] for r in values), rates


def rope_parameters(raw: dict[str, Any]) -> tuple[Rope, Rope]:
    """The `main` (sliding layers) and `compress` (CSA/HCA layers) rotary parameters, as
    nested `rope_parameters` or the flat form (YaRN applying to the compress rope only)."""
    given = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if isinstance(given.get("main"), dict) and isinstance(given.get("compress"), dict):
        main, compress = dict(given["main"]), dict(given["compress"])
    else:
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        compress = {k: v for k, v in given.items() if k not in ("main", "compress")}
        compress["rope_theta"] = raw.get("compress_rope_theta", 160000.0)
    return _rope(main, raw), _rope(compress, raw)


def _rope(params: dict[str, Any], raw: dict[str, Any]) -> Rope:
    kind = str(params.get("rope_type") or params.get("type") or "default")
    theta = float(params.get("rope_theta") or 10000.0)
    if kind == "default":
        return Rope(theta)
    if kind != "yarn":
        raise UnsupportedModel(f"RoPE type {kind!r} not supported for DeepSeek-V4 (yarn, default)")
    yarn = {k: float(v) for k, v in params.items() if isinstance(v, int | float)}
    original = yarn["original_max_position_embeddings"]
    factor = yarn.get("factor") or float(raw["max_position_embeddings"]) / original
    yarn["factor"] = factor
    # DeepSeek's reference never scales V4's cos/sin: only a factor the config names does
    factor_of = yarn.get("attention_factor")
    if factor_of is None:
        mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
        factor_of = 1.0
        if mscale and mscale_all_dim:
            factor_of = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
    return Rope(theta, yarn, factor_of)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_table(rope: Rope, dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions + 1, dim / 2], one angle per interleaved pair, YaRN's blend of
    extrapolated and interpolated frequencies applied."""
    inv_freq = 1.0 / rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.yarn:
        factor, original = rope.yarn["factor"], rope.yarn["original_max_position_embeddings"]
        fast, slow = rope.yarn.get("beta_fast") or 32.0, rope.yarn.get("beta_slow") or 1.0

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

        low = max(math.floor(correction_dim(fast)), 0)
        high = min(math.ceil(correction_dim(slow)), dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)
        keep = 1 - ramp.clamp(0, 1)
        inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
    angles = torch.outer(torch.arange(max_positions + 1, dtype=torch.float32), inv_freq)
    return angles.cos() * rope.attention_factor, angles.sin() * rope.attention_factor


def checkpoint_name(key: str) -> str:
    """This model's name for a checkpoint tensor: transformers' saved names as they are,
    DeepSeek's own release names (`embed.`, `layers.`, `norm.`, `hc_head_*`) mapped to them."""
    if key.startswith(("embed.", "layers.", "norm.")):
        key = "model." + key.replace("embed.", "embed_tokens.", 1)
    for part in ("fn", "base", "scale"):
        if key == f"hc_head_{part}":
            return f"model.hc_head.hc_{part}"
    return key


def expert_of(key: str) -> int | None:
    """The routed expert a checkpoint tensor belongs to (`...ffn.experts.{e}....`), if any."""
    parts = key.split(".")
    for i in range(len(parts) - 2):
        if parts[i] == "ffn" and parts[i + 1] == "experts":
            return int(parts[i + 2])
    return None


def state_elements_per_slot(
    config: DeepseekV4Config, max_kv_len: int, mtp: bool = False
) -> dict[str, int]:
    """Elements of per-request state one slot holds, by kind, over every layer (each buffer's
    scratch row included): the sliding window (W + 1 rows: one more than the window, so a
    draft under verification never overwrites a row still in view), compressed entries
    (max_kv_len // rate + 1 rows), and each compressor's projections of its last window(s)
    (kv and gate: 2 windows of the CSA rate for overlapping windows, 1 of the HCA rate);
    with `mtp`, the MTP block's sliding window too."""
    d, di = config.head_dim, config.index_head_dim
    counts = {"window": 0, "entries": 0, "index_keys": 0, "compressor": 0}
    for layer in range(config.num_layers + (1 if mtp else 0)):
        counts["window"] += (config.sliding_window + 2) * d
        rate = config.rate(layer)
        if not rate:
            continue
        counts["entries"] += (max_kv_len // rate + 1) * d
        if config.layer_kind(layer) == CSA:
            counts["index_keys"] += (max_kv_len // rate + 1) * di
            counts["compressor"] += (2 * rate + 1) * 2 * (2 * d + 2 * di)
        else:
            counts["compressor"] += (rate + 1) * 2 * d
    return counts


def state_elements_in_blocks(
    config: DeepseekV4Config, block_size: int, mtp: bool = False
) -> tuple[int, int]:
    """In a cache of blocks: the elements a slot holds whatever its length (its window and
    compressor rings) and those one block of `block_size` positions holds (each compressed
    layer's `block_size // rate` entries, and CSA's index keys). A request of n positions
    holds the first plus ceil(n / block_size) of the second."""
    counts = state_elements_per_slot(config, 0, mtp)
    fixed = counts["window"] + counts["compressor"]
    d, di = config.head_dim, config.index_head_dim
    per_block = 0
    for layer in range(config.num_layers + (1 if mtp else 0)):
        rate = config.rate(layer)
        if rate:
            width = d + (di if config.layer_kind(layer) == CSA else 0)
            per_block += block_size // rate * width
    return fixed, per_block
