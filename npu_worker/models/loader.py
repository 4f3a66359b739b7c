"""Loading a model directory (config, safetensors shards, tokenizer) onto a device."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from npu_worker.devices import auto_dtype
from npu_worker.models import deepseek_v3_config as deepseek_v3
from npu_worker.models import deepseek_v4_config as deepseek_v4
from npu_worker.models.config import ModelConfig, UnsupportedModel
from npu_worker.models.deepseek_v3 import DeepseekV3CausalLM
from npu_worker.models.deepseek_v3_config import DeepseekV3Config
from npu_worker.models.deepseek_v4 import DeepseekV4CausalLM
from npu_worker.models.deepseek_v4_config import DeepseekV4Config
from npu_worker.models.llama import CausalLM
from npu_worker.models.moe import expert_share
from npu_worker.models.weights import read_weights

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
    config: ModelConfig | DeepseekV3Config | DeepseekV4Config
    model: CausalLM | DeepseekV3CausalLM | DeepseekV4CausalLM
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    chat_template: dict[str, str] | None = None


def model_config(path: Path) -> ModelConfig | DeepseekV3Config | DeepseekV4Config:
    """The architecture and hyper-parameters of a model directory; UnsupportedModel says
    what is missing or not supported."""
    config_path = path / "config.json"
    if not config_path.exists():
        raise UnsupportedModel(f"{path} has no config.json")
    raw = json.loads(config_path.read_text())
    if deepseek_v3.ARCHITECTURE in (raw.get("architectures") or []) or (
        not raw.get("architectures") and raw.get("model_type") == deepseek_v3.MODEL_TYPE
    ):
        return DeepseekV3Config.from_dir(path)
    if deepseek_v4.ARCHITECTURE in (raw.get("architectures") or []) or (
        not raw.get("architectures") and raw.get("model_type") == deepseek_v4.MODEL_TYPE
    ):
        return DeepseekV4Config.from_dir(path)
    return ModelConfig.from_dir(path)


def load_model(
    path: Path,
    dtype_name: str,
    device: torch.device,
    max_kv_len: int,
    mtp: bool = False,
    expert_rank: tuple[int, int] | None = None,
) -> LoadedModel:
    """Build the model from `path` and load its weights; raises UnsupportedModel with the reason.

    With `mtp`, the checkpoint's MTP module (`mtp.*`, `num_nextn_predict_layers: 1`) is
    loaded too; without it, MTP weights are ignored. With `expert_rank` (rank, ranks:
    expert parallelism) the rank holds its share of the routed experts and reads only
    their tensors.
    """
    config = model_config(path)
    if mtp and config.mtp_layers != 1:
        raise UnsupportedModel(
            f"{path}: --mtp needs an MTP module with num_nextn_predict_layers: 1 "
            f"(config has {config.mtp_layers})"
        )
    experts = None
    if isinstance(config, ModelConfig):
        if expert_rank is not None:
            raise UnsupportedModel(
                f"{path}: --expert-parallel needs a mixture-of-experts model; "
                f"{config.architecture} is dense"
            )
        if config.sliding_window is not None and max_kv_len > config.sliding_window:
            raise UnsupportedModel(
                f"{path}: sliding-window attention ({config.sliding_window} tokens) is not "
                f"supported; use --max-model-len {config.sliding_window} or less"
            )
    elif expert_rank is not None:
        try:
            experts = expert_share(config.n_routed_experts, *expert_rank)
        except ValueError as exc:
            raise UnsupportedModel(f"{path}: {exc}") from exc
    tokenizer_path = path / "tokenizer.json"
    if not tokenizer_path.exists():
        raise UnsupportedModel(f"{path} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    if dtype_name == "auto":
        dtype = auto_dtype(DTYPES.get(config.torch_dtype, torch.float32), device)
    else:
        dtype = DTYPES[dtype_name]
    if dtype == torch.float16 and device.type == "cpu":
        dtype = torch.bfloat16
    model, state = _build(path, config, max_kv_len, mtp, experts)
    if not mtp:
        state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    head = "head.weight" if isinstance(model, DeepseekV4CausalLM) else "lm_head.weight"
    if config.tie_word_embeddings or head not in state:
        state.pop(head, None)
        model.tie_weights()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != head or not _is_tied(model)]
    if missing:
        raise UnsupportedModel(f"{path}: weights missing from the checkpoint: {missing[:8]}")
    unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise UnsupportedModel(f"{path}: unexpected weights in the checkpoint: {unexpected[:8]}")
    if isinstance(model, DeepseekV4CausalLM):
        model.place(device, dtype)
    else:
        model.to(device=device, dtype=dtype).eval()
        model.rope_cos = model.rope_cos.float()
        model.rope_sin = model.rope_sin.float()
    if isinstance(model, DeepseekV3CausalLM):
        for moe in model.moe_layers():
            moe.gate.float()  # routing stays in float32 whatever the weights' dtype
    return LoadedModel(path, config, model, tokenizer, dtype, device, read_chat_template(path))


def _build(
    path: Path,
    config: ModelConfig | DeepseekV3Config | DeepseekV4Config,
    max_kv_len: int,
    mtp: bool,
    experts: range | None,
) -> tuple[CausalLM | DeepseekV3CausalLM | DeepseekV4CausalLM, dict[str, torch.Tensor]]:
    """The architecture's model, and the checkpoint's tensors under its names."""
    if isinstance(config, ModelConfig):
        return CausalLM(config, max_positions=max_kv_len, with_mtp=mtp), read_weights(path)
    share = range(config.n_routed_experts) if experts is None else experts
    if isinstance(config, DeepseekV4Config):
        v4_state = {
            deepseek_v4.checkpoint_name(k): v
            for k, v in read_weights(path, lambda k: _v4_keeps(k, share, mtp)).items()
        }
        return DeepseekV4CausalLM(config, max_kv_len, mtp, experts=share), v4_state

    def keep(key: str) -> bool:
        expert = deepseek_v3.expert_of(key)
        name = deepseek_v3.checkpoint_name(key, config)
        return name is not None and (expert is None or expert in share)

    state = {}
    for key, tensor in read_weights(path, keep).items():
        name = deepseek_v3.checkpoint_name(key, config)
        if name is not None:
            state[name] = tensor
    if mtp and "mtp.shared_head.head.weight" not in state and "lm_head.weight" in state:
        state["mtp.shared_head.head.weight"] = state["lm_head.weight"]
    model = DeepseekV3CausalLM(config, max_positions=max_kv_len, with_mtp=mtp, experts=share)
    return model, state


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


def _v4_keeps(key: str, share: range, mtp: bool) -> bool:
    """A DeepSeek-V4 rank reads the main model's tensors (and the MTP module's, with `mtp`),
    of its routed experts only its own."""
    expert = deepseek_v4.expert_of(key)
    return (mtp or not key.startswith("mtp.")) and (expert is None or expert in share)


def _is_tied(model: CausalLM | DeepseekV3CausalLM | DeepseekV4CausalLM) -> bool:
    head = model.head if isinstance(model, DeepseekV4CausalLM) else model.lm_head
    return head.weight is model.model.embed_tokens.weight
