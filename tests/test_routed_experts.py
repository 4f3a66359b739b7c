"""Routed experts (models/moe.py, docs/architecture.md §4a): each expert computes only the
rows routed to it, and a token's output is what the dense form (every expert over every
token, weighted, summed in ascending expert order) gives it; a row's bits do not depend
on what shares its launch, on one rank and split over ranks of a real gloo group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from npu_worker.kernels.cpu.layers import CpuKit
from npu_worker.kernels.cpu.library import has_kernel_linear, load_cpu_kernels
from npu_worker.models.kit import LayerKit, TorchKit
from npu_worker.models.moe import (
    GatedMLP,
    LocalExperts,
    RoutedExperts,
    Routes,
    expert_share,
    routes,
)
from tests.test_expert_parallel import form_group, on_every_rank

pytestmark = pytest.mark.fast

HIDDEN, INNER, EXPERTS, TOP = 64, 96, 8, 2


def kits() -> dict[str, tuple[torch.dtype, LayerKit]]:
    """Products that pick kernels by row count (tiles of one shape) and, where the CPU
    kernels' product runs, one that keeps rows apart at every count."""
    found: dict[str, tuple[torch.dtype, LayerKit]] = {"torch-float32": (torch.float32, TorchKit())}
    if has_kernel_linear():
        found["kernel-products-bfloat16"] = (
            torch.bfloat16,
            CpuKit(load_cpu_kernels(), kernel_products=True),
        )
    return found


def experts_of(kit: LayerKit, dtype: torch.dtype, share: range, seed: int = 0) -> nn.ModuleDict:
    """Experts `share` of one seeded set (the same weights whichever rank builds which)."""
    generator = torch.Generator().manual_seed(seed)
    every = {}
    for e in range(EXPERTS):
        expert = GatedMLP(HIDDEN, INNER, kit)
        with torch.no_grad():
            for layer in (expert.gate_proj, expert.up_proj, expert.down_proj):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) * 0.2)
        every[str(e)] = expert
    held = nn.ModuleDict({str(e): every[str(e)] for e in share}).to(dtype)
    kit.prepare()
    return held


def random_routes(tokens: int, seed: int, valid: torch.Tensor | None = None) -> Routes:
    """Each token's top-`TOP` of random scores, weights their normalised scores."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, EXPERTS, generator=generator)
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :TOP]
    weights = scores.gather(1, top)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return routes(top, weights, torch.ones(tokens, dtype=torch.bool) if valid is None else valid)


def dense(experts: nn.ModuleDict, x: torch.Tensor, route: Routes) -> torch.Tensor:
    """Every expert over every token, weighted (zero where a token does not go), summed in
    ascending expert order in float32."""
    weights = torch.zeros(x.shape[0], EXPERTS)
    weights.scatter_(1, route.experts, route.weights)
    weights *= route.valid[:, None]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(EXPERTS):
        out += experts[str(e)](x).float() * weights[:, e : e + 1]
    return out.to(x.dtype)


@pytest.mark.parametrize("name", list(kits()))
def test_routed_experts_give_the_dense_forms_output(name: str) -> None:
    dtype, kit = kits()[name]
    experts = experts_of(kit, dtype, range(EXPERTS))
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    route = random_routes(40, seed=2)
    with torch.no_grad():
        routed = RoutedExperts(experts, range(EXPERTS), kit)(x, route, LocalExperts())
        want = dense(experts, x, route)
    if kit.rows_apart:  # the same pairs summed in the same order, rows apart at every count
        assert torch.equal(routed, want)
    else:
        torch.testing.assert_close(routed, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(kits()))
def test_a_rows_output_does_not_depend_on_what_shares_its_launch(name: str) -> None:
    """Row 0 (the same token, the same route) in launches of 1, 7 and 40 rows whose other
    tokens go elsewhere: the same bits each time."""
    dtype, kit = kits()[name]
    experts = experts_of(kit, dtype, range(EXPERTS))
    mine = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    my_route = random_routes(1, seed=4)
    outputs = []
    for others in (0, 6, 39):
        x = torch.cat([mine, torch.randn(others, HIDDEN).to(dtype)])
        rest = random_routes(others, seed=others)
        route = Routes(
            torch.cat([my_route.experts, rest.experts]),
            torch.cat([my_route.weights, rest.weights]),
            torch.ones(others + 1, dtype=torch.bool),
        )
        with torch.no_grad():
            outputs.append(RoutedExperts(experts, range(EXPERTS), kit)(x, route, LocalExperts()))
    assert all(torch.equal(out[0], outputs[0][0]) for out in outputs[1:])


def test_padding_tokens_route_nowhere_and_cost_nothing() -> None:
    kit = TorchKit()
    experts = experts_of(kit, torch.float32, range(EXPERTS))
    calls: list[int] = []
    for expert in experts.values():
        expert.register_forward_hook(lambda _m, args, _o: calls.append(args[0].shape[0]))
    x = torch.randn(6, HIDDEN)
    valid = torch.tensor([True, False, False, False, False, False])
    with torch.no_grad():
        out = RoutedExperts(experts, range(EXPERTS), kit)(
            x, random_routes(6, 5, valid), LocalExperts()
        )
    assert torch.equal(out[1:], torch.zeros(5, HIDDEN))
    assert len(calls) == TOP  # one token, its two experts, one tile each


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_ranks_give_each_token_the_bits_of_one_rank_holding_every_expert(
    redis_client, ranks: int
) -> None:
    """Each rank routes its own tokens (a different number on each, some padding) and holds
    its share of the experts; every token's output equals the one-rank output, bit for bit."""
    kit = TorchKit()
    tokens = [5 + 3 * r for r in range(ranks)]
    inputs = [
        torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(10 + r))
        for r, n in enumerate(tokens)
    ]
    valid = [torch.arange(n) % 4 != 3 for n in tokens]
    route = [random_routes(n, 20 + r, valid[r]) for r, n in enumerate(tokens)]
    every = experts_of(kit, torch.float32, range(EXPERTS))
    with torch.no_grad():
        alone = [
            RoutedExperts(every, range(EXPERTS), kit)(inputs[r], route[r], LocalExperts())
            for r in range(ranks)
        ]
    groups = form_group(redis_client, ranks, generation=7)

    def run(rank: int, group) -> torch.Tensor:
        share = expert_share(EXPERTS, rank, ranks)
        with torch.no_grad():
            return RoutedExperts(experts_of(kit, torch.float32, share), share, kit)(
                inputs[rank], route[rank], group
            )

    split = on_every_rank(groups, run)
    for rank in range(ranks):
        assert torch.equal(split[rank], alone[rank]), rank
