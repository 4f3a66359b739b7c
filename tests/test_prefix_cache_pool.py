"""Prefix caching in a running pool (docs/architecture.md §3b): a request that shares a
finished request's leading blocks is told how many prompt tokens came from the cache, on
its final chunk and through the gateway, and gets its lone run's tokens; the pool's
counters, gauges and status show the reuse; a rank killed holding cached blocks loses
nothing, and its new process holds none; two pools sharing one Redis each compute a
prefix once."""

from __future__ import annotations

import random

import openai
import pytest

from producer.client import Client
from producer.status import collect_status
from schemas.config import Settings
from tests.conftest import StartGateway, StartPool
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
from tests.test_metrics import free_port_block, scrape

MAX_TOKENS = 6


def served(client: Client, prompt: list[int], pool: str | None = None) -> tuple[list[int], int]:
    """A greedy request's tokens and its final chunk's cached tokens."""
    request_id = client.submit(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    chunks = list(client.stream(request_id, timeout_s=120))
    final = chunks[-1]
    assert final.usage is not None and final.usage.prompt_tokens == len(prompt)
    return check_stream(chunks), final.usage.cached_tokens


def test_a_shared_prefix_is_served_from_the_cache_with_the_lone_runs_tokens(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    port = free_port_block(1)
    # slots that reserve every position (the cache of blocks is the tests below)
    pool = start_pool(ranks=2, max_model_len=512, metrics_port=port, kv_cache_fraction=0)
    loaded = load_reference_model(pool.settings)
    runner = reference_runner(loaded, pool.settings)
    rng = random.Random(5)
    system = random_prompt(rng, 300, loaded.config.vocab_size)  # two full blocks and more
    prompts = [system + random_prompt(rng, n, loaded.config.vocab_size) for n in (9, 30, 4)]
    first, cached = served(client, prompts[0])
    assert cached == 0
    for prompt in prompts[1:] + [system[:256]]:
        tokens, cached = served(client, prompt)
        assert cached == min(256, len(prompt) - 1)
        want = reference(loaded, runner, pool.settings, prompt, MAX_TOKENS)
        assert first_divergence(tokens, want, TIE_TOLERANCE) is None

    api = openai.OpenAI(base_url=start_gateway().url + "/v1", api_key="unused", max_retries=0)
    reply = api.completions.create(
        model=pool.settings.model, prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == 256
    assert len(first) == MAX_TOKENS

    samples = scrape(port)
    assert samples["npupool_prefix_cache_hits_total"] == 4 * 256 - 1
    assert samples["npupool_prefix_cache_queries_total"] == sum(map(len, prompts)) + 256 + 309
    assert samples["npupool_kv_blocks_total"] == 2 * 16 * 4  # 2 ranks of 16 slots of 512
    assert samples["npupool_kv_blocks_used"] == 0
    assert samples["npupool_cached_blocks"] >= 2

    def status() -> dict:
        [found] = collect_status(client.redis, client.keys)["pools"]
        return dict(found)

    wait_until(lambda: status()["prefix_cache"]["hit_tokens"] == 4 * 256 - 1, what="status")
    found = status()
    assert (found["kv_blocks_total"], found["kv_blocks_used"]) == (128, 0)


@pytest.mark.parametrize("paged", [False, True])
def test_a_rank_killed_holding_cached_blocks_loses_nothing_and_its_new_process_holds_none(
    start_pool: StartPool, client: Client, paged: bool
) -> None:
    """Slots that reserve, or a cache of blocks (40 of them)."""
    settings = Settings(model="tiny", device="cpu", max_model_len=512)
    loaded = load_reference_model(settings)
    memory = 40 * 128 * loaded.model.new_state(1, 128, 128, 1).bytes_per_token
    budget = {"kv_cache_memory": memory} if paged else {"kv_cache_fraction": 0}
    pool = start_pool(ranks=1, max_model_len=512, **budget)
    runner = reference_runner(loaded, pool.settings)
    rng = random.Random(6)
    system = random_prompt(rng, 260, loaded.config.vocab_size)
    served(client, system + [7, 8, 9])
    # a long request holds the blocks while the rank dies under it
    request_id = client.submit(prompt_token_ids=system + [5], max_tokens=200, ignore_eos=True)
    stream = client.stream(request_id, timeout_s=180)
    chunks = [next(stream)]
    pool.processes.kill("rank0")
    chunks += list(stream)
    tokens = check_stream(chunks)
    want = reference(loaded, runner, pool.settings, system + [5], 200)
    assert first_divergence(tokens, want, TIE_TOLERANCE) is None
    assert chunks[-1].usage is not None and chunks[-1].usage.cached_tokens == 0  # resumed afresh
    prompt = system + [11, 12]
    tokens, cached = served(client, prompt)
    want = reference(loaded, runner, pool.settings, prompt, MAX_TOKENS)
    assert first_divergence(tokens, want, TIE_TOLERANCE) is None
    assert cached == 256  # the resumed request's blocks, computed by the new process


@pytest.mark.parametrize("paged", [False, True])
def test_two_pools_sharing_one_redis_each_compute_a_prefix_once(
    start_pool: StartPool, client: Client, paged: bool
) -> None:
    """Slots that reserve, or caches of blocks (40 a pool)."""
    loaded = load_reference_model(Settings(model="tiny", device="cpu", max_model_len=512))
    memory = 40 * 128 * loaded.model.new_state(1, 128, 128, 1).bytes_per_token
    pools = [
        start_pool(
            pool=name,
            max_model_len=512,
            **({"kv_cache_memory": memory} if paged else {"kv_cache_fraction": 0}),
        )
        for name in ("left", "right")
    ]
    runner = reference_runner(loaded, pools[0].settings)
    rng = random.Random(8)
    system = random_prompt(rng, 280, loaded.config.vocab_size)
    prompts = [system + random_prompt(rng, 5, loaded.config.vocab_size) for _ in range(8)]
    results = [served(client, p) for p in prompts]
    for prompt, (tokens, _) in zip(prompts, results):
        want = reference(loaded, runner, pools[0].settings, prompt, MAX_TOKENS)
        assert first_divergence(tokens, want, TIE_TOLERANCE) is None
    wait_until(
        lambda: (
            sum(
                p["prefix_cache"]["queried_tokens"]
                for p in collect_status(client.redis, client.keys)["pools"]
            )
            == sum(map(len, prompts))
        ),
        what="both pools' counts",
    )
    status = collect_status(client.redis, client.keys)["pools"]
    served_by = [p for p in status if p["prefix_cache"]["queried_tokens"]]
    misses = sum(cached == 0 for _, cached in results)
    assert misses == len(served_by)  # each pool that served any computed the prefix once
    assert all(cached in (0, 256) for _, cached in results)
