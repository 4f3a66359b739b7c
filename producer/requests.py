"""Building request entries and assembling completions: shared by the sync and async clients."""

from __future__ import annotations

import uuid
from typing import Any

from schemas.messages import Completion, GenerateRequest, ResultChunk, SamplingParams

# XLEN >= max_queue refuses the XADD atomically; returns {"full", depth} or the entry id.
# KEYS[1]: the request stream; ARGV: max_queue, encoded request. With KEYS[2] and ARGV[3..4],
# also set that hash field in the same atomic step (batch jobs record what they have sent).
ADMIT_SCRIPT = """
local depth = redis.call('XLEN', KEYS[1])
if depth >= tonumber(ARGV[1]) then
  return {'full', depth}
end
local id = redis.call('XADD', KEYS[1], '*', 'm', ARGV[2])
if KEYS[2] then
  redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
end
return id
"""


class QueueFull(RuntimeError):
    """The request stream holds `max_queue` outstanding requests; nothing was enqueued."""

    def __init__(self, depth: int, max_queue: int) -> None:
        super().__init__(
            f"queue full: {depth} outstanding requests (max_queue={max_queue}); retry later"
        )
        self.depth = depth
        self.max_queue = max_queue


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


def parse_admission(reply: Any, max_queue: int) -> str:
    """The entry id from the admission script, or QueueFull."""
    if isinstance(reply, list):
        raise QueueFull(int(reply[1]), max_queue)
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
