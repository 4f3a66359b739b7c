"""Reading a checkpoint's safetensors: only the tensors a rank keeps (an expert-parallel rank
reads its own experts alone), and FP8 block-quantized weights dequantized on the way in.

An FP8 weight's per-block scales sit beside it under one of two names: `X.weight_scale_inv`
(as DeepSeek-V3 and `transformers` save them, float32) or `X.scale` (DeepSeek-V4's release,
`scale_fmt: ue8m0`: powers of two stored as float8 e8m0)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from npu_worker.models.config import UnsupportedModel

SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv`: per-block scales of an FP8 `X.weight`
RELEASE_SCALE_SUFFIX = ".scale"  # `X.scale`: the same, as DeepSeek-V4's release names them
SCALE_FORMATS = (None, "ue8m0")  # `scale_fmt`: plain floats, or powers of two (float8 e8m0)


def scaled_weight(key: str) -> str | None:
    """The FP8 weight whose block scales `key` holds, None when `key` holds no scales."""
    if key.endswith(SCALE_SUFFIX):
        return key.removesuffix(SCALE_SUFFIX)
    if key.endswith(RELEASE_SCALE_SUFFIX):
        return key.removesuffix(RELEASE_SCALE_SUFFIX) + ".weight"
    return None


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory (sharded or not)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = sorted(p.name for p in path.glob("*.safetensors"))
    if not names:
        raise UnsupportedModel(f"{path} holds no *.safetensors weights")
    return [path / name for name in names]


class Weights(dict[str, torch.Tensor]):
    """Tensors read from a checkpoint, and the bytes each took there (`stored`, a weight's
    block scales counted with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.stored: dict[str, int] = {}


def read_weights(path: Path, keep: Callable[[str], bool] = lambda key: True) -> Weights:
    """Every tensor whose name `keep` accepts, FP8 weights dequantized to float32; the rest
    of each file is never read (files are memory-mapped)."""
    block = fp8_block_size(path)
    state = Weights()
    scales: dict[str, str] = {}  # scale tensor -> its weight
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                weight = scaled_weight(key)
                if keep(weight or key):
                    state[key] = f.get_tensor(key)
                    bytes_ = state[key].numel() * state[key].element_size()
                    state.stored[weight or key] = state.stored.get(weight or key, 0) + bytes_
                    if weight is not None:
                        scales[key] = weight
    for key, name in scales.items():
        scale = state.pop(key)
        if block is None:
            raise UnsupportedModel(f"{path}: {key} without an FP8 quantization_config")
        if name not in state:
            raise UnsupportedModel(f"{path}: {key} has no weight {name}")
        if state[name].dtype != torch.float8_e4m3fn:
            raise UnsupportedModel(
                f"{path}: {key} scales {name}, stored as {state[name].dtype}, not float8 e4m3"
            )
        state[name] = dequantize_blocks(state[name], scale, block)
    return state


def fp8_block_size(path: Path) -> tuple[int, int] | None:
    """The weight block size of an FP8 e4m3 block-quantized checkpoint, None when it is
    not quantized; UnsupportedModel naming any other format."""
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    quant = config.get("quantization_config")
    if not quant:
        return None
    method, fmt = quant.get("quant_method"), quant.get("fmt")
    block, scale_fmt = quant.get("weight_block_size"), quant.get("scale_fmt")
    if (
        method != "fp8"
        or fmt != "e4m3"
        or not block
        or len(block) != 2
        or scale_fmt not in SCALE_FORMATS
    ):
        raise UnsupportedModel(
            f"{path}: quantization {method!r} (fmt {fmt!r}, weight_block_size {block!r}, "
            f"scale_fmt {scale_fmt!r}) is not supported; supported: quant_method fp8, fmt e4m3, "
            "2-D weight_block_size, scale_fmt ue8m0 or none"
        )
    return int(block[0]), int(block[1])


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """An FP8 weight [out, in] times its per-block scales [ceil(out/b0), ceil(in/b1)] (float32,
    or float8 e8m0 powers of two)."""
    rows, cols = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows]
    scales = scales.repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scales
