"""Tool calls out of a chat completion's text, whole or as it streams: call blocks become
OpenAI's `tool_calls` (deltas when streaming), the rest stays content."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from schemas.tools import CALL_CLOSE, CALL_OPEN, parse_tool_calls


def call_id(request_id: str, index: int) -> str:
    """The id of a request's `index`-th call (what a `tool` message answers)."""
    return f"call_{request_id}-{index}"


def whole_message(text: str, request_id: str) -> tuple[dict[str, Any], bool]:
    """(the assistant message of a finished answer, whether it holds calls)."""
    content, calls = parse_tool_calls(text, f"call_{request_id}")
    if not calls:
        return {"role": "assistant", "content": text}, False
    dumped = [c.model_dump() for c in calls]
    return {"role": "assistant", "content": content, "tool_calls": dumped}, True


@dataclass(slots=True)
class CallSplitter:
    """One streamed choice's text split as it arrives: content is passed on at once except
    what may begin a call block (and trailing blank space, which only matters if no call
    follows); a whole block becomes one tool-call delta with its name and arguments."""

    request_id: str
    held: str = ""
    blank: str = ""  # trailing white space of the content, sent only before more content
    calls: int = 0
    _open: bool = field(default=False)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool-call deltas to send now) for the next piece."""
        self.held += text
        content, deltas = "", []
        while self.held:
            if self._open:
                end = self.held.find(CALL_CLOSE)
                if end < 0:
                    break
                block = self.held[len(CALL_OPEN) : end]
                self.held = self.held[end + len(CALL_CLOSE) :]
                self._open = False
                delta = self._delta(block)
                if delta is None:  # not a call after all: the model's own text
                    content += self._content(CALL_OPEN + block + CALL_CLOSE)
                else:
                    deltas.append(delta)
                continue
            start = self.held.find(CALL_OPEN)
            if start >= 0:
                content += self._content(self.held[:start])
                self.held = self.held[start:]
                self._open = True
                continue
            keep = _partial_open(self.held)
            content += self._content(self.held[: len(self.held) - keep])
            self.held = self.held[len(self.held) - keep :]
            break
        return content, deltas

    def finish(self) -> str:
        """What is left to send as content when the choice ends."""
        rest, self.held = self.held, ""
        if self.calls:
            return rest.strip() and self.blank + rest
        return self.blank + rest

    def _content(self, text: str) -> str:
        if not text:
            return ""
        stripped = text.rstrip()
        if not stripped:
            self.blank += text
            return ""
        out = self.blank + stripped
        self.blank = text[len(stripped) :]
        return out

    def _delta(self, block: str) -> dict[str, Any] | None:
        try:
            call = json.loads(block)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        delta = {
            "index": self.calls,
            "id": call_id(self.request_id, self.calls),
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments)},
        }
        self.calls += 1
        self.blank = ""  # space between calls is not content
        return delta


def _partial_open(text: str) -> int:
    """The length of the longest end of `text` that begins a call block's opening tag."""
    for size in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
