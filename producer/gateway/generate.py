"""Completions and chat completions: parse the body, submit, answer whole or streamed."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request

from producer.client import NotReplicated, QueueFull, RequestTooLarge, UnknownTenant
from producer.gateway.errors import RETRY_AFTER_S, ApiError, from_validation
from producer.gateway.protocol import ChatRequest, CompletionRequest
from producer.gateway.render import Renderer, token_id_text
from producer.gateway.responses import GenerationResponse
from producer.gateway.state import Gateway

DEADLINE_HEADER = "x-deadline-ms"
CANCEL_HEADER = "x-cancel-on-disconnect"
NO = ("0", "false", "no")


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object, at most `max_bytes` long (413 beyond, 400 if not JSON)."""
    declared = int(request.headers.get("content-length") or 0)
    if declared > max_bytes:
        raise ApiError(413, f"request body is {declared} bytes, over the limit of {max_bytes}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise ApiError(413, f"request body is over the limit of {max_bytes} bytes")
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise ApiError(400, f"request body is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, not {type(data).__name__}")
    return data


def _deadline(request: Request, body: dict[str, Any]) -> None:
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is not None and body.get("deadline_ms") is None:
        try:
            body["deadline_ms"] = int(raw)
        except ValueError as exc:
            raise ApiError(
                400, f"header X-Deadline-Ms: not epoch milliseconds ({raw!r:.40})"
            ) from exc


@dataclass(slots=True)
class Submission:
    """A parsed body as `Client.submit` arguments."""

    body: ChatRequest | CompletionRequest
    prompt: str | None
    token_ids: list[int] | None
    options: dict[str, Any]
    renames: dict[str, str]


def parse(kind: str, body: dict[str, Any]) -> Submission:
    """A body as submit arguments; 400 naming the field when something is wrong."""
    try:
        if kind == "chat":
            chat = ChatRequest.model_validate(body)
            options = chat.options() | {"messages": chat.chat_messages()}
            return Submission(chat, None, None, options, {"logprobs": "top_logprobs"})
        completion = CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from exc
    prompt, token_ids = completion.prompt_parts()
    renames = {"prompt_token_ids": "prompt"}
    return Submission(completion, prompt, token_ids, completion.options(), renames)


async def generate(request: Request, kind: str) -> GenerationResponse:
    """Submit a completion or chat request; answer it whole or as a stream."""
    gateway: Gateway = request.app.state.gateway
    body = await read_json(request, gateway.config.max_body_bytes)
    _deadline(request, body)
    job = parse(kind, body)
    pool, max_model_len = gateway.model_for(job.body.model)
    job.options.setdefault("max_tokens", max_model_len)  # chat with no limit: the model's
    request_id = request.state.request_id
    try:
        await gateway.client.submit(
            job.prompt,
            prompt_token_ids=job.token_ids,
            request_id=request_id,
            tenant=request.state.tenant,
            **job.options,
        )
    except ValidationError as exc:
        raise from_validation(exc, job.renames) from exc
    except QueueFull as exc:
        raise ApiError(
            429, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}
        ) from exc
    except RequestTooLarge as exc:
        raise ApiError(413, str(exc), code="too_large") from exc
    except UnknownTenant as exc:  # the key is this gateway's, its tenant not the pool's
        raise ApiError(403, str(exc), code="unknown_tenant") from exc
    except NotReplicated as exc:  # retryable with the same request id
        raise ApiError(
            503, str(exc), code="not_replicated", headers={"Retry-After": str(RETRY_AFTER_S)}
        ) from exc
    wants_logprobs = job.options.get("logprobs") is not None
    renderer = Renderer(
        "chat" if kind == "chat" else "completion",
        request_id,
        job.body.model,
        int(time.time()),
        wants_logprobs=wants_logprobs,
        token_text=await gateway.pools.token_text(pool) if wants_logprobs else token_id_text,
    )
    cancel_on_disconnect = request.headers.get(CANCEL_HEADER, "1").lower() not in NO
    return GenerationResponse(
        gateway.client.subscribe(request_id),
        renderer,
        lambda: gateway.client.cancel(request_id),
        stream=bool(job.body.stream),
        include_usage=job.body.include_usage,
        continuous_usage=job.body.continuous_usage,
        cancel_on_disconnect=cancel_on_disconnect,
        first_wait_s=gateway.config.first_chunk_wait_s,
        keepalive_s=gateway.config.keepalive_s,
        renames=job.renames,
    )
