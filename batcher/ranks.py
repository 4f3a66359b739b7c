"""Tracking a pool's ranks: which process (incarnation) serves each rank, and when one is lost.

A rank is live while its registry hash says `ready` with a fresh heartbeat under the
incarnation the batcher knows. A rank that goes stale, stops, or comes back as a new
process is lost: its requests move, and its old incarnation is marked `lost` so that a
process that was only hung fences itself off and registers anew.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from schemas.connection import hash_fields
from schemas.keys import Keys

# Mark an incarnation lost only if it is still the registered one (a new process may have
# registered in the meantime, and must not be overwritten).
MARK_LOST_SCRIPT = """
if redis.call('HGET', KEYS[1], 'incarnation') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'state', 'lost')
  return 1
end
return 0
"""


@dataclass(slots=True)
class RankChanges:
    """What one poll of the registry found."""

    lost: list[int] = field(default_factory=list)
    joined: list[int] = field(default_factory=list)


class RankRegistry:
    """The batcher's view of its ranks' incarnations."""

    def __init__(
        self, client: redis.Redis, keys: Keys, pool: str, num_ranks: int, rank_timeout_s: float
    ) -> None:
        self.client = client
        self.keys = keys
        self.pool = pool
        self.num_ranks = num_ranks
        self.rank_timeout_ms = rank_timeout_s * 1000
        self.incarnations: dict[int, str] = {}
        self.retired: set[str] = set()
        self.vocab_size = 0
        self.packs: dict[int, bool] = {}  # rank -> it runs packed prefill launches
        self._mark_lost = client.register_script(MARK_LOST_SCRIPT)

    def poll(self) -> RankChanges:
        """Read every rank's registry entry; report ranks lost and ranks (re)joined."""
        pipe = self.client.pipeline(transaction=False)
        for rank in range(self.num_ranks):
            pipe.hgetall(self.keys.rank(self.pool, rank))
        now_ms = time.time() * 1000
        changes = RankChanges()
        for rank, raw in enumerate(pipe.execute()):
            info = hash_fields(raw)
            incarnation = info.get(b"incarnation", b"").decode()
            alive = (
                info.get(b"state") == b"ready"
                and now_ms - float(info.get(b"hb_ms", 0)) < self.rank_timeout_ms
            )
            known = self.incarnations.get(rank)
            if known is not None and (not alive or incarnation != known):
                self.lose(rank)
                changes.lost.append(rank)
                known = None
            if known is None and alive and incarnation and incarnation not in self.retired:
                self.incarnations[rank] = incarnation
                self.vocab_size = int(info.get(b"vocab_size", 0))
                self.packs[rank] = info.get(b"packs", b"0") == b"1"
                changes.joined.append(rank)
        return changes

    def lose(self, rank: int) -> None:
        """Retire a rank's current incarnation and tell it so, if it is still registered."""
        incarnation = self.incarnations.pop(rank, None)
        if incarnation is not None:
            self.retired.add(incarnation)
            self._mark_lost(keys=[self.keys.rank(self.pool, rank)], args=[incarnation])

    def incarnation(self, rank: int) -> str:
        """The incarnation plans for `rank` are addressed to."""
        return self.incarnations.get(rank, "")

    @property
    def live(self) -> set[int]:
        """Ranks currently served by a known incarnation."""
        return set(self.incarnations)
