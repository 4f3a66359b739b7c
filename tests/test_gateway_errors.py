"""Gateway errors in OpenAI's format, each with its status, as the `openai` package sees them."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from producer.client import Client
from tests.conftest import StartGateway, StartPool
from tests.helpers import wait_until


def api_for(gateway_url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway_url + "/v1", api_key=api_key, max_retries=0)


def test_bad_fields_get_a_400_naming_the_field(
    start_pool: StartPool, start_gateway: StartGateway
) -> None:
    pool = start_pool(ranks=1)
    model, max_model_len = pool.settings.model, pool.settings.max_model_len
    api = api_for(start_gateway().url)
    too_long = [2 + i % 200 for i in range(max_model_len)]
    cases: list[tuple[str, dict[str, object]]] = [
        ("n", {"prompt": "hi", "n": 0}),
        ("frequency", {"prompt": "hi", "extra_body": {"frequency": 1}}),
        ("top_p", {"prompt": "hi", "top_p": 7}),
        ("presence_penalty", {"prompt": "hi", "presence_penalty": 5}),
        (
            "response_format",
            {
                "prompt": "hi",
                "extra_body": {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {
                            "name": "x",
                            "schema": {"type": "object", "minProperties": "x"},
                        },
                    }
                },
            },
        ),
        ("min_tokens", {"prompt": "hi", "max_tokens": 2, "extra_body": {"min_tokens": 5}}),
        ("prompt", {"prompt": too_long}),  # no room left within max_model_len
        ("prompt", {"prompt": too_long, "stream": True}),
        ("prompt", {"prompt": [10**6]}),  # outside the vocabulary
    ]
    for param, fields in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            api.completions.create(model=model, **fields)  # type: ignore[call-overload]
        error = caught.value
        assert error.status_code == 400 and error.param == param, (param, error.body)
        assert param in error.message or "prompt_token_ids" in error.message
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], top_logprobs=30
        )
    assert caught.value.param == "top_logprobs"
    with pytest.raises(openai.NotFoundError) as not_found:
        api.completions.create(model="no-such-model", prompt="hi")
    assert not_found.value.code == "model_not_found"


def test_a_full_queue_is_a_429_with_retry_after(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    model = start_pool(ranks=1, max_queue=1).settings.model
    api = api_for(start_gateway(env={"NPUPOOL_MAX_QUEUE": "1"}).url)
    running = client.submit("occupy", max_tokens=1000, ignore_eos=True)
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            api.completions.create(model=model, prompt="hi", max_tokens=2)
        assert caught.value.response.headers["retry-after"] == "1"
        assert caught.value.code == "queue_full"
    finally:
        client.cancel(running)
    assert client.result(running, timeout_s=60).finish_reason == "cancelled"
    # its entry is deleted just after its final chunk: then the queue has room again
    wait_until(lambda: client.redis.xlen(client.keys.requests) == 0, what="an empty queue")
    done = api.completions.create(model=model, prompt="hi", max_tokens=2)
    assert done.usage is not None and done.usage.completion_tokens <= 2


def test_a_request_past_its_deadline_is_a_504(
    start_pool: StartPool, start_gateway: StartGateway
) -> None:
    model = start_pool(ranks=1).settings.model
    api = api_for(start_gateway().url)
    past_ms = str(int(time.time() * 1000) - 1000)
    for how in (
        {"extra_headers": {"X-Deadline-Ms": past_ms}},
        {"extra_body": {"deadline_ms": past_ms}},
    ):
        with pytest.raises(openai.InternalServerError) as caught:
            api.completions.create(model=model, prompt="late", max_tokens=4, **how)  # type: ignore[call-overload]
        assert caught.value.status_code == 504 and caught.value.code == "timeout"


def test_no_ready_pool_is_a_503_and_health_says_so(
    start_pool: StartPool, start_gateway: StartGateway
) -> None:
    start_pool(ranks=1)
    gateway = start_gateway("--namespace", "elsewhere", ready=False)
    health = httpx.get(gateway.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    with pytest.raises(openai.InternalServerError) as caught:
        api_for(gateway.url).completions.create(model="tiny", prompt="hi")
    assert caught.value.status_code == 503 and caught.value.code == "no_ready_pool"


def test_api_keys_are_required_when_set_and_health_stays_open(
    start_pool: StartPool, start_gateway: StartGateway
) -> None:
    model = start_pool(ranks=1).settings.model
    gateway = start_gateway("--api-key", "key-one", env={"NPUPOOL_API_KEYS": "key-two, key-3"})
    assert httpx.get(gateway.url + "/health").status_code == 200
    for wrong in ("nope", "key-one-and-more", "key"):
        with pytest.raises(openai.AuthenticationError):
            api_for(gateway.url, api_key=wrong).models.list()
    unauthenticated = httpx.get(gateway.url + "/v1/models")
    assert unauthenticated.status_code == 401 and unauthenticated.json()["error"]["message"]
    for right in ("key-one", "key-two", "key-3"):
        done = api_for(gateway.url, api_key=right).completions.create(
            model=model, prompt="hi", max_tokens=2
        )
        assert done.usage is not None and done.usage.completion_tokens <= 2


def test_oversized_bodies_bad_json_and_bad_request_ids_are_refused(
    start_pool: StartPool, start_gateway: StartGateway
) -> None:
    start_pool(ranks=1, max_request_bytes=1024)
    gateway = start_gateway("--max-body-bytes", "2048")
    url = gateway.url + "/v1/completions"
    big = httpx.post(url, json={"model": "tiny", "prompt": "x" * 4096})
    assert big.status_code == 413 and "2048" in big.json()["error"]["message"]
    # under the gateway's limit, over the pool's max_request_bytes once encoded
    over = httpx.post(url, json={"model": "tiny", "prompt": "y" * 1500})
    assert over.status_code == 413 and "max_request_bytes=1024" in over.json()["error"]["message"]
    not_json = httpx.post(url, content=b"{nope", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]["message"]
    bad_id = httpx.post(url, json={"model": "tiny", "prompt": "x"}, headers={"X-Request-Id": "a b"})
    assert bad_id.status_code == 400 and "X-Request-Id" in bad_id.json()["error"]["message"]
    assert httpx.get(gateway.url + "/v1/nothing-here").status_code == 404
