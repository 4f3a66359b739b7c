"""Loading a model directory (config, safetensors shards, tokenizer) onto a device."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from npu_worker.devices import auto_dtype
from npu_worker.kernels import kit_for
from npu_worker.models.config import UnsupportedModel
from npu_worker.models.family import FamilyConfig
from npu_worker.models.kit import LayerKit
from npu_worker.models.launch import LaunchModel
from npu_worker.models.moe import expert_share
from npu_worker.models.registry import family_of
from npu_worker.models.stored import StoredLinear, weights_from_checkpoint
from npu_worker.weights.checkpoint import read_weights

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
    config: FamilyConfig
    model: LaunchModel[Any]
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    chat_template: dict[str, str] | None = None
    checkpoint_bytes: int = 0  # the tensors this rank read, as the checkpoint stores them
    weight_bytes: int = 0  # what they take on the device (`resident_bytes`)


def load_model(
    path: Path,
    dtype_name: str,
    device: torch.device,
    max_kv_len: int,
    mtp: bool = False,
    expert_rank: tuple[int, int] | None = None,
    kit: LayerKit | None = None,
) -> LoadedModel:
    """Build the model from `path` with the layers of `kit` (by default the device's own:
    `kit_for`), load its weights, place it and let the kit lay them out; raises
    UnsupportedModel with the reason.

    With `mtp`, the checkpoint's MTP module (`mtp.*`, `num_nextn_predict_layers: 1`) is
    loaded too; without it, MTP weights are ignored. With `expert_rank` (rank, ranks:
    expert parallelism) the rank holds its share of the routed experts and reads only
    their tensors.
    """
    family, config = family_of(path)
    if mtp and config.mtp_layers != 1:
        raise UnsupportedModel(
            f"{path}: --mtp needs an MTP module with num_nextn_predict_layers: 1 "
            f"(config has {config.mtp_layers})"
        )
    num_experts = family.num_experts(config)
    share = range(num_experts)
    if expert_rank is not None:
        if not num_experts:
            raise UnsupportedModel(
                f"{path}: --expert-parallel needs a mixture-of-experts model; "
                f"{config.architecture} is dense"
            )
        try:
            share = expert_share(num_experts, *expert_rank)
        except ValueError as exc:
            raise UnsupportedModel(f"{path}: {exc}") from exc
    family.check(config, path, max_kv_len)
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
    kit = kit or kit_for(device)
    with weights_from_checkpoint():  # every linear weight comes from the checkpoint
        model = family.build(config, max_kv_len, mtp, share, kit)
    placement = family.placement(config, share, mtp)
    state = {}
    read = read_weights(path, placement.keep)
    stored_bytes = 0
    for key, tensor in read.items():
        name = placement.name(key)
        if name is not None and (mtp or not name.startswith("mtp.")):
            state[name] = tensor
            stored_bytes += read.stored.get(key, 0)
    for key, stored in read.quantized.items():
        name = placement.name(key)
        if name is None or (not mtp and name.startswith("mtp.")):
            continue
        stored_bytes += read.stored.get(key, 0)
        layer = _stored_owner(model, name)
        if layer is None:  # a weight used as a tensor, not a product's: widened here
            state[name] = stored.dequantize()
        else:
            layer.keep_stored(stored)
    _load_state(model, placement.finish(state), config.tie_word_embeddings, path)
    model.place(device, dtype)
    kit.prepare(shared_storages(model))
    return LoadedModel(
        path,
        config,
        model,
        tokenizer,
        dtype,
        device,
        read_chat_template(path),
        stored_bytes,
        resident_bytes(model),
    )


def shared_storages(model: torch.nn.Module) -> frozenset[int]:
    """Data pointers of the storages more than one parameter uses (a tied head's)."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        pointer = param.untyped_storage().data_ptr()
        seen[pointer] = seen.get(pointer, 0) + 1
    return frozenset(pointer for pointer, uses in seen.items() if uses > 1)


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, and of the copies a kit laid out for its
    products (a layer's or a group's `packed`), each storage once."""
    seen: dict[tuple[str, int], int] = {}

    def count(tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor) or not tensor.numel():
            return
        if tensor.is_mkldnn:  # oneDNN's blocked copy: no storage to see, its elements' bytes
            seen[("mkldnn", id(tensor))] = tensor.numel() * tensor.element_size()
            return
        storage = tensor.untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()

    for module in model.modules():
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            count(tensor)
        for value in vars(module).values():  # a layer's packed copy, or a group's
            count(value)
            count(getattr(value, "packed", None))
    return sum(seen.values())


def _stored_owner(model: torch.nn.Module, name: str) -> StoredLinear | None:
    """The linear layer whose `weight` is `name`, where it can keep a stored weight."""
    path, _, leaf = name.rpartition(".")
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        return None
    return layer if leaf == "weight" and isinstance(layer, StoredLinear) else None


def _load_state(
    model: LaunchModel[Any], state: dict[str, torch.Tensor], tied: bool, path: Path
) -> None:
    """Load `state` into `model`, tying its head where the checkpoint does (or has none);
    UnsupportedModel naming weights missing or unexpected."""
    head = model.head_key
    if tied or head not in state:
        state.pop(head, None)
        model.tie_weights()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != head or not model.is_tied()]
    if missing:
        raise UnsupportedModel(f"{path}: weights missing from the checkpoint: {missing[:8]}")
    unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise UnsupportedModel(f"{path}: unexpected weights in the checkpoint: {unexpected[:8]}")


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
