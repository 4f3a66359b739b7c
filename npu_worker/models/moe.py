"""Mixture of experts at fixed shapes, and the seam where experts split across ranks.

Every token of a launch goes through every expert a rank holds, weighted by its routing
weight (zero for the experts it was not routed to, and for padding tokens), in ascending
expert order. That costs more arithmetic than gathering each expert's tokens, but each
token's row is computed at the launch's one shape whatever the others were routed to, so a
request's output never depends on what shares its launch (docs/architecture.md §2).

With expert parallelism each rank holds a contiguous share of the experts: the launch's
tokens and routing weights of every rank are gathered (`ExpertGroup.gather`), each rank
runs its share over all of them, and the partial sums come back to the tokens' own ranks,
added in rank order (`ExpertGroup.combine`). Every rank runs the same launches, so the
collectives always meet.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from npu_worker.models.kit import LayerKit


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

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [T, ...], stacked in rank order: [size * T, ...]."""
        ...

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum every rank's partial outputs [size * T, H] of this rank's T tokens, in rank
        order: [T, H]."""
        ...


class LocalExperts:
    """One rank holding every expert: gathering and combining are the identity."""

    rank = 0
    size = 1

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """`x` itself."""
        return x

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """`partial` itself."""
        return partial


class ExpertBlock(nn.Module):
    """An MoE block: its routed experts run their collectives in `group`."""

    group: ExpertGroup


class ExpertModel(nn.Module):
    """A model of ExpertBlocks, whose routed experts can be split over ranks."""

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


def routed_output(
    experts: nn.ModuleDict,
    share: range,
    x: torch.Tensor,
    weights: torch.Tensor,
    group: ExpertGroup,
) -> torch.Tensor:
    """Routed output [T, H] of tokens `x` [T, H] with dense routing weights [T, E] (zero
    where a token does not go), through this rank's `experts` (keyed by global index)."""
    every_x, every_w = group.gather(x), group.gather(weights)
    out = torch.zeros(every_x.shape, dtype=torch.float32, device=x.device)
    for e in share:
        out += experts[str(e)](every_x).float() * every_w[:, e : e + 1]
    return group.combine(out).to(x.dtype)
