"""Crashes lose nothing and change no token: kill -9 a worker, then the batcher, then a
whole pool (DESIGN §7, durability)."""

from __future__ import annotations

import os
import random
import signal

import msgpack

from npu_worker.reference import first_divergence, generate_alone
from producer.client import Client
from schemas.keys import Keys
from schemas.messages import FinishReason
from tests.helpers import (
    TIE_TOLERANCE,
    check_stream,
    load_reference_model,
    random_prompt,
    reference_runner,
    wait_until,
)

KEYS = Keys()


def published_chunks(redis_client, request_ids: list[str]) -> int:
    pipe = redis_client.pipeline(transaction=False)
    for request_id in request_ids:
        pipe.xlen(KEYS.result(request_id))
    return sum(pipe.execute())


def test_killing_a_worker_then_the_batcher_mid_decode_changes_no_token(
    start_pool, client: Client, redis_client
) -> None:
    pool = start_pool(
        ranks=2,
        decode_batch=4,
        max_num_seqs=40,
        kv_slots_per_rank=20,
        max_model_len=512,
        rank_timeout_s=3,
    )
    settings = pool.settings
    loaded = load_reference_model(settings)
    rng = random.Random(7)
    cases = [
        (
            random_prompt(rng, rng.randrange(1, 200), loaded.config.vocab_size),
            rng.randrange(100, 160),
        )
        for _ in range(40)
    ]
    ids = [
        client.submit(prompt_token_ids=p, max_tokens=m, ignore_eos=True, request_id=f"f{i}")
        for i, (p, m) in enumerate(cases)
    ]
    total = sum(m for _, m in cases)

    wait_until(
        lambda: published_chunks(redis_client, ids) > total * 0.15,
        timeout_s=120,
        what="decode to be under way",
    )
    pool.processes.kill("rank1")
    wait_until(
        lambda: published_chunks(redis_client, ids) > total * 0.5,
        timeout_s=120,
        what="decode to go on after the worker kill",
    )
    pool.processes.kill("batcher")

    runner = reference_runner(loaded, settings)
    for request_id, (prompt, max_tokens) in zip(ids, cases):
        tokens = check_stream(list(client.stream(request_id, timeout_s=180)))
        want = generate_alone(runner, prompt, max_tokens, set(), settings.max_model_len)
        problem = first_divergence(tokens, want, TIE_TOLERANCE)
        assert problem is None, f"{request_id}: {problem}"
    restarts = {c.name: c.restarts for c in pool.processes.children}
    assert restarts["rank1"] >= 1 and restarts["batcher"] >= 1
    wait_until(
        lambda: int(redis_client.hget(KEYS.pool("default"), "recovered") or 0) > 0,
        what="the restarted batcher to report the requests it resumed",
    )
    wait_until(lambda: redis_client.xlen(KEYS.requests) == 0, what="every entry deleted")
    assert redis_client.xlen(KEYS.dead) == 0


def test_a_pool_that_dies_entirely_has_its_requests_finished_by_another(
    start_pool, client: Client, redis_client
) -> None:
    doomed = start_pool(pool="a", ranks=1, max_num_seqs=12, rank_timeout_s=2, supervised=False)
    start_pool(pool="b", ranks=1, max_num_seqs=12, rank_timeout_s=2)
    ids = [
        client.submit(
            prompt_token_ids=[7 + i, 8, 9], max_tokens=120, ignore_eos=True, request_id=f"t{i}"
        )
        for i in range(24)
    ]

    def held_by(pool: str) -> int:
        return int(
            redis_client.xpending_range(
                KEYS.requests, "pools", "-", "+", 100, consumername=pool
            ).__len__()
        )

    wait_until(
        lambda: held_by("a") > 0 and published_chunks(redis_client, ids) > 100,
        timeout_s=60,
        what="pool a to be serving",
    )
    taken = held_by("a")
    doomed.processes.kill("batcher")
    doomed.processes.kill("rank0")

    for request_id in ids:
        tokens = check_stream(list(client.stream(request_id, timeout_s=180)))
        assert len(tokens) == 120
    assert taken > 0 and held_by("a") == 0
    wait_until(lambda: redis_client.xlen(KEYS.requests) == 0, what="every entry deleted")
    info = redis_client.hgetall(KEYS.pool("b"))
    assert int(info[b"claimed"]) >= taken


def test_a_hung_worker_is_taken_out_of_planning_and_fences_itself_when_it_wakes(
    start_pool, client: Client, redis_client
) -> None:
    pool = start_pool(ranks=2, max_num_seqs=16, rank_timeout_s=2, max_model_len=512)
    ids = [
        client.submit(prompt_token_ids=[11, i + 2], max_tokens=150, ignore_eos=True)
        for i in range(16)
    ]
    wait_until(lambda: published_chunks(redis_client, ids) > 200, what="decode to start")
    hung = pool.processes.children[2].process  # rank1
    assert hung is not None
    before = redis_client.hget(KEYS.rank("default", 1), "incarnation")
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        for request_id in ids:  # rank 0 alone finishes everything
            assert len(check_stream(list(client.stream(request_id, timeout_s=180)))) == 150
        assert redis_client.hget(KEYS.rank("default", 1), "state") == b"lost"
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    wait_until(
        lambda: (
            redis_client.hget(KEYS.rank("default", 1), "incarnation") != before
            and redis_client.hget(KEYS.rank("default", 1), "state") == b"ready"
        ),
        what="the woken worker to register afresh",
    )
    assert hung.poll() is None  # the same process, fenced and serving again
    again = [client.submit(prompt_token_ids=[12, i + 2], max_tokens=20) for i in range(8)]
    for request_id in again:
        assert len(check_stream(list(client.stream(request_id, timeout_s=120)))) > 0


def test_an_entry_delivered_too_often_goes_to_the_dead_letter_stream(
    start_pool, client: Client, redis_client
) -> None:
    redis_client.xgroup_create(KEYS.requests, "pools", id="0", mkstream=True)
    client.submit(prompt_token_ids=[5, 6], request_id="poison", max_tokens=4)
    redis_client.xreadgroup("pools", "default", {KEYS.requests: ">"}, count=1)
    (entry_id,) = [e for e, _ in redis_client.xrange(KEYS.requests)]
    for _ in range(3):  # three earlier batchers claimed it and died
        redis_client.xclaim(KEYS.requests, "pools", "default", 0, [entry_id])
    start_pool(ranks=1, max_deliveries=4)
    wait_until(lambda: redis_client.xlen(KEYS.dead) == 1, what="the dead letter")
    ((_, fields),) = redis_client.xrange(KEYS.dead)
    assert fields[b"reason"].startswith(b"delivered 5 times without finishing (max_deliveries=4)")
    assert fields[b"entry_id"] == entry_id
    assert msgpack.unpackb(fields[b"m"])["id"] == "poison"
    (final,) = client.stream("poison", timeout_s=10)
    assert final.finish_reason == FinishReason.ERROR and final.error is not None
    assert final.error.code == "max_deliveries" and final.usage is not None
    assert redis_client.xlen(KEYS.requests) == 0
    assert client.generate(prompt="next", max_tokens=3, timeout_s=60).token_ids
