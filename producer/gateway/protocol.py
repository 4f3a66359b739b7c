"""OpenAI request bodies (with vLLM's sampling extensions) and their pool request options.

Every field a body may carry is declared: an unknown one is a 400 naming it, and a known
one the pool cannot honour (`n > 1`, penalties, `logit_bias`, `echo`, ...) is a 400 too,
never silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from producer.gateway.errors import ApiError

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; the pool's own default is greedy
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """`stream_options`: a usage chunk at the end, or (vLLM) usage on every chunk."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


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
    # the pool's own
    priority: int | None = None
    deadline_ms: int | None = None

    def check_supported(self) -> None:
        """A 400 for a known field set to something the pool cannot do."""
        if self.n not in (None, 1):
            raise ApiError(400, f"field `n`: only n=1 is supported (got {self.n})", param="n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"field `{name}`: not supported; leave it 0", param=name)
        if self.logit_bias:
            raise ApiError(400, "field `logit_bias`: not supported", param="logit_bias")

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
    """One message of a chat request."""

    role: ChatRole
    content: str | list[TextPart] | None = None

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

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as the pool's `{role, content}` maps."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def options(self) -> dict[str, Any]:
        """`Client.submit` keywords (no `max_tokens` unless given: the model's length then)."""
        self.check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(
                400, "field `top_logprobs`: needs `logprobs: true`", param="top_logprobs"
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        options = self.common_options(max_tokens, logprobs)
        if self.metadata:
            options["metadata"] = {**self.metadata, **options.get("metadata", {})}
        return options
