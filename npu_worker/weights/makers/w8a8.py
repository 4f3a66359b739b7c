"""A checkpoint's linear layers as compressed-tensors writes W8A8 int8: each weight int8 with a
float32 scale per output channel (`X.weight_scale` [out, 1], symmetric: the channel's
largest |w| is 127), activations quantized per token at run time; the head, embeddings,
norms and routers stay as they are.

    python -m npu_worker.weights.makers.w8a8 SRC OUT
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from npu_worker.models.stored import StoredLinear
from npu_worker.weights.checkpoint import checkpoint_files
from npu_worker.weights.loader import load_model

SCHEME = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}


def int8_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] as int8 and its scales [out, 1] (float32): w / scale rounded half
    to even, scale = max |w| / 127 over the channel (1 for a channel of zeros)."""
    wide = weight.float()
    scale = wide.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(wide / scale).clamp(-127, 127).to(torch.int8), scale


def quantize(src: Path, out: Path) -> list[str]:
    """Write `src` (a single-file checkpoint whose tensor names are the model's) to `out`
    with its linear layers' weights as W8A8; returns their names."""
    loaded = load_model(src, "float32", torch.device("cpu"), 128)
    linears = {
        f"{name}.weight"
        for name, module in loaded.model.named_modules()
        if isinstance(module, StoredLinear) and f"{name}.weight" != loaded.model.head_key
    }
    (file,) = checkpoint_files(src)
    state = load_file(str(file))
    chosen = sorted(k for k in state if k in linears and state[k].dim() == 2)
    for key in chosen:
        state[key], state[key + "_scale"] = int8_channels(state[key])
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = SCHEME
    if out != src:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(src, out)
    save_file(state, str(out / file.name), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return chosen


def main() -> None:
    """Convert the checkpoint named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(f"{len(quantize(args.src, args.out))} weights as W8A8 in {args.out}")


if __name__ == "__main__":
    main()
