"""Turning request entries into tracked requests, or into dead letters and batcher-written ends."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis
from tokenizers import Tokenizer

from batcher.chat import ChatTemplate, ChatTemplateError
from batcher.queue import arrival_ms, urgency
from batcher.scheduler import Sequence
from schemas.codec import DeadLetter, Rejected, decode_request
from schemas.keys import FIELD, GROUP, Keys, priority_class
from schemas.messages import ErrorInfo, FinishReason, GenerateRequest, ResultChunk, Usage
from schemas.results import ResultWriter
from schemas.tenants import Tenants

# A request that was on this many ranks when they died runs alone on a rank from then on,
# so a request that kills its rank charges its next death to itself, not to its neighbours.
SUSPECT_AFTER_DEATHS = 2


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the batcher must know of the served model to validate requests."""

    vocab_size: int
    max_model_len: int


@dataclass(slots=True)
class Tracked:
    """A request the pool has taken from the stream, until its final chunk is written.

    `resumed_ids` are completion tokens already on its result stream (after a failure the
    request re-enters with them appended to its prompt); `start_seq` is the next chunk.
    """

    entry_id: bytes
    stream: str  # the request stream (priority class) the entry is on
    request: GenerateRequest
    prompt_ids: list[int]
    times_delivered: int = 1  # deliveries so far: reads, claims and lost ranks
    rank_deaths: int = 0  # ranks that died holding it, in this batcher's time
    payload: bytes = b""  # the entry's field `m`, for a dead letter
    seq: Sequence | None = None  # the planner's view, new (its next admission) at each queueing
    resumed_ids: list[int] = field(default_factory=list)
    start_seq: int = 0
    num_published: int = 0  # tokens its ranks reported in this epoch (for the TTFT metric)
    stop_reason: FinishReason | None = None

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.id

    def ttl_s(self, default_s: int) -> int:
        """Lifetime of its result stream after the final chunk."""
        return self.request.result_ttl_s or default_s


def parse_entry(
    raw: bytes | None,
    tokenizer: Tokenizer,
    facts: ModelFacts,
    max_request_bytes: int,
    chat: ChatTemplate | None = None,
    tenants: Tenants | None = None,
) -> tuple[GenerateRequest, list[int]]:
    """Decode and validate one entry's payload; raises DeadLetter or Rejected."""
    if raw is None:
        raise DeadLetter(f"entry has no field `{FIELD}`")
    request = decode_request(raw, max_request_bytes)
    if tenants is not None and tenants.get(request.tenant) is None:
        raise Rejected(
            request.id,
            "invalid_request",
            f"field `tenant`: unknown tenant {request.tenant!r}: the pool's tenants file "
            "does not name it",
        )
    if request.prompt_token_ids is not None:
        prompt_ids = list(request.prompt_token_ids)
        bad = [t for t in prompt_ids if t >= facts.vocab_size]
        if bad:
            raise Rejected(
                request.id,
                "invalid_request",
                f"field `prompt_token_ids`: token id {bad[0]} is outside the "
                f"vocabulary of {facts.vocab_size}",
                len(prompt_ids),
            )
    elif request.messages is not None:
        prompt_ids = _render_chat(request, tokenizer, chat)
    else:
        prompt_ids = tokenizer.encode(request.prompt or "").ids
    limit = facts.max_model_len
    if len(prompt_ids) >= limit:
        raise Rejected(
            request.id,
            "prompt_too_long",
            f"field `prompt`: {len(prompt_ids)} tokens leave no room for a completion "
            f"within max_model_len={limit}",
            len(prompt_ids),
        )
    outside = [int(t) for t in request.sampling.logit_bias if int(t) >= facts.vocab_size]
    if outside:
        raise Rejected(
            request.id,
            "invalid_request",
            f"field `sampling.logit_bias`: token id {outside[0]} is outside the "
            f"vocabulary of {facts.vocab_size}",
            len(prompt_ids),
        )
    if request.sampling.max_tokens > limit:
        raise Rejected(
            request.id,
            "invalid_request",
            f"field `sampling.max_tokens`: {request.sampling.max_tokens} exceeds "
            f"max_model_len={limit}",
            len(prompt_ids),
        )
    return request, prompt_ids


def _render_chat(
    request: GenerateRequest, tokenizer: Tokenizer, chat: ChatTemplate | None
) -> list[int]:
    """The token ids of a chat request: its messages through the model's template."""
    if chat is None:
        raise Rejected(
            request.id,
            "invalid_request",
            "field `messages`: the served model has no chat template; send `prompt` instead",
        )
    try:
        offered = request.tools if request.tool_choice != "none" else None
        text = chat.render(request.messages or [], offered)
    except ChatTemplateError as exc:
        raise Rejected(request.id, "invalid_request", f"field `messages`: {exc}") from exc
    return tokenizer.encode(text, add_special_tokens=False).ids


