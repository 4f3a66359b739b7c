"""The pool registry: a rank registers the launch shapes it runs, and the batcher refuses a
rank whose shapes are not the pool's, with a reason `status` shows, instead of failing
mid-step (docs/architecture.md §5)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from producer.client import Client
from producer.status import collect_status
from schemas.config import Settings
from schemas.registry import LaunchShapes, RankState
from tests.helpers import wait_until


@pytest.mark.fast
def test_launch_shapes_round_trip_and_name_every_difference() -> None:
    pool = Settings(decode_batch=8, kv_slots_per_rank=16, mtp=True).launch_shapes()
    assert LaunchShapes.decode(pool.encode()) == pool
    assert pool.differences(pool) is None
    rank = Settings(decode_batch=4, kv_slots_per_rank=16, mtp=False).launch_shapes()
    assert rank.differences(pool) == "decode_batch 4 (pool: 8), mtp False (pool: True)"
    other = Settings(decode_batch=8, mtp=True, model="smollm2", expert_parallel=True)
    assert other.launch_shapes().differences(pool) == (
        "expert_parallel True (pool: False), model smollm2 (pool: tiny)"
    )


@pytest.mark.fast
@pytest.mark.parametrize("raw", [b"", b"{}", b"[1, 2]", b'{"decode_batch": 8}', b"not json"])
def test_a_shapes_field_that_is_not_one_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError, match="not a launch-shapes record"):
        LaunchShapes.decode(raw)


def test_a_rank_whose_shapes_differ_is_refused_and_the_pool_serves_on(
    start_pool, client: Client, redis_url: str
) -> None:
    pool = start_pool(ranks=2, decode_batch=8, max_model_len=256)
    ranks = collect_status(client.redis, client.keys)["pools"][0]["ranks"]
    assert [r["planned"] for r in ranks] == [True, True]  # ready: the batcher plans for both
    rank1 = next(c for c in pool.processes.children if c.name == "rank1")
    rank1.args += ["--decode-batch", "4"]  # the supervisor restarts it with these flags
    pool.processes.kill("rank1")

    def refused() -> bool:
        ranks = collect_status(client.redis, client.keys)["pools"][0]["ranks"]
        return ranks[1]["state"] == RankState.FAILED.value and bool(ranks[1]["reason"])

    wait_until(refused, timeout_s=120, what="rank 1 refused")
    reason = collect_status(client.redis, client.keys)["pools"][0]["ranks"][1]["reason"]
    assert reason == ("its launch shapes differ from the pool's: decode_batch 4 (pool: 8)"), reason
    ranks = collect_status(client.redis, client.keys)["pools"][0]["ranks"]
    assert [r["planned"] for r in ranks] == [True, False]
    wait_until(lambda: rank1.failed, timeout_s=60, what="the refused rank to exit, failed")
    assert rank1.process is not None and rank1.process.returncode == 3
    log = (pool.processes.log_dir / "rank1.log").read_text()  # type: ignore[operator]
    assert "refused by the batcher: its launch shapes differ" in log

    shown = subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", "status", "--redis-url", redis_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "rank 1 failed: its launch shapes differ from the pool's: decode_batch 4" in " ".join(
        shown.stdout.split()
    )
    done = client.generate(prompt="still served", max_tokens=5, timeout_s=60)
    assert done.finish_reason is not None and done.error is None


def test_status_json_names_the_redis_url_it_read(redis_url: str) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", "status", "--json", "--redis-url", redis_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(shown.stdout)["redis_url"] == redis_url
