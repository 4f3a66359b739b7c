"""End to end: requests in through a real Redis, tokens out of worker processes (issue 2)."""

from __future__ import annotations

import random

from producer.client import Client
from schemas.control import StepResult
from schemas.keys import Keys
from schemas.messages import FinishReason
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

PROMPT_LENGTHS = [1, 127, 128, 129, 300, 2, 64, 200, 255, 256, 257, 17]


def test_concurrent_greedy_requests_match_each_request_run_alone(
    start_pool, client: Client, redis_client
) -> None:
    settings = start_pool(
        ranks=2, decode_batch=4, max_num_seqs=32, kv_slots_per_rank=16, max_model_len=512
    ).settings
    loaded = load_reference_model(settings)
    rng = random.Random(2)
    vocab = loaded.config.vocab_size
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(40)]
    cases = [(random_prompt(rng, n, vocab), rng.randrange(1, 65)) for n in lengths]
    ids = [
        client.submit(prompt_token_ids=p, max_tokens=m, request_id=f"r{i}")
        for i, (p, m) in enumerate(cases)
    ]

    runner = reference_runner(loaded, settings)
    for request_id, (prompt, max_tokens) in zip(ids, cases):
        chunks = list(client.stream(request_id, timeout_s=120))
        tokens = check_stream(chunks)
        want = reference(loaded, runner, settings, prompt, max_tokens)
        problem = first_divergence(tokens, want, TIE_TOLERANCE)
        assert problem is None, f"{request_id} (prompt {len(prompt)} tokens): {problem}"
        final = chunks[-1]
        assert final.usage is not None
        assert final.usage.prompt_tokens == len(prompt)
        assert final.usage.completion_tokens == len(tokens)
        expected_reason = FinishReason.LENGTH if len(tokens) == max_tokens else FinishReason.STOP
        assert final.finish_reason == expected_reason

    results = redis_client.xrange(Keys().step_results(settings.pool))
    steps = [StepResult.decode(fields[b"m"]) for _, fields in results]
    counts = [s.counts for s in steps]
    assert max(c.num_decode_launches for c in counts) == 4  # 16 rows per rank, B4 launches
    assert all(c.num_decode_rows + c.num_padding_rows == 4 * c.num_decode_launches for c in counts)
    wait_until(lambda: redis_client.xlen(Keys().requests) == 0, what="every entry deleted")


def test_async_client_streams_the_same_greedy_tokens_as_the_sync_client(
    start_pool, client: Client, redis_url: str
) -> None:
    import asyncio

    from producer.client import AsyncClient

    start_pool(ranks=1, max_model_len=256)
    expected = client.generate("async or not", max_tokens=12, timeout_s=60)

    async def run() -> list:
        aclient = AsyncClient(redis_url)
        try:
            assert await aclient.wait_ready(timeout_s=10) == "default"
            request_id = await aclient.submit("async or not", max_tokens=12)
            return [chunk async for chunk in aclient.stream(request_id, timeout_s=60)]
        finally:
            await aclient.close()

    chunks = asyncio.run(run())
    assert check_stream(chunks) == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text
