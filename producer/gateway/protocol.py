"""OpenAI request bodies (with vLLM's sampling extensions) and their pool request options.

Every field a body may carry is declared: an unknown one is a 400 naming it, and a known
one the pool cannot honour (`echo`, `best_of`, ...) is a 400 too, never silently ignored.
`response_format` (and vLLM's `structured_outputs`) become the request's constraint here,
so one that cannot compile is a 400 naming it before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producer.gateway.errors import ApiError
from producer.requests import invalid_reason
from schemas.constraints import Choice, Grammar, JsonObject, JsonSchema, Regex
from schemas.tools import Tool, ToolCall, ToolChoice

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; the pool's own default is greedy
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default
MAX_CHOICES = 16  # `n`: each choice is a request of its own in the pool


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """`stream_options`: a usage chunk at the end, or (vLLM) usage on every chunk."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: OpenAI's named schema."""

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`response_format`: text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: one of a JSON schema, a regex, a choice, a grammar."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Generation(_Strict):
    """Fields common to completions and chat completions."""

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    # the pool's own
    priority: int | None = None
    deadline_ms: int | None = None

    def check_supported(self) -> None:
        """A 400 for a known field set to something the pool cannot do."""
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise ApiError(
                400, f"field `n`: from 1 to {MAX_CHOICES} choices (got {self.n})", param="n"
            )

    def constraint(self) -> Any:
        """The request's constraint from `response_format` or `structured_outputs`; a 400
        naming the field when it cannot compile."""
        given = self.response_format is not None and self.response_format.type != "text"
        if given and self.structured_outputs is not None:
            raise ApiError(
                400,
                "field `structured_outputs`: give it or `response_format`, not both",
                param="structured_outputs",
            )
        try:
            if given:
                return _from_response_format(self.response_format)  # type: ignore[arg-type]
            if self.structured_outputs is not None:
                return _from_structured_outputs(self.structured_outputs)
        except ValidationError as exc:
            name = "response_format" if given else "structured_outputs"
            raise ApiError(400, f"field `{name}`: {invalid_reason(exc, {})}", param=name) from exc
        return None

    def common_options(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """`Client.submit` keywords: sampling, priority, deadline and metadata."""
        given: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "constraint": self.constraint(),
            "logprobs": logprobs,
            "priority": self.priority,
            "deadline_ms": self.deadline_ms,
        }
        options = {k: v for k, v in given.items() if v is not None}
        if self.user:
            options["metadata"] = {"user": self.user}
        return options

    @property
    def include_usage(self) -> bool:
        """A final chunk with usage and no choices, after the last choice chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far on every chunk (vLLM's `continuous_usage_stats`)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Generation):
    """`POST /v1/completions`: a prompt string or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompt_parts(self) -> tuple[str | None, list[int] | None]:
        """(prompt text, prompt token ids), exactly one set; one prompt per request."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(
                    400,
                    f"field `prompt`: one prompt per request (got {len(prompt)}); "
                    "send each as its own request",
                    param="prompt",
                )
            prompt = prompt[0]  # type: ignore[assignment]
        if isinstance(prompt, str):
            return prompt, None
        return None, list(prompt)  # type: ignore[arg-type]

    def options(self) -> dict[str, Any]:
        """`Client.submit` keywords for this body."""
        self.check_supported()
        if self.best_of not in (None, 1):
            raise ApiError(400, "field `best_of`: only best_of=1 is supported", param="best_of")
        if self.echo:
            raise ApiError(400, "field `echo`: not supported", param="echo")
        if self.suffix:
            raise ApiError(400, "field `suffix`: not supported", param="suffix")
        max_tokens = self.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        return self.common_options(max_tokens, self.logprobs)


class TextPart(_Strict):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


# The roles OpenAI's chat API takes; any other is a 400 there, and here.
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessageIn(_Strict):
    """One message of a chat request: an assistant's may carry its tool calls, a `tool`
    message answers one by its id."""

    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Generation):
    """`POST /v1/chat/completions`: messages through the model's chat template."""

    messages: list[ChatMessageIn]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    metadata: dict[str, str] | None = None

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as the pool's maps: role and content, and any tool fields."""
        out = []
        for m in self.messages:
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out

    @property
    def calls_tools(self) -> bool:
        """True when the answer may hold tool calls (tools offered, and not `none`)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_options(self) -> dict[str, Any]:
        """`Client.submit` keywords for the tools."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise ApiError(400, "field `tool_choice`: needs `tools`", param="tool_choice")
            return {}
        options: dict[str, Any] = {"tools": self.tools, "tool_choice": self.tool_choice}
        if self.parallel_tool_calls is not None:
            options["parallel_tool_calls"] = self.parallel_tool_calls
        return options

    def options(self) -> dict[str, Any]:
        """`Client.submit` keywords (no `max_tokens` unless given: the model's length then)."""
        self.check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(
                400, "field `top_logprobs`: needs `logprobs: true`", param="top_logprobs"
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        options = self.common_options(max_tokens, logprobs) | self.tool_options()
        if self.metadata:
            options["metadata"] = {**self.metadata, **options.get("metadata", {})}
        return options


def _from_response_format(form: ResponseFormat) -> Any:
    if form.type == "json_object":
        return JsonObject()
    if form.json_schema is None:
        raise ApiError(
            400,
            "field `response_format.json_schema`: required when type is json_schema",
            param="response_format",
        )
    return JsonSchema(
        json_schema=form.json_schema.json_schema, strict=bool(form.json_schema.strict)
    )


def _from_structured_outputs(given: StructuredOutputs) -> Any:
    chosen = [
        name
        for name in ("json_", "regex", "choice", "grammar", "json_object")
        if getattr(given, name) not in (None, False)
    ]
    if len(chosen) != 1:
        raise ApiError(
            400,
            "field `structured_outputs`: give exactly one of json, regex, choice, grammar "
            "or json_object",
            param="structured_outputs",
        )
    if given.regex is not None:
        return Regex(pattern=given.regex)
    if given.choice is not None:
        return Choice(choices=given.choice)
    if given.grammar is not None:
        return Grammar(grammar=given.grammar)
    if given.json_object:
        return JsonObject()
    schema = given.json_
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ApiError(
                400, f"field `structured_outputs.json`: not JSON: {exc}", param="structured_outputs"
            ) from exc
    if not isinstance(schema, dict):
        raise ApiError(
            400, "field `structured_outputs.json`: not a JSON schema", param="structured_outputs"
        )
    return JsonSchema(json_schema=schema)
