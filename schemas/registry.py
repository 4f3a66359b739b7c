"""The pool registry's hash fields and states, in one place, as `keys.py` is for key names
(docs/architecture.md §5): what a rank and a batcher write on their hashes, and what the
batcher, `npu-pool status`, `up` and the gateway read there.

A rank also registers the launch shapes it runs (`LaunchShapes`); the batcher plans only
for ranks whose shapes are the pool's, and refuses the others with a one-line reason.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import Enum


class RankState(str, Enum):
    """A rank's `state` field."""

    STARTING = "starting"  # written by `up` before the process is started
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    LOST = "lost"  # the batcher retired this incarnation (it was hung or lost Redis)
    FAILED = "failed"  # cannot start, or refused by the batcher: `reason` says why
    STOPPED = "stopped"


class BatcherState(str, Enum):
    """A pool's `state` field: its batcher's."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


# States in which a process no longer beats: a stale heartbeat there is not "unresponsive".
RESTING_STATES = (RankState.STOPPED.value, RankState.FAILED.value)
# States of a rank that is on its way up.
STARTING_STATES = (RankState.STARTING.value, RankState.LOADING.value, RankState.WARMING.value)


class RankField:
    """Fields of a rank's hash, `{ns}:pool:{pool}:rank:{r}`."""

    RANK = "rank"
    PID = "pid"
    HOST = "host"
    DEVICE = "device"
    DTYPE = "dtype"
    MODEL = "model"
    STATE = "state"
    REASON = "reason"  # why a rank is `failed`
    INCARNATION = "incarnation"
    HEARTBEAT_MS = "hb_ms"
    REQUESTS = "requests"  # ids of the requests it holds, comma-separated (for operators)
    VOCAB_SIZE = "vocab_size"
    PACKS = "packs"  # "1": it runs packed prefill launches
    MIXES = "mixes"  # "1": its decode rows may ride in packed prefill launches (same bits)
    PREFIX = "prefix"  # "1": its model state can copy a cached prefix between slots
    SHAPES = "shapes"  # LaunchShapes as JSON
    KV_BLOCKS = "kv_blocks"  # cache blocks it holds (0: a slot reserves every position)
    KV_MARKS = "kv_marks"  # copies of a slot's state outside blocks it keeps for prefixes
    PROGRESS = "progress"  # what a starting rank is doing, with done / total steps
    PROGRESS_DONE = "progress_done"
    PROGRESS_TOTAL = "progress_total"
    WEIGHT_BYTES = "weight_bytes"  # the model's weights as they sit on the device
    CHECKPOINT_BYTES = "checkpoint_bytes"  # the same tensors as the checkpoint stores them


class PoolField:
    """Fields of a pool's hash, `{ns}:pool:{pool}:info`, besides its counters."""

    STATE = "state"
    HEARTBEAT_MS = "hb_ms"
    EPOCH = "epoch"
    BATCHER_PID = "batcher_pid"
    BATCHER_HOST = "batcher_host"
    RANKS = "ranks"
    MODEL = "model"
    MAX_MODEL_LEN = "max_model_len"
    STARTED_MS = "started_ms"
    RUNNING = "running"
    WAITING = "waiting"
    PLANNED = "planned"  # the ranks its planner plans for, comma-separated
    KV_BLOCKS_TOTAL = "kv_blocks_total"  # cache blocks over its ranks' slots
    KV_BLOCKS_USED = "kv_blocks_used"  # of which its running requests' tokens fill
    CACHED_BLOCKS = "cached_blocks"  # distinct prefix blocks its slots hold for reuse


@dataclass(frozen=True, slots=True)
class LaunchShapes:
    """The fixed shapes a rank runs, and the model it runs them on, which the pool's
    planner must plan for exactly."""

    decode_batch: int  # rows per decode launch (B of BxS1, or of BxS2 with MTP)
    prefill_chunk: int  # tokens per prefill launch (S of B1xS)
    prefill_segments: int  # requests in one packed prefill launch, at most
    num_slots: int  # KV slots
    max_kv_len: int  # KV positions per slot
    mtp: bool  # decode launches verify drafts (BxS2)
    expert_parallel: bool = False  # launches run the experts' collectives with every rank
    model: str = ""  # the `--model` the rank serves, as given
    # a cache of blocks: positions a block, and the bytes of them a rank holds (0: a slot
    # reserves every position)
    block_size: int = 0
    kv_cache_memory: int = 0
    kv_cache_fraction: float = 0.0  # or this share of the free memory, once weights load
    ranks_sharing: int = 0  # the pool's ranks, which share a CPU's memory

    def encode(self) -> str:
        """The `shapes` field of a rank's hash."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> LaunchShapes:
        """Parse a `shapes` field; raises ValueError when it is not one."""
        try:
            fields = json.loads(raw)
            return cls(**{name: fields[name] for name in cls.__dataclass_fields__})
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"not a launch-shapes record: {raw!r}") from exc

    def differences(self, pool: LaunchShapes) -> str | None:
        """None when these are `pool`'s shapes, else one line naming each that differs."""
        differ = [
            f"{name} {getattr(self, name)} (pool: {getattr(pool, name)})"
            for name in self.__dataclass_fields__
            if getattr(self, name) != getattr(pool, name)
        ]
        return ", ".join(differ) if differ else None
