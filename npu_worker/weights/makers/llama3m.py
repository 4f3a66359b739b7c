"""Write the ~3M-parameter Llama checkpoint that `npu-pool bench` compares against vLLM on.

A `transformers` `LlamaForCausalLM` (hidden 256, 4 layers, 4 query heads of 64 and 2 KV
heads, MLP 640, vocabulary 512: 3.0M parameters) saved with `save_pretrained`, with the
`tiny` preset's byte-level tokenizer, so the pool, `transformers` and vLLM all read the same
`config.json`, `model.safetensors` and `tokenizer.json`.

The weights are drawn from one seeded generator in parameter-name order, not by
`transformers`' own initialisation, so every `transformers` version writes the same bytes.

    python -m npu_worker.weights.makers.llama3m DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

from npu_worker.weights.tiny import ensure_tiny_model

VOCAB_SIZE = 512
CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 640,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
# Weight scale: wide enough that greedy picks are clear (top-2 logit gaps far above
# float32 rounding between batch layouts), small enough that activations stay moderate.
WEIGHT_STD = 0.08
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_llama3m(out: Path, seed: int = 0) -> Path:
    """Write the checkpoint into `out` (created; must not hold a checkpoint yet); returns it."""
    if (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a checkpoint (config.json); remove it first")
    tiny = ensure_tiny_model()
    tokenizer_config = json.loads((tiny / "tokenizer_config.json").read_text())
    vocab = json.loads((tiny / "tokenizer.json").read_text())["model"]["vocab"]
    added = json.loads((tiny / "tokenizer.json").read_text())["added_tokens"]
    ids = {**vocab, **{t["content"]: t["id"] for t in added}}
    if len(ids) != VOCAB_SIZE:
        raise ValueError(f"the tiny tokenizer has {len(ids)} tokens; this checkpoint needs 512")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        bos_token_id=ids[tokenizer_config["bos_token"]],
        eos_token_id=ids[tokenizer_config["eos_token"]],
        initializer_range=WEIGHT_STD,
        **CONFIG,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    _fill_seeded(model, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tiny / name, out / name)
    return out


def _fill_seeded(model: torch.nn.Module, seed: int) -> None:
    """Norm weights 1, every other tensor N(0, WEIGHT_STD²), drawn in sorted-name order."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * WEIGHT_STD)


def main(argv: list[str] | None = None) -> int:
    """Build the checkpoint in the given directory and print its path and size."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="directory to write (must not hold a checkpoint)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = build_llama3m(args.out, args.seed)
    except (FileExistsError, ValueError) as exc:
        print(f"npu_worker.weights.makers.llama3m: {exc}", file=sys.stderr)
        return 2
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
