"""DeepSeek-V4's attention over its per-slot state (state.py).

One K=V head per token: queries through a low-rank `wq_a` / `wq_b`, keys `norm(wkv(x))`,
the trailing `rope_dim` channels of both rotated in interleaved pairs (the output's rotated
back at the query's position, since the value carried the key's rotation). A query sees
its sliding window (the last `sliding_window` positions, itself included) and, in CSA and
HCA layers, compressed entries: HCA every entry whose window has closed, CSA the
`index_topk` of them its lightning indexer scores highest. Softmax over the scores and a
per-head sink (`attn_sink`) that takes probability but gives no value. The heads' output
goes through a grouped low-rank projection (`wo_a` per group, then `wo_b`).

A compressor projects each token to kv and gate channels; the window ending at position
p (p + 1 a multiple of the rate) becomes one entry, `norm(sum softmax(gate + ape) * kv)`
rotated at the window's first position. CSA windows overlap: entry w mixes the first half
of the channels of window w - 1's tokens with the second half of window w's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from npu_worker.models.deepseek_v4.config import CSA, DeepseekV4Config
from npu_worker.models.deepseek_v4.state import DeepseekV4State, Entries, Ring
from npu_worker.models.kit import LayerKit
from npu_worker.models.launch import LaunchInputs
from npu_worker.models.layers import elementwise

KEY_BLOCK = 32  # keys a block of the attention's sums holds (see `_attend`)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x in interleaved pairs (x0, x1),
    (x2, x3), ... in place of layout; cos/sin broadcast against x[..., ::2] of that slice."""
    dim = 2 * cos.shape[-1]
    head, tail = x[..., :-dim], x[..., -dim:].float()
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return torch.cat((head, rotated.flatten(-2).to(x.dtype)), dim=-1)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def aligned(
    keys: torch.Tensor, seen: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window keys [B, K, D] (row b's key j at position positions[b, 0] + j) and which
    queries see them [B, S, K], laid out so each key sits at its position's place in blocks
    of `KEY_BLOCK` aligned to multiples of it: index i of row b holds position
    `base_b + i`, base_b the multiple of KEY_BLOCK at or below its first position. A query's
    keys then fall in the same blocks, at the same places, whichever launch reads them (a
    decode row's one position or a prefill chunk's 128), so `_attend` sums them in the same
    order (the places before and after a row's keys are unseen and add exact zeros)."""
    batch, count = keys.shape[:2]
    lead = positions[:, 0] % KEY_BLOCK  # [B]: places before the row's first key
    length = -(-(count + KEY_BLOCK - 1) // KEY_BLOCK) * KEY_BLOCK
    index = torch.arange(length, device=keys.device)[None] - lead[:, None]  # [B, L]
    inside = (index >= 0) & (index < count)
    index = index.clamp(0, count - 1)
    placed = keys.gather(1, index[..., None].expand(-1, -1, keys.shape[2]))
    seen = seen.gather(2, index[:, None].expand(-1, seen.shape[1], -1)) & inside[:, None]
    return placed, seen


class Launch:
    """What every layer of one launch shares: rows, positions, which tokens are real."""

    def __init__(self, launch: LaunchInputs, state: DeepseekV4State) -> None:
        if launch.packed:
            raise ValueError("DeepSeek-V4 runs one request per prefill launch (no packing)")
        self.positions = launch.positions
        self.slot_ids = launch.slot_ids
        self.real = launch.positions < state.scratch_position
        self.starts = launch.positions[:, 0]
        ws = launch.window_start
        self.rows: torch.Tensor | slice = (
            launch.slot_ids if ws is None else slice(ws, ws + launch.positions.shape[0])
        )
        self.span = launch.span


class Compressor(nn.Module):
    """One entry per closed window of `rate` tokens (`wkv`, `wgate`, `ape`, `norm`)."""

    def __init__(
        self, config: DeepseekV4Config, rate: int, dim: int, overlap: bool, kit: LayerKit
    ) -> None:
        super().__init__()
        self.rate, self.dim, self.overlap = rate, dim, overlap
        width = 2 * dim if overlap else dim
        self.wkv = kit.linear(config.hidden_size, width)
        self.wgate = kit.linear(config.hidden_size, width)
        self.ape = nn.Parameter(torch.zeros(rate, width))
        self.norm = kit.rms_norm(dim, config.rms_norm_eps, float32_weight=True)

    def forward(
        self,
        x: torch.Tensor,
        at: Launch,
        ring: Ring,
        entries: Entries,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Emit into `entries` every window the launch's tokens close, then keep their
        projections in `ring` for windows closing later."""
        batch, seq, _ = x.shape
        rate, length = self.rate, ring.size
        projected = torch.stack((self.wkv(x), self.wgate(x)), dim=2)  # [B, S, 2, width]
        history = torch.cat((ring.recent(at.rows, at.starts), projected), dim=1)
        closings = -(-seq // rate)
        first = (at.starts + rate) // rate * rate - 1  # first closing position at or after start
        ends = first[:, None] + rate * torch.arange(closings, device=x.device)  # [B, C]
        local = (ends - at.starts[:, None]).clamp(max=seq - 1)
        valid = at.real.gather(1, local) & (at.positions.gather(1, local) == ends)
        taken = local[:, :, None] + 1 + torch.arange(length, device=x.device)  # [B, C, L]
        flat = taken.view(batch, -1, 1, 1).expand(-1, -1, *projected.shape[2:])
        window = history.gather(1, flat).view(batch, closings, length, *projected.shape[2:])
        kv, gate = window[:, :, :, 0].float(), window[:, :, :, 1].float()
        ape = self.ape.float()
        if self.overlap:  # previous window's first half, then this window's second half
            d = self.dim
            kv = torch.cat((kv[:, :, :rate, :d], kv[:, :, rate:, d:]), dim=2)
            gate = torch.cat(
                (gate[:, :, :rate, :d] + ape[:, :d], gate[:, :, rate:, d:] + ape[:, d:]), 2
            )
        else:
            gate = gate + ape
        token_positions = ends[:, :, None] - length + 1 + torch.arange(length, device=x.device)
        gate = gate.masked_fill((token_positions < 0)[..., None], float("-inf"))
        pooled = (kv * gate.softmax(dim=2)).sum(dim=2)
        starts = torch.where(valid, ends + 1 - rate, 0)
        normed = self.norm.unrounded(pooled)  # float32 to the entry, rounded once as stored
        compressed = rope_pairs(normed, cos[starts], sin[starts])
        entries.write(at.slot_ids, (ends + 1) // rate - 1, valid, compressed)
        ring.write(at.slot_ids, at.positions, projected, at.real)


class Indexer(nn.Module):
    """CSA's lightning indexer: its own compressor at `index_head_dim`, and per query the
    `index_topk` entries of highest `sum_h w_h * relu(q_h . k)` (`wq_b`, `weights_proj`)."""

    def __init__(self, config: DeepseekV4Config, kit: LayerKit) -> None:
        super().__init__()
        self.config = config
        heads, dim = config.index_n_heads, config.index_head_dim
        self.compressor = Compressor(config, config.csa_rate, dim, overlap=True, kit=kit)
        self.wq_b = kit.linear(config.q_lora_rank, heads * dim)
        self.weights_proj = kit.linear(config.hidden_size, heads)

    def forward(
        self,
        x: torch.Tensor,
        q_low: torch.Tensor,
        keys: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        closed: torch.Tensor,
    ) -> torch.Tensor:
        """Which of `keys` [B, E, dim] each query sees [B, S, E]: its top-k closed entries,
        ties broken toward the lowest entry whatever the launch's span or padding."""
        c = self.config
        batch, seq, _ = x.shape
        q = self.wq_b(q_low).view(batch, seq, c.index_n_heads, c.index_head_dim)
        q = rope_pairs(q, cos[:, :, None], sin[:, :, None])
        scores = torch.einsum("bshd,bed->bshe", q.float(), keys.float())
        scores = F.relu(scores) * c.index_head_dim**-0.5
        weights = self.weights_proj(x).float() * c.index_n_heads**-0.5
        scores = (scores * weights[..., None]).sum(dim=2).masked_fill(~closed, float("-inf"))
        top = min(c.index_topk, keys.shape[1])
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :top]
        chosen = torch.zeros_like(closed).scatter_(-1, order, True)
        return chosen & closed


class Attention(nn.Module):
    """Sliding-window attention, plus compressed entries in CSA and HCA layers."""

    def __init__(self, config: DeepseekV4Config, layer: int, kit: LayerKit) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        self.rate = config.rate(layer)
        self.kind = config.layer_kind(layer)
        c, hidden, eps = config, config.hidden_size, config.rms_norm_eps
        self.wq_a = kit.linear(hidden, c.q_lora_rank)
        self.q_norm = kit.rms_norm(c.q_lora_rank, eps, float32_weight=True)
        self.wq_b = kit.linear(c.q_lora_rank, c.num_heads * c.head_dim)
        self.wkv = kit.linear(hidden, c.head_dim)
        self.norm = kit.rms_norm(c.head_dim, eps, float32_weight=True)
        group_in = c.num_heads * c.head_dim // c.o_groups
        # grouped: each group's slice of its outputs reads its own slice of the input
        self.wo_a = kit.linear(group_in, c.o_groups * c.o_lora_rank)
        self.wo_a.read_grouped = True
        self.wo_b = kit.linear(c.o_groups * c.o_lora_rank, hidden)
        self.attn_sink = nn.Parameter(torch.zeros(c.num_heads))
        if self.rate:
            self.compressor = Compressor(c, self.rate, c.head_dim, self.kind == CSA, kit)
        if self.kind == CSA:
            self.indexer = Indexer(c, kit)

    def forward(
        self,
        x: torch.Tensor,
        at: Launch,
        state: DeepseekV4State,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        c = self.config
        batch, seq, _ = x.shape
        table_cos, table_sin = rope
        cos, sin = table_cos[at.positions], table_sin[at.positions]  # [B, S, rope_dim / 2]
        q_low = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_low).view(batch, seq, c.num_heads, c.head_dim)
        q = rope_pairs(unit_rms(q, c.rms_norm_eps), cos[:, :, None], sin[:, :, None])
        kv = rope_pairs(self.norm(self.wkv(x)), cos, sin)  # [B, S, D]
        ring = state.window[self.layer]
        held = ring.recent(at.rows, at.starts)  # [B, R, D]
        t = at.positions[:, :, None]
        held_positions = at.starts[:, None] - ring.size + torch.arange(ring.size, device=x.device)
        held_seen = (held_positions[:, None] >= 0) & (
            held_positions[:, None] > t - c.sliding_window
        )
        own = at.positions[:, None, :]
        own_seen = (own <= t) & (own > t - c.sliding_window) & at.real[:, None, :]
        window, window_seen = aligned(
            torch.cat((held, kv), dim=1), torch.cat((held_seen, own_seen), dim=2), held_positions
        )
        keys, seen = [window], [window_seen]
        if self.rate:
            entries, entries_seen = self._compressed(x, q_low, at, state, rope)
            keys.append(F.pad(entries, (0, 0, 0, -entries.shape[1] % KEY_BLOCK)))
            seen.append(F.pad(entries_seen, (0, -entries.shape[1] % KEY_BLOCK)))
        out = self._attend(q, torch.cat(keys, dim=1), torch.cat(seen, dim=2))
        out = rope_pairs(out, cos[:, :, None], -sin[:, :, None])
        ring.write(at.slot_ids, at.positions, kv, at.real)
        grouped = out.reshape(batch, seq, c.o_groups, -1)
        mixed = self.wo_a.grouped(grouped)
        return self.wo_b(mixed.reshape(batch, seq, -1))

    def _compressed(
        self,
        x: torch.Tensor,
        q_low: torch.Tensor,
        at: Launch,
        state: DeepseekV4State,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Emit the windows this launch closes; the entries the launch reads [B, E, D] and
        which of them each query sees [B, S, E]."""
        compress_cos, compress_sin = rope
        entries, projections = state.entries[self.layer], state.projections[self.layer]
        assert entries is not None and projections is not None
        self.compressor(x, at, projections, entries, compress_cos, compress_sin)
        readable = min(-(-at.span // self.rate), entries.count)
        read = entries.read(at.rows, at.slot_ids, readable)
        closed = (
            torch.arange(readable, device=x.device) < (at.positions[:, :, None] + 1) // self.rate
        )
        if self.kind != CSA:
            return read, closed
        keys, index_projections = state.index_keys[self.layer], state.index_projections[self.layer]
        assert keys is not None and index_projections is not None
        self.indexer.compressor(x, at, index_projections, keys, compress_cos, compress_sin)
        cos, sin = compress_cos[at.positions], compress_sin[at.positions]
        index_keys = keys.read(at.rows, at.slot_ids, readable)
        seen = self.indexer(x, q_low, index_keys, cos, sin, closed)
        return read, seen

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Softmax of q [B, S, H, D] against shared K=V `keys` [B, K, D] where `seen`
        [B, S, K], and a per-head sink; masked keys add exactly zero. Returns [B, S, H, D].

        K grows with the launch's span, and a softmax or a product over a longer row may
        group its sums differently (this CPU's float32 kernels do). So the keys go in
        blocks of `KEY_BLOCK`: every block's scores, exponentials and weighted values at
        that one fixed shape, then the blocks' sums added in order (`cumsum`). Blocks past
        a row's keys add exact zeros, and a query's output does not depend on K."""
        batch, seq, heads, dim = q.shape
        blocks = -(-keys.shape[1] // KEY_BLOCK)
        padding = blocks * KEY_BLOCK - keys.shape[1]
        values = F.pad(keys.float(), (0, 0, 0, padding)).view(batch, blocks, KEY_BLOCK, dim)
        seen = F.pad(seen, (0, padding)).view(batch, seq, 1, blocks, KEY_BLOCK)
        queries = q.float().reshape(batch, 1, seq * heads, dim)
        scores = torch.matmul(queries, values.transpose(2, 3)) * self.config.head_dim**-0.5
        scores = scores.view(batch, blocks, seq, heads, KEY_BLOCK).permute(0, 2, 3, 1, 4)
        scores = scores.masked_fill(~seen, float("-inf"))  # [B, S, H, C, KB]
        sink = self.attn_sink.float().view(1, 1, heads)
        top = torch.maximum(scores.amax(dim=(3, 4)), sink)  # exact, in any order
        weights = elementwise(torch.exp, scores - top[..., None, None])
        total = weights.sum(dim=4).cumsum(dim=3)[..., -1] + elementwise(torch.exp, sink - top)
        blockwise = torch.matmul(  # [B, C, S*H, D]: each block's weighted values
            weights.permute(0, 3, 1, 2, 4).reshape(batch, blocks, seq * heads, KEY_BLOCK),
            values,
        )
        out = blockwise.cumsum(dim=1)[:, -1].view(batch, seq, heads, dim) / total[..., None]
        return out.to(q.dtype)
