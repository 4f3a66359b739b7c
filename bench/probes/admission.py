"""Admission latency behind Sentinels: `Client.submit` on a replicated Redis on loopback (a
primary, two replicas, three Sentinels), with `--min-replicas-ack 0` and 1 in alternating
rounds, the first `--warm-up` calls of each round left out. Not part of CI:

    python -m bench.probes.admission --calls 600 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from npu_pool.replicated import SentinelDeployment
from producer.client import Client


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50, p90 and p99 of `samples` (seconds), in milliseconds."""
    cuts = statistics.quantiles(samples, n=100)
    return {f"p{q}": round(cuts[q - 1] * 1000, 3) for q in (50, 90, 99)}


def one_round(url: str, replicas: int, calls: int, warm_up: int, tag: str) -> dict[str, float]:
    client = Client(url, min_replicas_ack=replicas)
    samples = []
    for i in range(calls):
        began = time.perf_counter()
        client.submit(prompt_token_ids=[5, 6, 7], max_tokens=1, request_id=f"{tag}-{i}")
        samples.append(time.perf_counter() - began)
    client.redis.delete(*client.keys.request_streams)  # no pool runs them
    return percentiles(samples[warm_up:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=600)
    parser.add_argument("--warm-up", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="npupool-admission-")) / "ha"
    root.mkdir(parents=True)
    deployment = SentinelDeployment(root)
    deployment.start()
    try:
        report = []
        for r in range(args.rounds):
            row: dict[str, object] = {"round": r + 1}
            for replicas in (0, 1):
                tag = f"r{r}-ack{replicas}"
                row[f"ack{replicas}"] = one_round(
                    deployment.url, replicas, args.calls, args.warm_up, tag
                )
            report.append(row)
    finally:
        deployment.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
