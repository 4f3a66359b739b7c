"""Priority orders the whole queue, and a much more urgent request preempts a running one,
which later resumes with exactly the tokens it would have had."""

from __future__ import annotations

import random

from producer.client import Client
from producer.status import pool_status
from schemas.keys import Keys
from tests.helpers import (
    TIE_TOLERANCE,
    check_stream,
    load_reference_model,
    random_prompt,
    reference,
    reference_runner,
    wait_until,
)
from tests.reference import first_divergence

KEYS = Keys()
LOW_TOKENS = 160


def final_entry_id(redis_client, request_id: str) -> tuple[int, int]:
    """Where a request's final chunk sits in time (its stream entry id)."""
    ((entry_id, _),) = redis_client.xrevrange(KEYS.result(request_id), count=1)
    ms, seq = entry_id.decode().split("-")
    return int(ms), int(seq)


def test_a_priority_9_request_behind_100_queued_ones_finishes_before_most_of_them(
    start_pool, client: Client, redis_client
) -> None:
    settings = start_pool(max_num_seqs=1, kv_slots_per_rank=1, max_model_len=256).settings
    loaded = load_reference_model(settings)
    rng = random.Random(9)
    vocab = loaded.config.vocab_size
    low = {f"low-{i}": random_prompt(rng, 20, vocab) for i in range(100)}
    for request_id, prompt in low.items():  # each long enough that a slot never frees in time
        client.submit(prompt_token_ids=prompt, max_tokens=LOW_TOKENS, request_id=request_id)
    wait_until(lambda: redis_client.xlen(KEYS.result("low-0")) > 0, what="the pool to be busy")
    urgent = random_prompt(rng, 20, vocab)
    client.submit(prompt_token_ids=urgent, max_tokens=24, request_id="urgent", priority=9)

    streams = {r: check_stream(list(client.stream(r, timeout_s=180))) for r in [*low, "urgent"]}
    runner = reference_runner(loaded, settings)
    # the urgent one, the one it preempted (low-0, running when it came) and a few others
    checked = [("urgent", urgent, 24)] + [
        (r, low[r], LOW_TOKENS) for r in ("low-0", "low-1", "low-50", "low-99")
    ]
    for request_id, prompt, max_tokens in checked:
        want = reference(loaded, runner, settings, prompt, max_tokens)
        problem = first_divergence(streams[request_id], want, TIE_TOLERANCE)
        assert problem is None, (request_id, problem)
    done_at = final_entry_id(redis_client, "urgent")
    ahead = [r for r in low if final_entry_id(redis_client, r) < done_at]
    assert len(ahead) < 10, f"{len(ahead)} of 100 earlier requests finished first"
    wait_until(
        lambda: pool_status(redis_client, KEYS, settings.pool, 0)["preempted"] >= 1,
        what="the preemption to be counted",
    )
