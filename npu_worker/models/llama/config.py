"""A Llama-family config.json (Llama, Mistral, Qwen2) read into the facts the model needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from npu_worker.models.config import UnsupportedModel, eos_ids

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
MODEL_TYPES = {  # `model_type` -> architecture, for configs that list no `architectures`
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Architecture hyper-parameters of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    rope_type: str = "default"
    rope_scaling: dict[str, float] = field(default_factory=dict)
    sliding_window: int | None = None
    mtp_layers: int = 0

    @classmethod
    def from_dir(cls, path: Path) -> LlamaConfig:
        """Parse `config.json` (+ `generation_config.json` for EOS ids) in a model directory."""
        config_path = path / "config.json"
        if not config_path.exists():
            raise UnsupportedModel(f"{path} has no config.json")
        raw: dict[str, Any] = json.loads(config_path.read_text())
        architectures = raw.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not architectures:
            arch = MODEL_TYPES.get(str(raw.get("model_type")))
        if arch is None:
            raise UnsupportedModel(
                f"{config_path}: architectures {architectures} (model_type "
                f"{raw.get('model_type')!r}) not supported; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES | {'DeepseekV3ForCausalLM'})}"
            )
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in raw
        ]
        if missing:
            raise UnsupportedModel(f"{config_path} lacks {', '.join(missing)}")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = str(rope.pop("rope_type", None) or rope.pop("type", None) or "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModel(
                f"{config_path}: RoPE type {rope_type!r} not supported; "
                f"supported: {sorted(SUPPORTED_ROPE_TYPES)}"
            )
        rope_theta = float(rope.pop("rope_theta", None) or raw.get("rope_theta", 10000.0))
        use_window = raw.get("use_sliding_window", arch == "MistralForCausalLM")
        num_heads = int(raw["num_attention_heads"])
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids(path, raw),
            rope_type=rope_type,
            rope_scaling={k: float(v) for k, v in rope.items() if isinstance(v, int | float)},
            mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
            sliding_window=int(raw["sliding_window"])
            if use_window and raw.get("sliding_window")
            else None,
        )
