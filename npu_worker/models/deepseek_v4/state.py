"""DeepSeek-V4's per-request state: fixed buffers, allocated once for every KV slot.

Per layer, a slot holds its sliding window of K=V rows (a ring indexed by position), and in
compressed layers the entries its compressor has emitted (indexed by window) with, for CSA,
the indexer's compressed keys; each compressor also keeps a ring of its kv/gate projections
of the last window (two, for CSA's overlapping windows), so a window that closes in a later
launch than it opened finds its earlier tokens there. Every buffer has one scratch row past
the end: padding tokens write there, and nothing reads it.

In a cache of blocks (`num_blocks` > 0) the entries and index keys, the state that grows
with a request's length, live in blocks of `block_size` positions that the planner hands
out (`block_size // rate` entries a block), read through the slot's table as the KV cache's
are (models/launch.py); the rings, a window's worth each, stay one per slot.

A prefix is shared by its blocks plus a *mark*: a copy of a slot's rings taken right after
a launch whose chunk ends on a block boundary B (`save_mark`), as many marks as slots.
Restored into a new request's slot (`restore_mark`), with the blocks before B shared, it
is the state that computing positions [0, B) leaves, so prefill resumes at B; or at B - 1,
rewriting position B - 1 with the same bits (at least the last prompt token is always
computed; with MTP the block's last position is, its MTP row depending on the next token).
A ring of `size` rows at B holds positions [B - size, B), all that position B - 1 reads.

Every write is a function of the token at a position alone, and rows are read only where
masks let them be seen, so state after any launches is the same however the tokens were
split into launches, and a rejected draft leaves nothing a later launch reads: its window
row is overwritten before it comes into view, and an entry it closed is emitted again by
the token that replaces it, before that token's attention reads it (docs/architecture.md §4).
"""

from __future__ import annotations

import torch

from npu_worker.models.deepseek_v4.config import CSA, DeepseekV4Config, state_elements_per_slot
from npu_worker.models.launch import assign_blocks, cache_zeros


class Ring:
    """Rows [slots, size + 1, ...] holding position p at row p % size; row `size` is scratch."""

    def __init__(
        self,
        num_slots: int,
        size: int,
        row: tuple[int, ...],
        like: torch.Tensor,
        num_marks: int = 0,
    ) -> None:
        self.size = size
        self.rows = torch.zeros((num_slots, size + 1, *row), dtype=like.dtype, device=like.device)
        self.marks = torch.zeros((num_marks, size, *row), dtype=like.dtype, device=like.device)

    def save(self, slot: int, mark: int) -> None:
        """Mark `mark` takes a copy of the slot's rows (its scratch row aside)."""
        self.marks[mark].copy_(self.rows[slot, : self.size])

    def restore(self, mark: int, slot: int) -> None:
        """The slot's rows become mark `mark`'s copy."""
        self.rows[slot, : self.size].copy_(self.marks[mark])

    def recent(self, rows: torch.Tensor | slice, starts: torch.Tensor) -> torch.Tensor:
        """Each launch row's ring in position order: [B, size, ...], row j of launch row b
        holding position starts[b] - size + j (what it holds when that is below zero is
        never seen)."""
        order = (starts[:, None] + torch.arange(self.size, device=starts.device)) % self.size
        held = self.rows[rows]
        index = order.view(*order.shape, *([1] * (held.dim() - 2))).expand(-1, -1, *held.shape[2:])
        return held.gather(1, index)

    def write(
        self,
        slot_ids: torch.Tensor,
        positions: torch.Tensor,
        values: torch.Tensor,
        real: torch.Tensor,
    ) -> None:
        """Store each row's last `size` real tokens [B, S, ...] at their positions; the rest
        (earlier tokens a longer chunk pushes out, and padding) go to the scratch row."""
        last = torch.where(real, positions, -1).amax(dim=1, keepdim=True)
        kept = real & (positions > last - self.size)
        index = torch.where(kept, positions % self.size, self.size)
        self.rows[slot_ids[:, None].expand_as(index), index] = values.to(self.rows.dtype)


