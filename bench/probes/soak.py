"""Soak: thousands of requests of mixed priorities with random cancels and a worker kill
every minute, or (`--failover-every`) a replicated Redis whose primary is killed or paused
every so often.

Reports requests submitted, completed, cancelled, lost (must be 0) and duplicated tokens
(must be 0), after checking every result stream's chunks; and memory: each worker's RSS
after warm-up and at the end, and Redis's used memory before, at the end, and once the
result streams have expired (when `--result-ttl` is at most 600 s). With failovers, each
one's time from the failure to the first step the pool published on the new primary. Not
part of CI:

    python -m bench.probes.soak --requests 3000 --kill-every 60 --json bench/out/soak.json
    python -m bench.probes.soak --requests 10000 --kill-every 0 --result-ttl 20   # memory soak
    python -m bench.probes.soak --requests 10000 --kill-every 0 --failover-every 60 --failovers 3
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import cast

from npu_pool.embedded import EmbeddedRedis
from npu_pool.launcher import PoolProcesses
from npu_pool.replicated import SentinelDeployment
from producer.client import Client
from producer.requests import retried
from producer.status import pool_status, queue_depths
from schemas.codec import decode
from schemas.config import Settings
from schemas.connection import Entry
from schemas.keys import Keys
from schemas.messages import ResultChunk

MAX_EXPIRY_WAIT_S = 600


class Failovers:
    """A replicated Redis whose primary is killed or paused every `every_s` seconds, up to
    `limit` times, timing each failure to the first step published after it."""

    def __init__(self, root: Path, every_s: float, limit: int, kind: str) -> None:
        self.deployment = SentinelDeployment(root)
        self.every_s, self.limit, self.kind = every_s, limit, kind
        self.recoveries_s: list[float | None] = []
        self.last = time.monotonic()
        self.thread: threading.Thread | None = None

    def start(self) -> str:
        self.deployment.root.mkdir(parents=True, exist_ok=True)
        self.deployment.start()
        return self.deployment.url

    def maybe_inflict(self, client: Client, steps_key: str) -> None:
        """Start the next failure on a thread of its own when one is due."""
        if self.thread is not None and self.thread.is_alive():
            return
        started = len(self.recoveries_s) + (self.thread is not None and self.thread.is_alive())
        if started < self.limit and time.monotonic() - self.last >= self.every_s:
            self.thread = threading.Thread(target=self.inflict, args=(client, steps_key))
            self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def inflict(self, client: Client, steps_key: str) -> None:
        """Fail the primary now; time it to the first step result written after it (read
        while the failure runs its course: the steps stream is trimmed)."""
        self.deployment.failed_at_ms = 0.0
        first: list[float] = []
        watcher = threading.Thread(target=self._watch, args=(client, steps_key, first))
        watcher.start()
        if self.kind == "kill":
            self.deployment.kill_primary()
        else:
            self.deployment.pause_primary()
        watcher.join()
        failed_ms = self.deployment.failed_at_ms
        # None: the pool had nothing left to run
        self.recoveries_s.append(round((first[0] - failed_ms) / 1000, 2) if first else None)
        self.last = time.monotonic()

    def _watch(self, client: Client, steps_key: str, first: list[float]) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            failed_ms = self.deployment.failed_at_ms
            if failed_ms:
                after = retried(
                    functools.partial(
                        client.redis.xrange, steps_key, min=f"{int(failed_ms) + 1}", count=1
                    )
                )
                if after:  # the entry id is the server's clock
                    first.append(float(cast(list[Entry], after)[0][0].split(b"-")[0]))
                    return
            time.sleep(0.02)


def audit(client: Client, request_ids: list[str]) -> dict[str, int]:
    """Count outcomes and stream faults over every result stream."""
    counts = {
        "completed": 0,
        "cancelled": 0,
        "lost": 0,
        "duplicated_tokens": 0,
        "gaps": 0,
        "extra_finals": 0,
        "other_endings": 0,
    }
    keys = Keys()
    for request_id in request_ids:
        entries = retried(
            lambda r=request_id: cast(list[Entry], client.redis.xrange(keys.result(r)))  # type: ignore[misc]
        )
        chunks = [decode(ResultChunk, fields[b"m"]) for _, fields in entries]
        finals = [c for c in chunks if c.is_final]
        expected_index = 0
        for chunk in chunks:
            if chunk.index < expected_index:
                counts["duplicated_tokens"] += expected_index - chunk.index
            elif chunk.index > expected_index:
                counts["gaps"] += 1
            expected_index = max(expected_index, chunk.index + len(chunk.token_ids))
        if not finals:
            counts["lost"] += 1
            continue
        counts["extra_finals"] += len(finals) - 1
        reason = finals[0].finish_reason
        key = {"stop": "completed", "length": "completed", "cancelled": "cancelled"}
        counts[key.get(str(reason), "other_endings")] += 1
    return counts


def outstanding(client: Client) -> int:
    """Requests queued or running, over every priority class."""
    return retried(
        lambda: sum(depth for depth, _ in queue_depths(client.redis, client.keys).values())
    )


def _worker_rss(processes: PoolProcesses) -> dict[str, int]:
    """Resident memory of each live worker process, in MiB (from /proc)."""
    rss = {}
    for child in processes.children[1:]:
        if child.process is None or child.process.poll() is not None:
            continue
        for line in Path(f"/proc/{child.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss[child.name] = int(line.split()[1]) // 1024
    return rss


def _redis_memory(client: Client) -> float:
    """Redis `used_memory` in MiB."""
    return round(int(retried(lambda: client.redis.info("memory"))["used_memory"]) / 2**20, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--cancel-rate", type=float, default=0.1)
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills")
    parser.add_argument(
        "--failover-every",
        type=float,
        default=0.0,
        help="seconds between failures of the primary of a replicated Redis (0: one Redis)",
    )
    parser.add_argument("--failovers", type=int, default=3, help="how many failures in all")
    parser.add_argument("--failover-kind", choices=["kill", "pause"], default="kill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-ttl", type=int, default=3600, help="result stream TTL, s")
    parser.add_argument(
        "--priorities",
        type=int,
        nargs="+",
        default=[-3, 0, 0, 0, 0, 2, 9],
        help="each request's priority is drawn from these",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="npupool-soak-"))
    failovers = None
    if args.failover_every:
        failovers = Failovers(
            workdir / "ha", args.failover_every, args.failovers, args.failover_kind
        )
        url = failovers.start()
    else:
        server = EmbeddedRedis(data_dir=workdir / "redis")
        url = server.start()
    settings = Settings(
        result_ttl_s=args.result_ttl,
        redis_url=url,
        ranks=args.ranks,
        max_num_seqs=64,
        kv_slots_per_rank=32,
        max_model_len=512,
        rank_timeout_s=3,
    )
    processes = PoolProcesses(settings, url, log_dir=workdir / "logs")
    processes.start()
    stop = threading.Event()
    kills: list[str] = []

    def supervise_and_kill() -> None:
        last_kill = time.monotonic()
        while not stop.wait(0.1):
            processes.supervise()
            if args.kill_every and time.monotonic() - last_kill >= args.kill_every:
                victim = f"rank{rng.randrange(args.ranks)}"
                try:
                    processes.kill(victim)
                    kills.append(victim)
                except RuntimeError:
                    pass
                last_kill = time.monotonic()

    threading.Thread(target=supervise_and_kill, daemon=True).start()
    client = Client(url)
    keys = Keys()
    client.wait_ready(timeout_s=300)
    steps_key = keys.step_results(settings.pool)
    redis_baseline = _redis_memory(client)
    rss_start: dict[str, int] = {}
    started = time.monotonic()
    ids: list[str] = []
    cancels = 0
    try:
        while len(ids) < args.requests:
            if failovers is not None:
                failovers.maybe_inflict(client, steps_key)
            if outstanding(client) >= args.concurrency:
                time.sleep(0.01)
                continue
            length = rng.randrange(1, 300)
            submit = functools.partial(
                client.submit,
                prompt_token_ids=[rng.randrange(2, 500) for _ in range(length)],
                max_tokens=rng.randrange(8, 96),
                priority=rng.choice(args.priorities),
                request_id=f"soak-{args.seed}-{len(ids)}",
            )
            ids.append(retried(submit))
            if len(ids) == 500:  # warmed up: every launch shape and allocator pool used
                rss_start = _worker_rss(processes)
            if rng.random() < args.cancel_rate:
                victim = rng.choice(ids[-50:])
                retried(lambda v=victim: client.cancel(v))  # type: ignore[misc]
                cancels += 1
        deadline = time.monotonic() + 600
        while outstanding(client) and time.monotonic() < deadline:
            time.sleep(0.5)
        if failovers is not None:  # a failure under way is timed to its end
            failovers.join()
        elapsed = time.monotonic() - started
        rss_end = _worker_rss(processes)
        redis_end = _redis_memory(client)
        # Streams of requests finished more than a TTL ago are gone: audit only when none are.
        counts = (
            audit(client, ids)
            if args.result_ttl > elapsed + 10
            else {"audit": "skipped: result streams expire during the run"}
        )
        redis_expired = None  # waiting out a long TTL would only idle
        if args.result_ttl <= MAX_EXPIRY_WAIT_S:
            time.sleep(args.result_ttl + 2)
            redis_expired = _redis_memory(client)
        report = {
            "submitted": len(ids),
            "cancels_sent": cancels,
            "worker_kills": len(kills),
            **(
                {
                    "failovers": len(failovers.recoveries_s),
                    "failover_kind": failovers.kind,
                    "failure_to_first_step_s": failovers.recoveries_s,
                    "dead_letters": retried(lambda: client.redis.xlen(keys.dead)),
                }
                if failovers is not None
                else {}
            ),
            "preempted": pool_status(client.redis, keys, settings.pool, 0)["preempted"],
            "seconds": round(elapsed, 1),
            **counts,
            "worker_rss_mb_after_warmup": rss_start,
            "worker_rss_mb_end": rss_end,
            "redis_used_mb": {
                "baseline": redis_baseline,
                "end": redis_end,
                "after_expiry": redis_expired,
            },
        }
    finally:
        stop.set()
        processes.stop(timeout_s=30)
        if failovers is not None:
            failovers.deployment.stop()
        else:
            server.stop()
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
