"""Result chunks as OpenAI bodies: completions and chat completions, whole or as stream chunks,
with logprobs in each API's own layout."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from producer.gateway.tool_calls import CallSplitter, whole_message
from schemas.messages import ResultChunk, Usage

Kind = Literal["completion", "chat"]
TokenText = Callable[[int], str]


def token_id_text(token_id: int) -> str:
    """A token's text when no tokenizer is at hand (vLLM's `token_id:N` form)."""
    return f"token_id:{token_id}"


def usage_body(usage: Usage | None | list[Usage | None]) -> dict[str, Any] | None:
    """OpenAI's usage object, with the total and the prompt's cached tokens; of several
    choices, the prompt once (the first choice's) and every choice's completion tokens."""
    usages = usage if isinstance(usage, list) else [usage]
    known = [u for u in usages if u is not None]
    if not known:
        return None
    prompt = known[0].prompt_tokens
    completion = sum(u.completion_tokens for u in known)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": known[0].cached_tokens},
    }


@dataclass(slots=True)
class Renderer:
    """Builds one request's response bodies; keeps what streaming needs between chunks."""

    kind: Kind
    request_id: str
    model: str
    created: int
    wants_logprobs: bool = False
    token_text: TokenText = token_id_text
    text_offsets: dict[int, int] = field(default_factory=dict)  # by choice
    tools: bool = False  # the answer may hold tool calls
    splitters: dict[int, CallSplitter] = field(default_factory=dict)  # by choice

    @property
    def object_name(self) -> str:
        """OpenAI's `object` of a whole answer of this kind."""
        return "text_completion" if self.kind == "completion" else "chat.completion"

    def _head(self, chunked: bool) -> dict[str, Any]:
        name = self.object_name + (".chunk" if chunked and self.kind == "chat" else "")
        return {"id": self.request_id, "object": name, "created": self.created, "model": self.model}

    def whole(self, choices: list[list[ResultChunk]]) -> dict[str, Any]:
        """The non-streaming body of a finished request: one choice per result stream."""
        bodies = []
        for index, chunks in enumerate(choices):
            text = "".join(c.text for c in chunks)
            entries = [e for c in chunks for e in (c.logprobs or [])]
            logprobs = self.logprobs(entries, text_so_far=0) if self.wants_logprobs else None
            choice: dict[str, Any] = {"index": index, "logprobs": logprobs}
            finish: str | None = chunks[-1].finish_reason
            if self.kind == "chat" and self.tools:
                choice["message"], called = whole_message(text, self._choice_id(index))
                finish = "tool_calls" if called and finish == "stop" else finish
            elif self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["finish_reason"] = finish
            bodies.append(choice)
        usage = usage_body([chunks[-1].usage for chunks in choices])
        return {**self._head(False), "choices": bodies, "usage": usage}

    def role_chunk(self, num_choices: int = 1) -> dict[str, Any]:
        """A chat stream's first chunk: the assistant role of each choice, no content yet."""
        delta = {"role": "assistant", "content": ""}
        choices = [
            {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
            for i in range(num_choices)
        ]
        return {**self._head(True), "choices": choices}

    def chunk(
        self, chunk: ResultChunk, usage: dict[str, Any] | None = None, index: int = 0
    ) -> dict[str, Any]:
        """One stream chunk for one result chunk of choice `index`."""
        logprobs = None
        offset = self.text_offsets.get(index, 0)
        if self.wants_logprobs:
            logprobs = self.logprobs(chunk.logprobs or [], text_so_far=offset)
        self.text_offsets[index] = offset + len(chunk.text)
        choice: dict[str, Any] = {"index": index}
        finish: str | None = chunk.finish_reason
        if self.kind == "chat" and self.tools:
            choice["delta"], called = self._tool_delta(chunk, index)
            finish = "tool_calls" if called and finish == "stop" else finish
        elif self.kind == "chat":
            choice["delta"] = {"content": chunk.text} if chunk.text or not chunk.is_final else {}
        else:
            choice["text"] = chunk.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        body = {**self._head(True), "choices": [choice]}
        if usage is not None:
            body["usage"] = usage
        return body

    def _choice_id(self, index: int) -> str:
        return self.request_id if index == 0 else f"{self.request_id}.{index}"

    def _tool_delta(self, chunk: ResultChunk, index: int) -> tuple[dict[str, Any], bool]:
        """A streamed chunk's delta when tools are offered: content, and any whole calls."""
        splitter = self.splitters.setdefault(index, CallSplitter(self._choice_id(index)))
        content, calls = splitter.feed(chunk.text)
        if chunk.is_final:
            content += splitter.finish()
        delta: dict[str, Any] = {}
        if content or not (chunk.is_final or calls):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, splitter.calls > 0

    def usage_chunk(self, usage: Usage | None | list[Usage | None]) -> dict[str, Any]:
        """The last stream chunk with `include_usage`: no choices, the request's usage."""
        return {**self._head(True), "choices": [], "usage": usage_body(usage)}

    def logprobs(self, entries: list[dict[str, Any]], text_so_far: int) -> dict[str, Any]:
        """Per-token log-probabilities in the layout of this request's API."""
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens, offsets = [], []
        offset = text_so_far
        for entry in entries:
            text = self.token_text(int(entry["token_id"]))
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [float(e["logprob"]) for e in entries],
            "top_logprobs": [
                {self.token_text(int(t)): float(lp) for t, lp in e.get("top", [])} for e in entries
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, entry: dict[str, Any]) -> dict[str, Any]:
        text = self.token_text(int(entry["token_id"]))
        top = []
        for token_id, logprob in entry.get("top", []):
            alt = self.token_text(int(token_id))
            top.append({"token": alt, "logprob": float(logprob), "bytes": list(alt.encode())})
        return {
            "token": text,
            "logprob": float(entry["logprob"]),
            "bytes": list(text.encode()),
            "top_logprobs": top,
        }
