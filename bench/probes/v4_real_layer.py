"""One DeepSeek-V4-Flash layer at its published sizes, in the release's layout, served by two
expert-parallel ranks:

    python -m bench.probes.v4_real_layer DIR [--requests 4] [--max-tokens 4] [--json FILE]

Writes (once) a checkpoint of V4-Flash's configuration (bench.probes.v4_state) cut to one
compressed-sparse layer and no MTP block: hidden 4096, 64 heads of 512, 256 routed experts
of 2048 and one shared, top-6 by score, the release's names, its attention projections as
FP8 e4m3 with UE8M0 128x128 block scales and its routed experts as MXFP4, random weights
(about 3.9 GB). Then starts a pool of two ranks with `--expert-parallel` (each rank reads
and holds its 128 experts as stored), sends the requests, reports each rank's resident
weight bytes beside the checkpoint's and the requests' tokens, and checks them against the
same prompts run alone on one rank holding every expert.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench.probes.v4_state import V4_FLASH
from npu_pool.embedded import EmbeddedRedis
from npu_pool.launcher import PoolProcesses
from npu_worker.models.deepseek_v4.config import DeepseekV4Config
from npu_worker.models.deepseek_v4.model import DeepseekV4CausalLM
from npu_worker.models.kit import TorchKit
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import load_model
from npu_worker.weights.makers.deepseek_v3 import fp8_blocks
from npu_worker.weights.makers.deepseek_v4 import attention_projections, mxfp4_blocks, release_name
from npu_worker.weights.tiny import ensure_tiny_model
from producer.client import Client
from producer.status import collect_status
from schemas.config import Settings
from schemas.control import PrefillChunk
from schemas.registry import LaunchShapes

MAX_MODEL_LEN = 256


def real_config() -> dict[str, Any]:
    """V4-Flash's configuration with one CSA layer, no hash-routed layer, no MTP block."""
    config = dict(V4_FLASH)
    config |= {
        "num_hidden_layers": 1,
        "num_hash_layers": 0,
        "num_nextn_predict_layers": 0,
        "compress_ratios": [4],
        "expert_dtype": "fp4",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    }
    return config


def write(out: Path, seed: int = 0) -> None:
    """The checkpoint: each tensor's name and shape from the model built on no memory."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(real_config(), indent=2))
    (out / "tokenizer.json").write_bytes((ensure_tiny_model() / "tokenizer.json").read_bytes())
    config = DeepseekV4Config.from_dir(out)
    with torch.device("meta"):
        model = DeepseekV4CausalLM(config, MAX_MODEL_LEN, with_mtp=False, kit=TorchKit())
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    shapes |= {
        name: tuple(b.shape)
        for name, b in model.named_buffers()
        if name.endswith("tid2eid") or name.endswith("e_score_correction_bias")
    }
    fp8 = set(attention_projections(dict.fromkeys(map(release_name, shapes), torch.empty(0))))
    for name, shape in shapes.items():  # each quantized as it is drawn: 25 GB as floats
        key = release_name(name)
        if "norm" in name or name.endswith(("attn_sink", "_scale", "_base")):
            state[key] = torch.ones(shape) if "norm" in name else torch.zeros(shape)
            continue
        fan_in = shape[-1] if len(shape) > 1 else 1
        tensor = torch.randn(shape, generator=generator) / fan_in**0.5
        scale_key = key.removesuffix(".weight") + ".scale"
        if ".ffn.experts." in key and key.endswith(".weight"):
            state[key], state[scale_key] = mxfp4_blocks(tensor)
        elif key in fp8:
            state[key], state[scale_key] = fp8_blocks(tensor, power_of_two=True)
        else:
            state[key] = tensor.bfloat16()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def greedy_alone(
    runner: LaunchRunner, prompt: list[int], max_tokens: int
) -> tuple[list[int], list[float]]:
    """The prompt alone in slot 0 (prefill, then one row a decode launch): its greedy
    tokens and each step's top-2 logit gap."""
    logits = runner.prefill([PrefillChunk(slot=0, start=0, num_tokens=len(prompt))], [prompt])
    last = logits.logits[:, 0]
    tokens: list[int] = []
    gaps: list[float] = []
    while True:
        top2 = last[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        tokens.append(int(last[0].argmax()))
        if len(tokens) >= max_tokens:
            return tokens, gaps
        last = runner.decode([0], [tokens[-1]], [len(prompt) + len(tokens) - 1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.probes.v4_real_layer", description=__doc__
    )
    parser.add_argument("dir", type=Path)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not (args.dir / "model.safetensors").exists():
        started = time.perf_counter()
        write(args.dir)
        print(f"wrote {args.dir} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    checkpoint = (args.dir / "model.safetensors").stat().st_size
    rng = random.Random(41)
    prompts = [
        [rng.randrange(3, 256) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    workdir = Path(tempfile.mkdtemp(prefix="npupool-v4-real-"))
    server = EmbeddedRedis(data_dir=workdir / "redis")
    url = server.start()
    report: dict[str, Any] = {
        "checkpoint_bytes": checkpoint,
        "settings": vars(args) | {"dir": str(args.dir), "json": str(args.json)},
    }
    settings = Settings(
        redis_url=url,
        model=str(args.dir),
        dtype=args.dtype,
        ranks=2,
        expert_parallel=True,
        threads_per_rank=1,
        decode_batch=8,
        kv_slots_per_rank=args.requests,
        max_num_seqs=args.requests,
        max_model_len=MAX_MODEL_LEN,
        pool="v4-real",
    )
    processes = PoolProcesses(settings, url, log_dir=workdir / "logs")
    processes.start()
    try:
        with Client(url) as client:
            started = time.perf_counter()
            client.wait_ready(timeout_s=1800, pool=settings.pool)
            report["ready_s"] = time.perf_counter() - started
            status = collect_status(client.redis, client.keys)
            report["ranks"] = [
                {k: rank.get(k) for k in ("rank", "weight_bytes", "checkpoint_bytes")}
                for pool in status["pools"]
                for rank in pool["ranks"]
            ]
            started = time.perf_counter()
            ids = [
                client.submit(prompt_token_ids=p, max_tokens=args.max_tokens, ignore_eos=True)
                for p in prompts
            ]
            served = [client.result(i, timeout_s=3600).token_ids for i in ids]
            report["served_s"] = time.perf_counter() - started
            report["served"] = served
    finally:
        processes.stop(timeout_s=60)
        server.stop()
    print(json.dumps(report, indent=2), file=sys.stderr)
    torch.set_num_threads(1)
    started = time.perf_counter()
    alone = load_model(args.dir, args.dtype, torch.device("cpu"), MAX_MODEL_LEN)
    shapes = LaunchShapes(
        decode_batch=1,
        prefill_chunk=128,
        prefill_segments=8,
        num_slots=1,
        max_kv_len=MAX_MODEL_LEN,
        mtp=False,
    )
    runner = LaunchRunner(alone.model, shapes)
    lone = [greedy_alone(runner, p, args.max_tokens) for p in prompts]
    report["alone_s"] = time.perf_counter() - started
    report["alone_weight_bytes"] = alone.weight_bytes
    report["alone_checkpoint_bytes"] = alone.checkpoint_bytes
    report["alone"] = [tokens for tokens, _ in lone]
    report["alone_top2_gaps"] = [gaps for _, gaps in lone]
    report["same_tokens"] = report["alone"] == report["served"]
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "alone_top2_gaps"}, indent=2))
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
