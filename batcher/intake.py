"""Turning request entries into planner Sequences, or into dead letters and rejections."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
from tokenizers import Tokenizer

from batcher.scheduler import Sequence
from schemas.codec import DeadLetter, Rejected, decode_request, encode
from schemas.keys import FIELD, GROUP, Keys
from schemas.messages import ErrorInfo, FinishReason, GenerateRequest, ResultChunk


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the batcher must know of the served model to validate requests."""

    vocab_size: int
    max_model_len: int


@dataclass(slots=True)
class Tracked:
    """A request the pool has taken from the stream, from admission to its final chunk."""

    entry_id: bytes
    request: GenerateRequest
    prompt_ids: list[int]
    seq: Sequence
    num_published: int = 0
    admitted_at: float = 0.0


def parse_entry(
    raw: bytes | None, tokenizer: Tokenizer, facts: ModelFacts, max_request_bytes: int
) -> tuple[GenerateRequest, list[int]]:
    """Decode and validate one entry's payload; raises DeadLetter or Rejected."""
    if raw is None:
        raise DeadLetter(f"entry has no field `{FIELD}`")
    request = decode_request(raw, max_request_bytes)
    if request.prompt_token_ids is not None:
        prompt_ids = list(request.prompt_token_ids)
        bad = [t for t in prompt_ids if t >= facts.vocab_size]
        if bad:
            raise Rejected(
                request.id,
                "invalid_request",
                f"field `prompt_token_ids`: token id {bad[0]} is outside the "
                f"vocabulary of {facts.vocab_size}",
            )
    else:
        prompt_ids = tokenizer.encode(request.prompt or "").ids
    limit = facts.max_model_len
    if len(prompt_ids) >= limit:
        raise Rejected(
            request.id,
            "prompt_too_long",
            f"field `prompt`: {len(prompt_ids)} tokens leave no room for a completion "
            f"within max_model_len={limit}",
        )
    if request.sampling.max_tokens > limit:
        raise Rejected(
            request.id,
            "invalid_request",
            f"field `sampling.max_tokens`: {request.sampling.max_tokens} exceeds "
            f"max_model_len={limit}",
        )
    return request, prompt_ids


def to_sequence(
    request: GenerateRequest, prompt_ids: list[int], order: int, max_model_len: int
) -> Sequence:
    """The planner's view of a freshly read request."""
    max_new = min(request.sampling.max_tokens, max_model_len - len(prompt_ids))
    return Sequence(request.id, len(prompt_ids), max_new, order, request.priority)


def write_dead_letter(
    pipe: redis.client.Pipeline,
    keys: Keys,
    entry_id: bytes,
    fields: dict[bytes, bytes],
    reason: str,
) -> None:
    """Move an unusable entry to `{ns}:dead` with the reason, and drop it from the stream."""
    payload = fields.get(FIELD.encode(), b"")
    pipe.xadd(
        keys.dead,
        {
            "reason": reason,
            "entry_id": entry_id,
            "m": payload[:65536],
            "at_ms": int(time.time() * 1000),
        },
        maxlen=100_000,
        approximate=True,
    )
    pipe.xack(keys.requests, GROUP, entry_id)
    pipe.xdel(keys.requests, entry_id)


def write_final_error(
    pipe: redis.client.Pipeline,
    keys: Keys,
    request_id: str,
    reason: FinishReason,
    code: str,
    message: str,
    ttl_s: int,
    seq: int = 0,
    index: int = 0,
) -> None:
    """End a request's result stream with one final chunk carrying an error."""
    chunk = ResultChunk(
        id=request_id,
        seq=seq,
        index=index,
        finish_reason=reason,
        error=ErrorInfo(code=code, message=message),
    )
    key = keys.result(request_id)
    pipe.xadd(key, {FIELD: encode(chunk)})
    pipe.expire(key, ttl_s)


def reject(
    pipe: redis.client.Pipeline, keys: Keys, entry_id: bytes, exc: Rejected, ttl_s: int
) -> None:
    """Answer a parsable but bad entry with a final `rejected` chunk and drop the entry."""
    write_final_error(
        pipe, keys, exc.request_id, FinishReason.REJECTED, exc.code, exc.message, ttl_s
    )
    pipe.xack(keys.requests, GROUP, entry_id)
    pipe.xdel(keys.requests, entry_id)
