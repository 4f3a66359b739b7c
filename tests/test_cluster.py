"""The Redis Cluster key layout the README documents: with a hash-tagged namespace every
command the pool sends is single-slot, so a cluster-mode server (which refuses cross-slot
commands even when one node owns every slot) serves a pool, cancels included."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from npu_pool.embedded import EmbeddedRedis
from producer.client import Client
from tests.helpers import check_stream, wait_until


@pytest.fixture
def cluster_url(tmp_path: Path):
    server = EmbeddedRedis(
        data_dir=tmp_path / "cluster",
        extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
    )
    url = server.start()
    admin = redis.Redis.from_url(url)
    admin.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
    wait_until(
        lambda: b"cluster_state:ok" in admin.execute_command("CLUSTER", "INFO"),
        what="the one-node cluster to own every slot",
    )
    admin.close()
    yield url
    server.stop()


def test_a_pool_runs_on_cluster_mode_redis_with_a_hash_tagged_namespace(
    start_pool, cluster_url: str
) -> None:
    namespace = "{npc}"
    probe = redis.Redis.from_url(cluster_url)
    with pytest.raises(redis.ResponseError, match="same slot"):  # the server does check
        probe.xread({"npupool:a": "0", "npupool:b": "0"})
    probe.close()
    start_pool(ranks=2, url=cluster_url, namespace=namespace)
    with Client(cluster_url, namespace) as client:
        ids = [
            client.submit(prompt_token_ids=[5, 6, 2 + i], max_tokens=12, ignore_eos=True)
            for i in range(6)
        ]
        slow = client.submit(prompt_token_ids=[9, 9], max_tokens=400, ignore_eos=True)
        for rid in ids:
            chunks = check_stream(list(client.stream(rid, timeout_s=120)))
            assert len(chunks) == 12
        wait_until(lambda: client.redis.exists(client.keys.result(slow)) == 1, what="the slow one")
        client.cancel(slow)
        assert client.result(slow, timeout_s=60).finish_reason == "cancelled"
        assert client.redis.xlen(client.keys.dead) == 0
