"""Redis high availability (docs/architecture.md §7): a pool on a Sentinel URL, under load
with live readers, keeps every accepted request when its primary dies and a replica takes
over: 0 lost, 0 duplicated tokens, 0 gaps, and what a reader saw before the failover is
what the streams say after it."""

from __future__ import annotations

import functools
import random
import threading
import time
from pathlib import Path

import pytest
import redis

from batcher.intake import SETTLE_SCRIPT
from npu_pool.replicated import SERVICE, SentinelDeployment
from producer.client import Client
from producer.requests import RETRYABLE, NotReplicated, retried
from schemas.config import Settings
from schemas.connection import connect, replicas_to_wait, sentinel_address
from schemas.keys import GROUP, Keys
from schemas.messages import ResultChunk
from schemas.sentinel import EpochSentinel, MasterNotFoundError, _newest, still_primary
from tests.helpers import (
    TIE_TOLERANCE,
    check_stream,
    load_reference_model,
    random_prompt,
    reference_runner,
    wait_until,
)
from tests.reference import first_divergence, generate_alone

KEYS = Keys()


@pytest.fixture
def sentinels(tmp_path: Path):
    deployment = SentinelDeployment(tmp_path / "ha")
    (tmp_path / "ha").mkdir()
    deployment.start()
    yield deployment
    deployment.stop()


class Reader(threading.Thread):
    """A live reader of one result stream that survives failovers: it reads the stream
    from 0 again and keeps the chunks of every seq it has seen, checking that a chunk seen
    twice is the same chunk."""

    def __init__(self, client: Client, request_id: str) -> None:
        super().__init__(daemon=True)
        self.client, self.request_id = client, request_id
        self.seen: dict[int, ResultChunk] = {}
        self.changed: list[str] = []
        self.done = False

    def run(self) -> None:
        deadline = time.monotonic() + 240
        while not self.done and time.monotonic() < deadline:
            try:
                for chunk in self.client.stream(self.request_id, timeout_s=30):
                    before = self.seen.setdefault(chunk.seq, chunk)
                    if before != chunk:
                        self.changed.append(f"seq {chunk.seq}: {before} then {chunk}")
                    if chunk.is_final:
                        self.done = True
            except (*RETRYABLE, TimeoutError):
                time.sleep(0.1)


def published(client: Client, ids: list[str]) -> int:
    """Chunks written on the current primary for `ids`."""

    def count() -> int:
        pipe = client.redis.pipeline(transaction=False)
        for request_id in ids:
            pipe.xlen(KEYS.result(request_id))
        return sum(pipe.execute())

    return int(retried(count))  # type: ignore[call-overload]


