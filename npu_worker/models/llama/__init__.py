"""The Llama family (Llama, Mistral, Qwen2): GQA, RoPE, RMSNorm, SwiGLU, tied or untied
head, and the optional DeepSeek-style MTP module (model.py; its config: config.py)."""

from __future__ import annotations

from pathlib import Path

from npu_worker.models.config import UnsupportedModel
from npu_worker.models.family import AsStored, Family, Placement
from npu_worker.models.kit import LayerKit
from npu_worker.models.llama.config import MODEL_TYPES, SUPPORTED_ARCHITECTURES, LlamaConfig
from npu_worker.models.llama.model import CausalLM


def build(
    config: LlamaConfig, max_positions: int, mtp: bool, experts: range, kit: LayerKit
) -> CausalLM:
    """The decoder and head (+ MTP module)."""
    return CausalLM(config, max_positions, with_mtp=mtp, kit=kit)


def placement(config: LlamaConfig, experts: range, mtp: bool) -> Placement:
    """Hugging Face names, as the model's."""
    return AsStored()


def check(config: LlamaConfig, path: Path, max_kv_len: int) -> None:
    """Sliding-window attention is served only within one window."""
    if config.sliding_window is not None and max_kv_len > config.sliding_window:
        raise UnsupportedModel(
            f"{path}: sliding-window attention ({config.sliding_window} tokens) is not "
            f"supported; use --max-model-len {config.sliding_window} or less"
        )


FAMILY = Family(
    name="llama",
    architectures=tuple(sorted(SUPPORTED_ARCHITECTURES)),
    model_types=tuple(MODEL_TYPES),
    read_config=LlamaConfig.from_dir,
    build=build,
    placement=placement,
    check=check,
)
