"""The prefix cache's index (docs/architecture.md §3b): which KV slots hold which full
blocks of which token prefix, so that a request whose prompt starts with cached blocks
skips their prefill. Pure: no I/O, no torch.

A block is `block_size` tokens; its key hashes the model and every token before and in it,
so one key names one exact prefix. A slot holds a chain of keys (its first blocks'); a key
is registered for a slot only once its rank has computed it (the request's first token has
come back, so every chunk of its prompt ran) and unregistered the moment the slot is given
to a request that will write over it. A request's K/V at a position depends only on the
tokens up to it (rows are computed alike whatever shares their launch), so a hit's tokens
are a miss's, bit for bit.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

Holder = tuple[int, int]  # (rank, slot)


def block_keys(token_ids: list[int], block_size: int, model: str = "") -> tuple[bytes, ...]:
    """The chained keys of every full block of `token_ids`."""
    keys: list[bytes] = []
    previous = hashlib.blake2b(model.encode(), digest_size=16).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = array("q", token_ids[start : start + block_size]).tobytes()
        previous = hashlib.blake2b(previous + tokens, digest_size=16).digest()
        keys.append(previous)
    return tuple(keys)


@dataclass(slots=True)
class Hit:
    """A prompt's longest cached prefix on one rank: `num_blocks` blocks, held by `slots`."""

    rank: int
    num_blocks: int
    slots: list[int]

    def slot(self, free: list[int]) -> tuple[int, bool]:
        """The holder to read from: a free one if any (then it is taken, and True)."""
        for slot in self.slots:
            if slot in free:
                return slot, True
        return self.slots[0], False


@dataclass(slots=True)
class PrefixIndex:
    """Which slot holds which blocks, on every rank; and when each free slot was freed
    (the least recently freed holder is written over first)."""

    holders: dict[bytes, set[Holder]] = field(default_factory=dict)
    chains: dict[Holder, tuple[bytes, ...]] = field(default_factory=dict)
    freed_at: dict[Holder, int] = field(default_factory=dict)
    clock: int = 0
    # keys a slot's request is prefilling now, not yet confirmed: a request starting with
    # them waits for them rather than computing them again
    computing: dict[bytes, set[Holder]] = field(default_factory=dict)

    def longest(self, keys: tuple[bytes, ...], ranks: set[int]) -> dict[int, Hit]:
        """Per rank, the slots holding the most leading blocks of `keys` (lowest first)."""
        hits: dict[int, Hit] = {}
        for depth, key in enumerate(keys, 1):
            found = [h for h in self.holders.get(key, ()) if h[0] in ranks]
            if not found:
                break  # a key chains every one before it: nothing deeper can be held
            by_rank: dict[int, list[int]] = {}
            for rank, slot in sorted(found):
                by_rank.setdefault(rank, []).append(slot)
            for rank, slots in by_rank.items():
                hits[rank] = Hit(rank, depth, slots)
        return hits

    def coming(
        self, keys: tuple[bytes, ...], rank: int, held: Callable[[bytes], bool] | None = None
    ) -> bool:
        """Whether the first of `keys` the rank holds in no slot (or, given `held`, that
        `held` says it does not hold) is being computed there."""
        for key in keys:
            if held is not None:
                holds = held(key)
            else:
                holds = any(h[0] == rank for h in self.holders.get(key, ()))
            if not holds:
                return any(h[0] == rank for h in self.computing.get(key, ()))
        return False

    def awaited(self, keys: tuple[bytes, ...], ranks: list[int]) -> bool:
        """Whether on every rank of `ranks` the next blocks of `keys` are being computed:
        waiting for them is then better than computing them once more anywhere."""
        return bool(keys and ranks) and all(self.coming(keys, rank) for rank in ranks)

    def reach(self, keys: tuple[bytes, ...], rank: int, held: Callable[[bytes], bool]) -> int:
        """How many of the leading `keys` the rank holds (as `held` says) or is computing."""
        count = 0
        for key in keys:
            if not (held(key) or any(h[0] == rank for h in self.computing.get(key, ()))):
                break
            count += 1
        return count

    def compute(self, holder: Holder, keys: tuple[bytes, ...]) -> None:
        """The slot's request will compute these blocks."""
        for key in keys:
            self.computing.setdefault(key, set()).add(holder)

    def settle(self, holder: Holder) -> None:
        """The slot computes nothing more that others wait for."""
        for key in [k for k, held in self.computing.items() if holder in held]:
            held = self.computing[key]
            held.discard(holder)
            if not held:
                del self.computing[key]

    def register(self, holder: Holder, keys: tuple[bytes, ...]) -> None:
        """The slot's rank has computed these blocks there (they extend what it holds)."""
        held = self.chains.get(holder, ())
        if len(keys) <= len(held):
            return
        for key in keys[len(held) :]:
            self.holders.setdefault(key, set()).add(holder)
        self.chains[holder] = keys
        self.settle(holder)

    def keep(self, holder: Holder, num_blocks: int) -> None:
        """The slot is written over past its first `num_blocks` blocks: forget the rest."""
        self.settle(holder)
        held = self.chains.get(holder, ())
        for key in held[num_blocks:]:
            holding = self.holders.get(key)
            if holding is not None:
                holding.discard(holder)
                if not holding:
                    del self.holders[key]
        if num_blocks:
            self.chains[holder] = held[:num_blocks]
        else:
            self.chains.pop(holder, None)
        self.freed_at.pop(holder, None)

    def freed(self, holder: Holder) -> None:
        """The slot's request is gone; what it holds stays until the slot is taken."""
        self.settle(holder)
        self.clock += 1
        self.freed_at[holder] = self.clock

    def forget_rank(self, rank: int) -> None:
        """The rank's process is gone (or new): it holds nothing."""
        for holder in [h for h in self.chains if h[0] == rank]:
            self.keep(holder, 0)
        for holder in [h for h in self.freed_at if h[0] == rank]:
            del self.freed_at[holder]
        for holder in {h for held in self.computing.values() for h in held if h[0] == rank}:
            self.settle(holder)

    def spare(self, rank: int, free: list[int]) -> int:
        """Of a rank's free slots, the one to write over: one holding nothing (the lowest),
        else the least recently freed."""
        empty = [s for s in free if (rank, s) not in self.chains]
        if empty:
            return min(empty)
        return min(free, key=lambda s: (self.freed_at.get((rank, s), 0), s))

    def blocks_held(self) -> int:
        """Distinct blocks held over every rank."""
        return len(self.holders)
