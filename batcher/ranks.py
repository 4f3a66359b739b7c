"""Tracking a pool's ranks: which process (incarnation) serves each rank, and when one is lost.

A rank is live while its registry hash says `ready` with a fresh heartbeat under the
incarnation the batcher knows. A rank that goes stale, stops, or comes back as a new
process is lost: its requests move, and its old incarnation is marked `lost` so that a
process that was only hung fences itself off and registers anew. A rank whose launch
shapes are not the pool's never joins: it is marked `failed` with the difference as its
reason, and stops (a restart with the same flags would not help).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from schemas.connection import hash_fields
from schemas.keys import Keys
from schemas.registry import LaunchShapes, RankField, RankState

# Mark an incarnation lost or failed only if it is still the registered one (a new process
# may have registered in the meantime, and must not be overwritten).
MARK_SCRIPT = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[3], ARGV[4])
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], ARGV[5], ARGV[6]) end
  return 1
end
return 0
"""


@dataclass(slots=True)
class RankChanges:
    """What one poll of the registry found."""

    lost: list[int] = field(default_factory=list)
    joined: list[int] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)  # (rank, why)
    vanished: set[int] = field(default_factory=set)  # lost ranks that are not alive at all


class RankRegistry:
    """The batcher's view of its ranks' incarnations."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        pool: str,
        num_ranks: int,
        rank_timeout_s: float,
        shapes: LaunchShapes,
    ) -> None:
        self.client = client
        self.keys = keys
        self.pool = pool
        self.num_ranks = num_ranks
        self.shapes = shapes  # the pool's: every rank must run exactly these
        self.rank_timeout_ms = rank_timeout_s * 1000
        self.incarnations: dict[int, str] = {}
        self.retired: set[str] = set()
        self.vocab_size = 0
        self.packs: dict[int, bool] = {}  # rank -> it runs packed prefill launches
        self.mixes: dict[int, bool] = {}  # rank -> its decode rows may ride in them
        self.prefix: dict[int, bool] = {}  # rank -> its state can copy a cached prefix
        self.kv_blocks: dict[int, int] = {}  # rank -> its cache blocks (0: slots reserve)
        self.kv_marks: dict[int, int] = {}  # rank -> marks of state outside its blocks
        self._mark = client.register_script(MARK_SCRIPT)

    def poll(self) -> RankChanges:
        """Read every rank's registry entry; report ranks lost and ranks (re)joined."""
        pipe = self.client.pipeline(transaction=False)
        for rank in range(self.num_ranks):
            pipe.hgetall(self.keys.rank(self.pool, rank))
        now_ms = time.time() * 1000
        changes = RankChanges()
        for rank, raw in enumerate(pipe.execute()):
            info = hash_fields(raw)
            incarnation = _field(info, RankField.INCARNATION).decode()
            alive = (
                _field(info, RankField.STATE) == RankState.READY.value.encode()
                and now_ms - float(_field(info, RankField.HEARTBEAT_MS, b"0"))
                < self.rank_timeout_ms
            )
            known = self.incarnations.get(rank)
            if known is not None and (not alive or incarnation != known):
                self.lose(rank)
                changes.lost.append(rank)
                if not alive:
                    changes.vanished.add(rank)
                known = None
            if known is None and alive and incarnation and incarnation not in self.retired:
                why = self._shapes_differ(info)
                if why is not None:
                    self.refuse(rank, incarnation, why)
                    changes.refused.append((rank, why))
                    continue
                self.incarnations[rank] = incarnation
                self.vocab_size = int(_field(info, RankField.VOCAB_SIZE, b"0"))
                self.packs[rank] = _field(info, RankField.PACKS, b"0") == b"1"
                self.mixes[rank] = _field(info, RankField.MIXES, b"0") == b"1"
                self.prefix[rank] = _field(info, RankField.PREFIX, b"0") == b"1"
                self.kv_blocks[rank] = int(_field(info, RankField.KV_BLOCKS, b"0"))
                self.kv_marks[rank] = int(_field(info, RankField.KV_MARKS, b"0"))
                changes.joined.append(rank)
        return changes

    def _shapes_differ(self, info: dict[bytes, bytes]) -> str | None:
        """Why a rank's registered launch shapes are not the pool's, if they are not."""
        raw = _field(info, RankField.SHAPES)
        try:
            shapes = LaunchShapes.decode(raw)
        except ValueError:
            return f"it registered no launch shapes the pool can read ({raw!r})"
        differ = shapes.differences(self.shapes)
        return None if differ is None else f"its launch shapes differ from the pool's: {differ}"

    def refuse(self, rank: int, incarnation: str, why: str) -> None:
        """Never plan for this incarnation; mark it failed with the reason (it stops)."""
        self.retired.add(incarnation)
        self._set(rank, incarnation, RankState.FAILED, why)

    def lose(self, rank: int) -> None:
        """Retire a rank's current incarnation and tell it so, if it is still registered."""
        incarnation = self.incarnations.pop(rank, None)
        if incarnation is not None:
            self.retired.add(incarnation)
            self._set(rank, incarnation, RankState.LOST)

    def _set(self, rank: int, incarnation: str, state: RankState, reason: str = "") -> None:
        args = [RankField.INCARNATION, incarnation, RankField.STATE, state.value]
        args += [RankField.REASON, reason] if reason else ["", ""]
        self._mark(keys=[self.keys.rank(self.pool, rank)], args=args)

    def incarnation(self, rank: int) -> str:
        """The incarnation plans for `rank` are addressed to."""
        return self.incarnations.get(rank, "")

    @property
    def live(self) -> set[int]:
        """Ranks currently served by a known incarnation."""
        return set(self.incarnations)


def _field(info: dict[bytes, bytes], name: str, default: bytes = b"") -> bytes:
    return info.get(name.encode(), default)
