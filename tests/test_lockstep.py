"""Lockstep: every rank runs the same launches in the same order every step, idle ones on
padding (decode, MTP draft, and prefill with its draft), so collectives can never hang."""

from __future__ import annotations

import random

import pytest
import torch

from batcher.dispatch import rank_plans
from batcher.intake import Tracked
from batcher.scheduler import PlannerConfig, PoolState, Sequence, finish, plan_step
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import load_model
from npu_worker.weights.presets import resolve_model_dir
from schemas.config import Settings
from schemas.messages import GenerateRequest, SamplingParams
from tests.helpers import LocalRank, random_prompt
from tests.reference import launch_shapes

SETTINGS = Settings(
    model="tiny",
    device="cpu",
    ranks=2,
    lockstep=True,
    mtp=True,
    decode_batch=2,
    kv_slots_per_rank=4,
    max_model_len=512,
)


@pytest.mark.parametrize("packed", [False, True])
def test_lockstep_ranks_run_identical_launch_sequences_every_step(packed: bool) -> None:
    path = resolve_model_dir("tiny")
    loaded = load_model(path, SETTINGS.dtype, torch.device("cpu"), SETTINGS.max_kv_len, mtp=True)
    engines = [
        LocalRank(
            LaunchRunner(loaded.model, launch_shapes(4, SETTINGS.max_kv_len, 128, 2)),
            loaded.tokenizer,
            (),
            SETTINGS.max_model_len,
            rank=rank,
            lockstep=True,
        )
        for rank in range(2)
    ]
    state = PoolState(PlannerConfig(2, 8, 4, 2, 128, 4, lockstep=True, pack_prefill=packed))
    rng = random.Random(3)
    tracked: dict[str, Tracked] = {}
    # uneven work: a long prompt, short ones, and one request that ends at once
    for order, (length, max_tokens) in enumerate([(300, 6), (12, 20), (9, 1), (40, 9), (5, 3)]):
        prompt = random_prompt(rng, length, loaded.config.vocab_size)
        request = GenerateRequest(
            id=f"r{order}",
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        tracked[request.id] = Tracked(b"0-1", "s", request, prompt)
        state.waiting.append(Sequence(request.id, length, max_tokens, order))

    idle_steps = 0
    for step in range(1, 200):
        if not (state.waiting or state.running):
            break
        plans = {p.rank: p for p in rank_plans(plan_step(state), tracked, 0, step, SETTINGS)}
        logs = []
        for rank, engine in enumerate(engines):
            plan = plans.get(rank)
            outcomes = engine.execute(plan).result.outcomes if plan else []
            logs.append(list(engine.engine.runner.launches) if plan else [])
            for outcome in outcomes:
                if outcome.finish_reason is not None:
                    finish(state, outcome.request_id)
            idle_steps += (
                plan is not None
                and not any(
                    s in engine.busy_slots for launch in plan.decode_launches for s in launch
                )
                and all(not launch for launch in plan.prefill)
            )
        assert logs[0] == logs[1], f"step {step}: rank 0 ran {logs[0]}, rank 1 ran {logs[1]}"
        assert any("draft" in launch for launch in logs[0]) or not logs[0]
    assert not state.running and not state.waiting
    assert idle_steps > 0, "no step left a rank idle: the test shows nothing"
