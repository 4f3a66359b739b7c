"""Whether routed-expert time grows with the rows routed, not with the experts held:

    python -m bench.probes.routed_experts [--experts 8 64] [--requests 24] [--tokens 48]

Writes tiny DeepSeek-V4 checkpoints at the bench sizes (hidden 256) whose MoE layers
differ only in the number of routed experts (each of `--inner` 1024, top-2), loads each on
one rank (`--dtype`, the CPU's kit) and serves a burst through the runner as a rank does:
`--requests` prompts of 32 tokens prefilled, then `--tokens` decode steps in B8S1
launches. The routed form (models/moe.py) runs against the dense form (every expert over
every token, as before), `--rounds` times alternated; the best round of each is reported
as generated tokens a second.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from npu_worker.models.moe import RoutedExperts, Routes
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import load_model
from npu_worker.weights.makers import deepseek_v4
from schemas.control import PrefillChunk
from schemas.registry import LaunchShapes

PROMPT = 32


class Dense:
    """Every expert over every token, weighted, summed in ascending expert order."""

    def __init__(self, routed: RoutedExperts) -> None:
        self.routed = routed

    def __call__(self, x: torch.Tensor, route: Routes, group: Any) -> torch.Tensor:
        experts = self.routed.experts
        weights = torch.zeros(x.shape[0], len(experts), dtype=torch.float32)
        weights.scatter_(1, route.experts, route.weights)
        weights *= route.valid[:, None]
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in self.routed.share:
            out += experts[str(e)](x).float() * weights[:, e : e + 1]
        return out.to(x.dtype)


def serve_burst(runner: LaunchRunner, requests: int, tokens: int, seed: int) -> float:
    """Seconds to prefill `requests` prompts and decode `tokens` steps for each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 500) for _ in range(PROMPT)] for _ in range(requests)]
    started = time.perf_counter()
    last = []
    for slot, prompt in enumerate(prompts):
        chunk = PrefillChunk(slot=slot, start=0, num_tokens=PROMPT)
        last.append(int(runner.prefill([chunk], [prompt]).logits[0, 0].argmax()))
    batch = runner.decode_batch
    for step in range(tokens):
        for first in range(0, requests, batch):
            slots = list(range(first, min(first + batch, requests)))
            logits = runner.decode(slots, [last[s] for s in slots], [PROMPT + step] * len(slots))
            for row, slot in enumerate(slots):
                last[slot] = int(logits[row].argmax())
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--inner", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--forms", nargs="+", default=["routed", "dense"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[tuple[int, str], float] = {}
    with tempfile.TemporaryDirectory() as root:
        for experts in args.experts:
            path = Path(root) / f"e{experts}"
            sizes = {"n_routed_experts": experts, "moe_intermediate_size": args.inner}
            deepseek_v4.build(path, bench_size=True, sizes=sizes)
            loaded = load_model(path, args.dtype, torch.device("cpu"), PROMPT + args.tokens + 8)
            shapes = LaunchShapes(8, 128, 8, args.requests, PROMPT + args.tokens + 8, False)
            runner = LaunchRunner(loaded.model, shapes)
            moes: list[Any] = [
                m
                for m in loaded.model.modules()
                if isinstance(getattr(m, "routed", None), RoutedExperts)
            ]
            routed: list[RoutedExperts] = [m.routed for m in moes]
            for round_ in range(args.rounds):
                for form in args.forms:
                    for moe, own in zip(moes, routed):
                        moe.routed = own if form == "routed" else Dense(own)
                    with torch.no_grad():
                        seconds = serve_burst(runner, args.requests, args.tokens, round_)
                    key = (experts, form)
                    results[key] = min(results.get(key, float("inf")), seconds)
            print(f"{experts} experts, {loaded.dtype}, kit {getattr(loaded.model, 'kit_name', '')}")
    generated = args.requests * args.tokens
    print(f"{'experts':>8} {'routed tok/s':>13} {'dense tok/s':>12}")
    for experts in args.experts:
        rates = [generated / results.get((experts, f), float("nan")) for f in ("routed", "dense")]
        print(f"{experts:>8} {rates[0]:>13.1f} {rates[1]:>12.1f}")
    if len(args.experts) > 1:
        few, many = args.experts[0], args.experts[-1]
        for form in args.forms:
            ratio = results[(many, form)] / results[(few, form)]
            print(f"{form}: {many} experts take {ratio:.2f}x the time of {few}")


if __name__ == "__main__":
    main()
