"""The rich rendering of `npu-pool status`: once, or live with `--watch`."""

from __future__ import annotations

import time
from typing import Any

import redis
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from producer.status import collect_status
from schemas.keys import Keys


def render(status: dict[str, Any], rates: dict[str, float] | None = None) -> RenderableType:
    """Queue line, then per pool: ranks table and counters (tokens/s when known)."""
    queue = status["queue"]
    parts: list[RenderableType] = [
        Text(
            f"queue: {queue['outstanding']} outstanding, {queue['in_progress']} in progress, "
            f"{queue['dead']} dead letters"
        )
    ]
    for pool in status["pools"]:
        table = Table(
            title=f"pool {pool['pool']} — {pool['state']} (batcher pid "
            f"{pool['batcher']['pid']} on {pool['batcher']['host']})"
        )
        for column in ("rank", "pid", "host", "device", "state"):
            table.add_column(column)
        for rank in pool["ranks"]:
            table.add_row(*(str(rank[c]) for c in ("rank", "pid", "host", "device", "state")))
        parts.append(table)
        line = (
            f"  running {pool['running']}, waiting {pool['waiting']}, steps {pool['steps']}, "
            f"tokens {pool['tokens']}, finished {pool['finished']}, "
            f"rejected {pool['rejected']}"
        )
        if rates is not None and pool["pool"] in rates:
            line += f", {rates[pool['pool']]:.0f} tokens/s"
        parts.append(Text(line))
        mtp = pool["mtp"]
        if mtp["proposed"]:
            parts.append(
                Text(
                    f"  MTP: {mtp['accepted']}/{mtp['proposed']} drafts accepted "
                    f"({mtp['acceptance']:.1%}), {mtp['tokens_per_row']:.2f} tokens per verify row"
                )
            )
    return Group(*parts)


def watch(client: redis.Redis, keys: Keys, interval_s: float = 1.0) -> None:
    """Refresh the view every `interval_s` until Ctrl-C, with tokens/s per pool."""
    last: dict[str, tuple[float, int]] = {}
    with Live(console=Console(), auto_refresh=False) as live:
        try:
            while True:
                status = collect_status(client, keys)
                now = time.monotonic()
                rates = {}
                for pool in status["pools"]:
                    before = last.get(pool["pool"])
                    if before is not None and now > before[0]:
                        rates[pool["pool"]] = (pool["tokens"] - before[1]) / (now - before[0])
                    last[pool["pool"]] = (now, pool["tokens"])
                live.update(render(status, rates), refresh=True)
                time.sleep(interval_s)
        except KeyboardInterrupt:
            pass
