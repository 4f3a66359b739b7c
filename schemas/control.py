"""Control-plane messages between a pool's batcher and its ranks (DESIGN §3, §5)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from schemas.messages import SamplingParams


class _Control(BaseModel):
    model_config = ConfigDict(extra="forbid", use_enum_values=True)


class NewRequest(_Control):
    """A request handed to a rank once, when it is admitted to one of its KV slots."""

    request_id: str
    slot: int
    prompt_token_ids: list[int]
    num_prompt_tokens: int = Field(description="tokens of the original prompt, for usage")
    sampling: SamplingParams
    start_index: int = 0
    start_seq: int = 0
    admission: int = Field(default=0, description="which admission of the request this is")
    result_ttl_s: int


class PrefillChunk(_Control):
    """Prefill tokens [start, start + num_tokens) of the request in `slot`."""

    slot: int
    start: int
    num_tokens: int


class SlotStop(_Control):
    """End a running request now (cancel or deadline: its rank writes the final chunk), or
    give its slot back unfinished (`preempted`: the batcher resumes it later)."""

    slot: int
    request_id: str
    finish_reason: str  # a FinishReason value, or PREEMPTED
    admission: int = 0


PREEMPTED = "preempted"


class RankStepPlan(_Control):
    """One rank's share of a step: new requests, decode launches, then prefill chunks.

    Each decode launch lists the slots of its rows (at most `decode_batch`); an empty
    launch or a prefill chunk with `num_tokens == 0` is a lockstep dummy.
    """

    epoch: int
    step: int
    rank: int
    incarnation: str = Field(default="", description="the rank process this plan is for")
    new_requests: list[NewRequest] = Field(default_factory=list)
    decode_launches: list[list[int]] = Field(default_factory=list)
    prefill: list[PrefillChunk] = Field(default_factory=list)
    stops: list[SlotStop] = Field(default_factory=list)


class RequestOutcome(_Control):
    """What one step did for one request on a rank."""

    request_id: str
    admission: int = 0
    num_new_tokens: int
    finish_reason: str | None = None
    lost: bool = Field(default=False, description="its stream moved on: this rank lost it")
    released: bool = Field(
        default=False, description="the rank no longer holds it, unfinished (preempted)"
    )


class StepResult(_Control):
    """A rank's report of a step, after its tokens are published."""

    epoch: int
    step: int
    rank: int
    incarnation: str = ""
    outcomes: list[RequestOutcome] = Field(default_factory=list)
    num_decode_launches: int = 0
    num_decode_rows: int = 0
    num_padding_rows: int = 0
    num_prefill_launches: int = 0
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    exec_ms: float = 0.0
