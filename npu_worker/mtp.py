"""Accepting MTP drafts (docs/architecture.md §4). A row's token at the draft's place is
the one it would take without a draft (the argmax, or its seeded draw from p), and the
draft is accepted iff it is that token. A sampled row so accepts the draft with
probability p(draft), and on a rejection its token is distributed as p without the draft,
renormalised: the usual lossless rule for a single draft. Drawn this way, a seeded
request's tokens do not depend on its drafts: they are its tokens without MTP, and a
request resumed after a crash or a preemption (whose first token comes from a prefill
launch, with no draft) draws the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from npu_worker.sampler import SamplingRows, sample


@dataclass(slots=True)
class Acceptance:
    """Per row: the token committed at the draft's place, the bonus token after an accepted
    draft (meaningful only where `accepted`), and whether the draft was accepted."""

    first: torch.Tensor
    second: torch.Tensor
    accepted: torch.Tensor


def accept_drafts(logits: torch.Tensor, drafts: torch.Tensor, rows: SamplingRows) -> Acceptance:
    """Decide every row of a verify launch: `logits` [n, 2, vocab] at [last token, draft]."""
    first = sample(logits[:, 0], rows)
    second = sample(logits[:, 1], replace(rows, index=rows.index + 1))
    return Acceptance(first=first, second=second, accepted=first == drafts)
