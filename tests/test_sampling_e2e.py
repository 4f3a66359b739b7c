"""Sampling through the pool: seeded draws independent of the batch, stop strings that never
leak, logprobs of the model's own distribution, and min_tokens."""

from __future__ import annotations

import random

import pytest
import torch

from producer.client import Client
from schemas.control import NewRequest, PrefillChunk, RankStepPlan
from schemas.messages import FinishReason, SamplingParams
from tests.helpers import (
    LocalRank,
    check_stream,
    load_reference_model,
    random_prompt,
    reference_runner,
)
from tests.reference import prefill_logits


def test_a_seeded_request_draws_the_same_text_alone_and_under_load(
    start_pool, client: Client
) -> None:
    start_pool(ranks=2, decode_batch=4, max_model_len=512)
    sampled = {"max_tokens": 40, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}
    alone = client.generate(prompt_token_ids=[40, 41, 42], timeout_s=60, **sampled)
    rng = random.Random(3)
    crowd = [
        client.submit(
            prompt_token_ids=random_prompt(rng, rng.randrange(1, 200), 512),
            max_tokens=30,
            temperature=1.0,
            seed=i,
        )
        for i in range(15)
    ]
    again = client.submit(prompt_token_ids=[40, 41, 42], **sampled)
    crowd += [
        client.submit(prompt_token_ids=[7, i], max_tokens=30, temperature=0.7) for i in range(8)
    ]
    assert client.result(again, timeout_s=120).token_ids == alone.token_ids
    assert client.result(again, timeout_s=5).text == alone.text
    for request_id in crowd:
        client.result(request_id, timeout_s=120)


def ascii_boundary(text_pieces: list[str]) -> int | None:
    """A token boundary whose neighbours both end/start in plain ASCII letters."""
    for k in range(3, len(text_pieces) - 1):
        left, right = text_pieces[k], text_pieces[k + 1]
        if (
            left[-1:].isascii()
            and left[-1:].isalnum()
            and right[:1].isascii()
            and right[:1].isalnum()
        ):
            return k
    return None


def test_a_stop_string_spanning_two_tokens_never_leaks(start_pool, client: Client) -> None:
    settings = start_pool(ranks=1, max_model_len=512).settings
    tokenizer = load_reference_model(settings).tokenizer
    for prompt in ("Hello there", "The queue said", "Once upon a time", "Redis streams"):
        full = client.generate(prompt, max_tokens=60, ignore_eos=True, timeout_s=60)
        pieces = [tokenizer.decode([t]) for t in full.token_ids]
        k = ascii_boundary(pieces)
        if k is not None:
            break
    else:
        pytest.fail("no ASCII token boundary found to build a spanning stop string")
    stop = pieces[k][-1] + pieces[k + 1][0]
    cut = full.text.find(stop)
    request_id = client.submit(prompt, max_tokens=60, ignore_eos=True, stop=[stop])
    chunks = list(client.stream(request_id, timeout_s=60))
    check_stream(chunks)
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == FinishReason.STOP
    assert text == full.text[:cut] and stop not in text
    assert not any(
        stop[0] == c.text[-1:] and c is not chunks[-1] and text.endswith(c.text)
        for c in chunks[:-1]
    )


def test_logprobs_are_the_log_softmax_of_the_models_logits(start_pool, client: Client) -> None:
    settings = start_pool(ranks=1, max_model_len=512, decode_batch=4).settings
    prompt = [30, 31, 32, 33]
    chunks = list(
        client.stream(
            client.submit(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True, logprobs=3),
            timeout_s=60,
        )
    )
    tokens = check_stream(chunks)
    entries = [e for c in chunks for e in (c.logprobs or [])]
    assert [e["token_id"] for e in entries] == tokens
    loaded = load_reference_model(settings)
    runner = reference_runner(loaded, settings)
    logits = prefill_logits(runner, 0, prompt, 0)[0]
    for i, entry in enumerate(entries):
        want = torch.log_softmax(logits.double(), dim=-1)
        assert entry["logprob"] == pytest.approx(float(want[tokens[i]]), abs=1e-4)
        top = want.topk(3)
        assert [t for t, _ in entry["top"]] == top.indices.tolist()
        assert [v for _, v in entry["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)
        logits = runner.decode([0], [tokens[i]], [len(prompt) + i])[0]


@pytest.mark.fast
def test_min_tokens_keeps_eos_away_until_reached() -> None:
    from schemas.config import Settings

    settings = Settings(
        model="tiny", device="cpu", max_model_len=256, decode_batch=2, kv_slots_per_rank=2
    )
    loaded = load_reference_model(settings)
    prompt = [50, 60, 70]
    first = int(prefill_logits(reference_runner(loaded, settings), 0, prompt, 0).argmax())

    def run(min_tokens: int) -> list[int]:
        engine = LocalRank(reference_runner(loaded, settings), loaded.tokenizer, (first,), 256)
        new = NewRequest(
            request_id="m",
            slot=0,
            prompt_token_ids=prompt,
            num_prompt_tokens=3,
            sampling=SamplingParams(max_tokens=8, min_tokens=min_tokens),
            result_ttl_s=60,
        )
        out = engine.execute(
            RankStepPlan(
                epoch=1,
                step=1,
                rank=0,
                new_requests=[new],
                prefill=[[PrefillChunk(slot=0, start=0, num_tokens=3)]],
            )
        )
        tokens = list(out.chunks[0].token_ids)
        step = 2
        while engine.busy_slots:
            out = engine.execute(RankStepPlan(epoch=1, step=step, rank=0, decode_launches=[[0]]))
            tokens += out.chunks[0].token_ids
            step += 1
        return tokens

    assert run(0) == [first]  # the greedy first token is the EOS here
    held = run(5)
    assert len(held) >= 5 and first not in held[:5]
