"""The queue bound is the pool's, for every producer: admission reads it from the limits the
batchers publish, and entries that bypass admission end `queue_full` within a tick."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import msgpack
import pytest

from producer.client import Client, QueueFull, RequestTooLarge
from producer.status import collect_status, queue_depths
from schemas.keys import Keys
from schemas.messages import FinishReason
from tests.helpers import check_stream, wait_until

KEYS = Keys()


def outstanding(client: Client) -> int:
    return sum(depth for depth, _ in queue_depths(client.redis, client.keys).values())


class DepthWatch:
    """Samples the queue depth in the background; reports how long it stayed over a bound."""

    def __init__(self, client: Client, bound: int) -> None:
        self.client, self.bound = client, bound
        self.longest_over_s = 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        over_since: float | None = None
        while not self.done.wait(0.005):
            now = time.monotonic()
            if outstanding(self.client) > self.bound:
                over_since = over_since or now
                self.longest_over_s = max(self.longest_over_s, now - over_since)
            else:
                over_since = None

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return self.longest_over_s


def test_the_pools_max_queue_binds_every_producer_and_raw_xadds(
    start_pool, redis_url: str, monkeypatch
) -> None:
    start_pool(max_queue=8, max_num_seqs=2, kv_slots_per_rank=2, max_model_len=256)
    monkeypatch.setenv("REDIS_URL", redis_url)
    with Client() as client:  # no bound of its own: the pool's holds
        accepted, refused = [], []
        for i in range(40):
            try:
                accepted.append(client.submit(f"prompt {i}", max_tokens=48, ignore_eos=True))
            except QueueFull as exc:
                refused.append(exc)
        assert refused and len(accepted) >= 8
        assert all(exc.max_queue == 8 and "max_queue=8" in str(exc) for exc in refused)
        for request_id in accepted:
            final = list(client.stream(request_id, timeout_s=120))[-1]
            assert final.finish_reason == FinishReason.LENGTH

        watch = DepthWatch(client, 8)
        burst = client.redis.pipeline(transaction=True)
        for i in range(40):  # a raw XADD bypasses admission
            raw = msgpack.packb(
                {"v": 1, "id": f"raw-{i}", "prompt": "x", "sampling": {"max_tokens": 32}}
            )
            burst.xadd(KEYS.requests, {"m": raw})
        burst.execute()
        reasons = {}
        for i in range(40):
            chunks = list(client.stream(f"raw-{i}", timeout_s=120))
            check_stream(chunks)
            reasons[i] = chunks[-1]
        longest_over_s = watch.stop()
    full = [c for c in reasons.values() if c.finish_reason == FinishReason.REJECTED]
    done = [c for c in reasons.values() if c.finish_reason == FinishReason.LENGTH]
    assert len(full) + len(done) == 40 and full and len(done) >= 8
    assert all(c.error is not None and c.error.code == "queue_full" for c in full)
    assert all("max_queue=8" in (c.error.message if c.error else "") for c in full)
    # the newest entries are the ones ended: every one that ran came before every one ended
    assert max(i for i, c in reasons.items() if c in done) < min(
        i for i, c in reasons.items() if c in full
    )
    assert longest_over_s < 1.0, f"the queue stayed over its bound for {longest_over_s:.2f}s"


def test_a_request_over_the_pools_max_request_bytes_is_refused_at_admission(
    start_pool, client: Client
) -> None:
    start_pool(max_request_bytes=512)
    with pytest.raises(RequestTooLarge, match="over max_request_bytes=512"):
        client.submit("x" * 600)
    assert outstanding(client) == 0


def test_pools_that_disagree_share_the_strictest_bound_and_status_says_so(
    start_pool, client: Client, redis_url: str
) -> None:
    strict = start_pool(pool="a", max_queue=8)
    start_pool(pool="b", max_queue=20)
    wait_until(
        lambda: (
            collect_status(client.redis, client.keys)["limits"].get("pools", {}).keys()
            == {"a", "b"}
        ),
        what="both pools' limits",
    )
    limits = collect_status(client.redis, client.keys)["limits"]
    assert limits["max_queue"] == 8
    assert {name: v["max_queue"] for name, v in limits["pools"].items()} == {"a": 8, "b": 20}
    shown = subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", "status", "--redis-url", redis_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "pools disagree" in shown.stdout and "the strictest holds" in shown.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", "status", "--json", "--redis-url", redis_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(as_json.stdout)["limits"]["max_queue"] == 8

    strict.processes.stop(timeout_s=30)  # the strict pool leaves: the other's bound holds
    wait_until(
        lambda: collect_status(client.redis, client.keys)["limits"]["max_queue"] == 20,
        timeout_s=30,
        what="pool b's bound",
    )
