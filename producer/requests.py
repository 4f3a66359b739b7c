"""Building request entries and assembling completions: shared by the sync and async clients."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import redis
from pydantic import BaseModel, TypeAdapter, ValidationError

from schemas.codec import encode
from schemas.constraints import Constraint, JsonObject, JsonSchema
from schemas.keys import DEFAULT_TENANT, Keys
from schemas.messages import Completion, GenerateRequest, ResultChunk, SamplingParams
from schemas.tenants import MAX_TENANT_STREAMS

# Admission: one atomic step that counts the outstanding requests over every request
# stream (each class's and the tenants' streams in use), checks the namespace's limits
# (published by its batchers in `{ns}:limits`; a client's own bound may only lower them)
# and the tenant's (`{ns}:tenants`, when a tenants file names them), and adds the entry to
# its tenant's class stream, listing that stream in `{ns}:queues` the first time.
# KEYS: `default`'s class streams, the limits hash, the queues hash, the tenants hash, the
# target stream, optionally a hash to mark in the same step.
# ARGV: number of class streams, the client's bound (0: none), the bound when no pool has
# published one, the tenant, the encoded request, the mark's field and value, the most
# tenant streams a namespace holds. Returns the entry id, {"full", depth, bound},
# {"tenant_full", depth, bound}, {"unknown_tenant"}, {"too_many_tenants", count} or
# {"too_large", size, limit}.
ADMIT_SCRIPT = """
local n = tonumber(ARGV[1])
local queues_key, tenants_key, target = KEYS[n + 2], KEYS[n + 3], KEYS[n + 4]
local tenant = ARGV[4]
local limits = redis.call('HMGET', KEYS[n + 1], 'max_queue', 'max_request_bytes',
                          'tenants_required')
