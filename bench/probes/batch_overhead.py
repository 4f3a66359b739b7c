"""What a batch job costs over feeding the pool directly: the same requests, the same number
in flight, once as an RQ batch job (`npu-pool batch`) and once from a plain client loop.

python -m bench.probes.batch_overhead --lines 400 --window 32 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from npu_pool.embedded import EmbeddedRedis
from npu_pool.launcher import PoolProcesses
from producer.batch.jobs import BatchInfo, submit
from producer.client import Client
from schemas.config import Settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lines", type=int, default=400)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="npupool-batchbench-"))
    server = EmbeddedRedis(data_dir=workdir / "redis")
    url = server.start()
    settings = Settings(redis_url=url, ranks=args.ranks, pool="bb", max_num_seqs=64)
    processes = PoolProcesses(settings, url, log_dir=workdir / "logs")
    requests = [
        {"prompt_token_ids": [5, 6, 2 + i % 400], "max_tokens": args.max_tokens, "ignore_eos": True}
        for i in range(args.lines)
    ]
    (workdir / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    try:
        processes.start()
        with Client(url) as client:
            client.wait_ready(timeout_s=300)
            started = time.monotonic()
            window: deque[str] = deque()
            for request in requests:
                if len(window) == args.window:
                    client.result(window.popleft(), timeout_s=120)
                window.append(client.submit(**request))  # type: ignore[arg-type]
            while window:
                client.result(window.popleft(), timeout_s=120)
            direct_s = time.monotonic() - started

            batch_id = submit(client, workdir / "in.jsonl", workdir / "out.jsonl", args.window)
            started = time.monotonic()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "npu_pool.cli",
                    "batch",
                    "--redis-url",
                    url,
                    "worker",
                    "--burst",
                ],
                check=True,
            )
            batch_s = time.monotonic() - started
            info = BatchInfo.read(client.redis, client.keys, batch_id)
            assert info is not None and info.state == "finished", info
    finally:
        processes.stop()
        server.stop()
    tokens = args.lines * args.max_tokens
    print(
        f"{args.lines} requests x {args.max_tokens} tokens, window {args.window}, "
        f"{args.ranks} ranks"
    )
    print(f"direct client loop: {direct_s:.2f} s, {tokens / direct_s:.0f} tokens/s")
    print(
        f"RQ batch job:       {batch_s:.2f} s, {tokens / batch_s:.0f} tokens/s "
        f"(worker start included)"
    )
    print(f"batch / direct:     {direct_s / batch_s:.2f}")


if __name__ == "__main__":
    main()
