"""A small random DeepSeek-V4 checkpoint written by `transformers` (a test and bench
dependency), with the tiny model's byte-level tokenizer, for the tests and `npu-pool bench`:

    python -m bench.make_deepseek_v4 DIR [--windows small|real] [--bench]

Every layer type is present (sliding, CSA, HCA) and both MoE kinds (hash-routed first, then
scored). `--windows small` uses a 16-token window and compress rates 4/16, so short prompts
cross many window boundaries; `--windows real` the V4-Flash values 128/4/128. Weights are
scaled up so greedy top-1/top-2 logit margins are clear, and the parameters transformers
initialises to constants (sinks, `ape`, hyper-connection bases, router biases, `tid2eid`)
are random, so each of them matters to the tokens.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

from npu_worker.models.tiny import ensure_tiny_model

VOCAB_SIZE = 512  # the tiny tokenizer's
LAYERS = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
)
MLP_LAYERS = ("hash_moe", "moe", "hash_moe", "moe")
WINDOWS = {"small": (16, 4, 16), "real": (128, 4, 128)}  # sliding window, CSA rate, HCA rate
BENCH_SIZE = {"hidden_size": 256, "head_dim": 64, "q_lora_rank": 96, "moe_intermediate_size": 128}


def config(windows: str = "small", **extra: Any) -> Any:
    """The checkpoint's `DeepseekV4Config`."""
    window, csa, hca = WINDOWS[windows]
    values: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": len(LAYERS),
        "num_attention_heads": 4,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.5,
        "layer_types": list(LAYERS),
        "mlp_layer_types": list(MLP_LAYERS),
        "compress_rates": {"compressed_sparse_attention": csa, "heavily_compressed_attention": hca},
        "sliding_window": window,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 8,
        "hc_mult": 4,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "bos_token_id": 0,
        "eos_token_id": 1,
        "num_nextn_predict_layers": 1,
    }
    values.update(extra)
    return transformers.DeepseekV4Config(**values)


def build(
    out: Path, windows: str = "small", seed: int = 0, bench_size: bool = False
) -> torch.nn.Module:
    """Write the checkpoint to `out`; returns the `transformers` model (float32)."""
    torch.manual_seed(seed)
    sizes: dict[str, Any] = dict(BENCH_SIZE) if bench_size else {}
    model = transformers.DeepseekV4ForCausalLM(config(windows, **sizes)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.split(".")[-1]
            if leaf in ("sinks", "position_bias", "base", "hc_base"):
                param.normal_(0.0, 0.5)
            elif leaf == "e_score_correction_bias":
                param.normal_(0.0, 0.1)
            elif "norm" not in name and leaf not in ("scale", "hc_scale"):
                param.mul_(4.0)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0.0, 0.1)
            table = getattr(module, "tid2eid", None)
            if isinstance(table, torch.Tensor):
                experts = model.config.n_routed_experts
                picks = torch.stack([torch.randperm(experts)[: table.shape[1]] for _ in table])
                table.copy_(picks)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    shutil.copy(ensure_tiny_model() / "tokenizer.json", out / "tokenizer.json")
    return model


def main() -> None:
    """Write the checkpoint named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--windows", choices=sorted(WINDOWS), default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bench", action="store_true", help="a few million parameters")
    args = parser.parse_args()
    build(args.out, args.windows, args.seed, bench_size=args.bench)
    print(args.out)


if __name__ == "__main__":
    main()
