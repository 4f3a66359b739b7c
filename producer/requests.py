"""Building request entries and assembling completions: shared by the sync and async clients."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import redis
from pydantic import ValidationError

from schemas.codec import encode
from schemas.keys import Keys
from schemas.messages import Completion, GenerateRequest, ResultChunk, SamplingParams

# Admission: one atomic step that counts the outstanding requests over every priority
# class, checks the namespace's limits (published by its batchers in `{ns}:limits`; a
# client's own bound may only lower them) and adds the entry to its class's stream.
# KEYS: the class streams, the limits hash, optionally a hash to mark in the same step.
# ARGV: number of class streams, the client's bound (0: none), the bound when no pool has
# published one, index of the target stream (1-based), the encoded request, then the
# mark's field and value. Returns the entry id, {"full", depth, bound} or
# {"too_large", size, limit}.
ADMIT_SCRIPT = """
local n = tonumber(ARGV[1])
local limits = redis.call('HMGET', KEYS[n + 1], 'max_queue', 'max_request_bytes')
local bound = tonumber(limits[1]) or tonumber(ARGV[3])
local own = tonumber(ARGV[2])
if own > 0 and own < bound then bound = own end
local max_bytes = tonumber(limits[2])
if max_bytes and #ARGV[5] > max_bytes then
  return {'too_large', #ARGV[5], max_bytes}
end
local depth = 0
for i = 1, n do depth = depth + redis.call('XLEN', KEYS[i]) end
if depth >= bound then
  return {'full', depth, bound}
end
local id = redis.call('XADD', KEYS[tonumber(ARGV[4])], '*', 'm', ARGV[5])
if KEYS[n + 2] then
  redis.call('HSET', KEYS[n + 2], ARGV[6], ARGV[7])
end
return id
"""
DEFAULT_MAX_QUEUE = 10000  # the bound while no pool of the namespace has published one


class QueueFull(RuntimeError):
    """The namespace holds `max_queue` outstanding requests; nothing was enqueued."""

    def __init__(self, depth: int, max_queue: int) -> None:
        super().__init__(
            f"queue full: {depth} outstanding requests (max_queue={max_queue}); retry later"
        )
        self.depth = depth
        self.max_queue = max_queue


class NotReplicated(redis.ConnectionError):
    """The request reached the primary, but not `wanted` replicas within the timeout: a
    failover now could lose it. Retryable, as a lost connection is: submit it again with
    the same id (an id is run at most once; a copy that finds its original in progress is
    dead-lettered, and the original answers). Raised too when the server that answered
    is no longer the primary the Sentinels name (a stale primary, paused or partitioned
    through a failover, whose writes the new primary never sees)."""

    def __init__(self, request_id: str, acked: int, wanted: int, stale: bool = False) -> None:
        reached = (
            "was acknowledged by a server that is no longer the primary"
            if stale
            else f"reached {acked} of the {wanted} replicas it must (min_replicas_ack)"
        )
        super().__init__(f"request {request_id} {reached}; retry with the same id")
        self.request_id = request_id
        self.acked = acked
        self.wanted = wanted


# What a producer retries with the same arguments (NotReplicated is a ConnectionError).
RETRYABLE = (redis.ConnectionError, redis.TimeoutError)
T = TypeVar("T")


def retried(call: Callable[[], T], timeout_s: float = 60.0) -> T:
    """`call()` until it answers, retrying a retryable error for up to `timeout_s`: with
    the same arguments, so the same request id (an id is run at most once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except RETRYABLE:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class RequestTooLarge(ValueError):
    """The encoded request is over the namespace's `max_request_bytes`; nothing was enqueued."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"request is {size} bytes, over max_request_bytes={limit}")
        self.size = size
        self.limit = limit


class RequestFailed(RuntimeError):
    """A completion that ended rejected or in error, raised by `generate`."""

    def __init__(self, completion: Completion) -> None:
        error = completion.error
        detail = f"{error.code}: {error.message}" if error else "no detail"
        super().__init__(f"request {completion.id} ended {completion.finish_reason}: {detail}")
        self.completion = completion


SAMPLING_FIELDS = set(SamplingParams.model_fields)


def build_request(
    prompt: str | None,
    prompt_token_ids: list[int] | None,
    request_id: str | None,
    options: dict[str, Any],
) -> GenerateRequest:
    """A GenerateRequest from `submit` arguments; unknown keywords are a TypeError."""
    sampling = {k: options.pop(k) for k in list(options) if k in SAMPLING_FIELDS}
    allowed = {"messages", "priority", "deadline_ms", "result_ttl_s", "metadata"}
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(f"unknown submit() keyword(s): {', '.join(sorted(unknown))}")
    return GenerateRequest(
        id=request_id or uuid.uuid4().hex,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        sampling=SamplingParams(**sampling),
        **options,
    )


def admission_call(
    keys: Keys,
    request: GenerateRequest,
    max_queue: int | None,
    mark: tuple[str, str, str | int] | None = None,
) -> tuple[list[str], list[str | int | bytes]]:
    """The KEYS and ARGV of the admission script for one request."""
    streams = keys.request_streams
    target = streams.index(keys.request_stream(request.priority)) + 1
    script_keys = [*streams, keys.limits]
    args: list[str | int | bytes] = [
        len(streams),
        max_queue or 0,
        DEFAULT_MAX_QUEUE,
        target,
        encode(request),
    ]
    if mark is not None:
        script_keys.append(mark[0])
        args += [mark[1], mark[2]]
    return script_keys, args


def parse_admission(reply: Any) -> str:
    """The entry id from the admission script, or QueueFull / RequestTooLarge."""
    if isinstance(reply, list):
        kind = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        if kind == "too_large":
            raise RequestTooLarge(int(reply[1]), int(reply[2]))
        raise QueueFull(int(reply[1]), int(reply[2]))
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def assemble(request_id: str, chunks: list[ResultChunk]) -> Completion:
    """One Completion from a stream's chunks (the last one final)."""
    final = chunks[-1]
    if final.finish_reason is None:
        raise ValueError(f"stream of {request_id} has no final chunk yet")
    return Completion(
        id=request_id,
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=final.finish_reason,
        usage=final.usage,
        error=final.error,
    )


def invalid_reason(exc: ValidationError, names: Mapping[str, str]) -> str:
    """The first thing pydantic found wrong, as one line: the field as the caller knows it
    (`names` maps field names to, say, command-line flags), the value given and the rule."""
    error = exc.errors(include_url=False)[0]
    rule = re.sub(r"^(Input|String|List|Value) should", "must", error["msg"])
    rule = rule.removeprefix("Value error, ")
    if not error["loc"]:  # a rule across fields: its message names them
        return rule
    field = str(error["loc"][-1])
    return f"{names.get(field, field)}={error['input']!r}: {rule}"
