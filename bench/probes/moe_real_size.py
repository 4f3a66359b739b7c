"""One DeepSeek-V4-Flash MoE layer at its published sizes, routed, on this machine's CPU:

    python -m bench.probes.moe_real_size [--experts 256] [--distinct 16] [--launches 5] [--fp4]

Hidden 4096, 256 routed experts of 2048 (V4's SwiGLU, `moe.py`'s `RoutedExperts` with the
CPU's kit in bfloat16), top-6 of random scores, one rank. So that the layer fits beside
everything else in memory, its experts share `--distinct` sets of weights (16 sets: 768 MiB,
more than any cache holds, so every expert's weights still stream from memory as they would
with 256 of their own). Times a B8S1 launch (8 tokens) and a B1S128 launch (128 tokens),
the median of `--launches`, against the routed arithmetic at the products' measured rate:
one expert's products timed alone at the row counts the launch gives it (the tile, or
every routed row where the products keep rows apart), times the experts the launch
touches; and against the routed pairs at the rate of one expert over 128 rows (what full
tiles reach). With `--fp4` the experts are MXFP4 kept as stored (all 256 distinct: 3.4 GB),
read by the kernels' MXFP4 product.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from npu_worker.kernels import kit_for
from npu_worker.models.deepseek_v4.blocks import Expert
from npu_worker.models.kit import LayerKit
from npu_worker.models.moe import EXPERT_TILE, LocalExperts, RoutedExperts, routes
from npu_worker.models.stored import Mxfp4, StoredLinear, weights_from_checkpoint

HIDDEN, INNER, TOP, LIMIT = 4096, 2048, 6, 10.0


def timed(fn, rounds: int) -> float:  # type: ignore[no-untyped-def]
    """The median seconds of `rounds` calls, after one."""
    fn()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def fp4_expert(kit: LayerKit) -> Expert:
    """An expert whose three weights are MXFP4 as the release stores them: random e2m1
    bytes, every 32 inputs scaled by 2^-8 (values of about HIDDEN^-0.5)."""
    with weights_from_checkpoint():
        expert = Expert(HIDDEN, INNER, LIMIT, kit)
    for layer in (expert.w1, expert.w2, expert.w3):
        assert isinstance(layer, StoredLinear)
        out, inp = layer.out_features, layer.in_features
        packed = torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8)
        layer.keep_stored(Mxfp4(packed, torch.full((out, inp // 32), 119, dtype=torch.uint8)))
    return expert.bfloat16()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--distinct", type=int, default=16)
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument(
        "--fp4", action="store_true", help="MXFP4 experts kept as stored, every one distinct"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    kit = kit_for(torch.device("cpu"))
    if args.fp4:
        args.distinct = args.experts
        sets = [fp4_expert(kit) for _ in range(args.distinct)]
    else:
        sets = [Expert(HIDDEN, INNER, LIMIT, kit).bfloat16() for _ in range(args.distinct)]
        for expert in sets:
            for layer in (expert.w1, expert.w2, expert.w3):
                nn.init.normal_(layer.weight, std=HIDDEN**-0.5)
    kit.prepare()
    experts = nn.ModuleDict({str(e): sets[e % args.distinct] for e in range(args.experts)})
    routed = RoutedExperts(experts, range(args.experts), kit)
    flop_per_row = 2 * 3 * HIDDEN * INNER
    tile = routed.rows_per_call()
    print(f"kit {kit.name or 'torch'}, rows apart: {tile is None}, tile {tile}")
    one = sets[0]
    with torch.no_grad():
        full = torch.randn(128, HIDDEN).bfloat16()
        full_rate = 128 * flop_per_row / timed(lambda: one(full), 5)
        print(f"one expert over 128 rows: {full_rate / 1e9:.1f} GFLOP/s")
        for tokens in (8, 128):
            x = torch.randn(tokens, HIDDEN).bfloat16()
            scores = torch.rand(tokens, args.experts)
            top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :TOP]
            weights = scores.gather(1, top)
            route = routes(top, weights / weights.sum(-1, keepdim=True), torch.ones(tokens).bool())
            launch = timed(lambda x=x, r=route: routed(x, r, LocalExperts()), args.launches)
            counts = torch.bincount(route.experts.flatten(), minlength=args.experts)
            touched = counts[counts > 0].tolist()
            product_time = 0.0
            for rows in sorted(set(touched)):
                calls = -(-rows // EXPERT_TILE) if tile is not None else 1
                shape = EXPERT_TILE if tile is not None else rows
                part = torch.randn(shape, HIDDEN).bfloat16()
                product_time += touched.count(rows) * calls * timed(lambda p=part: one(p), 3)
            pairs = tokens * TOP
            ideal = pairs * flop_per_row / full_rate
            print(
                f"B{'8S1' if tokens == 8 else '1S128'}: {launch * 1e3:.1f} ms for {pairs} routed "
                f"pairs over {len(touched)} experts; their products alone {product_time * 1e3:.1f}"
                f" ms ({launch / product_time:.2f}x); the pairs at the full-tile rate "
                f"{ideal * 1e3:.1f} ms ({launch / ideal:.2f}x)"
            )


if __name__ == "__main__":
    main()
