"""Reading a checkpoint's safetensors: only the tensors a rank keeps (an expert-parallel rank
reads its own experts alone), and FP8 block-quantized weights dequantized on the way in."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from npu_worker.models.config import UnsupportedModel

SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv`: per-block scales of an FP8 `X.weight`


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


def read_weights(
    path: Path, keep: Callable[[str], bool] = lambda key: True
) -> dict[str, torch.Tensor]:
    """Every tensor whose name `keep` accepts, FP8 weights dequantized to float32; the rest
    of each file is never read (files are memory-mapped)."""
    block = fp8_block_size(path)
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if keep(key.removesuffix(SCALE_SUFFIX)):
                    state[key] = f.get_tensor(key)
    for key in [k for k in state if k.endswith(SCALE_SUFFIX)]:
        scale = state.pop(key)
        name = key.removesuffix(SCALE_SUFFIX)
        if block is None:
            raise UnsupportedModel(f"{path}: {key} without an FP8 quantization_config")
        if name not in state:
            raise UnsupportedModel(f"{path}: {key} has no weight {name}")
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
    block = quant.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or not block or len(block) != 2:
        raise UnsupportedModel(
            f"{path}: quantization {method!r} (fmt {fmt!r}, weight_block_size {block!r}) is "
            "not supported; supported: quant_method fp8, fmt e4m3, 2-D weight_block_size"
        )
    return int(block[0]), int(block[1])


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """An FP8 weight [out, in] times its per-block scales [ceil(out/b0), ceil(in/b1)]."""
    rows, cols = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows]
    scales = scales.repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scales
