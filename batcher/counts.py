"""A pool's running counters: one struct, owned by the request book, shown on the pool's
registry hash (`npu-pool status`) and as Prometheus counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from schemas.control import StepCounts

# PoolCounts field <- (StepCounts field, scale): what a rank's step result adds.
FROM_STEP = {
    "decode_launches": ("num_decode_launches", 1),
    "padding_rows": ("num_padding_rows", 1),
    "prefill_launches": ("num_prefill_launches", 1),
    "prefill_tokens": ("num_prefill_tokens", 1),
    "mtp_proposed": ("num_draft_proposed", 1),
    "mtp_accepted": ("num_draft_accepted", 1),
    "rank_exec_us": ("exec_ms", 1000),  # ranks' model threads: in steps,
    "rank_launch_us": ("launch_ms", 1000),  # in launches,
    "rank_idle_us": ("idle_ms", 1000),  # waiting for plans,
    "rank_collective_us": ("collective_ms", 1000),  # in expert-parallel collectives
}


@dataclass(slots=True)
class PoolCounts:
    """Totals since the batcher started (they survive its epochs)."""

    steps: int = 0
    admitted: int = 0
    tokens: int = 0
    finished: int = 0
    rejected: int = 0
    dead: int = 0
    recovered: int = 0
    claimed: int = 0
    preempted: int = 0
    prefix_cache_queries: int = 0  # context tokens of admitted requests, with prefix caching on
    prefix_cache_hits: int = 0  # of which their slots held from a cached prefix
    decode_launches: int = 0
    padding_rows: int = 0
    prefill_launches: int = 0
    prefill_tokens: int = 0
    mtp_proposed: int = 0
    mtp_accepted: int = 0
    rank_exec_us: int = 0
    rank_launch_us: int = 0
    rank_idle_us: int = 0
    rank_collective_us: int = 0

    def add_step(self, counts: StepCounts) -> None:
        """Add what one rank's step did."""
        for name, (source, scale) in FROM_STEP.items():
            setattr(self, name, getattr(self, name) + int(getattr(counts, source) * scale))

    def as_dict(self) -> dict[str, int]:
        """Every counter by name, as the registry hash and the metrics name them."""
        return asdict(self)
