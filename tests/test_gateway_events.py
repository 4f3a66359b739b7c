"""Result streams over HTTP: resumable SSE events with `Last-Event-ID`, and a client that
leaves cancelling its request in the pool."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from producer.client import Client
from schemas.codec import encode
from schemas.keys import FIELD
from schemas.messages import ResultChunk
from tests.conftest import StartGateway, StartPool
from tests.helpers import check_stream


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    """(id, data) of each event of a text/event-stream, comments skipped."""
    event_id, data = None, []
    for line in lines:
        if not line:
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def read_events(
    url: str, headers: dict[str, str] | None = None, limit: int | None = None
) -> list[tuple[int, dict[str, Any]]]:
    """Events of a result stream as (id, chunk map); with `limit`, drop the connection then."""
    got: list[tuple[int, dict[str, Any]]] = []
    with httpx.stream("GET", url, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for event_id, data in sse_events(response.iter_lines()):
            got.append((int(event_id or -1), json.loads(data)))
            if limit is not None and len(got) == limit:
                break  # leaving the block closes the connection mid-stream
    return got


def whole_stream(client: Client, request_id: str) -> list[dict[str, Any]]:
    """The result stream read with the Redis client, as the JSON the events carry."""
    chunks = list(client.stream(request_id, timeout_s=120))
    check_stream(chunks)
    return [c.model_dump(mode="json") for c in chunks]


def test_events_resume_after_a_dropped_connection_with_no_chunk_lost_or_repeated(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    start_pool(ranks=1)
    gateway = start_gateway()
    request_id = client.submit("resume me", max_tokens=200, ignore_eos=True)
    url = f"{gateway.url}/v1/requests/{request_id}/events"

    before = read_events(url, limit=5)
    last_id = before[-1][0]
    after = read_events(url, headers={"Last-Event-ID": str(last_id)})
    expected = whole_stream(client, request_id)
    assert len(expected) > 5 and [e for _, e in before + after] == expected
    assert [i for i, _ in before + after] == [c["seq"] for c in expected]

    assert [e for _, e in read_events(url)] == expected  # replayed whole once finished
    final_seq = str(expected[-1]["seq"])
    assert read_events(url, headers={"Last-Event-ID": final_seq}) == []
    assert read_events(f"{url}?last_event_id={last_id}") == after  # for clients without headers
    bad = httpx.get(url, headers={"Last-Event-ID": "seven"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == request_id


def test_a_dropped_completion_stream_can_be_resumed_when_asked_not_to_cancel(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    model = start_pool(ranks=1).settings.model
    gateway = start_gateway()
    body = {"model": model, "prompt": "go on", "max_tokens": 120, "ignore_eos": True}
    headers = {"X-Request-Id": "keep-1", "X-Cancel-On-Disconnect": "false"}
    with httpx.stream(
        "POST", f"{gateway.url}/v1/completions", json=body | {"stream": True}, headers=headers
    ) as response:
        assert response.headers["x-request-id"] == "keep-1"
        first = next(sse_events(response.iter_lines()))
    seen = json.loads(first[1])["choices"][0]["text"]
    events = read_events(f"{gateway.url}/v1/requests/keep-1/events")
    done = client.result("keep-1", timeout_s=120)
    assert done.finish_reason == "length" and len(done.token_ids) == 120
    assert "".join(e["text"] for _, e in events) == done.text and done.text.startswith(seen)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request_in_the_pool(
    start_pool: StartPool, start_gateway: StartGateway, client: Client, stream: bool
) -> None:
    model = start_pool(ranks=1).settings.model
    gateway = start_gateway()
    request_id = f"leaver-{stream}"
    body = {"model": model, "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": stream}
    url = f"{gateway.url}/v1/completions"
    headers = {"X-Request-Id": request_id}
    if stream:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
            next(sse_events(response.iter_lines()))  # one chunk, then hang up
    else:
        with pytest.raises(httpx.ReadTimeout):  # give up waiting for the whole answer
            httpx.post(url, json=body, headers=headers, timeout=httpx.Timeout(60, read=0.25))
    chunks = list(client.stream(request_id, timeout_s=60))
    tokens = check_stream(chunks)
    assert chunks[-1].finish_reason == "cancelled" and len(tokens) < 1000


def test_text_with_unicode_line_separators_stays_one_event_for_a_line_splitting_client(
    start_gateway: StartGateway, client: Client
) -> None:
    # JSON need not escape U+0085, U+2028 or U+2029, but Python's str.splitlines (and so
    # httpx's iter_lines, which read_events uses) ends a line at each of them
    texts = ["one\u2028two", "three\x85four", "five\u2029six\n"]
    request_id = "line-separators"
    chunks = [
        ResultChunk(id=request_id, seq=seq, index=seq, token_ids=[seq], text=text)
        for seq, text in enumerate(texts)
    ]
    chunks[-1] = chunks[-1].model_copy(update={"finish_reason": "length"})
    for chunk in chunks:
        client.redis.xadd(client.keys.result(request_id), {FIELD: encode(chunk)})
    gateway = start_gateway(ready=False)
    events = read_events(f"{gateway.url}/v1/requests/{request_id}/events")
    assert [event_id for event_id, _ in events] == [0, 1, 2]
    assert [data["text"] for _, data in events] == texts
