"""Stop strings over streamed text: text never leaks past a stop string, even one that spans
tokens, because any tail that could still begin one is held back until it cannot."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StopStrings:
    """Streams text through, cutting it at the first stop string."""

    stops: list[str]
    held: str = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Append decoded text; returns the text safe to publish and whether a stop was hit."""
        buffer = self.held + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buffer[: min(hits)], True
        keep = self._longest_stop_prefix_suffix(buffer)
        self.held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """Release what is held (the completion ended for another reason)."""
        text, self.held = self.held, ""
        return text

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that some stop string starts with."""
        for size in range(min(len(buffer), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = buffer[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
