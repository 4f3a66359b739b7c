"""`npu-pool demo`: a pool on embedded Redis answering concurrent requests, streamed live,
then the answers and a summary. SmolLM2-135M-Instruct answers chat questions when its
package is installed (else the random tiny model continues prompts). Everything stops
cleanly at the end."""

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

from npu_pool.demo_workload import (
    DemoRequest,
    default_max_tokens,
    default_num_requests,
    demo_defaults,
    demo_model,
    demo_requests,
)
from npu_pool.embedded import DataDirInUse, EmbeddedRedis
from npu_pool.launcher import PoolProcesses
from producer.client import AsyncClient, Client
from producer.status import PoolFailed, pool_status
from producer.status_view import wait_ready_live
from schemas.config import Settings, add_settings_flags, cache_dir, settings_from_args


@dataclass(slots=True)
class Row:
    """Live state of one demo request."""

    request: DemoRequest
    submitted: float
    text: str = ""
    num_tokens: int = 0
    first_token_at: float | None = None
    done_at: float | None = None
    finish_reason: str = "queued"
    token_times: list[float] = field(default_factory=list)


def _printable(text: str, width: int) -> str:
    shown = "".join(c if c.isprintable() else "·" for c in text)
    return shown[-width:]


def _table(rows: list[Row], tail_width: int) -> Table:
    table = Table(title="npu-pool demo — live result streams", expand=True)
    table.add_column("#", justify="right")
    title = "question" if rows and rows[0].request.chat else "prompt"
    table.add_column(title, no_wrap=True, max_width=30, overflow="ellipsis")
    table.add_column("sampling", no_wrap=True)
    table.add_column("completion (tail)", no_wrap=True, ratio=1, min_width=16)
    table.add_column("tokens", justify="right")
    table.add_column("state")
    for i, row in enumerate(rows):
        state = row.finish_reason if row.done_at else ("streaming" if row.num_tokens else "queued")
        table.add_row(
            str(i),
            row.request.text,
            row.request.mode,
            _printable(row.text, tail_width),
            str(row.num_tokens),
            state,
        )
    return table


def _answers(rows: list[Row]) -> Table:
    """Each chat question with its whole answer, once every stream has ended."""
    table = Table(title="answers", expand=True, show_lines=True)
    table.add_column("#", justify="right")
    table.add_column("question", ratio=1)
    table.add_column("answer", ratio=2)
    for i, row in enumerate(rows):
        table.add_row(str(i), f"{row.request.text}\n[dim]{row.request.mode}[/]", row.text.strip())
    return table


async def _one(client: AsyncClient, row: Row, max_tokens: int) -> None:
    request = row.request
    request_id = await client.submit(
        None if request.chat else request.text,
        messages=[{"role": "user", "content": request.text}] if request.chat else None,
        max_tokens=max_tokens,
        temperature=request.temperature,
        seed=request.seed,
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
        tail_width = max(16, console.width - 76)  # what the other columns leave
        tasks = [asyncio.create_task(_one(client, row, max_tokens)) for row in rows]
        if console.is_terminal:
            with Live(_table(rows, tail_width), console=console, refresh_per_second=8) as live:
                while not all(t.done() for t in tasks):
                    live.update(_table(rows, tail_width))
                    await asyncio.sleep(0.1)
                live.update(_table(rows, tail_width))
        else:  # a file or a pipe: the table once, when every stream has ended
            await asyncio.wait(tasks)
            if not (rows and rows[0].request.chat):  # chat answers get a table of their own
                console.print(_table(rows, tail_width))
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
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"concurrent requests (default: {default_num_requests('smollm2')} for SmolLM2, "
        f"{default_num_requests('tiny')} for other models)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"most tokens per answer (default: {default_max_tokens('smollm2')} for SmolLM2, "
        f"{default_max_tokens('tiny')} for other models)",
    )
    add_settings_flags(parser)
    args = parser.parse_args(argv)
    console = Console()
    model, note = demo_model(args.model)
    if note:
        console.print(note)
    defaults = {k: v for k, v in demo_defaults(model).items() if getattr(args, k, None) is None}
    try:
        settings = settings_from_args(args, **defaults)
    except ValueError as exc:
        print(f"npu-pool demo: {exc}", file=sys.stderr)
        return 2
    num_requests = args.requests or default_num_requests(model)
    max_tokens = args.max_tokens or default_max_tokens(model)
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
        started = time.monotonic()
        rows = [Row(r, started) for r in demo_requests(model, num_requests)]
        asyncio.run(_workload(url, settings, rows, max_tokens, console))
        console.print()
        wall_s = time.monotonic() - started
        if rows and rows[0].request.chat:
            console.print(_answers(rows))
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
