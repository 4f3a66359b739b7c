"""The README stays true: its settings table lists every setting with its real default."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.config import Settings

pytestmark = pytest.mark.fast

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_settings_table_matches_the_settings_model() -> None:
    rows = {}
    for line in README.read_text().splitlines():
        if line.startswith("| `--"):
            cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[2]
    for name, field in Settings.model_fields.items():
        flag = (
            f"--[no-]{name.replace('_', '-')}"
            if field.annotation is bool
            else ("--" + name.replace("_", "-"))
        )
        assert flag in rows, f"README lacks {flag}"
        assert rows[flag] == str(field.default), f"README default of {flag}: {rows[flag]}"
    assert len(rows) == len(Settings.model_fields)
