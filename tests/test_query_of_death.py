"""A request whose processing raises ends alone (`error`/`internal`), in-process; a request
that kills whatever rank runs it ends `max_deliveries` after that many rank deaths, while
every other request finishes with its lone-run tokens and the pool serves on."""

from __future__ import annotations

import os
import random
import signal

import pytest

import npu_worker.engine as engine_module
from npu_worker.output.stops import StopStrings
from producer.client import Client
from producer.status import collect_status
from schemas.config import Settings
from schemas.control import NewRequest, PrefillChunk, RankStepPlan
from schemas.keys import Keys
from schemas.messages import FinishReason, ResultChunk, SamplingParams
from tests.helpers import (
    TIE_TOLERANCE,
    LocalRank,
    check_stream,
    load_reference_model,
    random_prompt,
    reference,
    reference_runner,
    wait_until,
)
from tests.reference import first_divergence

POISON_SEED = 666


def run_alone_in_engine(
    engine: LocalRank, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[ResultChunk]]:
    """Prefill every request in one step, then decode them together until all end."""
    news = [
        NewRequest(
            request_id=request_id,
            slot=slot,
            prompt_token_ids=prompt,
            num_prompt_tokens=len(prompt),
            sampling=sampling,
            result_ttl_s=60,
        )
        for slot, (request_id, (prompt, sampling)) in enumerate(requests.items())
    ]
    prefill = [
        [PrefillChunk(slot=n.slot, start=0, num_tokens=len(n.prompt_token_ids))] for n in news
    ]
    plan = RankStepPlan(epoch=0, step=0, rank=0, new_requests=news, prefill=prefill)
    chunks: dict[str, list[ResultChunk]] = {r: [] for r in requests}
    for step in range(1, 200):
        for chunk in engine.execute(plan).chunks:
            chunks[chunk.id].append(chunk)
        if not engine.busy_slots:
            return chunks
        launch = engine.busy_slots
        plan = RankStepPlan(epoch=0, step=step, rank=0, decode_launches=[launch])
    raise AssertionError("requests never ended")


@pytest.mark.fast
def test_an_exception_serving_one_request_ends_only_that_request(monkeypatch) -> None:
    settings = Settings(model="tiny", device="cpu", max_model_len=256, decode_batch=4)
    loaded = load_reference_model(settings)
    runner = reference_runner(loaded, settings)
    engine = LocalRank(runner, loaded.tokenizer, loaded.config.eos_token_ids, 256)
    real_sample, real_feed = engine_module.sample, StopStrings.feed

    def poisoned_sample(logits, rows):  # a sampling bug that only one request's row hits
        if POISON_SEED in rows.seed.tolist():
            raise FloatingPointError("poisoned row")
        return real_sample(logits, rows)

    def poisoned_feed(self, text):  # a stop-string bug that only one request's stop hits
        if self.stops == ["zz"]:
            raise UnicodeError("poisoned stop")
        return real_feed(self, text)

    monkeypatch.setattr(engine_module, "sample", poisoned_sample)
    monkeypatch.setattr(StopStrings, "feed", poisoned_feed)
    rng = random.Random(4)
    vocab = loaded.config.vocab_size
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    requests = {f"ok-{i}": (random_prompt(rng, 10 + i, vocab), greedy) for i in range(2)} | {
        "bad-sample": (
            random_prompt(rng, 7, vocab),
            greedy.model_copy(update={"seed": POISON_SEED, "temperature": 0.8}),  # sampled
        ),
        "bad-stop": (
            random_prompt(rng, 9, vocab),
            greedy.model_copy(update={"stop": ["zz"]}),
        ),
    }
    chunks = run_alone_in_engine(engine, requests)

    for request_id in ("bad-sample", "bad-stop"):
        final = chunks[request_id][-1]
        assert final.finish_reason == FinishReason.ERROR, request_id
        assert final.error is not None and final.error.code == "internal"
        assert ("poisoned row" if request_id == "bad-sample" else "poisoned stop") in (
            final.error.message
        )
        check_stream(chunks[request_id])
    reference_runner_alone = reference_runner(loaded, settings)
    for request_id in ("ok-0", "ok-1"):
        tokens = check_stream(chunks[request_id])
        prompt, sampling = requests[request_id]
        want = reference(loaded, reference_runner_alone, settings, prompt, sampling.max_tokens)
        assert first_divergence(tokens, want, TIE_TOLERANCE) is None, request_id
        assert chunks[request_id][-1].finish_reason == FinishReason.LENGTH


@pytest.mark.timeout(300)
def test_a_request_that_kills_every_rank_running_it_ends_after_max_deliveries(
    start_pool, client: Client, redis_client
) -> None:
    pool = start_pool(
        ranks=2,
        max_deliveries=3,
        rank_timeout_s=2.0,
        heartbeat_s=0.1,
        max_model_len=1024,
        decode_batch=4,
    )
    settings = pool.settings
    loaded = load_reference_model(settings)
    rng = random.Random(8)
    vocab = loaded.config.vocab_size
    others = {f"other-{i}": random_prompt(rng, 8 + i, vocab) for i in range(20)}
    client.submit(
        prompt_token_ids=random_prompt(rng, 16, vocab),
        request_id="deadly",
        max_tokens=1000,
        ignore_eos=True,
    )
    for request_id, prompt in others.items():
        client.submit(prompt_token_ids=prompt, request_id=request_id, max_tokens=16)

    keys = Keys()
    kills = 0

    def kill_whoever_holds_it() -> bool:
        nonlocal kills
        done = redis_client.xrevrange(keys.result("deadly"), count=1)
        if done and b"final" in done[0][1] and done[0][1][b"final"] == b"1":
            return True
        for rank in collect_status(redis_client, keys)["pools"][0]["ranks"]:
            if "deadly" in rank["requests"] and rank["state"] == "ready":
                os.kill(rank["pid"], signal.SIGKILL)
                kills += 1
                wait_until(
                    lambda r=rank: r["pid"] not in running_pids(redis_client, keys),
                    what="the killed rank to be replaced",
                    timeout_s=60,
                )
        return False

    wait_until(kill_whoever_holds_it, timeout_s=240, what="the deadly request to end")
    chunks = list(client.stream("deadly", timeout_s=10))
    check_stream(chunks)
    final = chunks[-1]
    assert final.finish_reason == FinishReason.ERROR and final.error is not None
    assert final.error.code == "max_deliveries" and kills == 3
    dead_letters = redis_client.xrange(keys.dead)
    (dead,) = dead_letters
    assert b"max_deliveries=3" in dead[1][b"reason"]

    runner = reference_runner(loaded, settings)
    for request_id, prompt in others.items():
        tokens = check_stream(list(client.stream(request_id, timeout_s=120)))
        want = reference(loaded, runner, settings, prompt, 16)
        assert first_divergence(tokens, want, TIE_TOLERANCE) is None, request_id
    assert client.generate(prompt="still serving", max_tokens=4, timeout_s=120).token_ids


def running_pids(redis_client, keys: Keys) -> set[int]:
    """Pids of ranks that registered as ready."""
    ranks = collect_status(redis_client, keys)["pools"][0]["ranks"]
    return {r["pid"] for r in ranks if r["state"] == "ready"}
