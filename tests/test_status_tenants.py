"""`npu-pool status` by tenant: each tenant's queued and in-progress entries over every
request stream, its `max_queue`, the running and waiting requests each pool holds of it,
and a tenant table in the human view only when there is more than `default` to show."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from rich.console import Console

from batcher.limits import publish_tenants
from producer.client import Client
from producer.status import collect_status
from producer.status_view import render
from schemas.keys import GROUP, Keys
from schemas.registry import BatcherState, PoolField
from schemas.tenants import load_tenants

pytestmark = pytest.mark.fast

KEYS = Keys()


def status_json(redis_url: str) -> dict[str, Any]:
    """What `npu-pool status --json` prints."""
    done = subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", "status", "--json", "--redis-url", redis_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def deliver_one(client: redis.Redis, stream: str) -> None:
    """A pool takes the oldest undelivered entry of `stream` (it stays pending)."""
    client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    client.xreadgroup(GROUP, "pool-x", {stream: ">"}, count=1)


def register_pool(client: redis.Redis, pool: str, state: BatcherState, tenants: str) -> None:
    """A pool's info hash as its batcher writes it, with its `tenants` load."""
    client.sadd(KEYS.pools, pool)
    client.hset(
        KEYS.pool(pool),
        mapping={
            PoolField.STATE: state.value,
            PoolField.HEARTBEAT_MS: int(time.time() * 1000),
            PoolField.RANKS: 0,
            "tenants": tenants,
        },
    )


def tenant_rows(status: dict[str, Any]) -> list[list[str]] | None:
    """The rows of the view's tenant table (None: the view has none)."""
    console = Console(file=io.StringIO(), width=120)
    console.print(render(status))
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    heads = [i for i, line in enumerate(lines) if "┃ tenant " in line]
    if not heads:
        return None
    rows = []
    for line in lines[heads[0] + 2 :]:
        if not line.startswith("│"):
            break
        rows.append([cell.strip() for cell in line.strip("│").split("│")])
    return rows


def test_status_json_counts_each_tenants_queued_and_in_progress_entries_with_its_max_queue(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\nmax_queue = 5\n[tenants.b]\n[tenants.c]\nmax_queue = 3\n")
    publish_tenants(redis_client, KEYS, load_tenants(path))
    with Client(redis_url, tenant="a") as a, Client(redis_url) as plain:
        a.submit("hi")
        a.submit("hi", priority=3)
        a.submit("hi")
        plain.submit("hi", tenant="b")
        plain.submit("hi")
    deliver_one(redis_client, KEYS.tenant_stream("a"))

    queue = status_json(redis_url)["queue"]

    assert queue["tenants"] == {
        "a": {"queued": 2, "in_progress": 1, "max_queue": 5},
        "b": {"queued": 1, "in_progress": 0, "max_queue": None},
        "c": {"queued": 0, "in_progress": 0, "max_queue": 3},
        "default": {"queued": 1, "in_progress": 0, "max_queue": None},
    }
    assert (queue["outstanding"], queue["in_progress"], queue["dead"]) == (5, 1, 0)
    assert queue["by_priority"] == {"3": 1, "0": 4}


def test_status_json_without_a_tenants_file_lists_default_and_each_tenant_with_entries(
    redis_url: str, client: Client
) -> None:
    client.submit("hi", tenant="analytics")

    tenants = status_json(redis_url)["queue"]["tenants"]

    assert tenants == {
        "analytics": {"queued": 1, "in_progress": 0, "max_queue": None},
        "default": {"queued": 0, "in_progress": 0, "max_queue": None},
    }


def test_status_shows_each_pools_tenant_load_and_the_view_a_table_of_running_pools(
    redis_client: redis.Redis, client: Client
) -> None:
    client.submit("hi", tenant="analytics")
    register_pool(
        redis_client, "p1", BatcherState.READY, '{"analytics": {"running": 2, "waiting": 1}}'
    )
    register_pool(
        redis_client, "p2", BatcherState.READY, '{"analytics": {"running": 1, "waiting": 0}}'
    )
    register_pool(
        redis_client, "gone", BatcherState.STOPPED, '{"analytics": {"running": 7, "waiting": 0}}'
    )

    status = collect_status(redis_client, KEYS)

    assert [p["tenants"] for p in status["pools"]] == [
        {"analytics": {"running": 7, "waiting": 0}},
        {"analytics": {"running": 2, "waiting": 1}},
        {"analytics": {"running": 1, "waiting": 0}},
    ]
    assert tenant_rows(status) == [["analytics", "1", "3", "-"], ["default", "0", "0", "-"]]


def test_the_view_has_no_tenant_table_for_default_alone_and_one_with_a_tenants_file(
    redis_client: redis.Redis, client: Client, tmp_path: Path
) -> None:
    client.submit("hi")
    register_pool(redis_client, "p1", BatcherState.READY, "not json")
    alone = collect_status(redis_client, KEYS)
    assert alone["pools"][0]["tenants"] == {}
    assert tenant_rows(alone) is None

    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.default]\nmax_queue = 9\n")
    publish_tenants(redis_client, KEYS, load_tenants(path))
    assert tenant_rows(collect_status(redis_client, KEYS)) == [["default", "1", "0", "9"]]
