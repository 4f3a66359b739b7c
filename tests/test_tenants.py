"""Tenants share a pool: weights hold in the planner, each tenant's `max_queue` holds at
admission while others are still admitted, unknown tenants are refused when a tenants file
requires it, and one tenant's flood does not hold back another's requests, across a
batcher restart too."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from batcher.fairness import TenantShare, fair_order, fair_shares, prefill_order
from batcher.limits import publish_tenants
from batcher.scheduler import PlannerConfig, PoolState, Sequence, finish, plan_step
from producer.client import Client, QueueFull, UnknownTenant
from schemas.codec import encode
from schemas.config import Settings
from schemas.keys import Keys
from schemas.messages import FinishReason, GenerateRequest
from schemas.tenants import TenantsFileError, load_tenants, request_streams
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


def tenants_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def outstanding(redis_client: redis.Redis) -> int:
    return sum(int(redis_client.xlen(s)) for s in request_streams(redis_client, KEYS))


# -- the tenants file ---------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[tenants.a]\nweight = 0\n", "tenants.a.weight: Input should be greater than 0"),
        ("[tenants.a]\nmax_queue = 0\n", "tenants.a.max_queue"),
        ("[tenants.a]\nquota = 3\n", "tenants.a.quota: Extra inputs are not permitted"),
        ("[tenants.'no spaces']\n", "tenants.no spaces"),
        ("[tenants.a]\napi_keys = ['k']\n[tenants.b]\napi_keys = ['k']\n", "both 'a' and 'b'"),
        ("[tenants.a\n", "not TOML"),
        ("", "tenants: Field required"),
    ],
)
def test_a_bad_tenants_file_is_refused_saying_where(tmp_path: Path, text: str, says: str) -> None:
    path = tenants_file(tmp_path, text)
    with pytest.raises(TenantsFileError, match="tenants file") as caught:
        load_tenants(path)
    assert says in str(caught.value)
    with pytest.raises(ValueError, match="tenants file"):
        Settings(tenants=str(path))


@pytest.mark.fast
def test_a_missing_tenants_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TenantsFileError, match="No such file"):
        load_tenants(tmp_path / "absent.toml")


# -- admission ----------------------------------------------------------------------------


@pytest.mark.fast
def test_a_tenant_over_its_max_queue_is_refused_while_another_is_admitted(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    path = tenants_file(tmp_path, "[tenants.batch]\nmax_queue = 3\n[tenants.web]\nweight = 2\n")
    publish_tenants(redis_client, KEYS, load_tenants(path))
    redis_client.hset(KEYS.limits, "max_queue", 6)  # the namespace's bound, as a pool sets it
    with Client(redis_url, tenant="batch") as batch, Client(redis_url, tenant="web") as web:
        accepted = [batch.submit("x", priority=p) for p in (0, 2, -1)]  # over three classes
        with pytest.raises(QueueFull, match="tenant 'batch' has 3") as caught:
            batch.submit("x")
        assert caught.value.tenant == "batch" and caught.value.max_queue == 3
        accepted += [web.submit("y"), web.submit("y", priority=5), web.submit("y")]
        with pytest.raises(QueueFull, match="queue full: 6 outstanding") as full:
            web.submit("y")  # the global bound still holds
        assert full.value.tenant is None
    assert outstanding(redis_client) == len(accepted) == 6  # nothing accepted was lost
    queued = {s: t.decode() for s, t in redis_client.hgetall(KEYS.queues).items()}
    assert sorted(Counter(queued.values()).items()) == [("batch", 3), ("web", 2)]


@pytest.mark.fast
def test_an_unknown_tenant_is_refused_only_when_a_tenants_file_requires_it(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    with Client(redis_url) as client:
        client.submit("x", tenant="anyone")  # no file: any name
        publish_tenants(redis_client, KEYS, load_tenants(tenants_file(tmp_path, "[tenants.a]\n")))
        with pytest.raises(UnknownTenant, match="unknown tenant 'anyone'"):
            client.submit("x", tenant="anyone")
        client.submit("x", tenant="a")
        client.submit("x")  # `default` is always allowed
        publish_tenants(redis_client, KEYS, None)
        client.submit("x", tenant="anyone")
    assert outstanding(redis_client) == 4


@pytest.mark.fast
def test_a_tenant_name_must_be_short_and_plain(redis_url: str) -> None:
    with Client(redis_url) as client, pytest.raises(ValueError, match="tenant"):
        client.submit("x", tenant="a b")


# -- the planner --------------------------------------------------------------------------


def make_seq(name: str, tenant: str, order: int, max_new: int, priority: int = 0) -> Sequence:
    seq = Sequence(name, 4, max_new, order, urgency=float(priority), priority=priority)
    seq.tenant = tenant
    return seq


@pytest.mark.fast
def test_the_fair_order_serves_tenants_by_held_over_weight_within_a_class() -> None:
    seqs = [make_seq(f"a{i}", "a", i, 1) for i in range(6)]
    seqs += [make_seq(f"b{i}", "b", 10 + i, 1) for i in range(6)]
    seqs.append(make_seq("urgent", "c", 99, 1, priority=3))
    seqs.sort(key=lambda s: (-s.urgency, s.order))
    tenants = {"a": TenantShare(weight=3.0)}
    order = [s.request_id for s in fair_order(seqs, {"c": 5}, tenants, capacity=8)]
    assert order[0] == "urgent"  # a higher class first, whoever holds what
    # shares of 8 slots: a 4.8, b 1.6, c 1.6; each next one to the tenant furthest below
    # its share: a from 4.8, 3.8, 2.8, 1.8 before b's 1.6, then alternating
    assert order[1:] == ["a0", "a1", "a2", "a3", "b0", "a4", "b1", "a5", "b2", "b3", "b4", "b5"]
    assert fair_shares(["a", "b"], 8, tenants) == {"a": 6.0, "b": 2.0}
    capped = {"a": TenantShare(weight=3.0, max_running=2)}
    assert fair_shares(["a", "b", "c"], 8, capped) == {"a": 2.0, "b": 3.0, "c": 3.0}


def simulate_backlog(
    weights: list[int], capacity: int, num_ranks: int, lengths: list[int], preempt: bool
) -> tuple[list[Counter[str]], list[Counter[str]], dict[str, float]]:
    """Tenant t0 takes the whole pool first, then every tenant keeps a backlog: the running
    requests of each tenant after every step, tokens planned per tenant, and the shares."""
    tenants = {f"t{i}": TenantShare(weight=float(w)) for i, w in enumerate(weights)}
    config = PlannerConfig(
        num_ranks=num_ranks,
        max_num_seqs=capacity,
        kv_slots_per_rank=-(-capacity // num_ranks),
        decode_batch=8,
        prefill_chunk=16,
        prefill_slots=4,
        preempt_margin=3.0 if preempt else None,
        tenants=tenants,
    )
    state = PoolState(config)
    order = 0

    def arrive(tenant: str) -> None:
        nonlocal order
        state.waiting.append(
            make_seq(f"{tenant}-{order}", tenant, order, lengths[order % len(lengths)])
        )
        order += 1

    for _ in range(capacity):
        arrive("t0")
    plan_step(state)
    occupancy: list[Counter[str]] = []
    tokens: list[Counter[str]] = []
    releasing: list[Sequence] = []
    for _ in range(120):
        for seq in releasing:  # a preempted request re-enters, as the book resumes it
            finish(state, seq.request_id)
            again = make_seq(seq.request_id, seq.tenant, seq.order, seq.max_new_tokens)
            state.waiting.append(again)
        for tenant in tenants:  # every tenant stays backlogged
            while sum(1 for s in state.waiting if s.tenant == tenant) < capacity:
                arrive(tenant)
        plan = plan_step(state)
        running = state.running.values()  # the planner's own counts agree with a recount
        assert state.occupancy == Counter(s.tenant for s in running if not s.stopping)
        assert state.leaving == sum(s.stopping for s in running)
        releasing = list(plan.preempted)
        step_tokens: Counter[str] = Counter()
        for launch in plan.decode_launches:
            for rows in launch.values():
                step_tokens.update(s.tenant for s in rows)
        tokens.append(step_tokens)
        occupancy.append(Counter(s.tenant for s in state.running.values() if not s.preempting))
        for seq in list(state.running.values()):
            if not seq.preempting and seq.num_planned_tokens >= seq.max_new_tokens:
                finish(state, seq.request_id)
    shares = fair_shares(tenants, capacity, tenants)
    return occupancy, tokens, shares


@pytest.mark.fast
def test_prefill_shares_tokens_by_weight_and_starves_no_prompt() -> None:
    tenants = {"a": TenantShare(weight=2.0)}
    seqs = [make_seq(f"a{i}", "a", i, 1) for i in range(6)]  # 4-token prompts
    seqs += [make_seq(f"b{i}", "b", 10 + i, 1) for i in range(6)]
    order = [s.request_id for s in prefill_order(seqs, {"b": 4.0}, tenants, most_tokens=512)]
    # virtual times: a from 0 by 4 / 2 a prompt, b from 4 by 4 (ties: the older head)
    assert order == ["a0", "a1", "a2", "b0", "a3", "a4", "b1", "a5", "b2", "b3", "b4", "b5"]

    # t0 holds more slots than its share with requests that end at their prefill, and t1's
    # new prompts keep arriving: t0's prompts are still prefilled, slots turn over, and
    # the occupancy settles at the shares (ordered by decoding rows, t0's never were)
    occupancy, _, shares = simulate_backlog([1, 2], 14, 1, [1], preempt=False)
    for running in occupancy[60:]:
        assert all(abs(running[t] - share) < 1 + 1e-9 for t, share in shares.items()), running


@pytest.mark.fast
@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    capacity=st.integers(4, 32),
    num_ranks=st.integers(1, 4),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    preempt=st.booleans(),
)
def test_backlogged_tenants_hold_slots_in_proportion_to_their_weights(
    weights: list[int], capacity: int, num_ranks: int, lengths: list[int], preempt: bool
) -> None:
    occupancy, tokens, shares = simulate_backlog(weights, capacity, num_ranks, lengths, preempt)
    # with preemption a tenant reaches its share at once; without, as slots turn over
    settled = occupancy[2:] if preempt else occupancy[60:]
    for step, running in enumerate(settled):
        assert sum(running.values()) <= capacity
        for tenant, share in shares.items():
            assert abs(running[tenant] - share) < 1 + 1e-9, (step, tenant, running, shares)
    if min(lengths) < 8:
        return  # short requests: prefill, not the slots, decides who gets tokens
    served = sum((Counter(t) for t in tokens[60:]), Counter())
    total = sum(served.values())
    for tenant, share in shares.items():
        # decode tokens follow occupancy: within a slot's worth of the share
        assert abs(served[tenant] / total - share / capacity) <= 1 / capacity + 1e-9


@pytest.mark.fast
def test_an_idle_tenants_share_goes_to_the_others() -> None:
    occupancy, _, _ = simulate_backlog([1, 3], 8, 2, [4, 7, 2], preempt=True)
    assert occupancy[1]["t0"] + occupancy[1]["t1"] == 8
    state = PoolState(
        PlannerConfig(1, 8, 8, 8, 16, 4, preempt_margin=3.0, tenants={"b": TenantShare(3.0)})
    )
    state.waiting = [make_seq(f"a{i}", "a", i, 50) for i in range(12)]
    plan_step(state)
    assert len(state.running) == 8  # b has nothing waiting: a takes every slot
    for _ in range(5):
        assert not plan_step(state).preempted


@pytest.mark.fast
def test_fairness_never_preempts_a_more_important_class() -> None:
    state = PoolState(PlannerConfig(1, 4, 4, 8, 16, 4, preempt_margin=3.0))
    state.waiting = [make_seq(f"a{i}", "a", i, 50, priority=2) for i in range(4)]
    plan_step(state)
    state.waiting = [make_seq(f"b{i}", "b", 10 + i, 50, priority=1) for i in range(4)]
    assert not plan_step(state).preempted
    state.waiting.append(make_seq("b-same", "b", 20, 50, priority=2))
    preempted = plan_step(state).preempted
    assert [s.tenant for s in preempted] == ["a"]  # b's class-2 request takes one back


@pytest.mark.fast
def test_max_running_caps_a_tenant_even_with_slots_free() -> None:
    tenants = {"a": TenantShare(max_running=2)}
    state = PoolState(PlannerConfig(1, 8, 8, 8, 16, 4, tenants=tenants))
    state.waiting = [make_seq(f"a{i}", "a", i, 5) for i in range(6)]
    state.waiting += [make_seq(f"b{i}", "b", 10 + i, 5) for i in range(3)]
    plan_step(state)
    assert Counter(s.tenant for s in state.running.values()) == {"a": 2, "b": 3}


# -- a real pool --------------------------------------------------------------------------

FLOOD_TOKENS = 48
B_TOKENS = 8


def submit_flood(redis_url: str, prompts: dict[str, list[int]], tenant: str, tokens: int) -> None:
    with Client(redis_url, tenant=tenant) as client:
        for request_id, prompt in prompts.items():
            client.submit(
                prompt_token_ids=prompt, max_tokens=tokens, request_id=request_id, ignore_eos=True
            )


def finished_before(redis_client: redis.Redis, request_id: str) -> tuple[int, int]:
    ((entry_id, _),) = redis_client.xrevrange(KEYS.result(request_id), count=1)
    ms, seq = entry_id.decode().split("-")
    return int(ms), int(seq)


def test_a_flood_of_one_tenant_does_not_hold_back_another_across_a_batcher_restart(
    start_pool, tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    path = tenants_file(tmp_path, "[tenants.flood]\n[tenants.web]\n")
    pool = start_pool(max_num_seqs=4, kv_slots_per_rank=4, max_model_len=256, tenants=str(path))
    settings_ = pool.settings
    loaded = load_reference_model(settings_)
    rng = random.Random(38)
    vocab = loaded.config.vocab_size
    flood = {f"flood-{i}": random_prompt(rng, 12, vocab) for i in range(60)}
    web = {f"web-{i}": random_prompt(rng, 12, vocab) for i in range(4)}
    submit_flood(redis_url, flood, "flood", FLOOD_TOKENS)
    wait_until(lambda: redis_client.xlen(KEYS.result("flood-0")) > 0, what="the flood to run")
    submit_flood(redis_url, web, "web", B_TOKENS)
    pool.processes.kill("batcher")  # its successor takes every entry back, in the same order
    with Client(redis_url) as client:
        streams = {r: list(client.stream(r, timeout_s=240)) for r in [*web, *flood]}
    tokens = {r: check_stream(chunks) for r, chunks in streams.items()}  # each exactly once
    for request_id, chunks in streams.items():
        assert chunks[-1].finish_reason == FinishReason.LENGTH
        assert chunks[-1].tenant == request_id.split("-")[0]
    last_web = max(finished_before(redis_client, r) for r in web)
    ahead = [r for r in flood if finished_before(redis_client, r) < last_web]
    assert len(ahead) < 20, f"{len(ahead)} of 60 flood requests finished before web's last"
    runner = reference_runner(loaded, settings_)
    for request_id, prompt, max_tokens in [
        ("web-0", web["web-0"], B_TOKENS),
        ("web-3", web["web-3"], B_TOKENS),
        ("flood-1", flood["flood-1"], FLOOD_TOKENS),
    ]:
        want = generate_alone(runner, prompt, max_tokens, set(), settings_.max_model_len)
        problem = first_divergence(tokens[request_id], want, TIE_TOLERANCE)
        assert problem is None, (request_id, problem)


def test_a_raw_request_of_an_unknown_tenant_ends_rejected(
    start_pool, tmp_path: Path, redis_client: redis.Redis, client: Client
) -> None:
    start_pool(max_model_len=256, tenants=str(tenants_file(tmp_path, "[tenants.a]\n")))
    raw = GenerateRequest(id="stranger", prompt="hello", tenant="nobody")
    redis_client.xadd(KEYS.requests, {"m": encode(raw)})  # past the admission script
    final = list(client.stream("stranger", timeout_s=60))[-1]
    assert final.finish_reason == FinishReason.REJECTED
    assert final.error is not None and final.error.code == "invalid_request"
    assert "unknown tenant 'nobody'" in final.error.message
    done = client.generate("hello", tenant="a", max_tokens=4, timeout_s=60)
    assert done.finish_reason == FinishReason.LENGTH  # the pool went on
    wait_until(lambda: outstanding(redis_client) == 0, what="both entries to be settled")
