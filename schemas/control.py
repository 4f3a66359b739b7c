"""Control-plane messages between a pool's batcher and its ranks, sent every step.

They are plain slots dataclasses encoded straight to msgpack arrays (field order is the
wire order): the batcher validated every request at the boundary, so nothing per step goes
through pydantic. See docs/architecture.md for the step they describe.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

from schemas.keys import DEFAULT_TENANT
from schemas.messages import SamplingParams

PREEMPTED = "preempted"  # a SlotStop reason: give the slot back unfinished


@dataclass(slots=True)
class NewRequest:
    """A request handed to a rank once, when it is admitted to one of its KV slots."""

    request_id: str
    slot: int
    prompt_token_ids: list[int]
    num_prompt_tokens: int  # tokens of the original prompt, for usage
    sampling: SamplingParams
    result_ttl_s: int
    start_index: int = 0  # completion index of its next token (after a resumption)
    start_seq: int = 0  # next chunk number on its result stream
    admission: int = 0  # which admission of the request this is
    tenant: str = DEFAULT_TENANT  # named on its final chunk
    grammar: str | None = None  # its constraint compiled to an llguidance grammar
    # a cached prefix: its first `num_cached_tokens` tokens' state is in slot `cached_from`
    # (copied from there first, unless that is its own slot); prefill starts after them
    cached_from: int = -1
    num_cached_tokens: int = 0
    # a cache of blocks: its table (the blocks of its positions, in order, shared ones
    # first), and [source, target] when a shared block it writes into is copied first
    blocks: list[int] = field(default_factory=list)
    copy_block: list[int] = field(default_factory=list)
    # and the mark whose copy of state outside blocks its slot takes first (-1: none)
    restore_mark: int = -1

    def to_wire(self) -> list[Any]:
        """The msgpack array form."""
        return [
            self.request_id,
            self.slot,
            self.prompt_token_ids,
            self.num_prompt_tokens,
            self.sampling.model_dump(),
            self.result_ttl_s,
            self.start_index,
            self.start_seq,
            self.admission,
            self.tenant,
            self.grammar,
            self.cached_from,
            self.num_cached_tokens,
            self.blocks,
            self.copy_block,
            self.restore_mark,
        ]

    @classmethod
    def from_wire(cls, row: list[Any]) -> NewRequest:
        """Back from the array form (sampling was validated by the batcher)."""
        sampling = SamplingParams.model_construct(**row[4])
        return cls(row[0], row[1], row[2], row[3], sampling, *row[5:])


# PrefillChunk.start of a decode row riding in a packed prefill launch (one token)
DECODE_ROW = -1


@dataclass(slots=True)
class PrefillChunk:
    """Prefill tokens [start, start + num_tokens) of the request in `slot`: one segment of
    a prefill launch. A segment starting at `DECODE_ROW` is a decode row riding in the
    launch: its rank feeds the request's last token at its own position."""

    slot: int
    start: int
    num_tokens: int
    request_id: str = ""
    # the mark that takes a copy of the slot's state outside blocks after the launch (and
    # its MTP draft): the segment ends on a block boundary a later prefix may start from
    mark: int = -1

    def to_wire(self) -> list[Any]:
        """The msgpack array form (a chunk that saves no mark leaves its mark out)."""
        row: list[Any] = [self.slot, self.start, self.num_tokens, self.request_id]
        return row if self.mark < 0 else [*row, self.mark]

    @classmethod
    def from_wire(cls, row: list[Any]) -> PrefillChunk:
        """Back from the array form; ValueError unless it has its four fields (or five,
        with a mark)."""
        if len(row) == 5:
            slot, start, num_tokens, request_id, mark = row
            return cls(slot, start, num_tokens, request_id, mark)
        slot, start, num_tokens, request_id = row
        return cls(slot, start, num_tokens, request_id)


@dataclass(slots=True)
class SlotStop:
    """End a running request now (cancel or deadline: its rank writes the final chunk), or
    give its slot back unfinished (`PREEMPTED`: the batcher resumes it later)."""

    slot: int
    request_id: str
    finish_reason: str  # a FinishReason value, or PREEMPTED
    admission: int = 0


