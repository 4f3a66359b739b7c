"""Client admission, URL discovery, settings flags and the command dispatcher."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import redis

from npu_pool.cli import main as cli_main
from npu_pool.embedded import EmbeddedRedis
from producer.client import AsyncClient, Client, QueueFull
from schemas.config import Settings
from schemas.connection import resolve_redis_url
from schemas.keys import Keys


def test_submit_refuses_atomically_at_max_queue_with_the_depth(
    redis_url: str, redis_client
) -> None:
    with Client(redis_url, max_queue=3) as client:
        for i in range(3):
            client.submit("hello", request_id=f"q{i}")
        with pytest.raises(QueueFull) as info:
            client.submit("one too many")
    assert info.value.depth == 3 and info.value.max_queue == 3
    assert "queue full: 3 outstanding" in str(info.value)
    assert redis_client.xlen(Keys().requests) == 3


def test_submit_rejects_unknown_keywords_before_enqueuing(redis_url: str, redis_client) -> None:
    with Client(redis_url) as client, pytest.raises(TypeError, match="max_tokenz"):
        client.submit("hi", max_tokenz=3)
    assert redis_client.xlen(Keys().requests) == 0


def test_client_without_url_finds_the_recorded_embedded_redis(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("NPUPOOL_HOME", str(tmp_path))
    with pytest.raises(ConnectionError, match="npu-pool up"):
        resolve_redis_url(None)
    server = EmbeddedRedis(data_dir=tmp_path / "redis")
    server.start()
    try:
        server.record()
        with Client() as client:
            assert client.redis.ping()
            assert client.redis.connection_pool.connection_kwargs["port"] == server.port
    finally:
        server.stop()
    assert not (tmp_path / "redis.json").exists()


def test_embedded_redis_runs_with_aof_and_a_password(tmp_path) -> None:
    with EmbeddedRedis(data_dir=tmp_path, password="s3cret") as server:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        client.close()


def test_wait_ready_without_a_pool_times_out_with_advice(redis_url: str) -> None:
    with Client(redis_url) as client, pytest.raises(TimeoutError, match="npu-pool status"):
        client.wait_ready(timeout_s=0.3)


def test_async_client_submits_and_times_out_cleanly(redis_url: str, redis_client) -> None:
    async def scenario() -> None:
        client = AsyncClient(redis_url)
        try:
            request_id = await client.submit("async hello", max_tokens=2)
            with pytest.raises(TimeoutError, match=request_id):
                await client.result(request_id, timeout_s=0.2)
        finally:
            await client.close()

    asyncio.run(scenario())
    assert redis_client.xlen(Keys().requests) == 1


def test_settings_come_from_flags_over_environment(monkeypatch) -> None:
    monkeypatch.setenv("NPUPOOL_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("REDIS_URL", "redis://example:6379/0")
    settings = Settings()
    assert settings.max_num_seqs == 7 and settings.redis_url == "redis://example:6379/0"
    assert Settings(max_num_seqs=9).max_num_seqs == 9
    with pytest.raises(ValueError, match="prefill_chunk=256 exceeds max_model_len=128"):
        Settings(prefill_chunk=256, max_model_len=128)


def test_service_args_round_trip_through_the_flags() -> None:
    import argparse

    from schemas.config import add_settings_flags, settings_from_args

    original = Settings(ranks=3, decode_batch=4, mtp=True, pool="p1", dtype="float64")
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    assert settings_from_args(parser.parse_args(original.service_args())) == original


def test_dispatcher_rejects_unknown_commands_and_bad_values(capsys) -> None:
    assert cli_main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert cli_main(["batcher", "--prefill-chunk", "999", "--max-model-len", "64"]) == 2
    assert "prefill_chunk=999 exceeds max_model_len=64" in capsys.readouterr().err
    assert cli_main([]) == 0
    assert "demo" in capsys.readouterr().out


def test_producer_and_batcher_never_import_torch() -> None:
    code = (
        "import sys, producer.cli, producer.client, npu_pool.launcher, npu_pool.demo, "
        "batcher.service; bad = [m for m in ('torch',) if m in sys.modules]; print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out.strip().replace("'", '"')) == []


def test_producer_gets_a_clear_error_not_a_hang_when_redis_is_gone(tmp_path) -> None:
    server = EmbeddedRedis(data_dir=tmp_path)
    url = server.start()
    client = Client(url)
    request_id = client.submit("hello", max_tokens=2)
    server.stop()
    with pytest.raises(redis.ConnectionError):
        client.submit("again")
    with pytest.raises(redis.ConnectionError):
        list(client.stream(request_id, timeout_s=5))
    client.close()


def test_serving_benchmark_reports_levels_ceiling_and_ratios(tmp_path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "npu_pool.cli",
            "bench",
            "--concurrency",
            "1",
            "4",
            "--requests",
            "6",
            "--output-len",
            "4",
            "8",
            "--prompt-len",
            "3",
            "9",
            "--no-peers",
            "--burst",
            "8",
            "--device",
            "cpu",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    for level in report["levels"]:
        assert level["requests"] == 6
        assert 6 * 4 <= level["output_tokens"] <= 6 * 8
        assert 0 < level["ttft_ms"]["p50"] <= level["ttft_ms"]["p99"]
    assert report["ceiling"]["output_tokens_per_s"] > 0
    assert report["planner_us_per_step"] > 0
    assert set(report["ratios"]) == {
        "pool_over_ceiling",
        "pool_over_workload_ceiling",
        "burst_ttft_p99_over_ideal",
    }
    assert "pool_over_ceiling" in done.stdout
    for level in report["levels"]:  # the launches a level needs, and where ranks spent time
        ceiling = level["workload_ceiling"]
        assert ceiling["prefill_launches"] == 1  # six 3-9 token prompts packed in one launch
        assert 0 < ceiling["output_tokens_per_s"] < ceiling["decode_only_tokens_per_s"]
        assert 0 <= level["rank_idle_share"] <= 1 and 0 < level["rank_host_share"] < 1
        assert 0 < level["prefill_efficiency"] <= 1
    burst = report["burst"]
    assert burst["requests"] == 8 and burst["prefill_bound_ideal_ms"] > 0
    assert burst["prefill_launches_per_request"] < 1  # eight short prompts share launches
