"""Opening a GGUF file and reading its metadata, for the importer and the tokenizer builder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from npu_worker.models.config import UnsupportedModel


def read_gguf(path: Path) -> Any:
    """The file opened with `gguf`'s reader (memory-mapped); raises UnsupportedModel."""
    from gguf import GGUFReader

    if not path.is_file():
        raise UnsupportedModel(f"GGUF file {path} does not exist")
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise UnsupportedModel(f"{path} is not a readable GGUF file: {exc}") from exc


def metadata(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value (a number, string, bool or list), or `default` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()
