"""Where the planner puts an admitted request (docs/architecture.md §3, §3c). Pure: no
I/O, no torch.

`ranks_for` lists the ranks a request could go to, `place` gives it a rank and a slot
(with reserved slots: the slot holding most of its prompt's cached blocks, or a copy of
them; in a cache of blocks: the blocks it shares and those it takes fresh), and `grow`
hands decoding requests the blocks their next positions lie in, preempting where a rank
has none left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from batcher.blocks import BlockPool

if TYPE_CHECKING:
    from batcher.scheduler import PoolState, Sequence, StepPlan
    from schemas.control import PrefillChunk


def victim_order(seq: Sequence) -> tuple[float, int]:
    return seq.urgency, -seq.order


def ranks_for(state: PoolState, isolated: bool, seq: Sequence | None = None) -> list[int]:
    """The live ranks with a free slot (in a cache of blocks, and blocks for `seq`'s
    prompt); never a rank that runs an isolated request, and for an isolated request only
    an empty rank."""
    hosts = {s.rank for s in state.running.values() if s.isolated}
    full = state.config.kv_slots_per_rank
    return [
        r
        for r in sorted(state.ranks)
        if state.free_slots[r]
        and r not in hosts
        and (not isolated or len(state.free_slots[r]) == full)
        and (seq is None or not state.config.paged or _fits(state, seq, r))
    ]


def _fits(state: PoolState, seq: Sequence, rank: int) -> bool:
    """Whether the rank has the free blocks `seq`'s prompt takes, the watermark left."""
    pool = state.pools.get(rank)
    if pool is None:
        return False
    _, shared, fresh = _prompt_blocks(state, seq, pool)
    return pool.num_free - pool.reusable(shared) - fresh >= state.watermark(rank)


