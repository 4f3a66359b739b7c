"""Progress of a rank's long start-up work (building a preset model, warm-up / graph
capture), published on its rank hash so `npu-pool up`, `demo` and `status` can show it."""

from __future__ import annotations

from collections.abc import Callable

import redis

from schemas.registry import RankField

# (what is being done, steps done, steps in all)
ReportProgress = Callable[[str, int, int], None]


def no_progress(what: str, done: int, total: int) -> None:
    """A ReportProgress that reports nothing."""


def rank_hash_reporter(client: redis.Redis, rank_key: str) -> ReportProgress:
    """A ReportProgress writing `progress`, `progress_done`, `progress_total` on a rank hash."""

    def report(what: str, done: int, total: int) -> None:
        client.hset(
            rank_key,
            mapping={
                RankField.PROGRESS: what,
                RankField.PROGRESS_DONE: done,
                RankField.PROGRESS_TOTAL: total,
            },
        )

    return report
