"""Packed prefill: several requests' prompts share one B1S128 launch, each token with its own
position and KV slot, attending only within its own request, and every request's greedy
tokens are those it gets run alone, whatever shares its launch and wherever it starts."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batcher.dispatch import rank_plans
from batcher.intake import Tracked
from batcher.scheduler import PlannerConfig, PoolState, Sequence, finish, plan_step
from producer.client import Client
from schemas.config import Settings
from schemas.control import PrefillChunk, StepResult
from schemas.keys import Keys
from schemas.messages import GenerateRequest, SamplingParams
from tests.helpers import (
    TIE_TOLERANCE,
    LocalRank,
    check_stream,
    load_reference_model,
    random_prompt,
    reference,
    reference_runner,
)
from tests.reference import first_divergence, prefill_logits

SETTINGS = Settings(
    model="tiny", device="cpu", max_model_len=384, decode_batch=4, kv_slots_per_rank=8
)
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model():
    loaded = load_reference_model(SETTINGS)
    return loaded, reference_runner(loaded, SETTINGS)


def run_packed(
    loaded, prompts: list[list[int]], segments: int, prefill_slots: int
) -> tuple[dict[str, list[int]], int]:
    """Plan and run `prompts` on one packed rank, as the pool would; tokens per request and
    how many prefill launches held more than one request."""
    rank = LocalRank(
        reference_runner(loaded, SETTINGS),
        loaded.tokenizer,
        loaded.config.eos_token_ids,
        SETTINGS.max_model_len,
    )
    config = PlannerConfig(
        1, 8, 8, 4, 128, prefill_slots, pack_prefill=True, prefill_segments=segments
    )
    state = PoolState(config)
    tracked: dict[str, Tracked] = {}
    for order, prompt in enumerate(prompts):
        request = GenerateRequest(
            id=f"r{order}",
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=MAX_TOKENS),
        )
        tracked[request.id] = Tracked(b"0-1", "s", request, prompt)
        state.waiting.append(Sequence(request.id, len(prompt), MAX_TOKENS, order))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    shared = 0
    for step in range(1, 500):
        if not (state.waiting or state.running):
            return tokens, shared
        plan = plan_step(state)
        shared += sum(len(launch) > 1 for launches in plan.prefill.values() for launch in launches)
        for rank_plan in rank_plans(plan, tracked, 0, step, SETTINGS):
            out = rank.execute(rank_plan)
            for chunk in out.chunks:
                tokens[chunk.id] += chunk.token_ids
            for outcome in out.result.outcomes:
                if outcome.finish_reason is not None:
                    finish(state, outcome.request_id)
    raise AssertionError("the requests never finished")


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=7),
    segments=st.integers(1, 6),
    prefill_slots=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_packed_requests_get_the_tokens_they_get_alone(
    model, lengths: list[int], segments: int, prefill_slots: int, seed: int
) -> None:
    loaded, runner = model
    rng = random.Random(seed)
    prompts = [random_prompt(rng, n, loaded.config.vocab_size) for n in lengths]
    tokens, _ = run_packed(loaded, prompts, segments, prefill_slots)
    for i, prompt in enumerate(prompts):
        want = reference(loaded, runner, SETTINGS, prompt, MAX_TOKENS)
        problem = first_divergence(tokens[f"r{i}"], want, TIE_TOLERANCE)
        assert problem is None, f"r{i} ({len(prompt)} tokens of {lengths}): {problem}"


@pytest.mark.fast
def test_short_prompts_share_launches(model) -> None:
    loaded, _ = model
    rng = random.Random(1)
    prompts = [random_prompt(rng, n, loaded.config.vocab_size) for n in (20, 30, 40, 25, 10)]
    _, shared = run_packed(loaded, prompts, segments=8, prefill_slots=4)
    assert shared >= 1


@pytest.mark.fast
def test_exact_keys_and_whole_spans_side_by_side_give_the_same_launch(model) -> None:
    """The eager backend attends over exactly the keys each segment sees; graph backends lay
    every segment's whole span side by side. A launch continuing a cached prompt and
    starting two fresh ones comes out the same either way."""
    loaded, _ = model
    runner = reference_runner(loaded, SETTINGS)
    rng = random.Random(3)
    vocab = loaded.config.vocab_size
    cached = random_prompt(rng, 180, vocab)
    prefill_logits(runner, 2, cached[:128], 0)
    prefill_logits(runner, 2, cached[128:150], 128)
    token_ids = [cached[150:], random_prompt(rng, 40, vocab), random_prompt(rng, 20, vocab)]
    chunks = [
        PrefillChunk(slot=slot, start=start, num_tokens=len(ids))
        for slot, start, ids in zip((2, 5, 0), (150, 0, 0), token_ids)
    ]
    exact = runner._prefill_inputs(chunks, token_ids)
    assert exact.packed_keys is not None and exact.packed_keys.shape[1] == 180 + 40 + 20
    whole = dataclasses.replace(exact, packed_keys=None)
    with torch.no_grad():
        want = runner.backend.run(whole)
        got = runner.backend.run(exact)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.hidden[0, :90], want.hidden[0, :90], rtol=1e-4, atol=1e-4)


def test_a_burst_is_prefilled_packed_with_lone_run_tokens(
    start_pool, client: Client, redis_client
) -> None:
    pool_settings = start_pool(
        max_num_seqs=32, kv_slots_per_rank=32, decode_batch=8, max_model_len=256
    ).settings
    loaded = load_reference_model(pool_settings)
    runner = reference_runner(loaded, pool_settings)
    rng = random.Random(5)
    prompts = [random_prompt(rng, rng.randint(16, 96), loaded.config.vocab_size) for _ in range(24)]
    ids = [client.submit(prompt_token_ids=p, max_tokens=8) for p in prompts]
    for request_id, prompt in zip(ids, prompts):
        tokens = check_stream(list(client.stream(request_id, timeout_s=120)))
        want = reference(loaded, runner, pool_settings, prompt, 8)
        assert first_divergence(tokens, want, TIE_TOLERANCE) is None, request_id
    steps = [
        StepResult.decode(fields[b"m"])
        for _, fields in redis_client.xrange(Keys().step_results(pool_settings.pool))
    ]
    launches = sum(s.counts.num_prefill_launches for s in steps)
    prompt_tokens = sum(s.counts.num_prefill_tokens for s in steps)
    assert prompt_tokens == sum(len(p) for p in prompts)
    assert launches < len(prompts)  # several prompts per launch; unpacked it takes 24
