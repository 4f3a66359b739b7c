"""Per-request state one KV slot of DeepSeek-V4-Flash holds, by kind, from the published
model's configuration (written here in its release terms and parsed as a checkpoint's
`config.json` is), at a few `--max-model-len` values:

    python -m bench.probes.v4_state [--dtype-bytes 2] [--mtp]

Then, in a cache of blocks of 128 positions (`--kv-cache-memory`), what a request of a few
lengths holds: its rings, and one block of entries and index keys per 128 positions.

Layers (the release's `compress_ratios`): two sliding-window layers, then CSA (rate 4) and
HCA (rate 128) alternating, 21 and 20 of them; the trailing 0 is the MTP block's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from npu_worker.models.deepseek_v4.config import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4Config,
    state_elements_in_blocks,
    state_elements_per_slot,
)

LAYERS = 43
V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "num_hash_layers": 3,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(LAYERS - 2)] + [0],
    "torch_dtype": "bfloat16",
}
LENGTHS = (8192, 131072, 1048576)
REQUEST_LENGTHS = (1024, 8192, 131072, 1048576)
BLOCK = 128


def v4_flash() -> DeepseekV4Config:
    """The published V4-Flash configuration, parsed as the pool parses a checkpoint's."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(V4_FLASH))
        return DeepseekV4Config.from_dir(Path(folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype-bytes", type=int, default=2, help="2: bfloat16")
    parser.add_argument("--mtp", action="store_true", help="with the MTP block's window")
    args = parser.parse_args()
    config = v4_flash()
    kinds = {kind: config.layer_types.count(kind) for kind in (SLIDING, CSA, HCA)}
    print(f"DeepSeek-V4-Flash: {config.num_layers} layers {kinds}, W {config.sliding_window}")
    for length in LENGTHS:
        counts = state_elements_per_slot(config, length, args.mtp)
        total = sum(counts.values()) * args.dtype_bytes
        parts = ", ".join(f"{k} {v * args.dtype_bytes / 2**20:.1f} MiB" for k, v in counts.items())
        print(f"max_model_len {length:>9,}: {total / 2**20:9.1f} MiB per slot ({parts})")
    fixed, per_block = state_elements_in_blocks(config, BLOCK, args.mtp)
    size = args.dtype_bytes
    print(
        f"blocks of {BLOCK}: {fixed * size / 2**20:.2f} MiB of rings a request, "
        f"{per_block * size / 2**10:.1f} KiB a block; a rank keeps as many marks as slots "
        f"(copies of the rings, less their scratch rows, where prefixes resume), each at most "
        f"{fixed * size / 2**20:.2f} MiB"
    )
    for length in REQUEST_LENGTHS:
        total = (fixed + -(-length // BLOCK) * per_block) * size
        print(f"a request of {length:>9,} positions: {total / 2**20:9.2f} MiB")


if __name__ == "__main__":
    main()
