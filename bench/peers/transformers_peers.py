"""The `transformers` peers of `npu-pool bench`, offline and behind RQ, each run in a process
of its own with the threads a rank gets (this process never imports torch)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from bench.ceiling import worker_threads
from bench.loadgen import Workload
from schemas.config import Settings


def rq_peer(
    url: str, settings: Settings, args: argparse.Namespace, num_requests: int
) -> dict[str, Any]:
    """One RQ job per request, one RQ worker per rank, the same greedy generation."""
    import redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    model_dir = settings.model
    server_client = redis.Redis.from_url(url)
    queue = Queue("npupool-peer", connection=server_client, serializer=JSONSerializer)
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.peers.hf_peer",
                "rq-worker",
                "--redis-url",
                url,
                "--model",
                model_dir,
                "--threads",
                str(worker_threads(settings)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(settings.ranks)
    ]
    try:
        warm = queue.enqueue("bench.peers.hf_peer.rq_generate", model_dir, [5, 6], 2)
        _wait_jobs([warm], timeout_s=600)
        workload = Workload(num_requests, tuple(args.prompt_len), tuple(args.output_len), seed=0)
        started = time.monotonic()
        jobs = [
            queue.enqueue(
                "bench.peers.hf_peer.rq_generate", model_dir, prompt, max_tokens, job_timeout=3600
            )
            for prompt, max_tokens in workload.requests()
        ]
        _wait_jobs(jobs, timeout_s=3600)
        wall = time.monotonic() - started
        tokens = sum(len(job.return_value() or []) for job in jobs)
    finally:
        for worker in workers:
            worker.terminate()
            worker.wait()
        server_client.close()
    return {
        "requests": num_requests,
        "workers": settings.ranks,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
    }


def _wait_jobs(jobs: list[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(job.is_finished or job.is_failed for job in jobs):
        if time.monotonic() > deadline:
            raise TimeoutError("RQ peer jobs did not finish")
        time.sleep(0.05)
        for job in jobs:
            job.refresh()


def offline_peer(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    """`transformers` static-batch generation at the pool's decode batch, in its own process."""
    prompt_len = sum(args.prompt_len) // 2
    max_tokens = sum(args.output_len) // 2
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.peers.hf_peer",
            "offline",
            "--model",
            settings.model,
            "--batch",
            str(settings.decode_batch),
            "--prompt-len",
            str(prompt_len),
            "--max-tokens",
            str(max_tokens),
            "--threads",
            str(worker_threads(settings) * settings.ranks),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])
