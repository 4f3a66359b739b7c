"""Every model family the worker serves, and which one a checkpoint is (docs/architecture.md
§8). A new family is a package under models/ with its `FAMILY`, and one line here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from npu_worker.models import deepseek_v3, deepseek_v4, llama
from npu_worker.models.config import UnsupportedModel
from npu_worker.models.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    deepseek_v3.FAMILY,
    deepseek_v4.FAMILY,
)


def family_of(path: Path) -> tuple[Family, Any]:
    """The family of a model directory and its config; UnsupportedModel says what is
    missing or not supported."""
    config_path = path / "config.json"
    if not config_path.exists():
        raise UnsupportedModel(f"{path} has no config.json")
    raw: dict[str, Any] = json.loads(config_path.read_text())
    for family in FAMILIES:
        if family.reads(raw):
            return family, family.read_config(path)
    supported = sorted(a for family in FAMILIES for a in family.architectures)
    raise UnsupportedModel(
        f"{config_path}: architectures {raw.get('architectures') or []} (model_type "
        f"{raw.get('model_type')!r}) not supported; supported: {supported}"
    )
