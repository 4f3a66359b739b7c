"""A pool with `--kv-cache-memory` (docs/architecture.md §3c): its cache is blocks handed
out as requests grow, so a budget that held 8 full-length slots runs dozens of short
requests at once, each with its lone run's tokens; a request that could never fit is
rejected saying why, and the pool goes on; status and Prometheus count the blocks."""

from __future__ import annotations

import random
import threading

from npu_worker.weights.loader import LoadedModel
from producer.client import Client
from producer.status import collect_status
from schemas.config import Settings
from tests.conftest import StartPool
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

MAX_MODEL_LEN = 2048


def tiny_model() -> tuple[LoadedModel, int]:
    """The pools' model, loaded here, and the cache bytes one token takes in it."""
    loaded = load_reference_model(Settings(model="tiny", device="cpu", max_model_len=MAX_MODEL_LEN))
    return loaded, loaded.model.new_state(1, 128, 128, 1).bytes_per_token


def test_eight_full_slots_memory_runs_64_short_requests_together(
    start_pool: StartPool, client: Client
) -> None:
    """What 8 slots of 2048 tokens reserved now holds 128 blocks: 64 requests of 200 tokens
    (2 blocks each) decode together, at least 48 of them running at once."""
    loaded, per_token = tiny_model()
    memory = 8 * MAX_MODEL_LEN * per_token
    port = free_port_block(1)
    pool = start_pool(
        max_model_len=MAX_MODEL_LEN,
        kv_slots_per_rank=64,
        max_num_seqs=64,
        kv_cache_memory=memory,
        metrics_port=port,
        heartbeat_s=0.1,
    )
    runner = reference_runner(loaded, pool.settings)
    rng = random.Random(21)
    prompts = [random_prompt(rng, 100, loaded.config.vocab_size) for _ in range(64)]
    ids = [client.submit(prompt_token_ids=p, max_tokens=100, ignore_eos=True) for p in prompts]
    most = 0
    done = threading.Event()

    def watch() -> None:  # the pool's status, as often as it is published
        nonlocal most
        while not done.wait(0.05):
            [found] = collect_status(client.redis, client.keys)["pools"]
            most = max(most, int(found["running"]))
            assert found["kv_blocks_total"] == 128

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i, request_id in enumerate(ids):
            tokens = check_stream(list(client.stream(request_id, timeout_s=300)))
            if i % 16 == 0:
                want = reference(loaded, runner, pool.settings, prompts[i], 100)
                assert first_divergence(tokens, want, TIE_TOLERANCE) is None
            assert len(tokens) == 100
    finally:
        done.set()
        watcher.join()
    assert most >= 48, most
    samples = scrape(port)
    assert samples["npupool_kv_blocks_total"] == 128
    wait_until(lambda: scrape(port)["npupool_kv_blocks_used"] == 0, what="blocks given back")


def test_a_request_that_could_never_fit_is_rejected_with_its_reason(
    start_pool: StartPool, client: Client
) -> None:
    loaded, per_token = tiny_model()
    pool = start_pool(max_model_len=MAX_MODEL_LEN, kv_cache_memory=6 * 128 * per_token)
    rng = random.Random(4)
    prompt = random_prompt(rng, 300, loaded.config.vocab_size)
    request_id = client.submit(prompt_token_ids=prompt, max_tokens=600, ignore_eos=True)
    [final] = list(client.stream(request_id, timeout_s=60))
    assert final.finish_reason == "rejected"
    assert final.error is not None and final.error.code == "cache_too_small"
    assert "8 cache blocks" in final.error.message and "holds 5" in final.error.message
    # the pool goes on: the same prompt asking for less fits
    request_id = client.submit(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True)
    tokens = check_stream(list(client.stream(request_id, timeout_s=60)))
    runner = reference_runner(loaded, pool.settings)
    want = reference(loaded, runner, pool.settings, prompt, 8)
    assert first_divergence(tokens, want, TIE_TOLERANCE) is None
