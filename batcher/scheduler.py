"""The step planner (docs/architecture.md §3): a pure function of pool state and config,
no I/O, no torch.

`plan_step` admits waiting requests, packs decode rows and prefill chunks onto the fixed
launches, and lists the running requests their ranks must end (stopped or preempted);
`preempt_threshold` says which queued entries would preempt, for the batcher's intake;
`finish`, `stop`, `lose_rank` and `join_rank` apply what happened since, and
`outcomes.apply_result` what a step's result did. Where an admitted request goes (its
rank, slot and blocks) is batcher/placement.py's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter

from batcher.blocks import BlockPool
from batcher.fairness import (
    EPSILON,
    TenantShare,
    at_cap,
    fair_order,
    fair_shares,
    prefill_order,
    share_of,
)
from batcher.placement import (
    boundary_mark,
    grow,
    key_planned,
    place,
    ranks_for,
    ranks_in_blocks,
    victim_order,
)
from batcher.prefix import PrefixIndex
from batcher.riding import ride, rooms_to_ride
from schemas.control import PREEMPTED, PrefillChunk
from schemas.keys import DEFAULT_TENANT

_TENANT = attrgetter("tenant")


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The limits the planner packs under."""

    num_ranks: int
    max_num_seqs: int
    kv_slots_per_rank: int
    decode_batch: int
    prefill_chunk: int
    prefill_slots: int
    lockstep: bool = False
    preempt_margin: float | None = None  # None: never preempt
    pack_prefill: bool = False  # several requests' chunks share a prefill launch
    prefill_segments: int = 8  # requests in one packed prefill launch, at most
    # a rank's decode micro-batch rides in the room its packed prefill launch leaves (its
    # ranks give a row the same bits either way); never with MTP or in lockstep
    mix_decode: bool = False
    # steps a rank's decode rows may wait while its prefill backlog drains (0: every step)
    decode_stall_steps: int = 0
    # tenants' weights and caps (batcher/fairness.py); a tenant not named: weight 1, no cap
    tenants: dict[str, TenantShare] = field(default_factory=dict, hash=False)
    # prefix caching (batcher/prefix.py): requests whose prompts start with blocks of
    # `block_size` tokens a slot holds skip their prefill; with MTP the last cached token is
    # computed again (its draft entry reads the token after it)
    prefix_caching: bool = False
    block_size: int = 128
    mtp: bool = False
    # a cache of blocks per rank (batcher/blocks.py): requests hold blocks as they grow,
    # and shared prefixes are held, not copied; False: each slot reserves every position
    paged: bool = False
    max_kv_len: int = 0  # positions a request may reach (paged: its table's length)

    def __post_init__(self) -> None:
        for name in (
            "num_ranks",
            "max_num_seqs",
            "kv_slots_per_rank",
            "decode_batch",
            "prefill_chunk",
            "prefill_slots",
            "prefill_segments",
            "block_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_stall_steps < 0:
            raise ValueError(f"decode_stall_steps must be >= 0, got {self.decode_stall_steps}")
        if self.paged and self.max_kv_len < self.block_size:
            raise ValueError(
                f"a cache of blocks: max_kv_len {self.max_kv_len} holds no block of "
                f"{self.block_size}"
            )
        if self.preempt_margin is not None and not self.preempt_margin >= 0:
            raise ValueError(f"preempt_margin must be >= 0 or None, got {self.preempt_margin}")


@dataclass(slots=True)
class Sequence:
    """Planner view of one request: plain counters, as the batcher knows them."""

    request_id: str
    num_prompt_tokens: int  # tokens to prefill: the prompt plus any tokens resumed after recovery
    max_new_tokens: int  # tokens this run may still produce
    order: int  # arrival order, for FIFO fairness
    urgency: float = 0.0  # effective-priority order, higher first (see batcher/queue.py)
    priority: int = 0  # priority class: a burst of lower classes never holds its decode back
    rank: int = -1
    slot: int = -1
    num_prefilled: int = 0
    num_planned_tokens: int = 0  # tokens the planned steps will have produced, at most
    stopping: bool = False  # cancelled, timed out or preempted: plan nothing more for it
    preempting: bool = False  # its rank is told to give its slot back to a more urgent one
    isolated: bool = False  # a suspect (ranks died holding it): it runs alone on a rank
    # which admission of the request this is, counted by the book each time it queues:
    # its rank's outcomes name it, and outcomes of an earlier one are stale
    admission: int = 0
    tenant: str = DEFAULT_TENANT  # whose request it is: tenants share the pool fairly
    block_keys: tuple[bytes, ...] = ()  # its context's full blocks (batcher/prefix.py)
    num_cached: int = 0  # context tokens its slot holds from a cached prefix at admission
    cached_from: int = -1  # the slot they are copied from (its own: they are there)
    registered: bool = False  # its blocks are in the prefix index
    deferred: bool = False  # it waits for a running request to compute its leading blocks
    # a cache of blocks: the blocks it holds, in the order of its positions; how many of
    # them its rank has been told of; and [source, target] of a shared block it copies
    blocks: list[int] = field(default_factory=list)
    num_sent_blocks: int = 0
    copy_block: list[int] = field(default_factory=list)
    restore_mark: int = -1  # the mark its slot's state outside blocks is restored from

    @property
    def is_admitted(self) -> bool:
        """True once the request holds a KV slot."""
        return self.slot >= 0

    @property
    def is_prefilled(self) -> bool:
        """True once every prompt token has been planned for prefill."""
        return self.num_prefilled >= self.num_prompt_tokens

    @property
    def wants_prefill(self) -> bool:
        """True while prompt tokens remain to be prefilled."""
        return not self.is_prefilled and not self.stopping

    @property
    def wants_decode(self) -> bool:
        """True while a decode step could still produce a token for it."""
        return (
            self.is_prefilled
            and self.num_planned_tokens < self.max_new_tokens
            and not self.stopping
        )


@dataclass(slots=True)
class PlannedStop:
    """A running request its rank must end by this step: why (a finish reason, or
    `preempted`: give the slot back and resume later)."""

    seq: Sequence
    reason: str


@dataclass(slots=True)
class StepPlan:
    """A whole pool's step: launch k of `decode_launches` maps rank -> its rows' slots.

    A `fence` opens an epoch: it goes to every live rank, which finishes what earlier
    epochs sent and drops it; the batcher sends one, empty, before any other step."""

    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    stops: list[PlannedStop] = field(default_factory=list)  # the preempted ones included
    decode_launches: list[dict[int, list[Sequence]]] = field(default_factory=list)
    prefill: dict[int, list[list[PrefillChunk]]] = field(default_factory=dict)  # launches
    fence: bool = False
    grown: list[Sequence] = field(default_factory=list)  # running requests given blocks

    @property
    def is_empty(self) -> bool:
        """True when the step has no launch to run."""
        return not self.decode_launches and not any(self.prefill.values())

    @property
    def is_idle(self) -> bool:
        """True when the step would tell no rank anything: no launch, nothing to end, no
        fence."""
        return self.is_empty and not self.stops and not self.admitted and not self.fence


@dataclass(slots=True)
class PoolState:
    """What the planner knows of a pool: waiting and running requests and free KV slots."""

    config: PlannerConfig
    waiting: list[Sequence] = field(default_factory=list)
    running: dict[str, Sequence] = field(default_factory=dict)
    free_slots: list[list[int]] = field(default_factory=list)
    live_ranks: set[int] | None = None  # None: every rank
    next_rank: int = 0
    decode_stalls: dict[int, int] = field(default_factory=dict)  # rank -> steps its decode waited
    stops: list[PlannedStop] = field(default_factory=list)  # stopped since the last plan
    # tenants' fair shares by (the tenants running or waiting, capacity): they seldom change
    shares: dict[tuple[frozenset[str], int], dict[str, float]] = field(default_factory=dict)
    # running requests by tenant, those being ended left out; and how many are being ended
    occupancy: Counter[str] = field(default_factory=Counter)
    leaving: int = 0
    version: int = 0  # moves with every change of `occupancy`
    # (version, tenants waiting, capacity) where no slot could move between tenants
    settled: tuple[int, frozenset[str], int] | None = None
    # tenants' prefill virtual times (tokens prefilled over weight) and the least of them
    prefill_served: dict[str, float] = field(default_factory=dict)
    prefill_floor: float = 0.0
    prefix: PrefixIndex = field(default_factory=PrefixIndex)  # which slot holds which blocks
    pools: dict[int, BlockPool] = field(default_factory=dict)  # a cache of blocks: per rank

    def __post_init__(self) -> None:
        if not self.free_slots:
            self.free_slots = [
                list(range(self.config.kv_slots_per_rank)) for _ in range(self.config.num_ranks)
            ]
        if self.live_ranks is None:
            self.live_ranks = set(range(self.config.num_ranks))

    @property
    def ranks(self) -> set[int]:
        """The ranks that can take work now."""
        assert self.live_ranks is not None  # set in __post_init__
        return self.live_ranks

    def num_free_slots(self) -> int:
        """Free KV slots over live ranks."""
        return sum(len(self.free_slots[r]) for r in self.ranks)

    def room(self) -> int:
        """How many more requests could be admitted now."""
        return max(0, min(self.config.max_num_seqs - len(self.running), self.num_free_slots()))

    def capacity(self) -> int:
        """How many requests the live ranks could run at once."""
        return min(self.config.max_num_seqs, self.config.kv_slots_per_rank * len(self.ranks))

    def add_running(self, seq: Sequence) -> None:
        """Count a request in as running (on the rank and slot it names)."""
        self.running[seq.request_id] = seq
        self.version += 1
        if seq.stopping:
            self.leaving += 1
        else:
            self.occupancy[seq.tenant] += 1

    def remove_running(self, request_id: str) -> Sequence | None:
        """Count a running request out; returns it (None: it was not running)."""
        seq = self.running.pop(request_id, None)
        if seq is not None:
            self.version += 1
            if seq.stopping:
                self.leaving -= 1
            else:
                self._occupy(seq.tenant, -1)
        return seq

    def mark_stopping(self, seq: Sequence, preempting: bool = False) -> None:
        """A running request's rank is to end it (and, preempting, give its slot back).
        Its blocks are free at once: the plan that tells its rank comes before any launch
        that writes them for another request."""
        if not seq.stopping:
            seq.stopping = True
            self.version += 1
            self.leaving += 1
            self._occupy(seq.tenant, -1)
        seq.preempting = seq.preempting or preempting
        self.release_blocks(seq)

    def release_blocks(self, seq: Sequence) -> None:
        """A request lets go of the blocks it holds (a cache of blocks)."""
        pool = self.pools.get(seq.rank)
        if seq.blocks and pool is not None:
            pool.release(seq.blocks)
        seq.blocks = []

    def blocks_needed(self, seq: Sequence, tokens: int) -> int:
        """Blocks a request's table needs to hold positions [0, tokens)."""
        size = self.config.block_size
        return min(-(-tokens // size), self.config.max_kv_len // size)

    def watermark(self, rank: int) -> int:
        """Free blocks admission leaves on a rank for running requests to grow into."""
        return max(1, self.pools[rank].total // 100)

    def _occupy(self, tenant: str, change: int) -> None:
        left = self.occupancy[tenant] + change
        if left:
            self.occupancy[tenant] = left
        else:
            del self.occupancy[tenant]  # its keys are the tenants running


def plan_step(state: PoolState) -> StepPlan:
    """Admit what fits (preempting for much more urgent requests), then plan decode for every
    prefilled request (but, while the pool has free slots, not on a rank whose prefill
    backlog exceeds one step, for at most `decode_stall_steps` steps in a row), then prefill
    chunks. A full pool always decodes: finishing requests is what lets queued ones in."""
    plan = StepPlan(admitted=_admit(state), preempted=_preempt(state))
    plan.preempted += _preempt_for_share(state)
    by_rank: dict[int, list[Sequence]] = {r: [] for r in sorted(state.ranks)}
    for seq in state.running.values():
        if seq.rank in by_rank:
            by_rank[seq.rank].append(seq)
    may_wait = state.room() > 0 and not state.waiting
    decoding = {
        r: seqs for r, seqs in by_rank.items() if not (may_wait and _decode_waits(state, r, seqs))
    }
    if not may_wait:
        state.decode_stalls.clear()
    if state.config.paged:
        plan.preempted += grow(state, decoding, plan)
    plan.stops = state.stops + [PlannedStop(seq, PREEMPTED) for seq in plan.preempted]
    state.stops = []
    plan.decode_launches = _plan_decode(decoding, state.config, lockstep_ranks=by_rank)
    config = state.config
    mixing = config.mix_decode and config.pack_prefill and not (config.mtp or config.lockstep)
    rooms = rooms_to_ride(plan.decode_launches, config.prefill_chunk) if mixing else {}
    plan.prefill = _plan_prefill(by_rank, state, rooms)
    if config.paged and config.prefix_caching:
        key_planned(state, plan.prefill)
    if mixing:
        plan.decode_launches = ride(plan.decode_launches, plan.prefill, config.prefill_chunk)
    return plan


def finish(state: PoolState, request_id: str) -> Sequence | None:
    """Remove a finished (or cancelled, or failed) request and free its slot."""
    state.stops = [s for s in state.stops if s.seq.request_id != request_id]
    seq = state.remove_running(request_id)
    if seq is None:
        waiting = [s for s in state.waiting if s.request_id == request_id]
        for s in waiting:
            state.waiting.remove(s)
        return waiting[0] if waiting else None
    if seq.rank in state.ranks:
        slots = state.free_slots[seq.rank]
        slots.append(seq.slot)
        slots.sort()
        state.prefix.freed((seq.rank, seq.slot))
        state.release_blocks(seq)
    return seq


def stop(state: PoolState, request_id: str, reason: str) -> Sequence | None:
    """Plan nothing more for a running request; the next plan tells its rank to end it."""
    seq = state.running.get(request_id)
    if seq is not None:
        state.mark_stopping(seq)
        state.stops.append(PlannedStop(seq, reason))
    return seq


def lose_rank(state: PoolState, rank: int) -> list[Sequence]:
    """Take a rank out of planning; returns the requests it held, now out of the pool."""
    state.ranks.discard(rank)
    state.prefix.forget_rank(rank)
    state.pools.pop(rank, None)
    state.decode_stalls.pop(rank, None)
    state.stops = [s for s in state.stops if s.seq.rank != rank]
    lost = [s for s in state.running.values() if s.rank == rank]
    for seq in lost:
        state.remove_running(seq.request_id)
    return lost


def join_rank(state: PoolState, rank: int, num_blocks: int = 0, num_marks: int = 0) -> None:
    """Put a (new) rank process into planning with all of its KV slots free (and, in a
    cache of blocks, its `num_blocks` blocks and `num_marks` marks)."""
    state.ranks.add(rank)
    state.free_slots[rank] = list(range(state.config.kv_slots_per_rank))
    state.prefix.forget_rank(rank)
    state.pools.pop(rank, None)
    if num_blocks:
        state.pools[rank] = BlockPool(num_blocks, num_marks)


def _admit(state: PoolState) -> list[Sequence]:
    """Admit waiting requests while there is room: most urgent first, and with several
    tenants waiting, in their fair order (batcher/fairness.py); none of a tenant at its
    `max_running`, and none whose next uncached blocks are being computed on every rank it
    could go to (it waits for them, so a burst sharing a prompt computes it once a rank;
    in a cache of blocks, none whose best rank is still computing them: `ranks_in_blocks`)."""
    admitted: list[Sequence] = []
    state.waiting.sort(key=lambda s: (-s.urgency, s.order))
    if not state.waiting or state.room() <= 0:
        return admitted
    tenants = state.config.tenants
    order, held = state.waiting, None
    if tenants or any(s.tenant != order[0].tenant for s in order):
        held = Counter(s.tenant for s in state.running.values())
        order = fair_order(order, held, tenants, state.capacity())
    prefix = state.prefix if state.config.prefix_caching else None
    for seq in order:
        if state.room() <= 0:
            break
        if held is not None and at_cap(tenants, seq.tenant, held):
            continue
        ranks = ranks_for(state, seq.isolated, seq)
        chosen: list[int] | None = ranks
        if prefix is not None and state.config.paged and ranks:
            chosen = ranks_in_blocks(state, seq, ranks)
        elif prefix is not None:
            chosen = None if prefix.awaited(seq.block_keys, ranks) else ranks
        seq.deferred = chosen is None
        if chosen is None:  # the blocks it starts with come soon: it need not compute them
            continue
        if not ranks:  # an isolated request waits for a rank to empty; the queue with it
            break
        place(state, seq, chosen)
        state.add_running(seq)
        admitted.append(seq)
        if held is not None:
            held[seq.tenant] += 1
    if admitted:
        taken = {id(s) for s in admitted}
        state.waiting = [s for s in state.waiting if id(s) not in taken]
    return admitted


def preempt_threshold(state: PoolState) -> float | None:
    """The urgency a request yet to be queued must exceed to preempt one that runs: with
    nothing waiting and no room left, the least urgent victim's plus the margin (None:
    it would be admitted, or could preempt nothing)."""
    margin = state.config.preempt_margin
    if margin is None or state.waiting or state.room() > 0:
        return None
    victim = _least_urgent(state)
    return victim.urgency + margin if victim is not None else None


def _preempt(state: PoolState) -> list[Sequence]:
    """With no room left, the least urgent running requests whose urgency a waiting one
    exceeds by the margin give their slots back (one per waiting request)."""
    margin = state.config.preempt_margin
    if margin is None or not state.waiting:
        return []
    pending = sum(1 for s in state.running.values() if s.preempting)
    first = _least_urgent(state)
    heads = [s for s in state.waiting if not s.deferred][pending:]
    if first is None or not heads or heads[0].urgency <= first.urgency + margin:
        return []  # (the common case, without sorting every running request)
    preempted: list[Sequence] = []
    for head, victim in zip(heads, _victims(state)):
        if head.urgency <= victim.urgency + margin:
            break
        state.mark_stopping(victim, preempting=True)
        preempted.append(victim)
    return preempted


def _preempt_for_share(state: PoolState) -> list[Sequence]:
    """With several tenants and every slot taken, a waiting request of a tenant under its
    fair share takes a slot from the tenant most over its own (that tenant's least urgent,
    newest request of the same priority class or lower) when the one's shortfall and the
    other's excess add up to more than a slot. Each such move lowers the sum of squared
    distances from the shares, so moves end and a slot is never taken back; where none is
    left, every tenant is within one slot of its share. Slots being given back already go
    to the waiting first."""
    config = state.config
    if config.preempt_margin is None or not state.waiting:
        return []
    held = state.occupancy
    waiting = frozenset(map(_TENANT, state.waiting))
    seen = (state.version, waiting, state.capacity())
    if seen == state.settled:
        return []  # as when last looked at: nothing can move
    active = held.keys() | waiting
    if len(active) < 2:
        return []
    shares = _shares(state, active)
    most_over = max(held[n] - shares[n] for n in active)
    if most_over + max(shares[n] - held[n] for n in waiting) <= 1 + EPSILON:
        state.settled = seen
        return []  # no pair could move a slot (what is being freed only narrows it)
    occupancy = Counter(held)
    freeing = state.room() + state.leaving
    victims: dict[str, list[Sequence]] = {}
    for seq in _victims(state):
        victims.setdefault(seq.tenant, []).append(seq)
    preempted: list[Sequence] = []
    ranked: list[str] | None = None
    for seq in fair_order(state.waiting, occupancy, config.tenants, state.capacity()):
        tenant = seq.tenant
        if at_cap(config.tenants, tenant, occupancy):
            continue
        if freeing > 0:
            freeing -= 1
            occupancy[tenant] += 1
            continue
        wanting = shares[tenant] - occupancy[tenant]  # how far below its share
        if wanting <= EPSILON:
            continue
        if ranked is None:  # tenants that could give a slot, most over their share first
            ranked = sorted(
                (name for name, seqs in victims.items() if seqs),
                key=lambda n: (occupancy[n] - shares[n], n),
                reverse=True,
            )
        donor = None
        for name in ranked:
            if occupancy[name] - shares[name] + wanting <= 1 + EPSILON:
                break  # nor any after it
            if name != tenant and victims[name] and victims[name][0].priority <= seq.priority:
                donor = name
                break
        if donor is None:
            continue
        ranked = None
        victim = victims[donor].pop(0)
        state.mark_stopping(victim, preempting=True)
        preempted.append(victim)
        occupancy[donor] -= 1
        occupancy[tenant] += 1
    return preempted


def _shares(state: PoolState, active: Iterable[str]) -> dict[str, float]:
    """The fair shares of the tenants running or waiting (batcher/fairness.py), kept."""
    key = (frozenset(active), state.capacity())
    found = state.shares.get(key)
    if found is None:
        if len(state.shares) >= 64:
            state.shares.clear()
        found = state.shares[key] = fair_shares(key[0], key[1], state.config.tenants)
    return found


def _prefill_clock(state: PoolState, tenants: set[str]) -> dict[str, float] | None:
    """The tenants' prefill virtual times, for the tenants with prompts waiting (None: one
    tenant or none, nothing to share). A tenant back after waiting for nothing starts from
    the least time of those that waited: what it did not ask for is not owed to it."""
    if len(tenants) < 2:
        state.prefill_served.clear()
        state.prefill_floor = 0.0
        return None
    floor, kept = state.prefill_floor, state.prefill_served
    # a tenant ahead of the others, with nothing waiting now, keeps its time for its return
    served = {name: t for name, t in kept.items() if t > floor}
    for name in tenants:
        served[name] = max(served.get(name, floor), floor)
    state.prefill_served = served
    return served


def _victims(state: PoolState) -> list[Sequence]:
    """Running requests that could give their slot back, least urgent (then newest) first."""
    return sorted(_could_give(state), key=victim_order)


def _least_urgent(state: PoolState) -> Sequence | None:
    """The first of `_victims`, if any."""
    return min(_could_give(state), key=victim_order, default=None)


def _could_give(state: PoolState) -> Iterator[Sequence]:
    ranks = state.ranks
    return (s for s in state.running.values() if not s.stopping and s.rank in ranks)


def _decode_waits(state: PoolState, rank: int, seqs: list[Sequence]) -> bool:
    """True when the rank's decode rows sit this step out so its prefill launches serve a
    backlog sooner: more prefill waits than the step's launches carry, none of the rows is
    of a higher priority class than every waiting prompt, and the rows have waited fewer
    than `decode_stall_steps` steps in a row. Counts the wait."""
    config = state.config
    stalled = state.decode_stalls.get(rank, 0)
    rows = [s.priority for s in seqs if s.wants_decode]
    prompts = [s.priority for s in seqs if s.wants_prefill]
    waits = (
        stalled < config.decode_stall_steps
        and bool(rows)
        and _prefill_launches_wanted(seqs, config) > config.prefill_slots
        and max(rows) <= max(prompts)
    )
    state.decode_stalls[rank] = stalled + 1 if waits else 0
    return waits


def _prefill_launches_wanted(seqs: list[Sequence], config: PlannerConfig) -> int:
    """Prefill launches the rank's waiting prompts could fill in one step: packed, their
    tokens by the chunk (and requests by the segments a launch holds); unpacked, one per
    request."""
    left = [s.num_prompt_tokens - s.num_prefilled for s in seqs if s.wants_prefill]
    if not config.pack_prefill:
        return len(left)
    by_tokens = -(-sum(left) // config.prefill_chunk)
    return max(by_tokens, -(-len(left) // config.prefill_segments))


def _plan_decode(
    by_rank: dict[int, list[Sequence]],
    config: PlannerConfig,
    lockstep_ranks: dict[int, list[Sequence]],
) -> list[dict[int, list[Sequence]]]:
    """Launch k holds the k-th micro-batch of every rank: no rank over `decode_batch` rows."""
    launches: list[dict[int, list[Sequence]]] = []
    for rank, seqs in by_rank.items():
        rows = sorted((s for s in seqs if s.wants_decode), key=lambda s: s.slot)
        for k in range(0, len(rows), config.decode_batch):
            index = k // config.decode_batch
            if index == len(launches):
                launches.append({})
            launches[index][rank] = rows[k : k + config.decode_batch]
    for launch in launches:
        for rows in launch.values():
            for seq in rows:
                seq.num_planned_tokens += 1
        if config.lockstep:
            for rank in lockstep_ranks:
                launch.setdefault(rank, [])
    return launches


def _plan_prefill(
    by_rank: dict[int, list[Sequence]],
    state: PoolState,
    rooms: dict[int, list[int]],
) -> dict[int, list[list[PrefillChunk]]]:
    """Up to `prefill_slots` launches per rank of up to `prefill_chunk` tokens each, filled
    most urgent request first (several tenants' prompts in their fair order: prefill
    tokens shared by weight, `fairness.prefill_order`). Packed, a launch holds segments of
    several requests back to back (a long prompt's last part shares its launch with the
    next prompts); unpacked, one request's chunk. An empty launch is a lockstep dummy. A
    rank's k-th launch leaves `rooms[rank][k]` tokens free for decode rows to ride in."""
    config = state.config
    prefill: dict[int, list[list[PrefillChunk]]] = {}
    per_launch = config.prefill_segments if config.pack_prefill else 1
    wanting = {
        rank: sorted((s for s in seqs if s.wants_prefill), key=lambda s: (-s.urgency, s.order))
        for rank, seqs in by_rank.items()
    }
    waiting = {s.tenant for seqs in wanting.values() for s in seqs}
    served = _prefill_clock(state, waiting)
    for rank, pending in wanting.items():
        if served is not None and len(pending) > 1:
            most = config.prefill_chunk * config.prefill_slots
            pending = prefill_order(pending, served, config.tenants, most)
        launches: list[list[PrefillChunk]] = []
        left = rooms.get(rank, [])  # tokens kept for decode rows riding in each launch
        while pending and len(launches) < config.prefill_slots:
            kept = left[len(launches)] if len(launches) < len(left) else 0
            room, launch = config.prefill_chunk - kept, list[PrefillChunk]()
            cut: list[Sequence] = []  # segments cut at a marked boundary: on in the next launch
            while pending and room and len(launch) < per_launch:
                seq = pending[0]
                wanted = min(room, seq.num_prompt_tokens - seq.num_prefilled)
                num_tokens, mark = boundary_mark(state, seq, wanted)
                launch.append(
                    PrefillChunk(seq.slot, seq.num_prefilled, num_tokens, seq.request_id, mark)
                )
                seq.num_prefilled += num_tokens
                room -= num_tokens
                if served is not None:
                    served[seq.tenant] += num_tokens / share_of(config.tenants, seq.tenant).weight
                if seq.is_prefilled:
                    seq.num_planned_tokens += 1  # the step that completes a prompt samples a token
                    pending.pop(0)
                elif not config.pack_prefill:
                    pending.pop(0)  # unpacked: one chunk per request per step, as before
                elif num_tokens < wanted:
                    cut.append(pending.pop(0))  # a launch holds one segment of a request
            pending[:0] = cut
            launches.append(launch)
        if launches:
            prefill[rank] = launches
    if served is not None:
        state.prefill_floor = min(served[name] for name in waiting)
    if config.lockstep and prefill:
        most = max(len(c) for c in prefill.values())
        for rank in by_rank:
            launches = prefill.setdefault(rank, [])
            launches += [[] for _ in range(most - len(launches))]
    return prefill