@pytest.mark.parametrize("failure", ["kill", "pause"])
def test_a_primary_lost_twice_loses_nothing_and_doubles_nothing(
    failure: str, sentinels: SentinelDeployment, start_pool
) -> None:
    """`kill -9` of the primary, or SIGSTOP until a replica is promoted and then SIGCONT
    (the stale primary serves its old connections until the Sentinels demote it), twice in
    one run under load."""
    pool = start_pool(
        url=sentinels.url,
        ranks=2,
        decode_batch=4,
        kv_slots_per_rank=12,
        max_model_len=512,
        rank_timeout_s=3,
    )
    client = Client(sentinels.url)
    assert client.min_replicas_ack == 1  # behind Sentinels, accepted means replicated
    loaded = load_reference_model(pool.settings)
    rng = random.Random(21)
    cases = [
        (
            f"ha{i}",
            random_prompt(rng, rng.randrange(3, 120), loaded.config.vocab_size),
            rng.randrange(60, 140),
        )
        for i in range(24)
    ]
    submitted: list[str] = []
    readers: list[Reader] = []

    def produce() -> None:  # a steady load: a request every 50 ms, retried as producers do
        for request_id, prompt, max_tokens in cases:
            submit = functools.partial(
                client.submit,
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                ignore_eos=True,
                request_id=request_id,
            )
            retried(submit)
            submitted.append(request_id)
            reader = Reader(Client(sentinels.url), request_id)
            reader.start()
            readers.append(reader)
            time.sleep(0.05)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    total = sum(m for _, _, m in cases)
    for share in (0.2, 0.5):
        wait_until(
            lambda s=share: published(client, [c[0] for c in cases]) > total * s,
            timeout_s=180,
            what=f"{share:.0%} of the tokens",
        )
        sentinels.kill_primary() if failure == "kill" else sentinels.pause_primary()
    producer.join(120)
    assert submitted == [c[0] for c in cases]  # every producer call was answered in the end

    runner = reference_runner(loaded, pool.settings)
    for (request_id, prompt, max_tokens), reader in zip(cases, readers):
        chunks = retried(lambda r=request_id: list(client.stream(r, timeout_s=180)))  # type: ignore[arg-type]
        tokens = check_stream(chunks)  # type: ignore[arg-type]  # no gap, no duplicate
        want = generate_alone(runner, prompt, max_tokens, set(), pool.settings.max_model_len)
        problem = first_divergence(tokens, want, TIE_TOLERANCE)
        assert problem is None, f"{request_id}: {problem}"
        reader.join(60)
        assert reader.done and not reader.changed, (request_id, reader.changed[:2])
        final = {c.seq: c for c in chunks}  # type: ignore[union-attr]
        differ = [
            (chunk, final.get(seq)) for seq, chunk in reader.seen.items() if final.get(seq) != chunk
        ]
        assert not differ, (request_id, differ[:2])
    wait_until(
        lambda: retried(lambda: client.redis.xlen(KEYS.requests)) == 0,
        timeout_s=60,
        what="every entry settled",
    )
    dead = retried(lambda: client.redis.xrange(KEYS.dead))
    for _, fields in dead:  # type: ignore[union-attr]
        # only a producer's retry of a call whose answer was lost: the original answered
        assert b"duplicates a request in progress" in fields[b"reason"], fields


def test_a_sentinel_url_names_the_sentinels_and_the_primary() -> None:
    address = sentinel_address("redis+sentinel://:secret@10.0.0.1:26379,h2/mymaster/3")
    assert address is not None
    assert address.sentinels == (("10.0.0.1", 26379), ("h2", 26379))
    assert (address.service, address.db, address.password, address.ssl) == (
        "mymaster",
        3,
        "secret",
        False,
    )
    tls = sentinel_address("rediss+sentinel://h:1/m")
    assert tls is not None and tls.ssl
    assert sentinel_address("redis://h:6379/0") is None
    for bad in ("redis+sentinel://h:1", "redis+sentinel://h:port/m", "redis+sentinel://h/m/x"):
        with pytest.raises(ValueError, match="Sentinel"):
            sentinel_address(bad)
    assert replicas_to_wait("redis+sentinel://h/m", None) == 1
    assert replicas_to_wait("redis://h/0", None) == 0
    assert replicas_to_wait("redis+sentinel://h/m", 0) == 0
    assert Settings(min_replicas_ack=2).min_replicas_ack == 2


def test_a_wait_that_times_out_is_not_replicated_and_retryable(redis_url: str) -> None:
    client = Client(redis_url, min_replicas_ack=1)  # a lone server has no replica to wait for
    started = time.monotonic()
    with pytest.raises(NotReplicated, match="reached 0 of the 1 replicas"):
        client.submit("hello", request_id="lonely", max_tokens=2)
    assert time.monotonic() - started < 5
    assert isinstance(NotReplicated("x", 0, 1), redis.ConnectionError)  # retryable
    with connect(redis_url) as plain:
        assert plain.xlen(KEYS.requests) == 1  # it reached the primary all the same


