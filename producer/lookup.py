"""Where a request stands, by id: queued, running, finished, or not known to the namespace.

A request is known while its entry is in a request stream (an entry is deleted only once its
final chunk is written) and while its result stream lives (`result_ttl_s` after the final
chunk). Used by `npu-pool cancel` to tell a typo from a request that already ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import redis

from schemas.codec import CodecError, decode, request_id_of
from schemas.connection import Entry
from schemas.keys import FIELD, GROUP, Keys
from schemas.messages import ResultChunk
from schemas.tenants import request_streams

PAGE = 500  # entries read per XRANGE while looking through a request stream


@dataclass(frozen=True, slots=True)
class RequestState:
    """`queued` (no pool has read it), `running` (a pool holds it or chunks are out),
    `finished` (its final chunk is written; `finish_reason` says how) or `unknown`."""

    state: str
    finish_reason: str | None = None


def find_request(client: redis.Redis, keys: Keys, request_id: str) -> RequestState:
    """The state of `request_id` in the namespace of `keys`."""
    last = cast(list[Entry], client.xrevrange(keys.result(request_id), count=1))
    if last:
        try:
            chunk = decode(ResultChunk, last[0][1][FIELD.encode()])
        except (CodecError, KeyError):
            return RequestState("running")
        if chunk.finish_reason is not None:
            return RequestState("finished", str(chunk.finish_reason))
        return RequestState("running")
    found = _queue_entry(client, keys, request_id)
    if found is None:
        return RequestState("unknown")
    stream, entry_id = found
    try:
        held = client.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
    except redis.ResponseError:  # no pool has created the group yet: nobody read it
        held = []
    return RequestState("running" if held else "queued")


def _queue_entry(client: redis.Redis, keys: Keys, request_id: str) -> tuple[str, bytes] | None:
    """The (stream, entry id) of the request's entry in any priority class's stream."""
    for stream in request_streams(client, keys):
        start: Any = "-"
        while True:
            entries = cast(list[Entry], client.xrange(stream, min=start, count=PAGE))
            for entry_id, fields in entries:
                if request_id_of(fields.get(FIELD.encode())) == request_id:
                    return stream, entry_id
            if len(entries) < PAGE:
                break
            start = b"(" + entries[-1][0]
    return None
