"""The rich rendering of `npu-pool status`: once, or live with `--watch`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import redis
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.table import Table
from rich.text import Text

from producer.status import collect_status, pool_status, ready_pool
from schemas.connection import redacted_url
from schemas.keys import Keys
from schemas.registry import STARTING_STATES, BatcherState, RankState


def render(
    status: dict[str, Any], rates: dict[str, float] | None = None, url: str | None = None
) -> RenderableType:
    """Redis and queue lines, then per pool: ranks table and counters (tokens/s when known)."""
    queue = status["queue"]
    classes = ", ".join(f"p{c}: {n}" for c, n in queue.get("by_priority", {}).items())
    parts: list[RenderableType] = []
    if url is not None:
        parts.append(Text(f"redis: {redacted_url(url)}"))
    parts.append(
        Text(
            f"queue: {queue['outstanding']} outstanding"
            + (f" ({classes})" if classes else "")
            + f", {queue['in_progress']} in progress, {queue['dead']} dead letters"
        )
    )
    parts += _limits_lines(status.get("limits", {}))
    parts += _tenant_table(status)
    for pool in status["pools"]:
        parts.append(
            Text(
                f"pool {pool['pool']} — {_pool_state(pool)} (batcher pid "
                f"{pool['batcher']['pid']} on {pool['batcher']['host']})",
                style="bold",
            )
        )
        table = Table()
        for column in ("rank", "pid", "host", "device", "state", "weights"):
            table.add_column(column)
        for rank in pool["ranks"]:
            cells = [str(rank[c]) for c in ("rank", "pid", "host", "device", "state")]
            progress = rank["progress"]
            if rank["state"] in STARTING_STATES and progress["total"]:
                cells[-1] += f" ({progress['what']}: {progress['done']}/{progress['total']})"
            table.add_row(*cells, _weights(rank))
        parts.append(table)
        parts += [
            Text(f"  rank {rank['rank']} failed: {rank['reason']}", style="red")
            for rank in pool["ranks"]
            if rank["state"] == RankState.FAILED.value and rank["reason"]
        ]
        line = (
            f"  running {pool['running']}, waiting {pool['waiting']}, steps {pool['steps']}, "
            f"tokens {pool['tokens']}, finished {pool['finished']}, "
            f"rejected {pool['rejected']}, preempted {pool.get('preempted', 0)}"
        )
        if rates is not None and pool["pool"] in rates:
            line += f", {rates[pool['pool']]:.0f} tokens/s"
        parts.append(Text(line))
        parts.append(Text(_cache_line(pool)))
        mtp = pool["mtp"]
        if mtp["proposed"]:
            parts.append(
                Text(
                    f"  MTP: {mtp['accepted']}/{mtp['proposed']} drafts accepted "
                    f"({mtp['acceptance']:.1%}), {mtp['tokens_per_row']:.2f} tokens per verify row"
                )
            )
    return Group(*parts)


def _cache_line(pool: dict[str, Any]) -> str:
    """Cache blocks in use and the prefix cache's reuse."""
    prefix = pool.get("prefix_cache", {})
    queried, hits = prefix.get("queried_tokens", 0), prefix.get("hit_tokens", 0)
    line = (
        f"  KV blocks {pool.get('kv_blocks_used', 0)}/{pool.get('kv_blocks_total', 0)} used, "
        f"{prefix.get('cached_blocks', 0)} prefix blocks held"
    )
    if queried:
        line += f", prompt tokens from cache {hits}/{queried} ({hits / queried:.1%})"
    return line


def _pool_state(pool: dict[str, Any]) -> str:
    """The pool's state; while it starts, how many of its ranks are ready."""
    if pool["state"] != BatcherState.STARTING.value or not pool["ranks"]:
        return str(pool["state"])
    ready = sum(r["state"] == RankState.READY.value for r in pool["ranks"])
    return f"starting, {ready}/{len(pool['ranks'])} ranks ready"


