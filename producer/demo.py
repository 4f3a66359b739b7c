"""`npu-pool demo`: a pool on embedded Redis with the tiny model, concurrent requests streamed
live, then a summary. Everything stops cleanly at the end."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from producer.client import AsyncClient, Client
from producer.embedded import DataDirInUse, EmbeddedRedis
from producer.launcher import PoolProcesses
from producer.status import PoolFailed, pool_status
from producer.status_view import wait_ready_live
from schemas.config import Settings, add_settings_flags, cache_dir, settings_from_args

PROMPTS = [
    "Once upon a time",
    "The queue said",
    "Hello, world!",
    "def add(a, b):",
    "Redis streams are",
    "A small model",
    "Decode first, then",
    "Every request gets",
    "In the beginning",
    "The batcher plans",
    "Fixed shapes keep",
    "Tokens flow out",
    "Größe und café",
    "東京 is",
    "Nothing accepted is",
    "The final chunk",
]


@dataclass(slots=True)
class Row:
    """Live state of one demo request."""

    prompt: str
    submitted: float
    text: str = ""
    num_tokens: int = 0
    first_token_at: float | None = None
    done_at: float | None = None
    finish_reason: str = "queued"
    token_times: list[float] = field(default_factory=list)


def _printable(text: str, width: int = 48) -> str:
    shown = "".join(c if c.isprintable() else "·" for c in text)
    return shown[-width:]


def _table(rows: list[Row]) -> Table:
    table = Table(title="npu-pool demo — live result streams", expand=True)
    table.add_column("#", justify="right")
    table.add_column("prompt", no_wrap=True)
    table.add_column("completion (tail)", no_wrap=True, ratio=1)
    table.add_column("tokens", justify="right")
    table.add_column("state")
    for i, row in enumerate(rows):
        state = row.finish_reason if row.done_at else ("streaming" if row.num_tokens else "queued")
        table.add_row(str(i), row.prompt, _printable(row.text), str(row.num_tokens), state)
    return table


async def _one(
    client: AsyncClient, row: Row, max_tokens: int, temperature: float, seed: int
) -> None:
    request_id = await client.submit(
        row.prompt, max_tokens=max_tokens, temperature=temperature, seed=seed
    )
    async for chunk in client.stream(request_id, timeout_s=300):
        now = time.monotonic()
        if chunk.token_ids and row.first_token_at is None:
            row.first_token_at = now
        row.token_times += [now] * len(chunk.token_ids)
        row.num_tokens += len(chunk.token_ids)
        row.text += chunk.text
        if chunk.finish_reason is not None:
            row.finish_reason = str(chunk.finish_reason)
            row.done_at = now


async def _workload(
    url: str, settings: Settings, rows: list[Row], max_tokens: int, console: Console
) -> None:
    client = AsyncClient(url, settings.namespace)
    try:
        with Live(_table(rows), console=console, refresh_per_second=8) as live:
            tasks = [
                asyncio.create_task(_one(client, row, max_tokens, 0.8 if i % 2 else 0.0, i))
                for i, row in enumerate(rows)
            ]
            while not all(t.done() for t in tasks):
                live.update(_table(rows))
                await asyncio.sleep(0.1)
            live.update(_table(rows))
            for task in tasks:
                task.result()
    finally:
        await client.close()


def _pool_stats(url: str, settings: Settings, num_requests: int) -> dict[str, Any]:
    """The pool's counters once they include every demo request (they flush each second)."""
    with Client(url, settings.namespace) as client:
        deadline = time.monotonic() + 3 * settings.heartbeat_s
        while True:
            status = pool_status(client.redis, client.keys, settings.pool, 0)
            if status["finished"] >= num_requests or time.monotonic() > deadline:
                return status
            time.sleep(0.1)


