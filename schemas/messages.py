"""Wire messages between producers and the pool (docs/architecture.md §6), schema version 1."""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from schemas.constraints import Constraint
from schemas.keys import DEFAULT_TENANT
from schemas.tools import MAX_TOOLS, NamedToolChoice, Tool, ToolCall, ToolChoice, call_constraint

SCHEMA_VERSION = 1
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)
MAX_METADATA_ITEMS = 32
MAX_METADATA_CHARS = 1024
MAX_LOGPROBS = 20
MAX_CHAT_MESSAGES = 256
MAX_LOGIT_BIAS = 1024
TENANT_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"


def _utf8(value: str) -> str:
    """`value` if UTF-8 can encode it; else an error naming where it cannot.

    The codec reads a request's strings with `surrogateescape`, so a byte that is not UTF-8
    arrives as U+DC80..U+DCFF and is reported at its byte offset in the entry's string; any
    other lone surrogate (JSON `\\ud800`, a Python str) at its character index."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = value[exc.start]
        if "\udc80" <= char <= "\udcff":
            offset = len(value[: exc.start].encode("utf-8", "surrogateescape"))
            raise PydanticCustomError(
                "utf8", "not valid UTF-8 at byte {offset}", {"offset": offset}
            ) from None
        raise PydanticCustomError(
            "utf8",
            "holds a lone surrogate U+{code} at character {index}, which is not valid Unicode",
            {"code": f"{ord(char):04X}", "index": exc.start},
        ) from None
    return value


# A string of the wire: anything UTF-8 can encode (msgpack strings are UTF-8).
Text = Annotated[str, AfterValidator(_utf8)]


class FinishReason(str, Enum):
    """Why a completion ended; `null` on non-final chunks."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    REJECTED = "rejected"
    ERROR = "error"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", use_enum_values=True)


class SamplingParams(_Wire):
    """Per-request sampling; `temperature == 0` is greedy."""

    max_tokens: int = Field(default=16, ge=1)
    min_tokens: int = Field(default=0, ge=0, description="no EOS or stop before this many")
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="0 or -1: no top-k filter")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[Text] = Field(default_factory=list, max_length=16)
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] = Field(
        default_factory=list, max_length=64
    )
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    presence_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, description="subtracted once from each output token's logit"
    )
    frequency_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, description="subtracted per occurrence in the output"
    )
    repetition_penalty: float = Field(
        default=1.0,
        gt=0.0,
        le=10.0,
        description="transformers' rule over prompt and output: positive logits divided by "
        "it, negative ones multiplied; 1 is off",
    )
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], float] = Field(
        default_factory=dict,
        max_length=MAX_LOGIT_BIAS,
        description="token id (as a string, as OpenAI's JSON has it) -> added to its logit",
    )

    @field_validator("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value}")
        return value

    @model_validator(mode="after")
    def _min_below_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[str, float]) -> dict[str, float]:
        for token, bias in value.items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias} for token {token} is outside [-100, 100]")
        return value

    @property
    def penalised(self) -> bool:
        """True when a penalty or a bias changes this request's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value


class ChatMessage(_Wire):
    """One turn of a chat, rendered into the prompt with the model's chat template."""

    role: Annotated[Text, Field(min_length=1, max_length=32)]
    content: Text | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOLS)  # assistant's
    tool_call_id: Annotated[Text, Field(max_length=128)] | None = None  # a `tool` answer's

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None:
            if not self.tool_calls:
                raise ValueError(
                    "a message needs `content` (only an assistant's with `tool_calls` may "
                    "leave it out)"
                )
            self.content = ""
        return self


class GenerateRequest(_Wire):
    """One generation request, field `m` of a `{ns}:requests` entry."""

    v: int = SCHEMA_VERSION
    id: Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]
    prompt: Text | None = None
    prompt_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    messages: list[ChatMessage] | None = Field(default=None, max_length=MAX_CHAT_MESSAGES)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    constraint: Constraint | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    priority: int = 0
    deadline_ms: int | None = Field(default=None, ge=0)
    tenant: Annotated[str, Field(pattern=TENANT_PATTERN)] = DEFAULT_TENANT
    result_ttl_s: int | None = Field(default=None, ge=1)
    metadata: dict[Text, Text] = Field(default_factory=dict, max_length=MAX_METADATA_ITEMS)

    @field_validator("v")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value != SCHEMA_VERSION:
            raise ValueError(f"unknown schema version {value}; this pool speaks {SCHEMA_VERSION}")
        return value

    @field_validator("metadata")
    @classmethod
    def _small_metadata(cls, value: dict[str, str]) -> dict[str, str]:
        size = sum(len(k) + len(v) for k, v in value.items())
        if size > MAX_METADATA_CHARS:
            raise ValueError(f"metadata holds {size} characters, at most {MAX_METADATA_CHARS}")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        given = [self.prompt, self.prompt_token_ids, self.messages]
        if sum(value is not None for value in given) != 1:
            raise ValueError("give exactly one of `prompt`, `prompt_token_ids` or `messages`")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("`prompt_token_ids` is empty")
        if self.prompt is not None and not self.prompt:
            raise ValueError("`prompt` is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("`messages` is empty")
        return self

    @model_validator(mode="after")
    def _tool_choice(self) -> GenerateRequest:
        """`tools` need `messages`; `tool_choice` `required` or a named function becomes
        the constraint of a call (so it cannot be given with one of its own)."""
        if self.tools is not None and self.messages is None:
            raise ValueError("`tools` need `messages` (a chat request)")
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return self
        if not self.tools:
            raise ValueError("`tool_choice` requires `tools`")
        if isinstance(choice, NamedToolChoice):
            names = {t.function.name for t in self.tools}
            if choice.function.name not in names:
                raise ValueError(
                    f"`tool_choice` names {choice.function.name!r}, which is not in `tools`"
                )
        if self.constraint is not None:
            wanted = call_constraint(self.tools, choice, self.parallel_tool_calls)
            if self.constraint != wanted:
                raise ValueError("give `constraint` or a `tool_choice` that calls, not both")
            return self
        self.constraint = call_constraint(self.tools, choice, self.parallel_tool_calls)
        return self


class ErrorInfo(_Wire):
    """What went wrong, on a `rejected` or `error` final chunk."""

    code: str
    message: str


class Usage(_Wire):
    """Token counts, on the final chunk."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt, served from the prefix cache (its last admission)


class ResultChunk(_Wire):
    """One entry of `{ns}:result:{id}`: tokens from `index` on, and the end if final."""

    v: int = SCHEMA_VERSION
    id: str
    seq: int
    index: int
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None
    usage: Usage | None = None
    logprobs: list[dict[str, Any]] | None = None
    tenant: str | None = None  # on the final chunk: whose request it was

    @property
    def is_final(self) -> bool:
        """True on the one chunk that ends the completion."""
        return self.finish_reason is not None


class Completion(_Wire):
    """A whole completion, assembled from a result stream."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage | None = None
    error: ErrorInfo | None = None
    parsed: Any = Field(default=None, exclude=True)  # the text validated, where a schema was given
