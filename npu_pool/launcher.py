"""`npu-pool up`: embedded Redis when no URL is given, a batcher and one worker per rank,
each a separate process, restarted with backoff if one dies."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rich.console import Console

from npu_pool.embedded import DataDirInUse, EmbeddedRedis
from npu_pool.extras import require
from producer.status import PoolFailed, ready_pool
from schemas.config import EXIT_FAILED, Settings, add_settings_flags, settings_from_args
from schemas.connection import connect
from schemas.keys import Keys
from schemas.registry import RankField, RankState

log = logging.getLogger("npu_pool.up")
MAX_BACKOFF_S = 30.0
EXIT_USAGE = 2  # argparse's exit status for a bad flag or setting
HEALTHY_AFTER_S = 30.0


@dataclass(slots=True)
class Child:
    """One supervised service process."""

    name: str
    args: list[str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    log_file: IO[bytes] | None = field(default=None, repr=False)
    failed: bool = False  # exited saying a restart cannot help


class PoolProcesses:
    """Starts, supervises and stops the batcher and worker processes of one pool."""

    def __init__(self, settings: Settings, redis_url: str, log_dir: Path | None = None) -> None:
        self.settings = settings
        self.env = dict(os.environ, REDIS_URL=redis_url, NPUPOOL_REDIS_URL=redis_url)
        self.log_dir = log_dir
        flags = settings.service_args()
        command = [sys.executable, "-m", "npu_pool.cli"]
        self.children = [Child("batcher", [*command, "batcher", *flags])]
        self.children += [
            Child(f"rank{r}", [*command, "worker", "--rank", str(r), *flags])
            for r in range(settings.ranks)
        ]

    def start(self) -> None:
        """Start every child process (they need the `worker` extra installed here), first
        forgetting what earlier processes left in the ranks' registry: a `failed` from an
        earlier run must not read as this run's."""
        require("worker")
        client = connect(self.env["REDIS_URL"])
        try:
            keys = Keys(self.settings.namespace)
            now_ms = int(time.time() * 1000)
            pipe = client.pipeline(transaction=False)
            for rank in range(self.settings.ranks):
                key = keys.rank(self.settings.pool, rank)
                pipe.hdel(
                    key,
                    RankField.REASON,
                    RankField.PROGRESS,
                    RankField.PROGRESS_DONE,
                    RankField.PROGRESS_TOTAL,
                )
                pipe.hset(
                    key,
                    mapping={
                        RankField.STATE: RankState.STARTING.value,
                        RankField.HEARTBEAT_MS: now_ms,
                    },
                )
            pipe.execute()
        finally:
            client.close()
        for child in self.children:
            self._spawn(child)

    def _spawn(self, child: Child) -> None:
        output: int | IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            if child.log_file is None:
                child.log_file = open(self.log_dir / f"{child.name}.log", "ab")  # noqa: SIM115
            output = child.log_file
        child.started_at = time.monotonic()
        child.process = subprocess.Popen(
            child.args,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
        )

    def supervise(self) -> None:
        """Restart any child that exited, with exponential backoff; a child that exited saying
        a restart cannot help (a bad flag, a model that cannot load) is left down."""
        now = time.monotonic()
        for child in self.children:
            if child.process is None or child.process.poll() is None or child.failed:
                continue
            if child.process.returncode in (EXIT_FAILED, EXIT_USAGE):
                child.failed = True
                log.error("%s cannot start (see its log or `npu-pool status`)", child.name)
                continue
            if child.next_start == 0.0:
                if now - child.started_at > HEALTHY_AFTER_S:
                    child.restarts = 0  # it ran well: a new failure starts the backoff over
                delay = min(MAX_BACKOFF_S, 0.5 * 2**child.restarts)
                child.next_start = now + delay
                log.warning(
                    "%s exited with %s; restarting in %.1fs",
                    child.name,
                    child.process.returncode,
                    delay,
                )
            elif now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                self._spawn(child)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the batcher (it drains while the ranks still run), then the ranks."""
        deadline = time.monotonic() + timeout_s
        for group in (self.children[:1], self.children[1:]):
            live = [c.process for c in group if c.process and c.process.poll() is None]
            for process in live:
                process.send_signal(signal.SIGTERM)
            for process in live:
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        for child in self.children:
            if child.log_file is not None:
                child.log_file.close()
                child.log_file = None

    @property
    def failed(self) -> list[str]:
        """Children that cannot start and are not restarted."""
        return [c.name for c in self.children if c.failed]

    def kill(self, name: str) -> int:
        """SIGKILL one child (`batcher` or `rank{R}`), as a crash would; returns its pid."""
        child = next(c for c in self.children if c.name == name)
        if child.process is None or child.process.poll() is not None:
            raise RuntimeError(f"{name} is not running")
        child.process.kill()
        child.process.wait()
        return child.process.pid


def up_main(argv: list[str]) -> int:
    """`npu-pool up`: run a whole pool in the foreground until Ctrl-C."""
    parser = argparse.ArgumentParser(prog="npu-pool up", description=__doc__)
    add_settings_flags(parser)
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"npu-pool up: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s up %(message)s")
    embedded = None
    redis_url = settings.redis_url
    if not redis_url:
        embedded = EmbeddedRedis()
        try:
            redis_url = embedded.start()
        except DataDirInUse as exc:
            print(f"npu-pool up: {exc}", file=sys.stderr)
            return 1
        embedded.record()
        log.info("embedded Redis at %s (data in %s)", redis_url, embedded.data_dir)
    stopping = False

    def request_stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    processes = PoolProcesses(settings, redis_url)
    try:
        processes.start()
        log.info(
            "pool %s: batcher + %d ranks started (model %s)",
            settings.pool,
            settings.ranks,
            settings.model,
        )
        _show_start_up(settings, redis_url, processes, lambda: stopping)
        while not stopping:
            processes.supervise()
            if processes.failed:
                print(f"npu-pool up: {failure_reason(redis_url, settings)}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        log.info("stopping")
    except PoolFailed as exc:
        print(f"npu-pool up: {exc}", file=sys.stderr)
        return 1
    finally:
        processes.stop(timeout_s=settings.drain_timeout_s + 5)
        if embedded is not None:
            embedded.stop()
    return 0


def failure_reason(redis_url: str, settings: Settings) -> str:
    """Why a pool's processes cannot start, as its ranks reported it."""
    client = connect(redis_url)
    try:
        ready_pool(client, Keys(settings.namespace), settings.pool)
    except PoolFailed as exc:
        return str(exc)
    finally:
        client.close()
    return f"pool {settings.pool}: a service cannot start; see its log"


def _show_start_up(
    settings: Settings, redis_url: str, processes: PoolProcesses, stopping: Callable[[], bool]
) -> None:
    """Progress bars of the ranks' start-up on a terminal; supervising all the while."""
    from producer.status_view import wait_ready_live

    console = Console(stderr=True)
    if not console.is_terminal:
        return
    client = connect(redis_url)

    def tick() -> None:
        processes.supervise()
        if stopping():
            raise KeyboardInterrupt

    try:
        wait_ready_live(client, Keys(settings.namespace), settings.pool, console, 3600, tick)
        log.info("pool %s ready", settings.pool)
    except (KeyboardInterrupt, TimeoutError):
        pass
    finally:
        client.close()