def _summary(rows: list[Row], wall_s: float, settings: Settings, pool: dict[str, Any]) -> Table:
    tokens = sum(r.num_tokens for r in rows)
    ttft = sorted((r.first_token_at - r.submitted) * 1000 for r in rows if r.first_token_at)
    gaps = [(b - a) * 1000 for r in rows for a, b in zip(r.token_times, r.token_times[1:])]
    reasons: dict[str, int] = {}
    for r in rows:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    table = Table(title="summary", show_header=False)
    mode = (
        f"MTP verify B{settings.decode_batch}S2"
        if settings.mtp
        else (f"decode B{settings.decode_batch}S1")
    )
    table.add_row(
        "pool",
        f"{settings.ranks} ranks, {mode}, "
        f"prefill B1S{settings.prefill_chunk}, model {settings.model}",
    )
    table.add_row("requests", f"{len(rows)} ({', '.join(f'{k} {v}' for k, v in reasons.items())})")
    table.add_row("completion tokens", str(tokens))
    table.add_row("wall time", f"{wall_s:.2f} s")
    table.add_row("throughput", f"{tokens / wall_s:.1f} tokens/s")
    if ttft:
        table.add_row("TTFT p50 / max", f"{statistics.median(ttft):.0f} / {ttft[-1]:.0f} ms")
    if gaps:
        table.add_row("inter-token p50", f"{statistics.median(gaps):.1f} ms")
    mtp = pool["mtp"]
    if mtp["proposed"]:
        per_launch = (mtp["proposed"] + mtp["accepted"]) / max(1, pool["decode_launches"])
        table.add_row(
            "MTP acceptance",
            f"{mtp['acceptance']:.1%} ({mtp['accepted']}/{mtp['proposed']} drafts)",
        )
        table.add_row(
            "tokens per verify", f"{mtp['tokens_per_row']:.2f} per row, {per_launch:.2f} per launch"
        )
    return table


def main(argv: list[str]) -> int:
    """Run the demo; exit 0 when every request ended normally."""
    parser = argparse.ArgumentParser(prog="npu-pool demo", description=__doc__)
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=48)
    add_settings_flags(parser)
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args, **_demo_defaults(args))
    except ValueError as exc:
        print(f"npu-pool demo: {exc}", file=sys.stderr)
        return 2
    console = Console()
    workdir = cache_dir() / "demo"
    embedded = None if settings.redis_url else EmbeddedRedis(data_dir=workdir / "redis")
    processes: PoolProcesses | None = None
    try:
        with console.status("starting embedded Redis and the pool"):
            url = embedded.start() if embedded else str(settings.redis_url)
            processes = PoolProcesses(settings, url, log_dir=workdir / "logs")
            processes.start()
        with Client(url, settings.namespace) as client:
            wait_ready_live(
                client.redis, client.keys, settings.pool, console, 300, processes.supervise
            )
        console.print(f"pool [bold]{settings.pool}[/] ready on {url} (logs in {workdir / 'logs'})")
        rows = [Row(PROMPTS[i % len(PROMPTS)], time.monotonic()) for i in range(args.requests)]
        started = time.monotonic()
        for row in rows:
            row.submitted = started
        asyncio.run(_workload(url, settings, rows, args.max_tokens, console))
        console.print()
        wall_s = time.monotonic() - started
        console.print(_summary(rows, wall_s, settings, _pool_stats(url, settings, len(rows))))
        ok = all(r.finish_reason in ("stop", "length") for r in rows)
    except (PoolFailed, DataDirInUse) as exc:
        console.print(f"[red]npu-pool demo: {exc}[/]")
        return 1
    finally:
        with console.status("shutting down"):
            if processes is not None:
                processes.stop(timeout_s=30)
            if embedded is not None:
                embedded.stop()
    return 0 if ok else 1


def _demo_defaults(args: argparse.Namespace) -> dict[str, object]:
    """The demo's own defaults, for settings not given as flags."""
    defaults: dict[str, object] = {"ranks": 2, "pool": "demo", "mtp": True, "decode_batch": 4}
    return {k: v for k, v in defaults.items() if getattr(args, k, None) is None}
