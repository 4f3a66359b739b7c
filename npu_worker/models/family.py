"""What a model family tells the rest of the worker (docs/architecture.md §8): which
checkpoints it reads, how to read their config, how to build its model, and where a
checkpoint's tensors go in that model. Each family package defines one `Family`; the
registry (registry.py) lists them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from npu_worker.models.kit import LayerKit
from npu_worker.models.launch import LaunchModel


class FamilyConfig(Protocol):
    """What the loader and the rank read of any family's config."""

    @property
    def architecture(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def torch_dtype(self) -> str: ...

    @property
    def tie_word_embeddings(self) -> bool: ...

    @property
    def mtp_layers(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


class Placement(Protocol):
    """Where a checkpoint's tensors go in one rank's model."""

    def keep(self, key: str) -> bool:
        """Whether this rank reads tensor `key` (an expert-parallel rank: its own experts)."""
        ...

    def name(self, key: str) -> str | None:
        """The model's name for tensor `key`; None: the model has no place for it."""
        ...

    def finish(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state dict with what the checkpoint leaves implied filled in."""
        ...


class AsStored:
    """A checkpoint whose names are the model's: every tensor read, none renamed."""

    def keep(self, key: str) -> bool:
        """Every tensor."""
        return True

    def name(self, key: str) -> str | None:
        """`key` itself."""
        return key

    def finish(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` as it is."""
        return state


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture family. `build(config, max_positions, mtp, experts, kit)` makes its
    model (with `experts` the routed experts this rank holds, for mixture-of-experts
    families); `placement(config, experts, mtp)` maps checkpoint tensors onto it;
    `num_experts(config)` is 0 for dense families; `check(config, path, max_kv_len)`
    raises UnsupportedModel for what this worker cannot serve at that length."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    read_config: Callable[[Path], Any]
    build: Callable[[Any, int, bool, range, LayerKit], LaunchModel[Any]]
    placement: Callable[[Any, range, bool], Placement]
    num_experts: Callable[[Any], int] = lambda config: 0
    check: Callable[[Any, Path, int], None] = lambda config, path, max_kv_len: None

    def reads(self, raw: dict[str, Any]) -> bool:
        """Whether a config.json (`raw`) is one of this family's: an architecture it
        lists, or with no architectures listed, its model type."""
        architectures = raw.get("architectures") or []
        if architectures:
            return any(a in self.architectures for a in architectures)
        return raw.get("model_type") in self.model_types
