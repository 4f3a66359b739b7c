"""Completions and chat completions: parse the body, submit, answer whole or streamed."""

from __future__ import annotations

import contextlib
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


def choice_request_ids(request_id: str, n: int) -> list[str]:
    """The pool requests of `n` choices: choice 0 is the request itself, choice i is
    `{request_id}.{i}` (each its own result stream, resumable as any other)."""
    return [request_id] + [f"{request_id}.{i}" for i in range(1, n)]


def choice_options(options: dict[str, Any], index: int) -> dict[str, Any]:
    """Choice `index`'s submit options: a given seed counts up per choice, so each choice is
    its own seeded stream and the whole answer is reproducible."""
    if index and options.get("seed") is not None:
        return {**options, "seed": options["seed"] + index}
    return options


async def _submit_choices(
    gateway: Gateway, job: Submission, choice_ids: list[str], tenant: str
) -> None:
    """Submit every choice; if one is refused, those already queued are cancelled."""
    queued: list[str] = []
    try:
        for index, choice_id in enumerate(choice_ids):
            await gateway.client.submit(
                job.prompt,
                prompt_token_ids=job.token_ids,
                request_id=choice_id,
                tenant=tenant,
                **choice_options(job.options, index),
            )
            queued.append(choice_id)
    except BaseException:
        for choice_id in queued:
            with contextlib.suppress(Exception):
                await gateway.client.cancel(choice_id)
        raise


async def generate(request: Request, kind: str) -> GenerationResponse:
    """Submit a completion or chat request; answer it whole or as a stream."""
    gateway: Gateway = request.app.state.gateway
    body = await read_json(request, gateway.config.max_body_bytes)
    _deadline(request, body)
    job = parse(kind, body)
    pool, max_model_len = gateway.model_for(job.body.model)
    job.options.setdefault("max_tokens", max_model_len)  # chat with no limit: the model's
    request_id = request.state.request_id
    choice_ids = choice_request_ids(request_id, job.body.n or 1)
    try:
        await _submit_choices(gateway, job, choice_ids, request.state.tenant)
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
        tools=isinstance(job.body, ChatRequest) and job.body.calls_tools,
        token_text=await gateway.pools.token_text(pool) if wants_logprobs else token_id_text,
    )
    cancel_on_disconnect = request.headers.get(CANCEL_HEADER, "1").lower() not in NO

    async def cancel_all() -> None:
        for choice_id in choice_ids:
            await gateway.client.cancel(choice_id)

    return GenerationResponse(
        [gateway.client.subscribe(choice_id) for choice_id in choice_ids],
        renderer,
        cancel_all,
        stream=bool(job.body.stream),
        include_usage=job.body.include_usage,
        continuous_usage=job.body.continuous_usage,
        cancel_on_disconnect=cancel_on_disconnect,
        first_wait_s=gateway.config.first_chunk_wait_s,
        keepalive_s=gateway.config.keepalive_s,
        renames=job.renames,
    )
