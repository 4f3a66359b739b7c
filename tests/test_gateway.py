"""The gateway driven by the official `openai` package: the pool's greedy results whole and
streamed, for completions and chat, sync and async; request ids; the models list."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import openai

from producer.client import Client
from tests.conftest import StartGateway, StartPool
from tests.helpers import check_stream

PROMPT = "The quick brown fox"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def api_for(gateway_url: str, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0, **kwargs)


def test_openai_client_gets_the_pools_greedy_completions_whole_and_streamed(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    pool = start_pool(ranks=1)
    gateway = start_gateway()
    api = api_for(gateway.url)
    model = pool.settings.model
    assert [m.id for m in api.models.list()] == [model]

    expected = client.generate(PROMPT, max_tokens=12, temperature=0.0)
    whole = api.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected.text
    assert whole.choices[0].finish_reason == expected.finish_reason
    assert expected.usage is not None and whole.usage is not None
    assert whole.usage.completion_tokens == expected.usage.completion_tokens
    assert whole.usage.prompt_tokens == expected.usage.prompt_tokens

    stream = api.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason

    by_ids = client.generate(prompt_token_ids=[5, 6, 7, 8], max_tokens=6)
    whole_ids = api.completions.create(
        model=model, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0
    )
    assert whole_ids.choices[0].text == by_ids.text

    rid = client.submit(PROMPT, max_tokens=6, logprobs=2)
    pool_logprobs = [e for c in client.stream(rid, timeout_s=30) for e in c.logprobs or []]
    scored = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, logprobs=2, temperature=0
    )
    assert scored.choices[0].logprobs is not None
    logprobs = scored.choices[0].logprobs
    assert logprobs.token_logprobs == [e["logprob"] for e in pool_logprobs]
    assert logprobs.top_logprobs is not None and logprobs.tokens is not None
    assert [sorted(top.values()) for top in logprobs.top_logprobs] == [
        sorted(lp for _, lp in e["top"]) for e in pool_logprobs
    ]
    assert len(logprobs.tokens) == 6 and all(isinstance(t, str) for t in logprobs.tokens)


def test_openai_client_gets_the_pools_chat_replies_whole_and_streamed(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    model = start_pool(ranks=1).settings.model
    api = api_for(start_gateway().url)
    expected = client.chat(MESSAGES, max_tokens=10, temperature=0.0)

    reply = api.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=10, temperature=0
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.usage is not None and expected.usage is not None
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens

    stream = api.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert {c.id for c in chunks} == {chunks[0].id}

    scored = api.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    assert scored.choices[0].logprobs is not None
    content = scored.choices[0].logprobs.content or []
    assert scored.usage is not None and len(content) == scored.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob  # the top one is the likeliest
        assert entry.bytes == list(entry.token.encode())


def test_a_client_chosen_request_id_names_the_request_in_the_pool(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    model = start_pool(ranks=1).settings.model
    api = api_for(start_gateway().url)
    raw = api.completions.with_raw_response.create(
        model=model,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        extra_headers={"X-Request-Id": "chosen-1"},
    )
    assert raw.headers["x-request-id"] == "chosen-1"
    completion = raw.parse()
    assert completion.id == "chosen-1"
    assert client.result("chosen-1", timeout_s=30).text == completion.choices[0].text
    again = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, extra_headers={"X-Request-Id": "chosen-1"}
    )  # the same id again: the finished request's answer, not a second run
    assert again.choices[0].text == completion.choices[0].text
    check_stream(list(client.stream("chosen-1", timeout_s=30)))
    models = api.models.with_raw_response.list()
    assert len(models.headers["x-request-id"]) == 32  # generated when not given


def test_async_openai_client_streams_concurrent_requests_each_as_the_pool_answers_it(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    model = start_pool(ranks=1).settings.model
    gateway = start_gateway()
    prompts = [f"{PROMPT} number {i}" for i in range(12)]
    expected = [client.generate(p, max_tokens=8, temperature=0.0).text for p in prompts]

    async def one(api: openai.AsyncOpenAI, prompt: str, stream: bool) -> str:
        if not stream:
            done = await api.completions.create(
                model=model, prompt=prompt, max_tokens=8, temperature=0
            )
            return done.choices[0].text
        parts = []
        async for chunk in await api.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True
        ):
            parts.append(chunk.choices[0].text)
        return "".join(parts)

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=gateway.url + "/v1", api_key="unused", max_retries=0
        ) as api:
            return list(
                await asyncio.gather(*(one(api, p, i % 2 == 0) for i, p in enumerate(prompts)))
            )

    assert asyncio.run(main()) == expected


def test_bench_http_measures_the_gateway_and_another_openai_server_with_one_client(
    start_pool: StartPool, start_gateway: StartGateway, tmp_path
) -> None:
    start_pool(ranks=1)
    other = start_gateway()  # stands in for another OpenAI-compatible server
    out = tmp_path / "bench.json"
    flags = ["--concurrency", "2", "--requests", "4", "--output-len", "3", "6"]
    flags += ["--prompt-len", "3", "7", "--no-peers", "--device", "cpu", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", "bench", "--http", "--http-url", other.url + "/v1"]
        + flags,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (level,) = json.loads(out.read_text())["levels"]
    # The same seeded workload with EOS ignored: every client gets every token.
    assert level["gateway"]["output_tokens"] == level["output_tokens"]
    assert level["http_peer"]["output_tokens"] == level["output_tokens"]
    assert level["gateway"]["requests"] == level["http_peer"]["requests"] == 4
    assert set(level["gateway_overhead"]) == {
        "ttft_p50_ms",
        "itl_p50_ms",
        "e2e_p50_ms",
        "throughput_ratio",
    }
    assert "gateway adds TTFT" in done.stdout


def test_cancel_route_ends_a_request_and_metrics_count_the_routes(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    import httpx

    start_pool(ranks=1)
    gateway = start_gateway()
    running = client.submit("long", max_tokens=200, ignore_eos=True)
    answer = httpx.post(f"{gateway.url}/v1/requests/{running}/cancel", timeout=10)
    assert answer.status_code == 202 and answer.json()["id"] == running
    assert client.result(running, timeout_s=60).finish_reason == "cancelled"
    bad = httpx.post(f"{gateway.url}/v1/requests/a%20b/cancel", timeout=10)
    assert bad.status_code == 400
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert (
        'npupool_gateway_requests_total{route="/v1/requests/{id}/cancel",status="202"} 1.0' in text
    )
    assert 'route="/v1/requests/{id}/cancel",status="400"} 1.0' in text
    assert "npupool_gateway_in_flight 0.0" in text
    assert running not in text  # request ids never become labels
