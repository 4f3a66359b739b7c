"""`npu-pool up`, `status --json` and `submit` as a user runs them, in separate processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from npu_worker.weights.tiny import ensure_tiny_model
from producer.client import Client, PoolFailed
from tests.helpers import wait_until


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", *args],
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
            "npu_pool.cli",
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
        assert all(r["weight_bytes"] > 0 and r["checkpoint_bytes"] > 0 for r in pool["ranks"])
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


def start_up(env: dict[str, str], *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "npu_pool.cli", "up", "--device", "cpu", "--threads-per-rank", "1"]
        + list(flags),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def unsupported_copy_of_tiny(tmp_path: Path) -> Path:
    model = tmp_path / "gpt2-ish"
    shutil.copytree(ensure_tiny_model(), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
    return model


def test_up_with_a_model_the_loader_refuses_stops_at_once_naming_the_reason(tmp_path) -> None:
    env = dict(os.environ, NPUPOOL_HOME=str(tmp_path / "home"))
    up = start_up(env, "--model", str(unsupported_copy_of_tiny(tmp_path)))
    _, stderr = up.communicate(timeout=90)  # not restarted forever with backoff
    assert up.returncode == 1, stderr
    assert "rank 0 failed" in stderr and "['GPT2LMHeadModel']" in stderr, stderr
    assert "not supported" in stderr


def test_up_with_weights_that_do_not_fit_their_config_stops_at_once_naming_the_reason(
    tmp_path,
) -> None:
    """Not only the loader's refusals: whatever fails while a rank prepares its model (here
    torch refusing the weights' shapes) fails the rank, which a restart would not mend."""
    model = tmp_path / "misfit"
    shutil.copytree(ensure_tiny_model(), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"intermediate_size": 160}))
    env = dict(os.environ, NPUPOOL_HOME=str(tmp_path / "home"))
    up = start_up(env, "--model", str(model))
    _, stderr = up.communicate(timeout=90)  # not restarted forever with backoff
    assert up.returncode == 1, stderr
    assert "rank 0 failed" in stderr and "size mismatch" in stderr, stderr


def test_a_rank_that_cannot_load_is_failed_with_its_reason_and_wait_ready_raises_it(
    start_pool, redis_url: str, tmp_path
) -> None:
    model = tmp_path / "no-tokenizer"
    shutil.copytree(ensure_tiny_model(), model)
    (model / "tokenizer.json").unlink()
    pool = start_pool(model=str(model), wait=False)
    with Client(redis_url) as client, pytest.raises(PoolFailed, match="has no tokenizer.json"):
        client.wait_ready(timeout_s=90)
    status = json.loads(
        run_cli(dict(os.environ), "status", "--json", "--redis-url", redis_url).stdout
    )
    (rank,) = status["pools"][0]["ranks"]
    assert rank["state"] == "failed" and "has no tokenizer.json" in rank["reason"]
    wait_until(lambda: pool.processes.failed == ["rank0"], what="the supervisor to give up")
    time.sleep(2)  # and it stays down: no restart loop
    assert pool.processes.children[1].restarts == 0


def test_a_second_up_on_one_home_is_refused_and_the_first_keeps_serving(tmp_path) -> None:
    env = dict(os.environ, NPUPOOL_HOME=str(tmp_path))
    first = start_up(env)
    try:
        wait_until(
            lambda: run_cli(env, "submit", "hi", "--max-tokens", "2").returncode == 0,
            timeout_s=120,
            what="the first pool to serve",
        )
        second = start_up(env)
        _, stderr = second.communicate(timeout=60)
        assert second.returncode == 1
        recorded = json.loads((tmp_path / "redis.json").read_text())
        assert f"pid {first.pid}" in stderr and recorded["url"] in stderr, stderr
        submitted = run_cli(env, "submit", "still here", "--max-tokens", "3", "--json")
        assert submitted.returncode == 0, submitted.stderr
        assert json.loads(submitted.stdout)["finish_reason"] in ("length", "stop")
        status = json.loads(run_cli(env, "status", "--json").stdout)
        assert status["pools"][0]["state"] == "ready"
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 0
