"""What every architecture's model takes and returns: one fixed-shape launch's inputs, its
outputs, the per-request state it reads and writes (a protocol: a KV cache, a latent cache,
DeepSeek-V4's compressed state), and the model interface the runner and backends rely on
(docs/architecture.md §2, §8)."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch import nn


@dataclass(slots=True)
class LaunchInputs:
    """One launch at a fixed shape [B, S].

    Rows read their cache in place from slots [window_start, window_start + B) when
    `window_start` is set (row i is slot window_start + i), else gathered by `slot_ids`.
    Only the first `span` cache positions are read; later ones are masked by position anyway.

    A *packed* launch (B = 1) carries several requests' segments back to back: token i
    belongs to segment `token_segments[i]`, whose request holds slot `segment_slots[j]`, and
    sees only that slot's keys up to its own position (causal within its own request).
    Eager backends also pass `packed_keys`: the slot, position and segment of exactly the
    keys the segments see, so attention spans their own tokens rather than every segment's
    whole `span`; graph backends, which need fixed shapes, lay whole spans side by side.
    """

    input_ids: torch.Tensor  # [B, S]
    positions: torch.Tensor  # [B, S], where each token's K/V is written and which keys it sees
    slot_ids: torch.Tensor  # [B]
    logit_index: torch.Tensor  # [B, K], the positions within S whose logits are returned
    span: int
    window_start: int | None
    segment_slots: torch.Tensor | None = None  # [segments], packed launches only
    token_segments: torch.Tensor | None = None  # [S], packed launches only
    packed_keys: torch.Tensor | None = None  # [3, K]: key slots, positions, segments (eager)
    rows: tuple[torch.Tensor, torch.Tensor] | None = None  # token_rows(), once per launch
    tables: torch.Tensor | None = None  # a cache of blocks: the rows' block tables, once
    # token_rows() through the cache's tables (`KVCache.locate`), once per launch and cache
    located: tuple[object, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def packed(self) -> bool:
        """True for a launch carrying several requests' segments."""
        return self.segment_slots is not None

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache slot and position of every token, flattened [B * S] (computed once,
        then shared by every layer)."""
        if self.rows is None:
            if self.packed:
                assert self.segment_slots is not None and self.token_segments is not None
                self.rows = self.segment_slots[self.token_segments], self.positions[0]
            else:
                seq = self.positions.shape[1]
                self.rows = self.slot_ids.repeat_interleave(seq), self.positions.reshape(-1)
        return self.rows


@dataclass(slots=True)
class LaunchOutput:
    """Logits at the requested positions and the final hidden states of every position."""

    logits: torch.Tensor  # [B, K, vocab], float32
    hidden: torch.Tensor  # [B, S, hidden], after the final norm


class ModelState(Protocol):
    """What the runner and backends know of a model's per-request state: fixed buffers for
    `num_slots` slots of up to `max_kv_len` positions each, on `device`, and the position
    padding tokens write to (no query reads it). Everything else is the model's own."""

    num_slots: int
    max_kv_len: int
    device: torch.device
    # whether a slot's first positions can be copied to another (prefix caching): the
    # state is one entry per position, each a function of the tokens up to it
    prefix_cacheable: bool
    # whether the state is a pool of blocks the planner hands out (KVCache's `num_blocks`)
    paged: bool
    num_blocks: int
    # copies of a slot's state that is not in blocks, taken at a block boundary, that a
    # prefix shared by its blocks needs as well (DeepSeek-V4's rings); 0: blocks suffice
    num_marks: int

    @property
    def bytes_per_token(self) -> int:
        """State bytes one position takes."""
        ...

    @property
    def scratch_position(self) -> int:
        """The position padding rows write to."""
        ...

    def copy_prefix(self, source: int, target: int, num_tokens: int) -> None:
        """Slot `target` takes slot `source`'s state for positions [0, num_tokens)."""
        ...

    def assign(self, slot: int, start: int, blocks: list[int]) -> None:
        """A slot's block table from entry `start` on (a state of blocks only)."""
        ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Each pair's target block takes its source block's entries (blocks only)."""
        ...

    @property
    def fixed_bytes(self) -> int:
        """Bytes a cache of blocks holds outside its blocks (slots' and marks' own state)."""
        ...

    def save_mark(self, slot: int, mark: int) -> None:
        """Mark `mark` takes a copy of the slot's state outside blocks (marks only)."""
        ...

    def restore_mark(self, mark: int, slot: int) -> None:
        """The slot's state outside blocks becomes mark `mark`'s copy (marks only)."""
        ...


