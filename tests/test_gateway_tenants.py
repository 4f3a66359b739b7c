"""The gateway's API keys map to tenants: each key's requests queue for its tenant, a key
the tenants file does not name is refused, a tenant past its own max_queue gets 429 while
another is served, and a flood of one tenant does not hold back another's HTTP requests."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import redis

from producer.client import Client
from schemas.keys import Keys
from tests.conftest import StartGateway, StartPool
from tests.helpers import wait_until

KEYS = Keys()
TENANTS = """
[tenants.web]
api_keys = ["web-key"]

[tenants.batch]
max_queue = 30
api_keys = ["batch-key"]
"""


def api_for(gateway_url: str, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway_url + "/v1", api_key=api_key, max_retries=0)


def last_chunk_ms(redis_client: redis.Redis, request_id: str) -> int:
    ((entry_id, _),) = redis_client.xrevrange(KEYS.result(request_id), count=1)
    return int(entry_id.split(b"-")[0])


def test_api_keys_queue_for_their_tenants_and_a_flood_holds_no_one_back(
    start_pool: StartPool,
    start_gateway: StartGateway,
    client: Client,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    pool = start_pool(ranks=1, max_num_seqs=4, kv_slots_per_rank=4, tenants=str(path))
    model = pool.settings.model
    gateway = start_gateway("--tenants", str(path))
    web, batch = api_for(gateway.url, "web-key"), api_for(gateway.url, "batch-key")

    with pytest.raises(openai.AuthenticationError):
        api_for(gateway.url, "stranger").completions.create(model=model, prompt="hi")

    # batch floods its quota over the raw wire; then its key is refused, web's is not
    with Client(client.url, tenant="batch") as flooder:
        flood = [
            flooder.submit("tell me", max_tokens=200, ignore_eos=True, request_id=f"flood-{i}")
            for i in range(30)
        ]
    with pytest.raises(openai.RateLimitError) as caught:
        batch.completions.create(model=model, prompt="hi", max_tokens=2)
    assert caught.value.response.headers["retry-after"] == "1"
    assert "tenant 'batch'" in caught.value.message

    def ask(i: int) -> str:
        done = web.completions.create(model=model, prompt=f"question {i}", max_tokens=8)
        assert done.usage is not None and 1 <= done.usage.completion_tokens <= 8
        return done.id

    with ThreadPoolExecutor(4) as threads:
        answered = list(threads.map(ask, range(4)))
    for request_id in flood:  # nothing accepted was lost
        assert client.result(request_id, timeout_s=180).finish_reason == "length"
    finals = {rid: list(client.stream(rid, timeout_s=10))[-1] for rid in answered}
    assert {chunk.tenant for chunk in finals.values()} == {"web"}
    assert list(client.stream(flood[0], timeout_s=10))[-1].tenant == "batch"
    last_web = max(last_chunk_ms(redis_client, rid) for rid in answered)
    behind = [r for r in flood if last_chunk_ms(redis_client, r) > last_web]
    assert len(behind) > 15, f"only {len(behind)} of 30 flood requests ended after web's"
    wait_until(lambda: client.redis.xlen(KEYS.requests) == 0, what="an empty default queue")


@pytest.mark.fast
def test_a_bad_tenants_file_stops_the_gateway_saying_why(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.web]\nweight = -1\n")
    command = [sys.executable, "-m", "npu_pool.cli", "gateway", "--tenants", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "tenants.web.weight: Input should be greater than 0" in done.stderr