def make_sequence(tracked: Tracked, order: int, max_model_len: int, aging_s: float) -> Sequence:
    """The planner's view of a request as it (re-)enters the queue, resuming after any
    tokens already published: its next admission."""
    request = tracked.request
    num_context = len(tracked.prompt_ids) + len(tracked.resumed_ids)
    max_new = min(
        request.sampling.max_tokens - len(tracked.resumed_ids), max_model_len - num_context
    )
    rank_by = urgency(request.priority, arrival_ms(tracked.entry_id), aging_s * 1000)
    seq = Sequence(
        request.id, num_context, max_new, order, rank_by, priority_class(request.priority)
    )
    seq.tenant = request.tenant
    seq.isolated = tracked.rank_deaths >= SUSPECT_AFTER_DEATHS
    seq.admission = tracked.seq.admission + 1 if tracked.seq is not None else 1
    return seq


def write_dead_letter(
    pipe: redis.client.Pipeline,
    keys: Keys,
    stream: str,
    entry_id: bytes,
    fields: dict[bytes, bytes] | None,
    reason: str,
) -> None:
    """Move an unusable entry to `{ns}:dead` with the reason, and drop it from the stream."""
    payload = (fields or {}).get(FIELD.encode(), b"")
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
    settle(pipe, stream, entry_id)


def settle(pipe: redis.client.Pipeline, stream: str, entry_id: bytes) -> None:
    """Acknowledge and delete a request entry that has no result stream to wait for."""
    pipe.xack(stream, GROUP, entry_id)
    pipe.xdel(stream, entry_id)


# Acknowledge and delete a request entry only on a server that holds its final chunk:
# KEYS[1] the request stream, KEYS[2] its result stream; ARGV[1] the group, ARGV[2] the
# entry id. Returns 1 if settled. A batcher that read the final chunk on a primary just
# before a failover may send this to the promoted replica, which never got the chunk: the
# entry then stays pending, and the new epoch resumes the request from what it holds.
SETTLE_SCRIPT = """
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if #last == 0 then return 0 end
local fields = last[1][2]
for i = 1, #fields, 2 do
  if fields[i] == 'final' and fields[i + 1] == '1' then
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
    redis.call('XDEL', KEYS[1], ARGV[2])
    return 1
  end
end
return 0
"""


class Settler:
    """Queues SETTLE_SCRIPT calls on a pipeline (loaded once, as the pipeline needs it)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.keys = keys
        self.script = client.register_script(SETTLE_SCRIPT)

    def finished(self, pipe: redis.client.Pipeline, tracked: Tracked) -> None:
        """Settle `tracked`'s entry where its final chunk is written."""
        self.script(
            keys=[tracked.stream, self.keys.result(tracked.request_id)],
            args=[GROUP, tracked.entry_id],
            client=pipe,
        )


def end_by_batcher(
    pipe: redis.client.Pipeline,
    writer: ResultWriter,
    tracked: Tracked,
    reason: FinishReason,
    ttl_s: int,
    error: ErrorInfo | None = None,
) -> None:
    """Write the final chunk of a request no rank holds (queued, or out of budget)."""
    num_done = len(tracked.resumed_ids)
    chunk = ResultChunk(
        id=tracked.request_id,
        seq=tracked.start_seq,
        index=num_done,
        finish_reason=reason,
        error=error,
        usage=Usage(prompt_tokens=len(tracked.prompt_ids), completion_tokens=num_done),
        tenant=tracked.request.tenant,
    )
    writer.append(pipe, chunk, tracked.ttl_s(ttl_s))


def reject(
    pipe: redis.client.Pipeline,
    writer: ResultWriter,
    stream: str,
    entry_id: bytes,
    exc: Rejected,
    ttl_s: int,
) -> None:
    """Answer a parsable but bad entry with a final `rejected` chunk and drop the entry."""
    writer.append(pipe, rejection_chunk(exc), ttl_s)
    settle(pipe, stream, entry_id)


def rejection_chunk(exc: Rejected) -> ResultChunk:
    """The one chunk of a rejected request's stream."""
    return ResultChunk(
        id=exc.request_id,
        seq=0,
        index=0,
        finish_reason=FinishReason.REJECTED,
        error=ErrorInfo(code=exc.code, message=exc.message),
        usage=Usage(prompt_tokens=exc.prompt_tokens, completion_tokens=0),
    )
