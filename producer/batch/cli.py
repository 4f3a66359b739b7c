"""`npu-pool batch submit|worker|status|result`: offline batch jobs through RQ.

    npu-pool batch submit in.jsonl --out out.jsonl [--window 32]   prints the batch id
    npu-pool batch worker [--burst]                                 an RQ worker for batches
    npu-pool batch status ID [--watch | --json]                     a progress bar
    npu-pool batch result ID                                        where the output is

Each input line is a JSON object of `npu-pool submit` fields: `prompt` or `prompt_token_ids`,
sampling fields (`max_tokens`, `temperature`, ...), `priority`, `metadata`, and an optional
`custom_id` echoed on its output line; blank lines are skipped. Each output line is
`{"line": N, "custom_id"?, "id", "text", "token_ids", "finish_reason", "usage", "error"}`, in
input order, N being the request's line number in the input counted from 1 (as errors count
them). Paths are resolved where `submit` runs and read or written where the batch worker
runs: give them a shared filesystem.

Redis: --redis-url, else REDIS_URL, else the running `npu-pool up` on this machine.

A plain RQ worker serves batches too:
    rq worker --url "$REDIS_URL" --serializer rq.serializers.JSONSerializer npupool-batch
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from pathlib import Path

import redis
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rq import SimpleWorker

from producer.batch.jobs import BatchError, BatchInfo, hand_back_lapsed, queue_of, submit
from producer.client import Client
from schemas.connection import connect
from schemas.keys import Keys

log = logging.getLogger("npu_pool.batch")

SWEEP_S = 1.0
TERMINAL = ("finished", "failed")


def work(client: Client, burst: bool) -> None:
    """Run batch jobs in this process (an RQ `SimpleWorker`: the job is I/O-bound and needs no
    isolation); a thread hands back, every second, batches whose worker died."""
    queue = queue_of(client.redis, client.keys)
    for batch_id in hand_back_lapsed(client.redis, client.keys):
        log.info("batch %s handed back to the queue", batch_id)
    stop = threading.Event()
    sweeper = threading.Thread(
        target=_sweep, args=(connect(client.url), client.keys, stop), daemon=True
    )
    sweeper.start()
    try:
        worker = SimpleWorker([queue], connection=client.redis, serializer=queue.serializer)
        worker.work(burst=burst, logging_level="INFO", with_scheduler=False)
    finally:
        stop.set()


def _sweep(connection: redis.Redis, keys: Keys, stop: threading.Event) -> None:
    while not stop.wait(SWEEP_S):
        try:
            for batch_id in hand_back_lapsed(connection, keys):
                log.info("batch %s: its worker died; handed back to the queue", batch_id)
        except redis.RedisError as exc:
            log.warning("batch sweep failed (%s); retrying", exc)


def status(client: Client, batch_id: str, watch: bool, as_json: bool) -> int:
    """Print a batch's progress (live with `watch`, until it ends)."""
    info = BatchInfo.read(client.redis, client.keys, batch_id)
    if info is None:
        print(f"npu-pool batch: no batch {batch_id}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps({"batch": batch_id, **vars(info)}))
        return 0
    progress = Progress(
        TextColumn("batch {task.fields[batch]} [bold]{task.fields[state]}"),
        BarColumn(),
        MofNCompleteColumn(),
    )
    task = progress.add_task("", total=info.total, completed=info.done, batch=batch_id, state="")
    console = Console()
    if not watch:
        progress.update(task, state=info.state)
        console.print(progress.make_tasks_table(progress.tasks))
    else:
        with Live(progress, console=console, refresh_per_second=4):
            while True:
                progress.update(task, completed=info.done, state=info.state)
                if info.state in TERMINAL:
                    break
                time.sleep(0.25)
                info = BatchInfo.read(client.redis, client.keys, batch_id) or info
    console.print(f"output: {info.output}", soft_wrap=True, highlight=False)
    if info.error:
        console.print(f"error: {info.error}", style="red", soft_wrap=True, highlight=False)
    return 0 if info.state != "failed" else 1


def result(client: Client, batch_id: str) -> int:
    """Print where a batch's output is; exit 3 while it is not finished."""
    info = BatchInfo.read(client.redis, client.keys, batch_id)
    if info is None:
        print(f"npu-pool batch: no batch {batch_id}", file=sys.stderr)
        return 1
    print(info.output)
    if info.state != "finished":
        print(
            f"npu-pool batch: {batch_id} is {info.state} ({info.done}/{info.total})",
            file=sys.stderr,
        )
        return 3
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Flags of `npu-pool batch`; `--redis-url` and `--namespace` go before or after the
    subcommand."""
    parser = argparse.ArgumentParser(
        prog="npu-pool batch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _connection_flags(parser, argparse.SUPPRESS)
    connection = argparse.ArgumentParser(add_help=False)
    _connection_flags(connection, argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help_text, parents=[connection])

    sub = command("submit", "check a JSONL file of requests and enqueue it; prints the batch id")
    sub.add_argument("input", type=Path, help="JSONL file, one request per line")
    sub.add_argument("--out", type=Path, required=True, help="JSONL output (must not exist)")
    sub.add_argument("--window", type=int, default=32, help="requests in the pool at once")
    sub.add_argument(
        "--tenant", default="default", help="the tenant its requests queue for (default: default)"
    )
    sub.add_argument("--job-timeout", type=int, default=24 * 3600, help="RQ job timeout, s")
    sub.add_argument("--retries", type=int, default=3, help="RQ retries of a run that raises")
    worker = command("worker", "run an RQ worker for batch jobs")
    worker.add_argument("--burst", action="store_true", help="exit once the queue is empty")
    show = command("status", "a batch's progress")
    show.add_argument("batch_id", help="the id `batch submit` printed")
    show.add_argument("--watch", action="store_true", help="follow it live until it ends")
    show.add_argument("--json", action="store_true", help="the batch record as JSON")
    done = command("result", "where a batch's output is; exit 3 while it is not finished")
    done.add_argument("batch_id", help="the id `batch submit` printed")
    return parser


def _connection_flags(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--redis-url",
        default=default,
        help="default: REDIS_URL, else the running `npu-pool up` (`npu-pool status --url`)",
    )
    parser.add_argument(
        "--namespace", default=default, help="prefix of the pool's Redis keys (default: npupool)"
    )


def main(argv: list[str]) -> int:
    """`npu-pool batch ...`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        client = Client(getattr(args, "redis_url", None), getattr(args, "namespace", None))
        client.redis.ping()
    except (ConnectionError, redis.RedisError) as exc:
        print(f"npu-pool batch: cannot reach Redis: {exc}", file=sys.stderr)
        return 1
    if args.command == "submit":
        try:
            batch_id = submit(
                client,
                args.input,
                args.out,
                args.window,
                args.job_timeout,
                args.retries,
                args.tenant,
            )
        except BatchError as exc:
            print(f"npu-pool batch: {args.input}: {exc}", file=sys.stderr)
            return 2
        print(batch_id)
        return 0
    if args.command == "worker":
        work(client, burst=args.burst)
        return 0
    if args.command == "status":
        return status(client, args.batch_id, args.watch, args.json)
    return result(client, args.batch_id)
