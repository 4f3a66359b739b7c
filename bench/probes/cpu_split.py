"""Throughput of a 1-rank pool at one concurrency, and each process's share of a core.

python -m bench.probes.cpu_split --concurrency 1 --requests 40
python -m bench.probes.cpu_split --concurrency 64 --requests 320
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import tempfile
from pathlib import Path

from bench.loadgen import Workload, run_workload, summarise
from npu_pool.embedded import EmbeddedRedis
from npu_pool.launcher import PoolProcesses
from producer.client import Client
from schemas.config import Settings


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """Direct child processes of a process (a rank's output process)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--decode-batch", type=int, default=8)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="npupool-split-"))
    server = EmbeddedRedis(data_dir=workdir / "redis")
    url = server.start()
    settings = Settings(
        redis_url=url,
        ranks=1,
        pool="split",
        max_num_seqs=128,
        kv_slots_per_rank=128,
        decode_batch=args.decode_batch,
        device="cpu",
    )
    processes = PoolProcesses(settings, url, log_dir=workdir / "logs")
    try:
        processes.start()
        Client(url).wait_ready(300, pool="split")
        pids = {c.name: c.process.pid for c in processes.children if c.process}
        for name, pid in list(pids.items()):
            for child in children(pid):
                pids[f"{name} output"] = child
        pids["redis"] = server.process.pid if server.process else 0
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        own = resource.getrusage(resource.RUSAGE_SELF)
        workload = Workload(args.requests, (32, 96), (48, 80), concurrency=args.concurrency)
        traces, wall = asyncio.run(run_workload(url, settings.namespace, workload))
        used = resource.getrusage(resource.RUSAGE_SELF)
        shares = {
            name: round((cpu_seconds(pid) - before[name]) / wall, 2) for name, pid in pids.items()
        }
        shares["load generator"] = round(
            (used.ru_utime + used.ru_stime - own.ru_utime - own.ru_stime) / wall, 2
        )
        tokens = summarise(traces, wall, 1e9, 1e9)["output_tokens_per_s"]
        print(f"tokens/s {tokens:.0f}  wall {wall:.1f}s  core shares {shares}")
    finally:
        processes.stop()
        server.stop()


if __name__ == "__main__":
    main()
