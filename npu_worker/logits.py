"""What a request's own rules do to its logits before it samples, row by row.

In order: the penalties over what it has seen (transformers' `repetition_penalty` over
prompt and output; OpenAI's `frequency_penalty` and `presence_penalty` over the output),
its `logit_bias`, its stop tokens banned while `min_tokens` says it may not end, and its
constraint's mask. Each row is changed from its own request's tokens alone, so a row's
logits — and its greedy tokens — never depend on its neighbours. Logits are
[rows, positions, vocab]: position p of a verify launch is the token after the row's
first p drafts, which count as seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schemas.messages import SamplingParams


@dataclass(slots=True, frozen=True)
class RowRules:
    """A request's penalties and bias, as the engine applies them."""

    presence: float
    frequency: float
    repetition: float
    bias_ids: tuple[int, ...]
    bias_values: tuple[float, ...]

    @classmethod
    def of(cls, sampling: SamplingParams) -> RowRules | None:
        """The rules of a request; None when it has none."""
        if not sampling.penalised:
            return None
        bias = sorted((int(t), b) for t, b in sampling.logit_bias.items())
        return cls(
            sampling.presence_penalty,
            sampling.frequency_penalty,
            sampling.repetition_penalty,
            tuple(t for t, _ in bias),
            tuple(b for _, b in bias),
        )

    def apply(self, logits: torch.Tensor, seen: list[int], output: list[int]) -> None:
        """Change one row's logits [vocab] in place: `seen` is its prompt and output,
        `output` its output alone."""
        if self.repetition != 1.0 and seen:
            ids = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
            values = logits[ids]
            penalised = torch.where(values < 0, values * self.repetition, values / self.repetition)
            logits[ids] = penalised
        if (self.frequency or self.presence) and output:
            ids = torch.tensor(output, dtype=torch.long, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)
            logits -= counts * self.frequency + (counts > 0).to(logits.dtype) * self.presence
        if self.bias_ids:
            at = torch.tensor(self.bias_ids, dtype=torch.long, device=logits.device)
            logits[at] += torch.tensor(self.bias_values, dtype=logits.dtype, device=logits.device)


def mask(logits: torch.Tensor, allowed: torch.Tensor) -> None:
    """Forbid what `allowed` [vocab] bool does not allow in one row's logits, in place."""
    logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
