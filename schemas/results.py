"""Writing and reading result streams with one writer at a time (docs/architecture.md §5, §6).

Every chunk is appended by a Lua script that checks the stream's last `seq`: a chunk whose
`seq` is not the next one, or that follows a final chunk, is refused. So a stale writer
(a rank declared dead, a batcher from an earlier epoch) can never duplicate or interleave
tokens, and a new writer continues exactly where the stream ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import redis

from schemas.codec import decode, encode
from schemas.keys import FIELD, Keys
from schemas.messages import ResultChunk

APPENDED, OUT_OF_ORDER, ALREADY_FINAL = 1, 0, -1

# append(key, seq, payload, final, ttl): 1 appended, 0 out of order, -1 after a final chunk
APPEND_FUNCTION = """
local function append(key, seq, payload, final, ttl)
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
  local expected = 0
  if #last > 0 then
    local fields = last[1][2]
    local last_seq, last_final = -1, '0'
    for i = 1, #fields, 2 do
      if fields[i] == 'seq' then last_seq = tonumber(fields[i + 1])
      elseif fields[i] == 'final' then last_final = fields[i + 1] end
    end
    if last_final == '1' then return -1 end
    expected = last_seq + 1
  end
  if tonumber(seq) ~= expected then return 0 end
  redis.call('XADD', key, '*', 'm', payload, 'seq', seq, 'final', final)
  if final == '1' then redis.call('EXPIRE', key, tonumber(ttl)) end
  return 1
end
"""
# One chunk: KEYS[1] its result stream; ARGV: seq, payload, final ('1'/'0'), ttl seconds.
APPEND_SCRIPT = APPEND_FUNCTION + "return append(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])"
# A rank's whole step in one call, fenced by its incarnation: KEYS[1] the pool's step results
# stream, KEYS[2] the rank's registry hash, KEYS[3..] the chunks' result streams in order;
# ARGV[1] the incarnation, ARGV[2] the encoded step result, ARGV[3] the step results maxlen,
# then seq, payload, final, ttl per chunk. Returns -2 (fenced: nothing written) or one
# append reply per chunk; the step result is added after the chunks.
STEP_SCRIPT = (
    APPEND_FUNCTION
    + """
local registered = redis.call('HMGET', KEYS[2], 'incarnation', 'state')
if registered[1] ~= ARGV[1] or registered[2] == 'lost' then return -2 end
local replies = {}
for i = 3, #KEYS do
  local a = 4 + (i - 3) * 4
  replies[i - 2] = append(KEYS[i], ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3])
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'm', ARGV[2])
return replies
"""
)
FENCED = -2


class ResultWriter:
    """Queues conditional chunk appends on a pipeline; each reply says appended or refused.

    The script is loaded once (`load`, again after Redis restarts) and called by its SHA,
    so a pipeline of appends is one round trip, with no script check before it.
    """

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self.sha = ""
        self.load()

    def load(self) -> None:
        """(Re)load the append script into Redis's script cache."""
        self.sha = str(self.client.script_load(APPEND_SCRIPT))

    def append(self, pipe: redis.client.Pipeline, chunk: ResultChunk, ttl_s: int) -> None:
        """Queue one chunk; a final chunk also sets the stream's TTL."""
        final = "1" if chunk.is_final else "0"
        pipe.evalsha(
            self.sha, 1, self.keys.result(chunk.id), chunk.seq, encode(chunk), final, ttl_s
        )


@dataclass(slots=True)
class Published:
    """What a result stream already holds: the tokens, the next seq, and whether it ended."""

    token_ids: list[int] = field(default_factory=list)
    next_seq: int = 0
    final: ResultChunk | None = None


def read_published(client: redis.Redis, keys: Keys, request_ids: list[str]) -> dict[str, Published]:
    """Read whole result streams (pipelined) to resume or settle requests after a failure."""
    pipe = client.pipeline(transaction=False)
    for request_id in request_ids:
        pipe.xrange(keys.result(request_id))
    found: dict[str, Published] = {}
    for request_id, entries in zip(request_ids, pipe.execute()):
        published = Published()
        for _, fields in cast(list[tuple[bytes, dict[bytes, Any]]], entries):
            chunk = decode(ResultChunk, fields[FIELD.encode()])
            published.token_ids += chunk.token_ids
            published.next_seq = chunk.seq + 1
            if chunk.is_final:
                published.final = chunk
        found[request_id] = published
    return found