local bound = tonumber(limits[1]) or tonumber(ARGV[3])
local own = tonumber(ARGV[2])
if own > 0 and own < bound then bound = own end
local max_bytes = tonumber(limits[2])
if max_bytes and #ARGV[5] > max_bytes then
  return {'too_large', #ARGV[5], max_bytes}
end
local quota = redis.call('HGET', tenants_key, tenant)
if not quota and limits[3] == '1' and tenant ~= 'default' then
  return {'unknown_tenant'}
end
local tenant_bound = tonumber(quota)
local depth, tenant_depth = 0, 0
for i = 1, n do
  local size = redis.call('XLEN', KEYS[i])
  depth = depth + size
  if tenant == 'default' then tenant_depth = tenant_depth + size end
end
local queues = redis.call('HGETALL', queues_key)
local listed = tenant == 'default'
for i = 1, #queues, 2 do
  local size = redis.call('XLEN', queues[i])
  depth = depth + size
  if queues[i + 1] == tenant then tenant_depth = tenant_depth + size end
  if queues[i] == target then listed = true end
end
if depth >= bound then
  return {'full', depth, bound}
end
if tenant_bound and tenant_depth >= tenant_bound then
  return {'tenant_full', tenant_depth, tenant_bound}
end
if not listed then
  if #queues / 2 >= tonumber(ARGV[8]) then return {'too_many_tenants', #queues / 2} end
  redis.call('HSET', queues_key, target, tenant)
end
local id = redis.call('XADD', target, '*', 'm', ARGV[5])
if KEYS[n + 5] then
  redis.call('HSET', KEYS[n + 5], ARGV[6], ARGV[7])
end
return id
"""
DEFAULT_MAX_QUEUE = 10000  # the bound while no pool of the namespace has published one


class QueueFull(RuntimeError):
    """The namespace holds `max_queue` outstanding requests, or the request's tenant holds
    its own `max_queue` (`tenant` names it); nothing was enqueued."""

    def __init__(self, depth: int, max_queue: int, tenant: str | None = None) -> None:
        whose = f"tenant {tenant!r} has " if tenant is not None else ""
        super().__init__(
            f"queue full: {whose}{depth} outstanding requests (max_queue={max_queue}); retry later"
        )
        self.depth = depth
        self.max_queue = max_queue
        self.tenant = tenant


class UnknownTenant(ValueError):
    """The request names a tenant the namespace's tenants file does not (or the namespace
    holds as many tenants' streams as it may); nothing was enqueued."""

    def __init__(self, tenant: str, detail: str = "") -> None:
        super().__init__(
            detail or f"unknown tenant {tenant!r}: the pool's tenants file does not name it"
        )
        self.tenant = tenant


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
    allowed = {"messages", "priority", "deadline_ms", "tenant", "result_ttl_s", "metadata"}
    allowed |= {"tools", "tool_choice", "parallel_tool_calls"}
    constraint = constraint_of(options.pop("constraint", None))
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(f"unknown submit() keyword(s): {', '.join(sorted(unknown))}")
    return GenerateRequest(
        id=request_id or uuid.uuid4().hex,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        sampling=SamplingParams(**sampling),
        constraint=constraint,
        **options,
    )


_CONSTRAINT: TypeAdapter[Any] = TypeAdapter(Constraint)

# What `submit(constraint=...)` takes: a wire constraint (model or map), or a pydantic
# model class, whose JSON schema the output must match (strictly, as OpenAI's `parse`).
ConstraintLike = Constraint | Mapping[str, Any] | type[BaseModel] | None


def constraint_of(value: ConstraintLike) -> Any:
    """The wire constraint `submit(constraint=...)` means; a ValidationError if none."""
    if value is None:
        return None
    if isinstance(value, type) and issubclass(value, BaseModel):
        return JsonSchema(json_schema=value.model_json_schema(), strict=True)
    return _CONSTRAINT.validate_python(value)


class Schemas:
    """The output schemas of requests this client submitted, kept until their result is
    read (at most `limit`, the oldest forgotten first), so `result()` can parse."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self.by_id: OrderedDict[str, Any] = OrderedDict()

    def remember(self, request_id: str, wanted: ConstraintLike) -> None:
        """Keep what `request_id`'s text should parse as, if it asked for JSON."""
        if isinstance(wanted, type) or isinstance(constraint_of(wanted), JsonSchema | JsonObject):
            self.by_id[request_id] = wanted
            while len(self.by_id) > self.limit:
                self.by_id.popitem(last=False)

    def parse(self, completion: Completion) -> Completion:
        """`completion` with `parsed` set where its request asked for JSON and it is whole."""
        wanted = self.by_id.pop(completion.id, None)
        if wanted is None or completion.finish_reason != "stop":
            return completion
        try:
            if isinstance(wanted, type) and issubclass(wanted, BaseModel):
                completion.parsed = wanted.model_validate_json(completion.text)
            else:
                completion.parsed = json.loads(completion.text)
        except (ValueError, ValidationError):
            pass  # left None: the text is what the pool produced, for the caller to see
        return completion


def admission_call(
    keys: Keys,
    request: GenerateRequest,
    max_queue: int | None,
    mark: tuple[str, str, str | int] | None = None,
) -> tuple[list[str], list[str | int | bytes]]:
    """The KEYS and ARGV of the admission script for one request."""
    streams = keys.request_streams
    target = keys.tenant_stream(request.tenant, request.priority)
    script_keys = [*streams, keys.limits, keys.queues, keys.tenants, target]
    args: list[str | int | bytes] = [
        len(streams),
        max_queue or 0,
        DEFAULT_MAX_QUEUE,
        request.tenant,
        encode(request),
        mark[1] if mark is not None else "",
        mark[2] if mark is not None else "",
        MAX_TENANT_STREAMS,
    ]
    if mark is not None:
        script_keys.append(mark[0])
    return script_keys, args


def parse_admission(reply: Any, tenant: str = DEFAULT_TENANT) -> str:
    """The entry id from the admission script, or QueueFull / UnknownTenant /
    RequestTooLarge."""
    if isinstance(reply, list):
        kind = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        if kind == "too_large":
            raise RequestTooLarge(int(reply[1]), int(reply[2]))
        if kind == "unknown_tenant":
            raise UnknownTenant(tenant)
        if kind == "too_many_tenants":
            raise UnknownTenant(
                tenant,
                f"tenant {tenant!r} refused: the namespace holds {int(reply[1])} tenants' "
                "request streams already; name tenants in a tenants file",
            )
        if kind == "tenant_full":
            raise QueueFull(int(reply[1]), int(reply[2]), tenant)
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
