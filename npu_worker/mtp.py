"""Accepting MTP drafts (docs/architecture.md §4): greedy rows accept a draft iff it is the argmax;
sampled rows accept it with probability p(draft) and otherwise draw from p without it,
renormalised, which leaves every token's probability exactly p (lossless)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from npu_worker.sampler import SamplingRows, filtered_probs, inverse_cdf, uniform

ACCEPT_STREAM = 1


@dataclass(slots=True)
class Acceptance:
    """Per row: the token committed at the draft's place, the bonus token after an accepted
    draft (meaningful only where `accepted`), and whether the draft was accepted."""

    first: torch.Tensor
    second: torch.Tensor
    accepted: torch.Tensor


def accept_drafts(logits: torch.Tensor, drafts: torch.Tensor, rows: SamplingRows) -> Acceptance:
    """Decide every row of a verify launch: `logits` [n, 2, vocab] at [last token, draft]."""
    greedy_first = logits[:, 0].argmax(-1)
    greedy_second = logits[:, 1].argmax(-1)
    if rows.all_greedy:
        accepted = greedy_first == drafts
        return Acceptance(torch.where(accepted, drafts, greedy_first), greedy_second, accepted)
    probs = filtered_probs(logits[:, 0], rows)
    p_draft = probs.gather(1, drafts[:, None]).squeeze(1).double()
    sampled_accept = uniform(rows.seed, rows.index, ACCEPT_STREAM) < p_draft
    without_draft = probs.scatter(1, drafts[:, None], 0.0)
    corrected = inverse_cdf(without_draft, uniform(rows.seed, rows.index))
    next_rows = replace(rows, index=rows.index + 1)
    bonus = inverse_cdf(filtered_probs(logits[:, 1], next_rows), uniform(rows.seed, rows.index + 1))
    greedy = rows.temperature == 0
    accepted = torch.where(greedy, greedy_first == drafts, sampled_accept)
    fallback = torch.where(greedy, greedy_first, corrected)
    return Acceptance(
        first=torch.where(accepted, drafts, fallback),
        second=torch.where(greedy, greedy_second, bonus),
        accepted=accepted,
    )
