"""DeepSeek-V4's blocks: hyper-connections, its mixture of experts, and the decoder block.

- Manifold-constrained hyper-connections: the residual is `hc_mult` streams; before each
  attention and MoE block one projection of the streams gives how they collapse into the
  block's input (`pre`), how its output spreads back (`post`) and how the streams mix
  (`comb`, made doubly stochastic by Sinkhorn iterations); `hc_head` collapses them before
  the final norm.
- Mixture of experts with a shared expert and SwiGLU clamped at `swiglu_limit`: hash layers
  (`hash_moe`) take each token's experts from `tid2eid[token id]`, scored layers the top-k
  of `score + bias`; weights are the chosen scores, normalised, times
  `routed_scaling_factor` (moe.py: each expert over its routed rows, expert parallelism).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from npu_worker.models.deepseek_v4.attention import Attention, Launch, unit_rms
from npu_worker.models.deepseek_v4.config import SLIDING, DeepseekV4Config
from npu_worker.models.deepseek_v4.state import DeepseekV4State
from npu_worker.models.kit import LayerKit
from npu_worker.models.layers import elementwise, ordered_softmax, ordered_sum
from npu_worker.models.moe import (
    ExpertBlock,
    ExpertGroup,
    LocalExperts,
    RoutedExperts,
    Routes,
    routes,
)
from npu_worker.models.stored import StoredLinear


def hyper_mix(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    config: DeepseekV4Config,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From float32 streams [B, S, n, H]: `post` [B, S, n], `comb` [B, S, n, n]
    (Sinkhorn-balanced), both float32, and the streams collapsed by `pre` into one block
    input [B, S, H], rounded once to `dtype`."""
    n, eps = config.hc_mult, config.hc_eps
    flat = unit_rms(streams.flatten(2).float(), config.rms_norm_eps)
    pre_w, post_w, comb_w = F.linear(flat, fn.float()).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    scale = scale.float()
    pre = elementwise(torch.sigmoid, pre_w * scale[0] + pre_b) + eps
    post = 2 * elementwise(torch.sigmoid, post_w * scale[1] + post_b)
    comb_logits = comb_w.view(*comb_w.shape[:-1], n, n) * scale[2] + comb_b.view(n, n)
    comb = ordered_softmax(comb_logits) + eps
    comb = comb / (ordered_sum(comb, -2, keepdim=True) + eps)
    for _ in range(config.hc_sinkhorn_iters - 1):
        comb = comb / (ordered_sum(comb, -1, keepdim=True) + eps)
        comb = comb / (ordered_sum(comb, -2, keepdim=True) + eps)
    collapsed = ordered_sum(pre[..., None] * streams, 2).to(dtype)
    return post, comb, collapsed