def test_a_client_leaves_a_server_that_is_no_longer_the_primary(
    sentinels: SentinelDeployment,
) -> None:
    client = connect(sentinels.url)
    client.set("k", "1")
    assert still_primary(client)
    old = sentinels.primary_port()
    # a primary that may not write (NOREPLICAS) is left as a demoted one is
    primary = redis.Redis(port=old)
    primary.config_set("min-replicas-to-write", 3)
    with pytest.raises(redis.ConnectionError, match="demoted"):
        client.set("k", "2")
    primary.config_set("min-replicas-to-write", 0)
    client.set("k", "3")
    # after a promotion, the server this thread wrote to is no longer the primary
    redis.Redis(port=sentinels.sentinel_ports[0]).execute_command("SENTINEL FAILOVER", SERVICE)
    wait_until(lambda: not still_primary(client), timeout_s=30, what="the promotion seen")
    # (no server counts as the primary until a Sentinel besides the failover's leader names it)
    wait_until(
        lambda: retried(lambda: client.set("k", "4")) and still_primary(client),
        what="a write on the server the Sentinels name",
    )
    assert client.connection_pool.connection_kwargs["connection_pool"].master_address[1] != old


def test_an_entry_is_settled_only_where_its_final_chunk_is(redis_url: str) -> None:
    """The batcher may read a final chunk on a primary and settle on the promoted replica,
    which never got it: the entry must stay there, to be resumed."""
    client = redis.Redis.from_url(redis_url)
    stream, result = KEYS.requests, KEYS.result("r1")
    client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    entry_id = client.xadd(stream, {"m": b"x"})
    client.xreadgroup(GROUP, "pool-a", {stream: ">"})
    settle = client.register_script(SETTLE_SCRIPT)

    def settled() -> bool:
        return bool(settle(keys=[stream, result], args=[GROUP, entry_id]))

    assert not settled()  # no result stream at all
    client.xadd(result, {"m": b"c0", "seq": 0, "final": "0"})
    assert not settled()  # chunks, but not the final one
    assert client.xlen(stream) == 1 and client.xpending(stream, GROUP)["pending"] == 1
    client.xadd(result, {"m": b"c1", "seq": 1, "final": "1"})
    assert settled()
    assert client.xlen(stream) == 0 and client.xpending(stream, GROUP)["pending"] == 0


def test_no_primary_is_named_while_a_failover_runs(sentinels: SentinelDeployment) -> None:
    # what the Sentinels answer now, then the moments of a failover when a paused old
    # primary answers again: its leader raises the epoch at the promotion but marks the old
    # primary down (redis-py's check rejects that answer) and names it until the failover
    # ends; a Sentinel not yet told names it under the old epoch, no longer down
    states = [redis.Redis(port=p).sentinel_master(SERVICE) for p in sentinels.sentinel_ports]
    usable = EpochSentinel([]).check_master_state
    old = (states[0]["ip"], int(states[0]["port"]))

    def newest(*answers: dict[str, object]) -> tuple[str, int]:
        return _newest(list(answers), SERVICE, lambda s: usable(s, SERVICE))

    assert newest(*states) == old
    epoch = int(states[0]["config-epoch"])
    running = {"master", "s_down", "o_down", "failover_in_progress"}
    leader = states[0] | {"config-epoch": epoch + 1, "flags": running}
    leader |= {"is_sdown": True, "is_odown": True}
    assert not usable(leader, SERVICE)
    behind = states[1] | {"config-epoch": epoch}
    with pytest.raises(MasterNotFoundError, match="failover"):
        newest(leader, behind)
    told = states[2] | {"config-epoch": epoch + 1, "ip": "127.0.0.1", "port": 1}
    with pytest.raises(MasterNotFoundError, match="failover"):
        newest(leader, behind, told)
    # an answer rejected as down still counts for the newest epoch
    down = states[0] | {"config-epoch": epoch + 1, "flags": {"master", "s_down", "o_down"}}
    down |= {"is_sdown": True, "is_odown": True}
    with pytest.raises(MasterNotFoundError, match="newest epoch"):
        newest(down, behind)
    ended = states[0] | {"config-epoch": epoch + 1, "ip": "127.0.0.1", "port": 1}
    assert newest(ended, behind, told) == ("127.0.0.1", 1)