class KVCache:
    """Per-layer K and V buffers, allocated once, in one of two layouts.

    - **A slot a request** (`num_blocks` 0): [slots, kv_heads, positions + 1, dim], each slot
      reserving every position. The extra last position is scratch: padding rows write
      there, and no query reads it.
    - **Blocks** (`num_blocks` > 0): [num_blocks + 1, kv_heads, block_size, dim], a pool the
      pool's planner hands out `block_size` positions at a time. Slot s's position p lies
      in block `tables[s, p // block_size]`; every table's last column (the scratch
      position's) and every block not handed out name block `num_blocks`, the scratch.

    A latent cache (DeepSeek's MLA) keeps one buffer per layer: its values are the first
    `value_dim` channels of its keys (`values_in_keys`), so V is a view, not a copy.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_kv_len: int,
        num_kv_heads: int,
        key_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        value_dim: int | None = None,
        values_in_keys: bool = False,
        block_size: int = 0,
        num_blocks: int = 0,
    ) -> None:
        self.paged = num_blocks > 0
        if self.paged:
            if block_size < 1 or max_kv_len % block_size:
                raise ValueError(f"block_size {block_size} must divide {max_kv_len} positions")
            shape = (num_blocks + 1, num_kv_heads, block_size, key_dim)
            width = max_kv_len // block_size + 1
            self.tables = torch.full((num_slots, width), num_blocks, dtype=torch.long)
        else:
            shape = (num_slots, num_kv_heads, max_kv_len + 1, key_dim)
            block_size = max_kv_len + 1
            self.tables = torch.arange(num_slots, dtype=torch.long)[:, None]
        self.tables = self.tables.to(device)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.k = [cache_zeros(shape, dtype, device) for _ in range(num_layers)]
        value_dim = key_dim if value_dim is None else value_dim
        if values_in_keys:
            self.v = [k[..., :value_dim] for k in self.k]
        else:
            v_shape = (*shape[:-1], value_dim)
            self.v = [cache_zeros(v_shape, dtype, device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_kv_len = max_kv_len
        self.device = device

    prefix_cacheable = True
    num_marks = 0  # a position's keys and values are all its state: blocks suffice
    fixed_bytes = 0

    def save_mark(self, slot: int, mark: int) -> None:
        """Refused: a KV cache keeps no state outside its positions."""
        raise ValueError("a KV cache keeps no marks")

    def restore_mark(self, mark: int, slot: int) -> None:
        """Refused: see `save_mark`."""
        raise ValueError("a KV cache keeps no marks")

    def locate(
        self, slots: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where (slot, position) pairs lie: the first two indices of a buffer's entry."""
        if not self.paged:
            return slots, positions
        return self.tables[slots, positions // self.block_size], positions % self.block_size

    def locate_tokens(self, launch: LaunchInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """`locate` of every token of the launch (`token_rows`), computed once per launch and
        shared by every layer."""
        if launch.located is None or launch.located[0] is not self:
            launch.located = (self, self.locate(*launch.token_rows()))
        return launch.located[1]

    def spans(self, buffer: torch.Tensor, slots: torch.Tensor, span: int) -> torch.Tensor:
        """[B, Hkv, span, D]: positions [0, span) of each of `slots`' entries in `buffer`
        (one layer's K or V), in place where the layout allows a view."""
        if not self.paged:
            return buffer[slots, :, :span]
        blocks = self.tables[slots, : -(-span // self.block_size)]  # [B, n]
        gathered = buffer[blocks]  # [B, n, Hkv, block, D]
        batch, count, heads, block, dim = gathered.shape
        rows = gathered.transpose(1, 2).reshape(batch, heads, count * block, dim)
        return rows[:, :, :span]

    def assign(self, slot: int, start: int, blocks: list[int]) -> None:
        """Slot `slot`'s table from entry `start` on names `blocks`."""
        assign_blocks(self.tables, self.num_blocks, slot, start, blocks)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block `target` takes block `source`'s entries, every layer's, for each pair."""
        if not pairs:
            return
        source = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        target = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        views = self.v[0].data_ptr() == self.k[0].data_ptr()
        for k, v in zip(self.k, self.v):
            k[target] = k[source]
            if not views:
                v[target] = v[source]

    def copy_prefix(self, source: int, target: int, num_tokens: int) -> None:
        """Slot `target` takes slot `source`'s keys and values for positions
        [0, num_tokens), every layer's (a latent cache's values are in its keys)."""
        if source == target or num_tokens <= 0:
            return
        positions = torch.arange(num_tokens, device=self.device)
        to_slot = torch.full_like(positions, target)
        at = self.locate(torch.full_like(positions, source), positions)
        to = self.locate(to_slot, positions)
        views = self.v[0].data_ptr() == self.k[0].data_ptr()
        for k, v in zip(self.k, self.v):
            k[to[0], :, to[1]] = k[at[0], :, at[1]]
            if not views:
                v[to[0], :, to[1]] = v[at[0], :, at[1]]

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over every layer (the views counted once)."""
        per_layer = self.k[0][0, :, 0].numel() * self.k[0].element_size()
        if self.v[0].data_ptr() != self.k[0].data_ptr():
            per_layer += self.v[0][0, :, 0].numel() * self.v[0].element_size()
        return per_layer * len(self.k)

    @property
    def scratch_position(self) -> int:
        """The position padding rows write to."""
        return self.max_kv_len


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache buffer. On the CPU it is an anonymous mapping, whose pages the kernel
    hands out zeroed when they are first written: a cache sized by a share of the host's
    memory takes only what its blocks have held (as a GPU's would, all of it at once)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype).view(shape)


def assign_blocks(
    tables: torch.Tensor, scratch: int, slot: int, start: int, blocks: list[int]
) -> None:
    """Slot `slot`'s row of block `tables` from entry `start` on names `blocks`; a new
    request's (from 0) first points every entry but the scratch column's at `scratch`."""
    row = tables[slot]
    if start == 0:
        row[:-1] = scratch
    row[start : start + len(blocks)] = torch.tensor(blocks, dtype=torch.long)


class Kit(Protocol):
    """What the runner knows of the layer kit a model was built with (models/kit.py)."""

    @property
    def name(self) -> str:
        """What the kit computes its own way, appended to the backend's name (`+...`)."""
        ...


State = TypeVar("State", bound=ModelState)


class LaunchModel(nn.Module, Generic[State]):
    """What the runner and its backends need of an architecture's model: its per-request
    state, one launch at a fixed shape, and (with an MTP module) the draft over a launch.
    Every architecture's model derives from it. Its layers come from `kit`, the layer kit
    its backend supplied when it was built (models/kit.py)."""

    mtp: nn.Module | None
    kit: Kit
    packs = True  # its prefill launches may carry several requests' segments
    # a decode row and a packed prefill token take the same layers (attention included),
    # so where the kit's products keep rows apart a decode row may ride in a prefill launch
    decode_rows_pack = False
    head_key = "lm_head.weight"  # the checkpoint's output head

    def new_state(
        self, num_slots: int, max_kv_len: int, block_size: int = 0, num_blocks: int = 0
    ) -> State:
        """The state every launch of this model reads and writes, allocated once: a slot
        reserving `max_kv_len` positions per request, or (`num_blocks` > 0, where the state
        is a KV cache) a pool of blocks of `block_size` positions the planner hands out."""
        raise NotImplementedError

    def forward(self, launch: LaunchInputs, state: State) -> LaunchOutput:
        """Run one launch: write its state, return logits at `logit_index` and hidden states."""
        raise NotImplementedError

    def draft(self, launch: LaunchInputs, hidden: torch.Tensor, state: State) -> torch.Tensor:
        """MTP logits for a launch whose tokens follow the hidden states `hidden`."""
        raise NotImplementedError

    def output_head(self) -> nn.Linear:
        """The layer that turns final hidden states into logits."""
        raise NotImplementedError

    def input_embeddings(self) -> nn.Embedding:
        """The token embedding."""
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Share the embedding with the head, for tied checkpoints."""
        self.output_head().weight = self.input_embeddings().weight

    def is_tied(self) -> bool:
        """Whether the head is the embedding."""
        return self.output_head().weight is self.input_embeddings().weight

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move to `device` in `dtype`, keeping in float32 what the architecture keeps so."""
        self.to(device=device, dtype=dtype).eval()
