"""How close bfloat16 DeepSeek-V4 runs come to the float32 reference, the pool's and
`transformers`':

    python -m bench.probes.v4_precision [--prompts 20 150 300] [--seed 24]

Writes the tiny V4 test checkpoint (`small` windows), runs each random prompt through the
pool's model in float32 (the reference: it matches `transformers`' float32 `generate`,
tests/test_deepseek_v4.py), through the pool's model in bfloat16 (prefilled in 128-token
chunks, as a rank does) and through `transformers`' own model cast to bfloat16 (the whole
prompt in one forward), and prints, for each prompt's last-position logits, the largest
absolute difference from the reference and one minus their cosine similarity.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import load_model
from npu_worker.weights.makers import deepseek_v4
from schemas.control import PrefillChunk
from schemas.registry import LaunchShapes

MAX_LEN = 512


def pool_logits(path: Path, dtype: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The pool's last-position logits of each prompt, prefilled in 128-token chunks."""
    loaded = load_model(path, dtype, torch.device("cpu"), MAX_LEN)
    runner = LaunchRunner(loaded.model, LaunchShapes(1, 128, 1, 1, MAX_LEN, False))
    out = []
    for prompt in prompts:
        for start in range(0, len(prompt), 128):
            part = prompt[start : start + 128]
            chunk = PrefillChunk(slot=0, start=start, num_tokens=len(part))
            last = runner.prefill([chunk], [part]).logits[0, 0]
        out.append(last.float())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[20, 150, 300])
    parser.add_argument("--seed", type=int, default=24)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    vocab = deepseek_v4.VOCAB_SIZE
    prompts = [[rng.randrange(2, vocab) for _ in range(n)] for n in args.prompts]
    with tempfile.TemporaryDirectory() as root:
        path = Path(root) / "v4"
        hf = deepseek_v4.build(path)
        reference = pool_logits(path, "float32", prompts)
        pool = pool_logits(path, "bfloat16", prompts)
        hf = hf.to(torch.bfloat16)
        with torch.no_grad():
            theirs = [hf(torch.tensor([p])).logits[0, -1].float() for p in prompts]
    print(f"{'prompt':>7} {'pool max|d|':>12} {'hf max|d|':>10} {'pool 1-cos':>11} {'hf 1-cos':>9}")
    for n, want, ours, hfs in zip(args.prompts, reference, pool, theirs):
        cos = torch.nn.functional.cosine_similarity
        print(
            f"{n:>7} {float((ours - want).abs().max()):>12.4f} "
            f"{float((hfs - want).abs().max()):>10.4f} "
            f"{1 - float(cos(ours, want, dim=0)):>11.2e} {1 - float(cos(hfs, want, dim=0)):>9.2e}"
        )


if __name__ == "__main__":
    main()
