"""`npu-pool up`, `status --json` and `submit` as a user runs them, in separate processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from tests.helpers import wait_until


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "schemas.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_up_serves_submit_and_status_on_its_embedded_redis_then_stops_cleanly(tmp_path) -> None:
    env = dict(os.environ, NPUPOOL_HOME=str(tmp_path))
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "schemas.cli",
            "up",
            "--ranks",
            "2",
            "--device",
            "cpu",
            "--threads-per-rank",
            "1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def ready() -> bool:
            result = run_cli(env, "status", "--json")
            if result.returncode != 0:
                return False
            pools = json.loads(result.stdout)["pools"]
            return (
                bool(pools)
                and pools[0]["state"] == "ready"
                and all(r["state"] == "ready" for r in pools[0]["ranks"])
            )

        wait_until(ready, timeout_s=120, what="`npu-pool status --json` to show a ready pool")
        status = json.loads(run_cli(env, "status", "--json").stdout)
        pool = status["pools"][0]
        assert pool["pool"] == "default" and [r["rank"] for r in pool["ranks"]] == [0, 1]
        assert all(r["pid"] > 0 and r["device"] == "cpu" for r in pool["ranks"])
        assert pool["batcher"]["pid"] > 0 and status["queue"]["outstanding"] == 0
        for rank in pool["ranks"]:  # start-up progress ends with every warm-up launch run
            progress = rank["progress"]
            assert progress["what"].startswith("warm-up") and progress["total"] > 0
            assert progress["done"] == progress["total"]

        submitted = run_cli(env, "submit", "Hello pool", "--max-tokens", "6", "--json")
        assert submitted.returncode == 0, submitted.stderr
        completion = json.loads(submitted.stdout)
        assert completion["usage"]["completion_tokens"] == len(completion["token_ids"]) > 0
        assert completion["finish_reason"] in ("length", "stop")
    finally:
        up.send_signal(signal.SIGTERM)
        output, _ = up.communicate(timeout=60)
    assert up.returncode == 0, output
    assert not (tmp_path / "redis.json").exists()
    assert run_cli(env, "status", "--json").returncode == 1  # no Redis to talk to any more