@dataclass(slots=True)
class RankStepPlan:
    """One rank's share of a step: new requests, stops, decode launches, then prefill.

    Each decode launch lists the slots of its rows (at most `decode_batch`); each prefill
    launch lists its segments (one unless prefill is packed). An empty launch is a
    lockstep dummy.
    """

    epoch: int
    step: int
    rank: int
    incarnation: str = ""  # the rank process this plan is for
    new_requests: list[NewRequest] = field(default_factory=list)
    decode_launches: list[list[int]] = field(default_factory=list)
    prefill: list[list[PrefillChunk]] = field(default_factory=list)
    stops: list[SlotStop] = field(default_factory=list)
    # a cache of blocks: [slot, first entry, blocks] for running requests that grow
    blocks: list[list[Any]] = field(default_factory=list)

    def encode(self) -> bytes:
        """msgpack bytes of the plan."""
        return msgpack.packb(
            [
                self.epoch,
                self.step,
                self.rank,
                self.incarnation,
                [n.to_wire() for n in self.new_requests],
                self.decode_launches,
                [[c.to_wire() for c in launch] for launch in self.prefill],
                [[s.slot, s.request_id, s.finish_reason, s.admission] for s in self.stops],
                self.blocks,
            ]
        )

    @classmethod
    def decode(cls, raw: bytes) -> RankStepPlan:
        """A plan from its bytes; ValueError if they are not one."""
        try:
            epoch, step, rank, incarnation, news, decode, prefill, stops, blocks = msgpack.unpackb(
                raw
            )
            return cls(
                epoch,
                step,
                rank,
                incarnation,
                [NewRequest.from_wire(n) for n in news],
                decode,
                [[PrefillChunk.from_wire(c) for c in launch] for launch in prefill],
                [SlotStop(*s) for s in stops],
                blocks,
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"not a step plan: {exc}") from exc


@dataclass(slots=True)
class RequestOutcome:
    """What one step did for one request on a rank."""

    request_id: str
    admission: int
    num_new_tokens: int
    finish_reason: str | None = None
    lost: bool = False  # its stream moved on: this rank lost it
    released: bool = False  # the rank no longer holds it, unfinished (preempted)


@dataclass(slots=True)
class StepCounts:
    """What one step of a rank did: its launches, rows, prompt tokens and MTP drafts, and
    where its time went. The rank's model thread counts them; its step result carries them."""

    num_decode_launches: int = 0
    num_decode_rows: int = 0
    num_padding_rows: int = 0
    num_prefill_launches: int = 0
    num_prefill_tokens: int = 0
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    exec_ms: float = 0.0  # the step on the rank's model thread
    launch_ms: float = 0.0  # of which inside launches
    idle_ms: float = 0.0  # waiting for this plan before it
    collective_ms: float = 0.0  # of the launches' time, in expert-parallel collectives

    def to_wire(self) -> list[Any]:
        """The counts in field order."""
        return [getattr(self, name) for name in _STEP_COUNT_FIELDS]

    @classmethod
    def from_wire(cls, values: list[Any]) -> StepCounts:
        """Counts from `to_wire`'s list; ValueError if it is not one."""
        if len(values) != len(_STEP_COUNT_FIELDS):
            raise ValueError(f"{len(values)} step counts, expected {len(_STEP_COUNT_FIELDS)}")
        return cls(*values)


_STEP_COUNT_FIELDS = tuple(f.name for f in fields(StepCounts))


@dataclass(slots=True)
class StepResult:
    """A rank's report of a step, written in the same script as the step's chunks."""

    epoch: int
    step: int
    rank: int
    incarnation: str = ""
    outcomes: list[RequestOutcome] = field(default_factory=list)
    counts: StepCounts = field(default_factory=StepCounts)

    def encode(self) -> bytes:
        """msgpack bytes of the result."""
        outcomes = [
            [o.request_id, o.admission, o.num_new_tokens, o.finish_reason, o.lost, o.released]
            for o in self.outcomes
        ]
        return msgpack.packb(
            [self.epoch, self.step, self.rank, self.incarnation, outcomes, self.counts.to_wire()]
        )

    @classmethod
    def decode(cls, raw: bytes) -> StepResult:
        """A result from its bytes; ValueError if they are not one."""
        try:
            epoch, step, rank, incarnation, outcomes, counts = msgpack.unpackb(raw)
            return cls(
                epoch,
                step,
                rank,
                incarnation,
                [RequestOutcome(*o) for o in outcomes],
                StepCounts.from_wire(counts),
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(f"not a step result: {exc}") from exc
