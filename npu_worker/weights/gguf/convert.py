"""Importing a GGUF file (llama.cpp's format) into an ordinary model directory.

The weights are dequantized to float32 with the `gguf` package's numpy kernels, renamed
from llama.cpp's tensor names to Hugging Face's, and the Q/K rows llama.cpp permutes for
its interleaved RoPE are put back in rotate-half order. The hyper-parameters come from the
GGUF metadata (`config.json`), the tokenizer from its vocabulary and merges
(`tokenizer.json`, see `gguf_tokenizer.py`), the chat template and special
tokens into `tokenizer_config.json`. The result loads like any other model directory.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from npu_worker.models.config import UnsupportedModel
from npu_worker.startup import ReportProgress, no_progress
from npu_worker.weights.gguf.reader import metadata, read_gguf
from npu_worker.weights.gguf.tokenizer import build_tokenizer, tokenizer_config

# GGUF `general.architecture` -> (Hugging Face class, whether llama.cpp permuted Q/K rows)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}
# llama.cpp tensor names -> Hugging Face names ("{i}" is the layer)
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_config(reader: Any) -> dict[str, Any]:
    """A Hugging Face `config.json` for the model the GGUF metadata describes."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise UnsupportedModel("GGUF with per-dimension RoPE frequency factors is not supported")

    def need(key: str) -> Any:
        value = metadata(reader, f"{arch}.{key}")
        if value is None:
            raise UnsupportedModel(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(metadata(reader, f"{arch}.attention.key_length", hidden // heads))
    rotary = int(metadata(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise UnsupportedModel(f"partial RoPE ({rotary} of {head_dim} dims) is not supported")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch][0]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _float32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(metadata(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata(reader, "tokenizer.ggml.eos_token_id"),
    }
    config["rope_scaling"] = _rope_scaling(reader, arch)
    if arch == "qwen2":
        config["use_sliding_window"] = False
    return config


def _float32(value: float) -> float:
    """A float32 metadata value written as its shortest decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(reader: Any, arch: str) -> dict[str, Any] | None:
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        factor = float(metadata(reader, f"{arch}.rope.scaling.factor"))
        return {"rope_type": "linear", "factor": factor}
    raise UnsupportedModel(f"GGUF RoPE scaling {kind!r} is not supported; supported: none, linear")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor; raises UnsupportedModel for unknown ones."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in LAYER_NAMES:
        raise UnsupportedModel(f"GGUF tensor {gguf_name!r} has no counterpart in this model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"


def unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (each head's rotary pairs interleaved) back to
    rotate-half order (first halves, then second halves), for weights and biases alike."""
    head_rows = rows.shape[0] // num_heads
    grouped = rows.reshape(num_heads, head_rows // 2, 2, *rows.shape[1:])
    return grouped.swapaxes(1, 2).reshape(rows.shape)


def dequantized(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32 in numpy (row-major, Hugging Face's [out, in] layout)."""
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise UnsupportedModel(
            f"GGUF tensor {tensor.name}: {tensor.tensor_type.name} cannot be dequantized ({exc})"
        ) from exc
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.asarray(values, dtype=np.float32).reshape(shape)


def hf_weights(
    reader: Any, config: dict[str, Any], progress: ReportProgress = no_progress
) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its Hugging Face name."""
    permuted = ARCHITECTURES[config["model_type"]][1]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights: dict[str, torch.Tensor] = {}
    tensors = list(reader.tensors)
    for done, tensor in enumerate(tensors):
        progress("importing GGUF: dequantizing weights", done, len(tensors))
        values = dequantized(tensor)
        match = LAYER_TENSOR.match(tensor.name)
        if permuted and match is not None and match.group(2) in heads:
            values = unpermute_rope_rows(values, heads[match.group(2)])
        weights[hf_name(tensor.name)] = torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
    progress("importing GGUF: dequantizing weights", len(tensors), len(tensors))
    return weights


def import_gguf(path: Path, out: Path, progress: ReportProgress = no_progress) -> Path:
    """Write `path` as a model directory at `out` (created atomically); returns `out`."""
    path, out = Path(path), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; choose another --out")
    reader = read_gguf(path)
    config = hf_config(reader)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        progress("importing GGUF: tokenizer", 0, 1)
        write_tokenizer_files(reader, config, staging)
        weights = hf_weights(reader, config, progress)
        progress("importing GGUF: writing safetensors", 0, 1)
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        source = {"gguf": path.name, "name": metadata(reader, "general.name")}
        config_text = json.dumps(config | {"npupool_import": source}, indent=2)
        (staging / "config.json").write_text(config_text)
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def write_tokenizer_files(reader: Any, config: dict[str, Any], out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json (EOS and EOT ids)."""
    build_tokenizer(reader).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(reader), indent=2))
    ends = (config["eos_token_id"], metadata(reader, "tokenizer.ggml.eot_token_id"))
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": sorted({int(i) for i in ends if i is not None}),
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
