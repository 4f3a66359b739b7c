"""Fixed-shape launches: only declared shapes reach the model, and a row's logits never
depend on the span read, the cache layout, or what its neighbours hold."""

from __future__ import annotations

import random

import pytest
import torch

from npu_worker.models.launch import LaunchInputs
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import LoadedModel
from schemas.config import Settings
from schemas.control import NewRequest, PrefillChunk, RankStepPlan
from schemas.messages import SamplingParams
from tests.helpers import LocalRank, load_reference_model, random_prompt
from tests.reference import launch_shapes, prefill_logits

pytestmark = pytest.mark.fast

SETTINGS = Settings(
    model="tiny", device="cpu", max_model_len=512, kv_slots_per_rank=8, decode_batch=4
)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_reference_model(SETTINGS)


def make_runner(loaded: LoadedModel, num_slots: int = 8) -> LaunchRunner:
    return LaunchRunner(
        loaded.model,
        launch_shapes(
            num_slots, SETTINGS.max_kv_len, SETTINGS.prefill_chunk, SETTINGS.decode_batch
        ),
    )


def prefilled(runner: LaunchRunner, slot: int, prompt: list[int]) -> int:
    """Prefill `prompt` into `slot`; returns its greedy next token."""
    logits = torch.empty(0)
    for start in range(0, len(prompt), runner.prefill_chunk):
        logits = prefill_logits(runner, slot, prompt[start : start + runner.prefill_chunk], start)
    return int(logits.argmax())


def test_decode_logits_are_bit_identical_whatever_span_or_layout(loaded: LoadedModel) -> None:
    runner = make_runner(loaded)
    prompt = random_prompt(random.Random(0), 100, loaded.config.vocab_size)
    token = prefilled(runner, 2, prompt)
    scratch = runner.state.scratch_position
    outputs = []
    for span, window in [(128, 2), (256, 2), (512, 0), (512, None)]:
        slots = list(range(window, window + 4)) if window is not None else [2, 0, 0, 0]
        row = 2 - window if window is not None else 0
        ids = [[0]] * 4
        positions = [[scratch]] * 4
        ids[row], positions[row] = [token], [len(prompt)]
        launch = LaunchInputs(
            torch.tensor(ids),
            torch.tensor(positions),
            torch.tensor(slots),
            torch.zeros(4, 1, dtype=torch.long),
            span,
            window,
        )
        outputs.append(loaded.model(launch, runner.state).logits[row, 0])
    for other in outputs[1:]:
        assert torch.equal(outputs[0], other)


def test_a_rows_logits_do_not_depend_on_its_neighbours(loaded: LoadedModel) -> None:
    runner = make_runner(loaded)
    rng = random.Random(1)
    prompts = [random_prompt(rng, n, loaded.config.vocab_size) for n in (5, 40, 130, 7)]
    tokens = [prefilled(runner, slot, p) for slot, p in enumerate(prompts)]
    positions = [len(p) for p in prompts]
    together = runner.decode([0, 1, 2, 3], tokens, positions)
    for slot in range(4):
        fresh = make_runner(loaded)
        prefilled(fresh, slot, prompts[slot])
        alone = fresh.decode([slot], [tokens[slot]], [positions[slot]])
        assert torch.equal(alone[0], together[slot])


def test_padding_rows_and_dummy_launches_touch_only_scratch(loaded: LoadedModel) -> None:
    runner = make_runner(loaded)
    prompt = random_prompt(random.Random(2), 50, loaded.config.vocab_size)
    prefilled(runner, 5, prompt)
    before = [k[:, :, :-1].clone() for k in runner.state.k]
    runner.dummy_prefill()
    runner.decode([], [], [])
    after = [k[:, :, :-1] for k in runner.state.k]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_engine_runs_only_the_declared_launch_shapes(loaded: LoadedModel) -> None:
    runner = make_runner(loaded)
    shapes: set[tuple[int, ...]] = set()
    loaded.model.register_forward_pre_hook(
        lambda _m, args: shapes.add(tuple(args[0].input_ids.shape))
    )
    engine = LocalRank(runner, loaded.tokenizer, (), SETTINGS.max_model_len)
    rng = random.Random(3)
    news = [
        NewRequest(
            request_id=f"r{i}",
            slot=i,
            prompt_token_ids=random_prompt(rng, n, 500),
            num_prompt_tokens=n,
            sampling=SamplingParams(max_tokens=3),
            result_ttl_s=60,
        )
        for i, n in enumerate((3, 200))
    ]
    plans = [
        RankStepPlan(
            epoch=1,
            step=1,
            rank=0,
            new_requests=news,
            prefill=[
                [PrefillChunk(slot=0, start=0, num_tokens=3)],
                [PrefillChunk(slot=1, start=0, num_tokens=128)],
            ],
        ),
        RankStepPlan(
            epoch=1,
            step=2,
            rank=0,
            decode_launches=[[0]],
            prefill=[[PrefillChunk(slot=1, start=128, num_tokens=72)]],
        ),
        RankStepPlan(epoch=1, step=3, rank=0, decode_launches=[[0, 1]]),
    ]
    outputs = [engine.execute(plan) for plan in plans]
    assert shapes == {(1, SETTINGS.prefill_chunk), (SETTINGS.decode_batch, 1)}
    assert [len(o.chunks) for o in outputs] == [1, 2, 2]
    assert outputs[2].chunks[0].finish_reason == "length"  # r0: 3 tokens, max_tokens 3
    assert outputs[2].result.counts.num_padding_rows == SETTINGS.decode_batch - 2


def test_generation_stops_at_max_model_len(loaded: LoadedModel) -> None:
    runner = make_runner(loaded)
    engine = LocalRank(runner, loaded.tokenizer, (), max_model_len=130)
    prompt = random_prompt(random.Random(4), 128, 500)
    new = NewRequest(
        request_id="long",
        slot=0,
        prompt_token_ids=prompt,
        num_prompt_tokens=128,
        sampling=SamplingParams(max_tokens=50),
        result_ttl_s=60,
    )
    first = engine.execute(
        RankStepPlan(
            epoch=1,
            step=1,
            rank=0,
            new_requests=[new],
            prefill=[[PrefillChunk(slot=0, start=0, num_tokens=128)]],
        )
    )
    second = engine.execute(RankStepPlan(epoch=1, step=2, rank=0, decode_launches=[[0]]))
    assert first.chunks[0].finish_reason is None
    final = second.chunks[0]
    assert final.finish_reason == "length" and final.index == 1
    assert final.usage is not None and final.usage.completion_tokens == 2
    assert engine.busy_slots == []
