"""Loading a model directory (config, safetensors shards, tokenizer) onto a device."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from npu_worker.models.config import ModelConfig, UnsupportedModel
from npu_worker.models.llama import CausalLM

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(slots=True)
class LoadedModel:
    """A model on its device with its tokenizer and the facts the pool needs."""

    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    chat_template: dict[str, str] | None = None


def load_model(
    path: Path, dtype_name: str, device: torch.device, max_kv_len: int, mtp: bool = False
) -> LoadedModel:
    """Build the model from `path` and load its weights; raises UnsupportedModel with the reason.

    With `mtp`, the checkpoint's MTP module (`mtp.*`, `num_nextn_predict_layers: 1`) is
    loaded too; without it, MTP weights are ignored.
    """
    config = ModelConfig.from_dir(path)
    if mtp and config.mtp_layers != 1:
        raise UnsupportedModel(
            f"{path}: --mtp needs an MTP module with num_nextn_predict_layers: 1 "
            f"(config has {config.mtp_layers})"
        )
    if config.sliding_window is not None and max_kv_len > config.sliding_window:
        raise UnsupportedModel(
            f"{path}: sliding-window attention ({config.sliding_window} tokens) is not "
            f"supported; use --max-model-len {config.sliding_window} or less"
        )
    tokenizer_path = path / "tokenizer.json"
    if not tokenizer_path.exists():
        raise UnsupportedModel(f"{path} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    dtype = (
        DTYPES.get(config.torch_dtype, torch.float32)
        if dtype_name == "auto"
        else DTYPES[dtype_name]
    )
    if dtype == torch.float16 and device.type == "cpu":
        dtype = torch.bfloat16
    model = CausalLM(config, max_positions=max_kv_len, with_mtp=mtp)
    state = _read_weights(path)
    if not mtp:
        state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    if config.tie_word_embeddings or "lm_head.weight" not in state:
        state.pop("lm_head.weight", None)
        model.tie_weights()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not _is_tied(model)]
    if missing:
        raise UnsupportedModel(f"{path}: weights missing from the checkpoint: {missing[:8]}")
    unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise UnsupportedModel(f"{path}: unexpected weights in the checkpoint: {unexpected[:8]}")
    model.to(device=device, dtype=dtype).eval()
    model.rope_cos = model.rope_cos.float()
    model.rope_sin = model.rope_sin.float()
    return LoadedModel(path, config, model, tokenizer, dtype, device, read_chat_template(path))


def read_chat_template(path: Path) -> dict[str, str] | None:
    """The model's chat template and its special tokens, as Hugging Face directories keep
    them (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`)."""
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    jinja = path / "chat_template.jinja"
    template = jinja.read_text() if jinja.exists() else config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one serves chat
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        return None
    return {
        "template": template,
        "bos_token": _token_text(config.get("bos_token")),
        "eos_token": _token_text(config.get("eos_token")),
    }


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _is_tied(model: CausalLM) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{path} holds no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state
