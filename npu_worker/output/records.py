"""What a rank's model thread hands its output process each step, and what comes back.

Plain slots dataclasses encoded straight to msgpack arrays: no torch here, so the output
process never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

from schemas.control import NewRequest, SlotStop, StepCounts


@dataclass(slots=True)
class TokenRow:
    """What one step gave one request: its new tokens, and how it ended, if it did.

    `finish` is a FinishReason value the model thread can see from token ids alone (`stop`
    for EOS or a stop token id, `length`) or `error` (then `error` says why); `logprobs`
    holds one entry per new token when the request asked for them.
    """

    slot: int
    admission: int
    token_ids: list[int]
    finish: str | None = None
    error: str | None = None
    logprobs: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class StepRecord:
    """One executed step of a rank: requests it took on, stops it was told, tokens it made."""

    epoch: int
    step: int
    rank: int
    incarnation: str
    new_requests: list[NewRequest] = field(default_factory=list)
    stops: list[SlotStop] = field(default_factory=list)
    rows: list[TokenRow] = field(default_factory=list)
    counts: StepCounts = field(default_factory=StepCounts)

    def encode(self) -> bytes:
        """msgpack bytes of the record."""
        return msgpack.packb(
            [
                self.epoch,
                self.step,
                self.rank,
                self.incarnation,
                [n.to_wire() for n in self.new_requests],
                [[s.slot, s.request_id, s.finish_reason, s.admission] for s in self.stops],
                [
                    [r.slot, r.admission, r.token_ids, r.finish, r.error, r.logprobs]
                    for r in self.rows
                ],
                self.counts.to_wire(),
            ]
        )

    @classmethod
    def decode(cls, raw: bytes) -> StepRecord:
        """A record from its bytes."""
        values = dict(zip([f.name for f in fields(cls)], msgpack.unpackb(raw), strict=True))
        values["new_requests"] = [NewRequest.from_wire(n) for n in values["new_requests"]]
        values["stops"] = [SlotStop(*s) for s in values["stops"]]
        values["rows"] = [TokenRow(*r) for r in values["rows"]]
        values["counts"] = StepCounts.from_wire(values["counts"])
        return cls(**values)


@dataclass(slots=True)
class Feedback:
    """From the output process back to the model thread: requests it ended (a stop string, a
    detokenizing error, a stream that moved on) whose slots need no more rows, and whether
    publishing failed (the rank must start afresh)."""

    ended: list[tuple[int, str, int]] = field(default_factory=list)  # (slot, id, admission)
    failed: bool = False
    acked: bool = False  # every record sent before a reset is done

    def encode(self) -> bytes:
        """msgpack bytes of the feedback."""
        return msgpack.packb([self.ended, self.failed, self.acked])

    @classmethod
    def decode(cls, raw: bytes) -> Feedback:
        """Feedback from its bytes."""
        ended, failed, acked = msgpack.unpackb(raw)
        return cls([(s, r, a) for s, r, a in ended], failed, acked)
