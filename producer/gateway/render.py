"""Result chunks as OpenAI bodies: completions and chat completions, whole or as stream chunks,
with logprobs in each API's own layout."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from schemas.messages import ResultChunk, Usage

Kind = Literal["completion", "chat"]
TokenText = Callable[[int], str]


def token_id_text(token_id: int) -> str:
    """A token's text when no tokenizer is at hand (vLLM's `token_id:N` form)."""
    return f"token_id:{token_id}"


def usage_body(usage: Usage | None) -> dict[str, int] | None:
    """OpenAI's usage object, with the total."""
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
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
    text_offset: int = 0

    @property
    def object_name(self) -> str:
        """OpenAI's `object` of a whole answer of this kind."""
        return "text_completion" if self.kind == "completion" else "chat.completion"

    def _head(self, chunked: bool) -> dict[str, Any]:
        name = self.object_name + (".chunk" if chunked and self.kind == "chat" else "")
        return {"id": self.request_id, "object": name, "created": self.created, "model": self.model}

    def whole(self, chunks: list[ResultChunk]) -> dict[str, Any]:
        """The non-streaming body of a finished request."""
        final = chunks[-1]
        text = "".join(c.text for c in chunks)
        entries = [e for c in chunks for e in (c.logprobs or [])]
        logprobs = self.logprobs(entries, text_so_far=0) if self.wants_logprobs else None
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["finish_reason"] = final.finish_reason
        return {**self._head(False), "choices": [choice], "usage": usage_body(final.usage)}

    def role_chunk(self) -> dict[str, Any]:
        """A chat stream's first chunk: the assistant role, no content yet."""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**self._head(True), "choices": [choice]}

    def chunk(self, chunk: ResultChunk, usage: dict[str, int] | None = None) -> dict[str, Any]:
        """One stream chunk for one result chunk."""
        logprobs = None
        if self.wants_logprobs:
            logprobs = self.logprobs(chunk.logprobs or [], text_so_far=self.text_offset)
        self.text_offset += len(chunk.text)
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = {"content": chunk.text} if chunk.text or not chunk.is_final else {}
        else:
            choice["text"] = chunk.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = chunk.finish_reason
        body = {**self._head(True), "choices": [choice]}
        if usage is not None:
            body["usage"] = usage
        return body

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
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
