"""Vectorised sampling over a launch's rows; random draws depend only on (seed, index).

Greedy rows (temperature 0) take the argmax. Other rows sample from the filtered softmax
(top_k, top_p, min_p) by inverse CDF with a counter-based uniform per row, so a seeded
request draws the same numbers whatever else shares its launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from schemas.messages import SamplingParams

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_STREAM = _signed(0xD1B54A32D192ED03)  # separates independent draws of one (seed, index)


@dataclass(slots=True)
class SamplingRows:
    """Per-row sampling parameters of one launch, as tensors on the launch's device."""

    temperature: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] long, <= 0 means off
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    seed: torch.Tensor  # [N] long
    index: torch.Tensor  # [N] long, completion index of the token being drawn
    all_greedy: bool  # no row samples (known on the host, so no device sync asks it)


def uniform(seed: torch.Tensor, index: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """splitmix64(seed, index, stream) -> float64 in [0, 1); int64 wraps like uint64."""
    z = seed + (index + 1) * _GOLDEN + stream * _STREAM
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).double() / float(1 << 53)


def uniform_reference(seed: int, index: int, stream: int = 0) -> float:
    """The same draw in plain Python integers, to check the tensor version against."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15 + stream * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 seen as uint64."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def filtered_probs(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Softmax of logits / temperature with top_k, top_p and min_p applied, renormalised."""
    temperature = rows.temperature.clamp_min(1e-5)[:, None]
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    top_k = torch.where(rows.top_k > 0, rows.top_k, probs.shape[-1])[:, None]
    drop = rank >= top_k
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= before >= rows.top_p[:, None]
    drop |= sorted_probs < rows.min_p[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """One token per row: argmax where temperature is 0, else a seeded draw."""
    greedy = logits.argmax(dim=-1)
    if rows.all_greedy:
        return greedy
    picked = inverse_cdf(filtered_probs(logits, rows), uniform(rows.seed, rows.index))
    return torch.where(rows.temperature == 0, greedy, picked)


def inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Per row, the token whose cumulative probability interval holds `draws` (in [0, 1))."""
    cdf = probs.double().cumsum(dim=-1)
    target = draws * cdf[:, -1]
    picked = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    return picked.clamp_max(probs.shape[-1] - 1)


def sampling_rows(
    params: list[SamplingParams], seeds: list[int], indices: list[int], device: torch.device
) -> SamplingRows:
    """The tensors of a launch's rows, from each request's parameters."""

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return SamplingRows(
        temperature=column([p.temperature for p in params], torch.float32),
        top_k=column([p.top_k for p in params], torch.long),
        top_p=column([p.top_p for p in params], torch.float32),
        min_p=column([p.min_p for p in params], torch.float32),
        seed=column(seeds, torch.long),
        index=column(indices, torch.long),
        all_greedy=all(p.temperature == 0 for p in params),
    )


class SamplingTable:
    """Every KV slot's sampling parameters as device tensors, written when a request is
    admitted; a launch gathers its rows' instead of building them per step."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.device = device
        self.temperature = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.seed = torch.zeros(num_slots, dtype=torch.long, device=device)

    def set(self, slot: int, params: SamplingParams, seed: int) -> None:
        """Record an admitted request's parameters in its slot."""
        self.temperature[slot] = params.temperature
        self.top_k[slot] = params.top_k
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        self.seed[slot] = seed  # below 2**63: the request schema and _seed_of keep it there

    def rows(self, slots: list[int], indices: list[int], all_greedy: bool) -> SamplingRows:
        """The sampling rows of a launch: slot `slots[i]` drawing completion index `indices[i]`."""
        at = torch.tensor(slots, dtype=torch.long, device=self.device)
        return SamplingRows(
            temperature=self.temperature[at],
            top_k=self.top_k[at],
            top_p=self.top_p[at],
            min_p=self.min_p[at],
            seed=self.seed[at],
            index=torch.tensor(indices, dtype=torch.long, device=self.device),
            all_greedy=all_greedy,
        )


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], wanted: list[int | None]
) -> list[dict[str, Any] | None]:
    """Per row that asked: the chosen token's log-probability and the top-n alternatives.

    Log-probabilities are of the model's own distribution (log_softmax of the logits,
    before temperature and filters), as vLLM reports them by default.
    """
    rows = [r for r, n in enumerate(wanted) if n is not None]
    out: list[dict[str, Any] | None] = [None] * len(wanted)
    if not rows:
        return out
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    most = max(wanted[r] or 0 for r in rows)
    top_values, top_ids = logprobs.topk(most, dim=-1) if most else (None, None)
    for i, row in enumerate(rows):
        entry: dict[str, Any] = {
            "token_id": token_ids[row],
            "logprob": float(logprobs[i, token_ids[row]]),
        }
        n = wanted[row] or 0
        if top_values is not None and top_ids is not None:
            entry["top"] = [
                [int(t), float(v)]
                for t, v in zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist())
            ]
        else:
            entry["top"] = []
        out[row] = entry
    return out
