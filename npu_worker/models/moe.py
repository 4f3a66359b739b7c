"""Mixture of experts: each expert computes only the rows routed to it, exactly, and the seam
where experts split across ranks (docs/architecture.md §4a).

A router gives each token its `k` experts and their weights (`Routes`). The launch's
(token, expert) pairs are sorted by expert; each expert runs its products over the rows of
its pairs alone, and each token's output is the weighted sum of its pairs' outputs, added
in float32 in ascending expert order, from zero. Padding tokens route nowhere and cost
nothing; no routed pair is ever dropped.

A row's bits never depend on what shares its launch: an expert's products see a number of
rows that does depend on the others, so they are called either with rows whatever their
number, where the kit's products keep each row's sums apart from its count (`rows_apart`:
the CPU kernels' own product), or else in tiles of `EXPERT_TILE` rows, zero-padded, at one
shape (the premise every launch rests on: at a fixed shape a row's result depends only on
the row). The same pairs summed in the same order give the dense form's bits wherever the
products give a row the same bits at every count (tests/test_routed_experts.py).

With expert parallelism each rank holds a contiguous share of the experts
(`expert_share`). Each rank routes its own tokens and sends every other rank only the rows
routed to that rank's experts: first how many for each of its experts, then the rows
(`ExpertGroup.gather`); each rank runs its experts over what it received and sends the
outputs back (`ExpertGroup.combine`), where they are weighted and summed as above, so a
token's output has the bits it has on one rank holding every expert. Every rank runs the
same launches, so the collectives always meet, with zero rows where none are routed.
"""

from __future__ import annotations

from types import EllipsisType
from typing import NamedTuple, Protocol

import torch
from torch import nn

from npu_worker.models.kit import LayerKit
from npu_worker.models.stored import StoredLinear

EXPERT_TILE = 8  # rows per expert product where the products do not keep rows apart


class Routes(NamedTuple):
    """Where a launch's tokens go: each token's `k` experts in ascending order [T, k] and
    their weights [T, k] (float32); `valid` [T] is False for padding, which goes nowhere."""

    experts: torch.Tensor
    weights: torch.Tensor
    valid: torch.Tensor


def routes(top: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor) -> Routes:
    """Routes of each token's chosen experts `top` [T, k] and their weights [T, k], put in
    ascending expert order (the order the outputs are summed in)."""
    experts, order = torch.sort(top.long(), dim=-1, stable=True)
    return Routes(experts, weights.float().gather(1, order), valid.bool())