def _limits_lines(limits: dict[str, Any]) -> list[RenderableType]:
    """The bound admission applies, and a warning when the pools' own values differ."""
    if "max_queue" not in limits:
        return []
    lines: list[RenderableType] = [
        Text(
            f"limits: max_queue {limits['max_queue']}, max_request_bytes "
            f"{limits.get('max_request_bytes')}, max_model_len {limits.get('max_model_len')}"
        )
    ]
    pools = limits.get("pools", {})
    if len({json.dumps(v, sort_keys=True) for v in pools.values()}) > 1:
        each = "; ".join(f"{name}: max_queue {v.get('max_queue')}" for name, v in pools.items())
        lines.append(Text(f"  pools disagree ({each}): the strictest holds", style="yellow"))
    return lines


def _tenant_table(status: dict[str, Any]) -> list[RenderableType]:
    """Queued and running requests and `max_queue` by tenant: only when the namespace has a
    tenants file or work of tenants besides `default`."""
    queued = status["queue"].get("tenants", {})
    running: dict[str, int] = {}
    for pool in status["pools"]:
        if pool["state"] != BatcherState.STOPPED.value:
            for tenant, load in pool.get("tenants", {}).items():
                running[tenant] = running.get(tenant, 0) + int(load.get("running", 0))
    names = sorted({*queued, *running})
    if len(names) <= 1 and not status.get("limits", {}).get("tenants_required"):
        return []
    table = Table()
    for column in ("tenant", "queued", "running", "max_queue"):
        table.add_column(column)
    for name in names:
        max_queue = queued.get(name, {}).get("max_queue")
        table.add_row(
            name,
            str(queued.get(name, {}).get("queued", 0)),
            str(running.get(name, 0)),
            "-" if max_queue is None else str(max_queue),
        )
    return [table]


def watch(client: redis.Redis, keys: Keys, interval_s: float = 1.0, url: str | None = None) -> None:
    """Refresh the view every `interval_s` until Ctrl-C, with tokens/s per pool; when the
    output is not a terminal, print one plain snapshot per interval instead."""
    console = Console()
    last: dict[str, tuple[float, int]] = {}

    def snapshot() -> RenderableType:
        status = collect_status(client, keys)
        now = time.monotonic()
        rates = {}
        for pool in status["pools"]:
            before = last.get(pool["pool"])
            if before is not None and now > before[0]:
                rates[pool["pool"]] = (pool["tokens"] - before[1]) / (now - before[0])
            last[pool["pool"]] = (now, pool["tokens"])
        return render(status, rates, url)

    try:
        if not console.is_terminal:
            while True:
                console.print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}")
                console.print(snapshot())
                console.file.flush()
                time.sleep(interval_s)
        with Live(console=console, auto_refresh=False) as live:
            while True:
                live.update(snapshot(), refresh=True)
                time.sleep(interval_s)
    except KeyboardInterrupt:
        pass


def wait_ready_live(
    client: redis.Redis,
    keys: Keys,
    pool: str,
    console: Console,
    timeout_s: float,
    tick: Callable[[], None] = lambda: None,
) -> None:
    """Block until `pool` is ready, with a progress bar per rank for its start-up work
    (building a preset model, warm-up / graph capture); `tick` runs on every poll."""
    deadline = time.monotonic() + timeout_s
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        tasks: dict[int, TaskID] = {}
        while ready_pool(client, keys, pool) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"pool {pool} not ready after {timeout_s:.0f}s; see its logs")
            for rank in pool_status(client, keys, pool, int(time.time() * 1000))["ranks"]:
                shown = rank["progress"]
                what = shown["what"] or (
                    RankState.STARTING.value if rank["state"] == "unknown" else rank["state"]
                )
                if rank["rank"] not in tasks:
                    tasks[rank["rank"]] = progress.add_task("", total=None)
                progress.update(
                    tasks[rank["rank"]],
                    description=f"rank {rank['rank']}: {what}",
                    completed=shown["done"],
                    total=shown["total"] or None,
                )
            tick()
            time.sleep(0.1)


def _weights(rank: dict[str, Any]) -> str:
    """A rank's resident weight bytes, and their ratio to the checkpoint's (once loaded)."""
    held, stored = rank.get("weight_bytes", 0), rank.get("checkpoint_bytes", 0)
    if not held:
        return ""
    text = f"{held / 2**20:.1f} MiB"
    return f"{text} ({held / stored:.2f}× stored)" if stored else text
