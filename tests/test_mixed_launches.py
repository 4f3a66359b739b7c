"""Decode rows riding in packed prefill launches (docs/architecture.md §3): where a rank's
products keep rows apart, a decode micro-batch runs as one-token segments in the room a
prefill launch leaves, a launch fewer, and every request's tokens and logprobs keep
their bits, greedy or seeded, whatever rode where."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from batcher.dispatch import rank_plans
from batcher.intake import Tracked
from batcher.scheduler import PlannerConfig, PoolState, Sequence, finish, plan_step
from npu_worker.kernels.cpu.layers import CpuKit
from npu_worker.kernels.cpu.library import CpuKernels
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import load_model
from npu_worker.weights.presets import resolve_model_dir
from schemas.config import Settings
from schemas.control import DECODE_ROW
from schemas.messages import GenerateRequest, SamplingParams
from tests.helpers import LocalRank, random_prompt

SETTINGS = Settings(
    model="tiny",
    device="cpu",
    dtype="bfloat16",
    max_model_len=384,
    decode_batch=4,
    kv_slots_per_rank=8,
    prefill_segments=4,
)
MAX_TOKENS = 10


def runner_of(path: Path, kernels: CpuKernels, product: bool | Literal["tiles"]) -> Any:
    kit = CpuKit(kernels, kernel_products=product)
    loaded = load_model(path, "bfloat16", torch.device("cpu"), SETTINGS.max_kv_len, kit=kit)
    shapes = replace(
        SETTINGS.launch_shapes(), block_size=0, kv_cache_memory=0, kv_cache_fraction=0.0
    )
    return loaded, LaunchRunner(loaded.model, shapes)


def run(loaded: Any, runner: LaunchRunner, mix: bool, seed: int) -> tuple[dict, int]:
    """Requests arriving over the first steps, planned as the pool plans them (decode rows
    riding where `mix`) and run on one rank: each request's chunks (tokens, logprobs), and
    how many rows rode."""
    rank = LocalRank(runner, loaded.tokenizer, (), SETTINGS.max_model_len)
    config = PlannerConfig(
        1, 8, 8, 4, 128, 2, pack_prefill=True, prefill_segments=4, mix_decode=mix
    )
    state = PoolState(config)
    rng = random.Random(seed)
    vocab = loaded.config.vocab_size
    arrivals = [(step, random_prompt(rng, rng.randint(5, 150), vocab)) for step in range(0, 14, 2)]
    tracked: dict[str, Tracked] = {}
    out: dict[str, list[tuple[list[int], Any]]] = {}
    rode = 0
    for step in range(1, 400):
        for order, (at, prompt) in enumerate(arrivals):
            if at == step - 1:
                sampled = order % 2 == 1  # every other request samples, seeded
                sampling = SamplingParams(
                    max_tokens=MAX_TOKENS,
                    ignore_eos=True,
                    logprobs=2,
                    temperature=1.0 if sampled else 0.0,
                    seed=order if sampled else None,
                )
                request = GenerateRequest(
                    id=f"r{order}", prompt_token_ids=prompt, sampling=sampling
                )
                tracked[request.id] = Tracked(b"0-1", "s", request, prompt)
                state.waiting.append(Sequence(request.id, len(prompt), MAX_TOKENS, order))
                out[request.id] = []
        if step > len(arrivals) * 2 and not (state.waiting or state.running):
            return out, rode
        plan = plan_step(state)
        launches = [launch for by_rank in plan.prefill.values() for launch in by_rank]
        rode += sum(chunk.start == DECODE_ROW for launch in launches for chunk in launch)
        for rank_plan in rank_plans(plan, tracked, 0, step, SETTINGS):
            done = rank.execute(rank_plan)
            for chunk in done.chunks:
                out[chunk.id].append((chunk.token_ids, chunk.logprobs))
            for outcome in done.result.outcomes:
                if outcome.finish_reason is not None:
                    finish(state, outcome.request_id)
    raise AssertionError("the requests never finished")


@pytest.mark.parametrize(
    ("family", "product"), [("llama", "kernels"), ("llama", "tiles"), ("deepseek_v3", "kernels")]
)
def test_rows_riding_in_prefill_launches_keep_their_tokens_and_logprobs(
    kernels: CpuKernels, family: str, product: str, tmp_path: Path
) -> None:
    if product == "tiles" and not kernels.has_tiles:
        pytest.skip("no AMX tiles on this CPU, in this build or from this kernel")
    if family == "llama":
        path = resolve_model_dir("tiny")
    else:  # routed experts too: each expert's rows are its products' own
        path = tmp_path / "v3"
        pytest.importorskip("npu_worker.weights.makers.deepseek_v3").build(path, q_lora=True)
    chosen: bool | Literal["tiles"] = "tiles" if product == "tiles" else True
    loaded, runner = runner_of(path, kernels, chosen)
    assert runner.mixes
    apart, none_rode = run(loaded, runner, mix=False, seed=3)
    mixed, rode = run(loaded, runner, mix=True, seed=3)
    assert none_rode == 0 and rode >= 8  # rows rode in several launches
    assert set(mixed) == set(apart) and all(mixed[r] == apart[r] for r in apart)
    assert all(sum(len(t) for t, _ in chunks) == MAX_TOKENS for chunks in mixed.values())


def test_a_rank_mixes_only_where_its_products_keep_rows_apart(kernels: CpuKernels) -> None:
    path = resolve_model_dir("tiny")
    loaded, onednn = runner_of(path, kernels, False)
    assert not loaded.model.kit.rows_apart  # oneDNN picks its kernels by the row count
    assert not onednn.mixes
