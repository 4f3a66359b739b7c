"""One rank's cache blocks, as the planner hands them out (docs/architecture.md §3c). Pure:
no I/O, no torch.

With `--kv-cache-memory` a rank's cache is a pool of blocks of `block_size` positions. A
request holds a table of them: the blocks of its prompt from admission on, one more each
time its decode reaches a new block. A full block of a prompt whose request has computed
it is keyed by its prefix (batcher/prefix.py's `block_keys`), and a later request whose
prompt starts with the same keys holds the same blocks instead of computing them: a
block is shared by every request holding it and never written while shared. A block no
request holds is free; a keyed free block keeps its entries (and its key) until it is
handed out again, the least recently freed first, after the free blocks that hold
nothing: those freed holding nothing, then those never handed out (a count, not a list:
a cache sized by a share of a host's memory may hold hundreds of thousands of a small
model's blocks).

Where a model's state is not all in blocks (DeepSeek-V4's rings), its rank keeps `num_marks`
marks, copies of a slot's other state taken when a prefill segment ends on a block boundary:
a block's mark is that copy at the block's end. A prefix is shared only up to a marked
block (batcher/placement.py); marks are handed out least recently used first, and a block
handed out again loses its mark.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockPool:
    """A rank's `total` blocks: which requests hold each (by count), which are free in the
    order they are handed out, and which prefix each keyed block holds."""

    total: int
    num_marks: int = 0
    held: dict[int, int] = field(default_factory=dict)  # block -> requests holding it
    free: OrderedDict[int, None] = field(default_factory=OrderedDict)  # freed, in order
    fresh: int = 0  # blocks [fresh, total) were never handed out (free, holding nothing)
    key_of: dict[int, bytes] = field(default_factory=dict)
    block_of: dict[bytes, int] = field(default_factory=dict)
    marks: OrderedDict[int, int] = field(default_factory=OrderedDict)  # mark -> block or -1
    mark_of: dict[int, int] = field(default_factory=dict)  # block -> its mark

    def __post_init__(self) -> None:
        if not self.marks:
            self.marks = OrderedDict.fromkeys(range(self.num_marks), -1)

    @property
    def num_free(self) -> int:
        """Blocks no request holds (those keeping a cached prefix included)."""
        return len(self.free) + self.total - self.fresh

    @property
    def free_share(self) -> float:
        """The share of its blocks no request holds (ranks of different sizes compare by it)."""
        return self.num_free / max(self.total, 1)

    @property
    def num_used(self) -> int:
        """Blocks some request holds."""
        return len(self.held)

    @property
    def num_cached(self) -> int:
        """Blocks keyed by the prefix they hold, held or free."""
        return len(self.key_of)

    def cached(self, keys: tuple[bytes, ...]) -> list[int]:
        """The blocks holding the leading `keys`, as far as they are all here."""
        found: list[int] = []
        for key in keys:
            block = self.block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def reusable(self, blocks: list[int]) -> int:
        """How many of `blocks` are free now (holding them takes them off the free list)."""
        return sum(1 for b in blocks if b in self.free)

    def hold(self, blocks: list[int]) -> None:
        """One more request holds each of `blocks` (cached ones it shares)."""
        for block in blocks:
            self.free.pop(block, None)
            self.held[block] = self.held.get(block, 0) + 1

    def take(self, count: int) -> list[int]:
        """`count` free blocks for one request to write, which then holds them: those
        holding nothing first, then the least recently freed (their keys forgotten)."""
        if count > self.num_free:
            raise ValueError(f"{count} blocks wanted, {self.num_free} free")
        taken = [self._next_free() for _ in range(count)]
        for block in taken:
            key = self.key_of.pop(block, None)
            if key is not None:
                del self.block_of[key]
            self.held[block] = 1
            mark = self.mark_of.pop(block, None)
            if mark is not None:  # its copy is of what the block held: the next to go
                self.marks[mark] = -1
                self.marks.move_to_end(mark, last=False)
        return taken

    def _next_free(self) -> int:
        """The free block to hand out next: one freed holding nothing, else one never
        handed out, else the least recently freed."""
        if self.free and next(iter(self.free)) not in self.key_of:
            return self.free.popitem(last=False)[0]
        if self.fresh < self.total:
            self.fresh += 1
            return self.fresh - 1
        return self.free.popitem(last=False)[0]

    def mark_for(self, block: int) -> int:
        """The mark that takes the copy at `block`'s end: its own, or the least recently
        used (whose block loses its mark)."""
        mark = self.mark_of.get(block)
        if mark is None:
            mark, old = self.marks.popitem(last=False)
            self.mark_of.pop(old, None)
            self.mark_of[block] = mark
        self.marks[mark] = block
        self.marks.move_to_end(mark)
        return mark

    def use_mark(self, block: int) -> int:
        """`block`'s mark, now the most recently used (-1 if it has none)."""
        mark = self.mark_of.get(block, -1)
        if mark >= 0:
            self.marks.move_to_end(mark)
        return mark

    def release(self, blocks: list[int]) -> None:
        """A request lets go of its blocks: one no one else holds is free, a keyed one at
        the end of the order (kept longest), a plain one at the front (reused first)."""
        for block in blocks:
            count = self.held.get(block, 0) - 1
            if count > 0:
                self.held[block] = count
                continue
            self.held.pop(block, None)
            self.free[block] = None
            if block not in self.key_of:
                self.free.move_to_end(block, last=False)

    def register(self, keys: tuple[bytes, ...], blocks: list[int]) -> None:
        """The request holding `blocks` has computed the full blocks `keys` name there: a
        key already held elsewhere keeps its block."""
        for key, block in zip(keys, blocks, strict=False):
            if key in self.block_of or block in self.key_of:
                continue
            self.key_of[block] = key
            self.block_of[key] = block
