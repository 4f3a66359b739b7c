"""DeepSeek-V4's per-request state: fixed buffers, allocated once for every KV slot.

Per layer, a slot holds its sliding window of K=V rows (a ring indexed by position), and in
compressed layers the entries its compressor has emitted (indexed by window) with, for CSA,
the indexer's compressed keys; each compressor also keeps a ring of its kv/gate projections
of the last window (two, for CSA's overlapping windows), so a window that closes in a later
launch than it opened finds its earlier tokens there. Every buffer has one scratch row past
the end: padding tokens write there, and nothing reads it.

Every write is a function of the token at a position alone, and rows are read only where
masks let them be seen, so state after any launches is the same however the tokens were
split into launches, and a rejected draft leaves nothing a later launch reads: its window
row is overwritten before it comes into view, and an entry it closed is emitted again by
the token that replaces it, before that token's attention reads it (docs/architecture.md §4).
"""

from __future__ import annotations

import torch

from npu_worker.models.deepseek_v4.config import CSA, DeepseekV4Config, state_elements_per_slot


class Ring:
    """Rows [slots, size + 1, ...] holding position p at row p % size; row `size` is scratch."""

    def __init__(self, num_slots: int, size: int, row: tuple[int, ...], like: torch.Tensor) -> None:
        self.size = size
        self.rows = torch.zeros((num_slots, size + 1, *row), dtype=like.dtype, device=like.device)

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
    ) -> None:
        self.mtp = mtp
        num_layers = config.num_layers + (1 if mtp else 0)  # the MTP block's is last
        self.num_slots, self.max_kv_len, self.device = num_slots, max_kv_len, device
        self.config = config
        like = torch.empty(0, dtype=dtype, device=device)
        d, di = config.head_dim, config.index_head_dim
        self.window = [
            Ring(num_slots, config.sliding_window + 1, (d,), like) for _ in range(num_layers)
        ]
        self.entries: list[torch.Tensor | None] = []
        self.index_keys: list[torch.Tensor | None] = []
        self.projections: list[Ring | None] = []
        self.index_projections: list[Ring | None] = []
        for layer in range(num_layers):
            rate = config.rate(layer)
            csa = config.layer_kind(layer) == CSA
            num_entries = max_kv_len // rate if rate else 0
            self.entries.append(self._zeros(num_slots, num_entries + 1, d, like) if rate else None)
            self.index_keys.append(
                self._zeros(num_slots, num_entries + 1, di, like) if csa else None
            )
            width = 2 * d if csa else d
            self.projections.append(
                Ring(num_slots, 2 * rate if csa else rate, (2, width), like) if rate else None
            )
            self.index_projections.append(
                Ring(num_slots, 2 * rate, (2, 2 * di), like) if csa else None
            )

    # a slot's compressor rings and partial windows at a block's end are not kept apart
    # from what comes after it, so a prefix cannot be copied out of a slot
    prefix_cacheable = False
    paged = False  # a slot reserves every position
    num_blocks = 0

    def copy_prefix(self, source: int, target: int, num_tokens: int) -> None:
        """Refused: see `prefix_cacheable`."""
        raise ValueError("DeepSeek-V4's state cannot share a prefix between slots")

    def assign(self, slot: int, start: int, blocks: list[int]) -> None:
        """Refused: its state is not kept in blocks."""
        raise ValueError("DeepSeek-V4's state is not kept in blocks")

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Refused: its state is not kept in blocks."""
        raise ValueError("DeepSeek-V4's state is not kept in blocks")

    @staticmethod
    def _zeros(num_slots: int, rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros((num_slots, rows, width), dtype=like.dtype, device=like.device)

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
        """State bytes per position of a slot, averaged over `max_kv_len` positions."""
        return self.bytes_per_slot // max(self.max_kv_len, 1)