class ExpertGroup(Protocol):
    """The ranks that share a model's experts."""

    @property
    def rank(self) -> int:
        """This rank's place in the group."""
        ...

    @property
    def size(self) -> int:
        """Ranks in the group."""
        ...

    def gather(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send each rank the rows routed to its experts: `rows` [P, H] in expert order and
        `counts` [size, share] (how many rows for each expert of each rank). Returns the
        rows this rank received, by source rank then expert, and how many from each source
        for each of its experts [size, share]."""
        ...

    def combine(
        self, outputs: torch.Tensor, sent: torch.Tensor, received: torch.Tensor
    ) -> torch.Tensor:
        """Send the outputs of the rows `gather` received (`received` counts) back to their
        ranks; returns the outputs of the rows this rank sent (`sent` counts), in their order."""
        ...


class LocalExperts:
    """One rank holding every expert: nothing to exchange."""

    rank = 0
    size = 1

    def gather(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows themselves."""
        return rows, counts

    def combine(
        self, outputs: torch.Tensor, sent: torch.Tensor, received: torch.Tensor
    ) -> torch.Tensor:
        """The outputs themselves."""
        return outputs


class ExpertBlock(nn.Module):
    """An MoE block: its routed experts run their collectives in `group`."""

    group: ExpertGroup


class ExpertModel(nn.Module):
    """A model of ExpertBlocks, whose routed experts can be split over ranks. Which rows an
    expert computes depends on the routing, so its launches have no one shape for a graph
    to capture (backends.py runs them eagerly)."""

    static_shapes = False

    def use_experts(self, group: ExpertGroup) -> None:
        """Split the routed experts over `group` (each rank holds its share)."""
        for module in self.modules():
            if isinstance(module, ExpertBlock):
                module.group = group


def expert_share(num_experts: int, rank: int, size: int) -> range:
    """The experts rank `rank` of `size` holds; ValueError if they do not divide evenly."""
    if num_experts % size:
        raise ValueError(
            f"{num_experts} routed experts do not divide over {size} expert-parallel ranks"
        )
    share = num_experts // size
    return range(rank * share, (rank + 1) * share)


class GatedMLP(nn.Module):
    """SiLU-gated MLP (`gate_proj`, `up_proj`, `down_proj`): a dense layer or one expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, kit: LayerKit) -> None:
        super().__init__()
        self.gate_proj = kit.linear(hidden_size, intermediate_size)
        self.up_proj = kit.linear(hidden_size, intermediate_size)
        self.down_proj = kit.linear(intermediate_size, hidden_size)
        self.gated = kit.gated(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(x))


def in_tiles(expert: nn.Module, rows: torch.Tensor, tile: int | None) -> torch.Tensor:
    """`expert` over `rows` [N, H]: in one call (`tile` None), or in zero-padded tiles of
    `tile` rows, each at the same shape."""
    if tile is None:
        return expert(rows)  # type: ignore[no-any-return]
    count = rows.shape[0]
    padded = rows.new_zeros(-(-count // tile) * tile, rows.shape[1])
    padded[:count] = rows
    return torch.cat([expert(part) for part in padded.split(tile)])[:count]


class RoutedExperts:
    """A rank's share of a layer's routed experts (`experts`, keyed by global index) and
    how their products are called (`kit.rows_apart`, read once the kit has laid the
    weights out)."""

    def __init__(self, experts: nn.ModuleDict, share: range, kit: LayerKit) -> None:
        self.experts, self.share, self.kit = experts, share, kit
        self.tile: int | None | EllipsisType = ...  # `rows_per_call`, once known

    def __call__(self, x: torch.Tensor, route: Routes, group: ExpertGroup) -> torch.Tensor:
        """The routed output [T, H] of tokens `x` [T, H] (float32 sums, in `x`'s dtype)."""
        tokens, k = route.experts.shape
        total = len(self.share) * group.size
        flat = route.experts.reshape(-1)
        pairs = route.valid.repeat_interleave(k).nonzero().squeeze(1)
        experts = flat[pairs]
        experts, order = torch.sort(experts, stable=True)
        pairs = pairs[order]
        counts = torch.bincount(experts, minlength=total).view(group.size, len(self.share))
        received_rows, received = group.gather(x[pairs // k], counts)
        outputs = self._run(received_rows, received)
        back = group.combine(outputs, counts, received)
        per_pair = torch.zeros(tokens * k, x.shape[-1], dtype=torch.float32, device=x.device)
        per_pair[pairs] = back.float() * route.weights.reshape(-1)[pairs, None]
        per_pair = per_pair.view(tokens, k, -1)
        out = torch.zeros(tokens, x.shape[-1], dtype=torch.float32, device=x.device)
        for slot in range(k):
            out += per_pair[:, slot]
        return out.to(x.dtype)

    def rows_per_call(self) -> int | None:
        """Rows an expert's products take at a time (None: any number, where every layer of
        every expert keeps rows apart at any count: `StoredLinear.keeps_rows_apart`; a
        weight widened at each call goes through torch's products, which keep rows apart
        only at one shape). Read on the first call, once the weights are in."""
        if self.tile is ...:
            apart = all(
                m.keeps_rows_apart(self.kit.rows_apart)
                for m in self.experts.modules()
                if isinstance(m, StoredLinear)
            )
            self.tile = None if apart else EXPERT_TILE
        return self.tile  # type: ignore[return-value]

    def _run(self, rows: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        """This rank's experts over the rows it received ([size, share] counts: by source,
        then expert), each expert over its rows alone; outputs in the rows' order."""
        size, share = received.shape
        local = torch.arange(share, device=rows.device).repeat(size)
        which = local.repeat_interleave(received.reshape(-1))
        which, order = torch.sort(which, stable=True)
        tile = self.rows_per_call()
        outputs = torch.empty_like(rows)
        start = 0
        for local_index, count in enumerate(received.sum(0).tolist()):
            if count:
                index = order[start : start + count]
                expert = self.experts[str(self.share.start + local_index)]
                outputs[index] = in_tiles(expert, rows[index], tile)
                start += count
        return outputs