def _prompt_blocks(
    state: PoolState, seq: Sequence, pool: BlockPool, hits: list[int] | None = None
) -> tuple[int, list[int], int]:
    """A prompt's cached tokens on a rank, the blocks it would share there (wholly
    before its first computed position) and how many it takes fresh (a copy of the
    block it starts computing in, if cached, among them); `hits`: its `_hits` there, if
    already found."""
    hits = _hits(state, seq, pool) if hits is None else hits
    cached = _cached_tokens(state, seq, len(hits))
    shared = hits[: cached // state.config.block_size]
    return cached, shared, state.blocks_needed(seq, seq.num_prompt_tokens) - len(shared)


def _hits(state: PoolState, seq: Sequence, pool: BlockPool) -> list[int]:
    """The cached blocks a prompt can start from on a rank: its leading cached blocks; with
    marks (state outside blocks), only as far as its computing resumes at a marked block's
    end B, or at B - 1 (rewriting that position with the same bits)."""
    if not state.config.prefix_caching:
        return []
    hits = pool.cached(seq.block_keys)
    if not pool.num_marks:
        return hits
    size = state.config.block_size
    for count in range(len(hits), 0, -1):
        boundary = -(-_cached_tokens(state, seq, count) // size)  # blocks B covers
        if boundary and hits[boundary - 1] in pool.mark_of:
            return hits[:count]
    return []


def boundary_mark(state: PoolState, seq: Sequence, num_tokens: int) -> tuple[int, int]:
    """A prefill segment of `num_tokens` from `seq.num_prefilled` on, cut at the end of the
    last keyed prompt block it completes, if that wants a mark (no marked block holds its
    key yet), with the mark that takes the copy there: (tokens, mark or -1). Unpacked, a
    chunk is never cut: only a chunk ending on a block's end is marked."""
    config = state.config
    pool = state.pools.get(seq.rank)
    if pool is None or not (pool.num_marks and config.prefix_caching):
        return num_tokens, -1
    size, start = config.block_size, seq.num_prefilled
    end = start + num_tokens
    last = min(end // size, len(seq.block_keys))  # blocks complete at its end, keyed
    if last * size <= start or (not config.pack_prefill and last * size != end):
        return num_tokens, -1
    cached = pool.block_of.get(seq.block_keys[last - 1])
    if cached is not None and cached in pool.mark_of:
        return num_tokens, -1
    return last * size - start, pool.mark_for(seq.blocks[last - 1])


def _cached_tokens(state: PoolState, seq: Sequence, num_blocks: int) -> int:
    """Prompt tokens `num_blocks` cached leading blocks spare it (at least the last is
    always computed, with MTP the last cached one too; unpacked, prefill resumes on a
    chunk's boundary)."""
    config = state.config
    if not num_blocks:
        return 0
    recompute = 1 if config.mtp else 0
    cached = min(num_blocks * config.block_size - recompute, seq.num_prompt_tokens - 1)
    if not config.pack_prefill:
        cached -= cached % config.prefill_chunk
    return max(cached, 0)


def place(state: PoolState, seq: Sequence, ranks: list[int]) -> None:
    """Give a request a rank and a slot: the rank holding most of its prompt's leading
    blocks, if any does (its slot, when free; else a copy of them), else the rank with the
    most free slots of those not computing them already, ties round-robin. Cached tokens
    count as prefilled (at least the last is always computed; unpacked, prefill resumes
    on a chunk's boundary)."""
    config, prefix = state.config, state.prefix
    if config.paged:
        _place_in_blocks(state, seq, ranks)
        return
    hits = prefix.longest(seq.block_keys, set(ranks)) if config.prefix_caching else {}
    cached = 0
    if hits:
        hit = max(hits.values(), key=lambda h: (h.num_blocks, len(state.free_slots[h.rank])))
        cached = _cached_tokens(state, seq, hit.num_blocks)
    if cached > 0:
        rank, free = hit.rank, state.free_slots[hit.rank]
        source, taken = hit.slot(free)
        slot = source if taken else prefix.spare(rank, free)
        kept = hit.num_blocks if taken else 0
        reused = hit.num_blocks
        seq.num_cached, seq.cached_from, seq.num_prefilled = cached, source, cached
    else:  # a rank not computing its blocks already, if there is one
        fresh = [r for r in ranks if not prefix.coming(seq.block_keys, r)]
        rank = _pick_rank(state, fresh or ranks)
        slot = prefix.spare(rank, state.free_slots[rank])
        kept = reused = 0
    state.free_slots[rank].remove(slot)
    prefix.keep((rank, slot), kept)
    if config.prefix_caching:
        prefix.compute((rank, slot), seq.block_keys[reused:])
    seq.rank, seq.slot = rank, slot


def ranks_in_blocks(state: PoolState, seq: Sequence, ranks: list[int]) -> list[int] | None:
    """In a cache of blocks with prefix caching, the ranks `place` may put `seq` on, or
    None when it should wait. A rank reaches the leading prompt blocks it holds or is
    computing. Of the ranks reaching any, the one reaching most (ties: the larger share of
    its blocks free, so a burst spreads over ranks computing the same prompt) takes it,
    sharing what it holds, unless its next blocks are still being computed there: then the
    request waits for them (keyed as planned, they come a step later). Where every rank
    reaching any is still computing and some rank reaches none, a miss goes to one of those:
    a burst computes a shared prompt once a rank, in parallel."""
    prefix = state.prefix
    reaching: list[tuple[tuple[int, float, int], bool]] = []
    fresh: list[int] = []
    for rank in ranks:
        held = held_by(state, rank)
        reach = prefix.reach(seq.block_keys, rank, held)
        if not reach:
            fresh.append(rank)
            continue
        order = (reach, state.pools[rank].free_share, -rank)
        reaching.append((order, prefix.coming(seq.block_keys, rank, held)))
    if not reaching:
        return ranks
    if fresh and all(coming for _, coming in reaching):
        return fresh
    order, coming = max(reaching)
    return None if coming else [-order[2]]


def _place_in_blocks(state: PoolState, seq: Sequence, ranks: list[int]) -> None:
    """`place` in a cache of blocks: the rank whose cached blocks spare the most of the
    prompt (ties: a larger share of its blocks free), else the one with the largest share
    free of those not computing its blocks already. The request holds the cached blocks
    before its first computed position, shared; the block that position lies in, if
    cached, is copied into a fresh one (a shared block is never written); the rest of its
    prompt's blocks are fresh."""
    config, prefix = state.config, state.prefix
    best: tuple[int, float, int] | None = None
    for rank in ranks:
        cached, _, _ = _prompt_blocks(state, seq, state.pools[rank])
        key = (cached, state.pools[rank].free_share, -rank)
        if cached and (best is None or key > best):
            best = key
    if best is not None:
        rank = -best[2]
    else:
        fresh_ranks = [r for r in ranks if not prefix.coming(seq.block_keys, r, held_by(state, r))]
        rank = _pick_rank(state, fresh_ranks or ranks, by_blocks=True)
    pool = state.pools[rank]
    hits = _hits(state, seq, pool)  # before `take` hands any of them out again
    cached, shared, fresh = _prompt_blocks(state, seq, pool, hits)
    size = config.block_size
    # a mark's copy is restored before any launch, as a cached block is copied
    seq.restore_mark = pool.use_mark(hits[-(-cached // size) - 1]) if cached else -1
    pool.hold(shared)
    seq.blocks = shared + pool.take(fresh)
    seq.num_sent_blocks = len(seq.blocks)
    seq.copy_block = []
    if cached % size:  # its first computed position is inside a cached block
        seq.copy_block = [hits[len(shared)], seq.blocks[len(shared)]]
    seq.num_cached, seq.num_prefilled = cached, cached
    slot = min(state.free_slots[rank])
    state.free_slots[rank].remove(slot)
    prefix.keep((rank, slot), 0)
    if config.prefix_caching:
        prefix.compute((rank, slot), seq.block_keys[len(shared) :])
    seq.rank, seq.slot = rank, slot


def held_by(state: PoolState, rank: int) -> Callable[[bytes], bool]:
    """Whether a rank's blocks hold a prefix key."""
    pool = state.pools.get(rank)
    return (lambda key: key in pool.block_of) if pool is not None else (lambda key: False)


def key_planned(state: PoolState, prefill: dict[int, list[list[PrefillChunk]]]) -> None:
    """Key the full prompt blocks a step's chunks complete as the step is planned, not once
    the request's first token is back: a rank runs its steps in order and every chunk
    planned for a request it holds (one whose admission failed still computes its prompt),
    so requests admitted to later steps may share them. A burst sharing a prompt starts on
    it the step after its last block is planned. Where a block's boundary needs a mark (its
    copy is taken in the launch), blocks are keyed at the first token, as before."""
    size = state.config.block_size
    for rank, launches in prefill.items():
        pool = state.pools.get(rank)
        if pool is None or pool.num_marks:
            continue
        ids = {chunk.request_id for launch in launches for chunk in launch}
        for seq in (state.running[i] for i in sorted(ids) if i in state.running):
            full = min(seq.num_prefilled // size, len(seq.block_keys))
            if full:
                pool.register(seq.block_keys[:full], seq.blocks[:full])


def grow(state: PoolState, decoding: dict[int, list[Sequence]], plan: StepPlan) -> list[Sequence]:
    """Give each request about to decode the blocks its next positions lie in, most
    urgent first; where a rank has none free, its least urgent running requests give theirs
    back (preempted: they resume later, recomputing what is not cached), the one growing
    itself if it is the least urgent. Returns the preempted."""
    config = state.config
    preempted: list[Sequence] = []
    for rank, seqs in decoding.items():
        pool = state.pools.get(rank)
        if pool is None:
            continue
        order = sorted((s for s in seqs if s.wants_decode), key=victim_order, reverse=True)
        for seq in order:
            if seq.stopping:
                continue
            ahead = seq.num_planned_tokens  # tokens to feed: the last at this position
            if config.mtp:  # a verify feeds a draft after it; a step may commit two
                ahead = min(2 * ahead, seq.max_new_tokens) + 1
            need = state.blocks_needed(seq, seq.num_prompt_tokens + ahead) - len(seq.blocks)
            while need > pool.num_free:
                victims = [s for s in seqs if not s.stopping and s.blocks]
                victim = min(victims, key=victim_order)
                state.mark_stopping(victim, preempting=True)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.stopping or need <= 0:
                continue
            seq.blocks += pool.take(need)
            plan.grown.append(seq)
    return preempted


def _pick_rank(state: PoolState, ranks: list[int], by_blocks: bool = False) -> int:
    """Of `ranks`, the one with the most free slots (or the largest share of its blocks
    free: ranks sized from a share of their host's free memory differ by a few blocks, and
    the most free blocks would send every request to the largest), ties round-robin."""

    def free(rank: int) -> float:
        return state.pools[rank].free_share if by_blocks else len(state.free_slots[rank])

    most = max(free(r) for r in ranks)
    tied = [r for r in ranks if free(r) == most]
    chosen = next((r for r in tied if r >= state.next_rank), tied[0])
    state.next_rank = (chosen + 1) % state.config.num_ranks
    return chosen
