"""Prometheus endpoints of the batcher and every rank: counters move during a run and agree
with what the result streams hold, per tenant too."""

from __future__ import annotations

import random
import socket
import urllib.request

import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batcher.metrics import BatcherMetrics, tenant_gauges
from producer.client import Client
from schemas.keys import Keys
from tests.helpers import check_stream, interrupt_once_shown, wait_until


def free_port_block(size: int) -> int:
    """A base port with `size` free ports after it (checked, not reserved)."""
    for _ in range(50):
        base = random.randrange(20000, 60000)
        sockets = []
        try:
            for port in range(base, base + size):
                sock = socket.socket()
                sock.bind(("127.0.0.1", port))
                sockets.append(sock)
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free ports")


def scrape_text(port: int) -> str:
    """One endpoint's exposition text."""
    return str(
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    )


def scrape(port: int) -> dict[str, float]:
    """Samples of one endpoint, summed over label sets, by sample name."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(scrape_text(port)):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def by_tenant(text: str, name: str) -> dict[str, float]:
    """One sample name's values by their `tenant` label."""
    return {
        sample.labels["tenant"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


@pytest.mark.fast
def test_tenant_gauges_give_each_tenants_queue_depth_and_load_zero_where_it_has_none(
    redis_client: redis.Redis, client: Client
) -> None:
    client.submit("hi", tenant="analytics")
    client.submit("hi", tenant="analytics", priority=2)
    client.submit("hi")
    load = {"batch": {"running": 3, "waiting": 1}}
    metrics = BatcherMetrics(
        "p", dict, set(), tenant_gauges=lambda: tenant_gauges(load, redis_client, Keys())
    )

    text = generate_latest(metrics.registry).decode()

    assert by_tenant(text, "npupool_tenant_queue_depth") == {"analytics": 2, "default": 1}
    assert by_tenant(text, "npupool_tenant_running") == {"analytics": 0, "batch": 3, "default": 0}
    assert by_tenant(text, "npupool_tenant_waiting") == {"analytics": 0, "batch": 1, "default": 0}
    assert 'npupool_tenant_running{pool="p",tenant="batch"} 3.0' in text


def test_metrics_counters_move_and_match_the_result_streams(start_pool, client: Client) -> None:
    base = free_port_block(3)
    start_pool(ranks=2, metrics_port=base)
    ids = [
        client.submit(
            prompt_token_ids=[5, 6, i + 2],
            max_tokens=60,
            ignore_eos=True,
            tenant="analytics" if i % 3 == 0 else "default",
        )
        for i in range(12)
    ]
    wait_until(lambda: scrape(base).get("npupool_tokens_total", 0) > 0, what="tokens counted")
    during = scrape(base)
    tokens = sum(len(check_stream(list(client.stream(r, timeout_s=120)))) for r in ids)
    wait_until(lambda: scrape(base)["npupool_finished_total"] == 12, what="all finished")
    batcher = scrape(base)
    ranks = [scrape(base + 1), scrape(base + 2)]
    assert during["npupool_tokens_total"] <= batcher["npupool_tokens_total"] == tokens == 720
    assert sum(r["npupool_tokens_total"] for r in ranks) == tokens
    assert batcher["npupool_step_seconds_count"] > 0 and batcher["npupool_running"] == 0
    assert batcher["npupool_decode_launches_total"] == sum(
        r["npupool_decode_launches_total"] for r in ranks
    )
    assert batcher["npupool_prefill_launches_total"] == sum(
        r["npupool_prefill_launches_total"] for r in ranks
    )
    # new requests alternate between the ranks, whose caches of blocks (each a share of
    # the host's free memory when it started) differ by a few blocks
    assert all(r["npupool_prefill_launches_total"] >= 1 for r in ranks)
    # one queue time and one TTFT per request, one inter-token gap per later token
    assert batcher["npupool_queue_seconds_count"] == batcher["npupool_ttft_seconds_count"] == 12
    assert batcher["npupool_itl_seconds_count"] == tokens - 12
    assert 0 < batcher["npupool_queue_seconds_sum"] < batcher["npupool_ttft_seconds_sum"]
    assert batcher["npupool_admitted_total"] == 12
    # the same tokens and first tokens by tenant, beside the pool-wide series
    text = scrape_text(base)
    assert by_tenant(text, "npupool_tenant_tokens_total") == {"analytics": 240, "default": 480}
    assert by_tenant(text, "npupool_tenant_ttft_seconds_count") == {"analytics": 4, "default": 8}
    assert set(by_tenant(text, "npupool_tenant_queue_depth")) == {"analytics", "default"}
    wait_until(
        lambda: (
            by_tenant(scrape_text(base), "npupool_tenant_running") == {"analytics": 0, "default": 0}
        ),
        what="no tenant running after a heartbeat",
    )
    for rank in ranks:  # every launch timed; every step counts both shapes
        launches = rank["npupool_prefill_launches_total"] + rank["npupool_decode_launches_total"]
        assert rank["npupool_launch_seconds_count"] == launches
        assert rank["npupool_launches_per_step_sum"] == launches
        assert rank["npupool_launches_per_step_count"] == 2 * rank["npupool_steps_total"]


def test_status_watch_shows_a_live_view_until_interrupted(
    start_pool, client: Client, redis_url: str
) -> None:
    import os
    import subprocess
    import sys

    start_pool(ranks=1)
    client.generate(prompt="warm", max_tokens=8, timeout_s=60)
    watcher = subprocess.Popen(
        [sys.executable, "-m", "npu_pool.cli", "status", "--watch", "--interval", "0.2"],
        env=dict(os.environ, REDIS_URL=redis_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    shown, _ = interrupt_once_shown(watcher, b"tokens/s", 1)
    output = shown.decode()
    assert watcher.returncode == 0
    assert "pool default — ready" in output and "tokens/s" in output
