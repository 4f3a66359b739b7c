"""What every family's config reading shares: the error for a checkpoint this worker
cannot serve, and the EOS token ids a directory names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class UnsupportedModel(ValueError):
    """A checkpoint this worker cannot serve, with what is missing or wrong."""


def eos_ids(path: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    """The EOS token ids: `generation_config.json`'s, else `config.json`'s."""
    generation = path / "generation_config.json"
    value = raw.get("eos_token_id")
    if generation.exists():
        value = json.loads(generation.read_text()).get("eos_token_id", value)
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