class Entries:
    """One compressed layer's entries (or index keys), entry e covering positions
    [e * rate, (e + 1) * rate): [slots, count + 1, dim], row `count` scratch; or in a cache
    of blocks [blocks + 1, block_size // rate, dim], entry e of slot s in block
    `tables[s, e // per_block]` at row `e % per_block`, block `blocks` scratch."""

    def __init__(
        self,
        num_slots: int,
        max_kv_len: int,
        rate: int,
        dim: int,
        like: torch.Tensor,
        tables: torch.Tensor | None = None,
        block_size: int = 0,
        num_blocks: int = 0,
    ) -> None:
        self.count = max_kv_len // rate
        self.tables = tables
        if tables is None:
            self.per_block = self.count + 1
            shape = (num_slots, self.count + 1, dim)
        else:
            self.per_block = block_size // rate
            shape = (num_blocks + 1, self.per_block, dim)
        self.rows = cache_zeros(shape, like.dtype, like.device)
        self.scratch = num_blocks

    def write(
        self, slot_ids: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store values [B, C, dim] as entries `index` [B, C] of each row's slot where
        `valid`; the rest go to scratch."""
        slots = slot_ids[:, None].expand_as(index)
        if self.tables is None:
            self.rows[slots, torch.where(valid, index, self.count)] = values.to(self.rows.dtype)
            return
        safe = torch.where(valid, index, 0)
        blocks = torch.where(valid, self.tables[slots, safe // self.per_block], self.scratch)
        at = torch.where(valid, safe % self.per_block, 0)
        self.rows[blocks, at] = values.to(self.rows.dtype)

    def copy_blocks(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Blocks `target` take blocks `source`'s entries (a cache of blocks)."""
        self.rows[target] = self.rows[source]

    def read(self, rows: torch.Tensor | slice, slot_ids: torch.Tensor, count: int) -> torch.Tensor:
        """[B, count, dim]: each launch row's first `count` entries (`rows` its slots, in
        place where they are a window; through the tables in a cache of blocks)."""
        if self.tables is None:
            return self.rows[rows, :count]
        blocks = self.tables[slot_ids, : -(-count // self.per_block)]  # [B, n]
        held = self.rows[blocks]  # [B, n, per_block, dim]
        return held.reshape(held.shape[0], -1, held.shape[-1])[:, :count]


class DeepseekV4State:
    """Every layer's window ring, and in compressed layers its entries, index keys and
    projection rings, for `num_slots` slots of up to `max_kv_len` positions (a
    `ModelState`: models/launch.py)."""

    def __init__(
        self,
        config: DeepseekV4Config,
        num_slots: int,
        max_kv_len: int,
        dtype: torch.dtype,
        device: torch.device,
        mtp: bool = False,
        block_size: int = 0,
        num_blocks: int = 0,
    ) -> None:
        self.mtp = mtp
        num_layers = config.num_layers + (1 if mtp else 0)  # the MTP block's is last
        self.num_slots, self.max_kv_len, self.device = num_slots, max_kv_len, device
        self.config = config
        like = torch.empty(0, dtype=dtype, device=device)
        self.paged, self.num_blocks, self.block_size = num_blocks > 0, num_blocks, block_size
        self.tables: torch.Tensor | None = None
        if self.paged:
            rates = {config.rate(layer) for layer in range(num_layers)} - {0}
            if block_size < 1 or max_kv_len % block_size or any(block_size % r for r in rates):
                raise ValueError(
                    f"block_size {block_size} must divide {max_kv_len} positions and be a "
                    f"multiple of every compression rate ({sorted(rates)})"
                )
            width = max_kv_len // block_size + 1
            self.tables = torch.full((num_slots, width), num_blocks, dtype=torch.long)
            self.tables = self.tables.to(device)
        blocks = (self.tables, block_size, num_blocks)
        # a prefix is shared in a cache of blocks, its rings by marks (one a slot)
        self.prefix_cacheable = self.paged
        self.num_marks = marks = num_slots if self.paged else 0
        d, di = config.head_dim, config.index_head_dim
        self.window = [
            Ring(num_slots, config.sliding_window + 1, (d,), like, marks) for _ in range(num_layers)
        ]
        self.entries: list[Entries | None] = []
        self.index_keys: list[Entries | None] = []
        self.projections: list[Ring | None] = []
        self.index_projections: list[Ring | None] = []
        for layer in range(num_layers):
            rate = config.rate(layer)
            csa = config.layer_kind(layer) == CSA
            self.entries.append(
                Entries(num_slots, max_kv_len, rate, d, like, *blocks) if rate else None
            )
            self.index_keys.append(
                Entries(num_slots, max_kv_len, rate, di, like, *blocks) if csa else None
            )
            width = 2 * d if csa else d
            self.projections.append(
                Ring(num_slots, 2 * rate if csa else rate, (2, width), like, marks)
                if rate
                else None
            )
            self.index_projections.append(
                Ring(num_slots, 2 * rate, (2, 2 * di), like, marks) if csa else None
            )

    def rings(self) -> list[Ring]:
        """Every layer's rings: what a slot holds whatever its length."""
        rings = [r for r in (*self.projections, *self.index_projections) if r is not None]
        return [*self.window, *rings]

    def copy_prefix(self, source: int, target: int, num_tokens: int) -> None:
        """Refused: with slots that reserve every position, a slot's rings at a prefix's
        end are not kept apart from what comes after it (a cache of blocks keeps marks)."""
        raise ValueError("DeepSeek-V4's state shares a prefix only in a cache of blocks")

    def save_mark(self, slot: int, mark: int) -> None:
        """Mark `mark` takes a copy of the slot's rings, as they are now."""
        for ring in self.rings():
            ring.save(slot, mark)

    def restore_mark(self, mark: int, slot: int) -> None:
        """The slot's rings become mark `mark`'s copy."""
        for ring in self.rings():
            ring.restore(mark, slot)

    def assign(self, slot: int, start: int, blocks: list[int]) -> None:
        """Slot `slot`'s table from entry `start` on names `blocks` (a cache of blocks)."""
        if self.tables is None:
            raise ValueError("this DeepSeek-V4 state reserves every position a slot")
        assign_blocks(self.tables, self.num_blocks, slot, start, blocks)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Each pair's target block takes its source block's entries and index keys, every
        layer's (a cache of blocks)."""
        if not pairs:
            return
        if not self.paged:
            raise ValueError("this DeepSeek-V4 state reserves every position a slot")
        source = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        target = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        for entries in (*self.entries, *self.index_keys):
            if entries is not None:
                entries.copy_blocks(source, target)

    @property
    def scratch_position(self) -> int:
        """The position padding rows write to."""
        return self.max_kv_len

    @property
    def bytes_per_slot(self) -> int:
        """State bytes one slot takes over every layer (config.py's formula)."""
        elements = sum(state_elements_per_slot(self.config, self.max_kv_len, self.mtp).values())
        return elements * self.window[0].rows.element_size()

    @property
    def bytes_per_token(self) -> int:
        """State bytes per position of a slot, averaged over `max_kv_len` positions; in a
        cache of blocks, those of a block's entries and index keys (what grows with a
        request's length) over its positions."""
        if not self.paged:
            return self.bytes_per_slot // max(self.max_kv_len, 1)
        held = [e for e in (*self.entries, *self.index_keys) if e is not None]
        per_block = sum(e.rows[0].numel() * e.rows.element_size() for e in held)
        return per_block // self.block_size

    @property
    def bytes_per_slot_fixed(self) -> int:
        """State bytes a slot holds whatever its length: its rings."""
        return sum(r.rows[0].numel() * r.rows.element_size() for r in self.rings())

    @property
    def fixed_bytes(self) -> int:
        """State bytes outside blocks: every slot's rings, and the marks'."""
        return sum(r.rows.nbytes + r.marks.nbytes for r in self.rings())
