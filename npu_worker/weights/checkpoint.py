"""Reading a checkpoint's safetensors: only the tensors a rank keeps (an expert-parallel rank
reads its own experts alone), quantized weights in the form they are stored
(npu_worker/models/stored.py).

A quantized weight's scales sit beside it:
- FP8 e4m3 with per-block scales: `X.weight_scale_inv` (as DeepSeek-V3 and `transformers`
  save them, float32) or `X.scale` (DeepSeek-V4's release, `scale_fmt: ue8m0`: powers of
  two stored as float8 e8m0);
- MXFP4 (DeepSeek-V4's routed experts, `expert_dtype: fp4`): e2m1 pairs as
  `float4_e2m1fn_x2` (or their bytes) [out, in / 2], and `X.scale`, UE8M0 [out, in / 32];
- W8A8 (compressed-tensors, `int-quantized`): int8 `X.weight` and `X.weight_scale` [out, 1].
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from npu_worker.models.config import UnsupportedModel
from npu_worker.models.stored import MX_BLOCK, Fp8Blocks, Int8Channels, Mxfp4, StoredWeight

SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv`: per-block scales of an FP8 `X.weight`
RELEASE_SCALE_SUFFIX = ".scale"  # `X.scale`: FP8's block scales or MXFP4's, in the release
CHANNEL_SCALE_SUFFIX = "_scale"  # `X.weight_scale`: compressed-tensors' per-channel scales
SCALE_FORMATS = (None, "ue8m0")  # `scale_fmt`: plain floats, or powers of two (float8 e8m0)


@dataclass(frozen=True, slots=True)
class Quantization:
    """How a checkpoint's quantized weights are stored: FP8 blocks of `block` (with MXFP4
    experts where the tensors say so), or W8A8 int8 (`int8`)."""

    block: tuple[int, int] | None = None
    int8: bool = False


def scaled_weight(key: str, quantization: Quantization | None = None) -> str | None:
    """The weight whose scales `key` holds, None when `key` holds no scales."""
    if key.endswith(SCALE_SUFFIX):
        return key.removesuffix(SCALE_SUFFIX)
    if key.endswith(RELEASE_SCALE_SUFFIX):
        return key.removesuffix(RELEASE_SCALE_SUFFIX) + ".weight"
    if quantization is not None and quantization.int8 and key.endswith(".weight_scale"):
        return key.removesuffix(CHANNEL_SCALE_SUFFIX)
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
    """Tensors read from a checkpoint, its quantized weights as stored (`quantized`, by the
    weight's name), and the bytes each took there (`stored`, a weight's scales counted with
    it)."""

    def __init__(self) -> None:
        super().__init__()
        self.stored: dict[str, int] = {}
        self.quantized: dict[str, StoredWeight] = {}


def read_weights(path: Path, keep: Callable[[str], bool] = lambda key: True) -> Weights:
    """Every tensor whose name `keep` accepts; quantized weights in `quantized`, as stored.
    The rest of each file is never read (files are memory-mapped)."""
    quantization = quantization_of(path)
    state = Weights()
    scales: dict[str, str] = {}  # scale tensor -> its weight
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                weight = scaled_weight(key, quantization)
                if keep(weight or key):
                    state[key] = f.get_tensor(key)
                    bytes_ = state[key].numel() * state[key].element_size()
                    state.stored[weight or key] = state.stored.get(weight or key, 0) + bytes_
                    if weight is not None:
                        scales[key] = weight
    for key, name in scales.items():
        scale = state.pop(key)
        if quantization is None:
            raise UnsupportedModel(f"{path}: {key} without a quantization_config")
        if name not in state:
            raise UnsupportedModel(f"{path}: {key} has no weight {name}")
        state.quantized[name] = stored_form(path, name, state.pop(name), scale, quantization)
    unscaled = [k for k, v in state.items() if v.dtype in QUANTIZED_DTYPES]
    if unscaled:
        raise UnsupportedModel(f"{path}: quantized weights without scales: {unscaled[:4]}")
    return state


QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float4_e2m1fn_x2)  # never read without scales


def stored_form(
    path: Path, name: str, weight: torch.Tensor, scale: torch.Tensor, quantization: Quantization
) -> StoredWeight:
    """`weight` and its scales as the form they make; UnsupportedModel naming a mismatch."""
    if weight.dtype == torch.float8_e4m3fn and quantization.block is not None:
        return Fp8Blocks(weight, scale.float(), quantization.block)
    if weight.dtype == torch.float4_e2m1fn_x2 or (
        weight.dtype in (torch.uint8, torch.int8)
        and not quantization.int8
        and weight.dim() == 2
        and scale.shape == (weight.shape[0], weight.shape[1] * 2 // MX_BLOCK)
    ):
        if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8) or scale.shape != (
            weight.shape[0],
            -(-weight.shape[1] * 2 // MX_BLOCK),
        ):
            raise UnsupportedModel(
                f"{path}: {name} is MXFP4 but its scales are {scale.dtype} {tuple(scale.shape)}, "
                f"not float8 e8m0 [{weight.shape[0]}, {weight.shape[1] * 2 // MX_BLOCK}]"
            )
        return Mxfp4(weight.view(torch.uint8), scale.view(torch.uint8))
    if weight.dtype == torch.int8 and quantization.int8:
        if scale.numel() != weight.shape[0]:
            raise UnsupportedModel(
                f"{path}: {name} has {scale.numel()} scales for {weight.shape[0]} channels"
            )
        return Int8Channels(weight, scale.float().reshape(-1))
    raise UnsupportedModel(
        f"{path}: {name} is stored as {weight.dtype}, which its scales do not fit"
    )


def quantization_of(path: Path) -> Quantization | None:
    """How a checkpoint is quantized (None: it is not), from its `quantization_config`;
    UnsupportedModel naming any other format."""
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    quant = config.get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") == "compressed-tensors":
        return Quantization(int8=_w8a8(path, quant))
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
            "2-D weight_block_size, scale_fmt ue8m0 or none (with MXFP4 experts), and "
            "compressed-tensors W8A8 int8"
        )
    return Quantization(block=(int(block[0]), int(block[1])))


def _w8a8(path: Path, quant: dict[str, Any]) -> bool:
    """True for compressed-tensors' W8A8 int8: symmetric int8 weights per channel, int8
    activations per token, dynamic; UnsupportedModel naming anything else."""
    groups = list((quant.get("config_groups") or {}).values())
    for group in groups:
        weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
        if not (
            weights.get("num_bits") == 8
            and weights.get("type") == "int"
            and weights.get("symmetric", True)
            and weights.get("strategy") == "channel"
            and inputs.get("num_bits") == 8
            and inputs.get("type") == "int"
            and inputs.get("symmetric", True)
            and inputs.get("strategy") == "token"
            and inputs.get("dynamic", False)
        ):
            raise UnsupportedModel(
                f"{path}: compressed-tensors scheme weights {weights} / input_activations "
                f"{inputs} is not supported; supported: W8A8 int8 (symmetric, weights per "
                "channel, activations per token, dynamic)"
            )
    if not groups:
        raise UnsupportedModel(
            f"{path}: compressed-tensors quantization_config has no config_groups"
        )
    return True
