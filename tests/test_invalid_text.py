"""Text that is not valid Unicode gets a clear rejection on every way in (a raw entry, the
Python client, the gateway), never a dead letter, a codec error or a 500; and unknown chat
roles are refused at the gateway as OpenAI's API refuses them."""

from __future__ import annotations

import json

import httpx
import msgpack
import openai
import pytest
from pydantic import ValidationError

from producer.client import Client
from schemas.codec import Rejected, decode_request
from schemas.keys import Keys
from schemas.messages import FinishReason, GenerateRequest
from tests.conftest import StartGateway, StartPool
from tests.helpers import wait_until

KEYS = Keys()
LATIN1 = "café crème".encode("latin-1")  # é is one byte, 0xE9, that is not UTF-8 here


PLACEHOLDER = "#" * len(LATIN1)


def raw_entry(request_id: str, where: str) -> bytes:
    """A request whose `where` string (prompt, stop, metadata) is a msgpack *str* holding
    Latin-1 bytes, as a producer in another language that never declared its encoding
    writes it: packed with a placeholder of the same length, whose bytes are then swapped."""
    request: dict[str, object] = {"v": 1, "id": request_id, "prompt": "fine"}
    request["sampling"] = {"max_tokens": 4, "stop": [PLACEHOLDER] if where == "stop" else []}
    if where == "prompt":
        request["prompt"] = PLACEHOLDER
    if where == "metadata":
        request["metadata"] = {"source": PLACEHOLDER}
    packed = msgpack.packb(request, use_bin_type=True)
    assert packed.count(PLACEHOLDER.encode()) == 1
    return packed.replace(PLACEHOLDER.encode(), LATIN1)


@pytest.mark.parametrize(
    ("where", "field"),
    [("prompt", "prompt"), ("stop", "sampling.stop.0"), ("metadata", "metadata.source")],
)
def test_a_field_that_is_not_utf8_is_rejected_naming_the_field_and_byte(
    where: str, field: str
) -> None:
    raw = raw_entry("latin-1", where)
    assert msgpack.unpackb(raw, raw=True)[b"id"] == b"latin-1"  # the map itself is fine
    with pytest.raises(Rejected) as caught:
        decode_request(raw, 1 << 20)
    rejected = caught.value
    assert rejected.request_id == "latin-1" and rejected.code == "invalid_request"
    assert f"field `{field}`: not valid UTF-8 at byte 3" in str(rejected)  # after "caf"


def test_a_lone_surrogate_is_a_validation_error_naming_the_field() -> None:
    with pytest.raises(ValidationError) as caught:
        GenerateRequest(id="s", prompt="\ud800 hello")
    error = caught.value.errors()[0]
    assert error["loc"] == ("prompt",)
    assert "lone surrogate U+D800 at character 0" in error["msg"]
    with pytest.raises(ValidationError) as caught:
        GenerateRequest(id="s", messages=[{"role": "user", "content": "hi \udfff"}])
    assert caught.value.errors()[0]["loc"] == ("messages", 0, "content")


def test_invalid_text_through_the_stream_and_the_client_is_rejected_and_the_pool_serves_on(
    start_pool: StartPool, client: Client, redis_client
) -> None:
    start_pool(ranks=1)
    redis_client.xadd(KEYS.requests, {"m": raw_entry("raw-latin-1", "prompt")})
    chunks = list(client.stream("raw-latin-1", timeout_s=60))
    assert len(chunks) == 1 and chunks[0].finish_reason == FinishReason.REJECTED
    assert chunks[0].error is not None and chunks[0].error.code == "invalid_request"
    assert "field `prompt`: not valid UTF-8 at byte 3" in chunks[0].error.message
    assert redis_client.xlen(KEYS.dead) == 0

    with pytest.raises(ValidationError) as caught:
        client.submit("\ud800 hello", max_tokens=4)
    assert caught.value.errors()[0]["loc"] == ("prompt",)
    with pytest.raises(ValidationError):
        client.submit(prompt_token_ids=[5], stop=["ok", "\udc80"], max_tokens=4)

    done = client.generate(prompt="still serving", max_tokens=4, timeout_s=60)
    assert done.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    wait_until(lambda: redis_client.xlen(KEYS.requests) == 0, what="every entry deleted")


def test_the_gateway_answers_invalid_text_and_unknown_roles_with_a_400_naming_the_field(
    start_pool: StartPool, start_gateway: StartGateway
) -> None:
    pool = start_pool(ranks=1)
    model = pool.settings.model
    gateway = start_gateway()
    # the `openai` package cannot encode a lone surrogate, so these bodies are written as
    # JSON text with the escape, as other JSON encoders produce it
    bodies = [
        ("/v1/completions", {"model": model, "prompt": "\\ud800 hello"}, "prompt"),
        (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "hi \\udfff"}]},
            "messages",
        ),
    ]
    for path, body, param in bodies:
        text = json.dumps(body).replace("\\\\u", "\\u")
        reply = httpx.post(
            gateway.url + path,
            content=text.encode(),
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and "lone surrogate" in error["message"], error
        assert error["type"] == "invalid_request_error", error

    api = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(
            model=model,
            messages=[{"role": "narrator", "content": "Once upon a time"}],  # type: ignore[misc]
        )
    assert caught.value.status_code == 400 and caught.value.param == "messages"
    assert "role" in caught.value.message

    reply = api.chat.completions.create(
        model=model, messages=[{"role": "developer", "content": "hi"}], max_tokens=3
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