def hyper_add(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The streams after a block: its output spread by `post` plus the streams mixed by
    `comb`, all in float32 (DeepSeek's reference keeps the residual streams float32)."""
    mixed = torch.matmul(comb.transpose(-1, -2), streams)
    return post[..., None] * out.float()[:, :, None] + mixed


class Expert(nn.Module):
    """SwiGLU with clamped pre-activations (`w1` gate, `w3` up, `w2` down)."""

    def __init__(self, hidden_size: int, inner: int, limit: float, kit: LayerKit) -> None:
        super().__init__()
        self.w1 = kit.linear(hidden_size, inner)
        self.w2 = kit.linear(inner, hidden_size)
        self.w3 = kit.linear(hidden_size, inner)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Router(nn.Module):
    """Each token's experts and weights, in float32 (`ffn.gate.*`): by token id or by score;
    among equal scores the lower expert wins (a stable sort, as DeepSeek's reference)."""

    def __init__(self, config: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        self.config, self.hashed = config, hashed
        experts, k = config.n_routed_experts, config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(experts))

    tid2eid: torch.Tensor

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, valid: torch.Tensor) -> Routes:
        c = self.config
        logits = F.linear(x.float(), self.weight.float())
        if c.scoring_func == "softmax":
            scores = elementwise(torch.exp, logits - logits.amax(dim=-1, keepdim=True))
            scores = scores / scores.sum(dim=-1, keepdim=True)
        elif c.scoring_func == "sigmoid":
            scores = elementwise(torch.sigmoid, logits)
        else:
            scores = elementwise(F.softplus, logits).sqrt()
        if self.hashed:
            top = self.tid2eid[token_ids].long()
        else:
            ranked = torch.sort(scores + self.bias.float(), dim=-1, descending=True, stable=True)
            top = ranked.indices[:, : c.num_experts_per_tok]
        weights = scores.gather(1, top)
        weights = weights / (ordered_sum(weights, -1, keepdim=True) + 1e-20)
        return routes(top, weights * c.routed_scaling_factor, valid)


class MoE(ExpertBlock):
    """Routed experts (this rank's share, `ffn.experts.{e}.*`) plus the shared expert."""

    def __init__(self, config: DeepseekV4Config, layer: int, share: range, kit: LayerKit) -> None:
        super().__init__()
        self.share = share
        self.gate = Router(config, config.hashed(layer))
        size, inner, limit = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.experts = nn.ModuleDict({str(e): Expert(size, inner, limit, kit) for e in share})
        self.routed = RoutedExperts(self.experts, share, kit)
        self.shared_experts = Expert(size, inner, limit, kit)
        self.group: ExpertGroup = LocalExperts()

    def forward(
        self, x: torch.Tensor, scored: torch.Tensor, token_ids: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """Of the block input `x` [B, S, H]; the router scores `scored` (`x` before its
        rounding, float32, as DeepSeek's reference)."""
        flat = x.reshape(-1, x.shape[-1])
        scores_of = scored.reshape(-1, scored.shape[-1])
        route = self.gate(scores_of, token_ids.reshape(-1), valid.reshape(-1))
        out = self.routed(flat, route, self.group).view(x.shape)
        return out + self.shared_experts(x)


class Block(nn.Module):
    """Attention, then MoE, each between its hyper-connection mix (`hc_attn_*`, `hc_ffn_*`)."""

    def __init__(self, config: DeepseekV4Config, layer: int, share: range, kit: LayerKit) -> None:
        super().__init__()
        self.config = config
        self.rope = "main" if config.layer_kind(layer) == SLIDING else "compress"
        self.attn = Attention(config, layer, kit)
        self.ffn = MoE(config, layer, share, kit)
        self.attn_norm = kit.rms_norm(config.hidden_size, config.rms_norm_eps, float32_weight=True)
        self.ffn_norm = kit.rms_norm(config.hidden_size, config.rms_norm_eps, float32_weight=True)
        n, h = config.hc_mult, config.hidden_size
        self.hc_attn_fn = nn.Parameter(torch.zeros((2 + n) * n, n * h))
        self.hc_attn_base = nn.Parameter(torch.zeros((2 + n) * n))
        self.hc_attn_scale = nn.Parameter(torch.ones(3))
        self.hc_ffn_fn = nn.Parameter(torch.zeros((2 + n) * n, n * h))
        self.hc_ffn_base = nn.Parameter(torch.zeros((2 + n) * n))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3))

    @property
    def dtype(self) -> torch.dtype:
        """What the block computes in: its linear layers' dtype (the streams stay float32)."""
        down = self.ffn.shared_experts.w2
        return down.dtype if isinstance(down, StoredLinear) else down.weight.dtype

    def forward(
        self,
        streams: torch.Tensor,
        token_ids: torch.Tensor,
        at: Launch,
        state: DeepseekV4State,
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        c = self.config
        post, comb, collapsed = hyper_mix(
            streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, c, self.dtype
        )
        out = self.attn(self.attn_norm(collapsed), at, state, ropes[self.rope])
        streams = hyper_add(streams, out, post, comb)
        post, comb, collapsed = hyper_mix(
            streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, c, self.dtype
        )
        normed = self.ffn_norm.unrounded(collapsed)  # the router scores it unrounded
        out = self.ffn(normed.to(collapsed.dtype), normed, token_ids, at.real)
        return hyper_add(streams, out, post, comb)


def hyper_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    config: DeepseekV4Config,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The float32 streams [B, S, n, H] collapsed into one hidden state [B, S, H], rounded
    once to `dtype`."""
    flat = unit_rms(streams.flatten(2).float(), config.rms_norm_eps)
    mixes = F.linear(flat, fn.float())
    pre = elementwise(torch.sigmoid, mixes * scale.float() + base.float()) + config.hc_eps
    return ordered_sum(pre[..., None] * streams, 2).to(dtype)


class HyperHead(nn.Module):
    """The streams collapsed into one hidden state before the final norm (`hc_head.*`)."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.config = config
        n = config.hc_mult
        self.hc_fn = nn.Parameter(torch.zeros(n, n * config.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return hyper_head(streams, self.hc_fn, self.hc_base, self.hc_scale, self.config, dtype)
