"""Tenants sharing one pool: the goals of bench/RESULTS.md ("Tenants").

- flood: tenant B sends 20 requests to an idle pool (its TTFT there), then tenant A floods
  500 and 2 s later B sends 20 again: B's TTFT p95 against the idle one, and A's part of the
  tokens served while B's requests run (weights 1:1);
- weights: tenants of weights 3 and 1 both keep a backlog; the tokens each is served in
  every 10 s window after the first;
- planner: `plan_step` on a full pool (64 running, 64 waiting, 8 ranks) with one tenant and
  with 32, preemption on.

Times come from the result streams' entry ids (Redis's clock) and the submit calls (this
host's clock, the same host). Not part of CI:

    python -m bench.probes.tenants --model tiny --json bench/out/tenants.json
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path
from typing import Any, cast

from batcher.fairness import TenantShare
from batcher.scheduler import PlannerConfig, PoolState, Sequence, finish, plan_step
from npu_pool.embedded import EmbeddedRedis
from npu_pool.launcher import PoolProcesses
from producer.client import Client
from schemas.codec import decode
from schemas.config import Settings
from schemas.connection import Entry
from schemas.keys import FIELD, Keys
from schemas.messages import ResultChunk

KEYS = Keys()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.tenants", description=__doc__)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--flood", type=int, default=500, help="tenant A's requests")
    parser.add_argument("--burst", type=int, default=20, help="tenant B's requests")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--weights-s", type=float, default=40.0, help="the 3:1 run's length")
    parser.add_argument("--weights-len", type=int, default=200, help="the 3:1 run's outputs")
    parser.add_argument("--only", choices=("flood", "weights"), default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"planner_us": planner_us()}
    print(f"planner: {report['planner_us']}", file=sys.stderr)
    workdir = Path(tempfile.mkdtemp(prefix="npupool-tenants-"))
    tenants = workdir / "tenants.toml"
    tenants.write_text(
        "[tenants.a]\n[tenants.b]\n[tenants.heavy]\nweight = 3\n[tenants.light]\nweight = 1\n"
    )
    server = EmbeddedRedis(data_dir=workdir / "redis")
    url = server.start()
    settings = Settings(
        redis_url=url,
        model=args.model,
        ranks=args.ranks,
        max_num_seqs=args.max_num_seqs,
        kv_slots_per_rank=-(-args.max_num_seqs // args.ranks),
        max_model_len=256,
        tenants=str(tenants),
    )
    processes = PoolProcesses(settings, url, log_dir=workdir / "logs")
    try:
        processes.start()
        with Client(url) as client:
            client.wait_ready(timeout_s=600)
            if args.only in (None, "flood"):
                report["flood"] = flood(client, args)
                print(f"flood: {json.dumps(report['flood'])}", file=sys.stderr)
            if args.only in (None, "weights"):
                report["weights"] = weights(client, args)
                print(f"weights: {json.dumps(report['weights'])}", file=sys.stderr)
    finally:
        processes.stop(timeout_s=30)
        server.stop()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


def submit(client: Client, tenant: str, n: int, tokens: int, tag: str) -> dict[str, float]:
    """Submit `n` requests of `tenant`; their ids -> submit time (ms, this host's clock)."""
    rng = random.Random(tag)
    sent: dict[str, float] = {}
    for i in range(n):
        request_id = f"{tag}-{i}"
        prompt = [rng.randrange(2, 200) for _ in range(16)]
        sent[request_id] = time.time() * 1000
        client.submit(
            prompt_token_ids=prompt,
            max_tokens=tokens,
            request_id=request_id,
            tenant=tenant,
            ignore_eos=True,
        )
    return sent


def token_times(client: Client, request_id: str) -> list[tuple[float, int]]:
    """(ms, tokens) of each chunk of a request's result stream."""
    found = []
    entries = cast(list[Entry], client.redis.xrange(KEYS.result(request_id)))
    for entry_id, fields in entries:
        chunk = decode(ResultChunk, fields[FIELD.encode()])
        found.append((float(entry_id.split(b"-")[0]), len(chunk.token_ids)))
    return found


def ttfts(client: Client, sent: dict[str, float]) -> list[float]:
    """Each request's time to its first token, ms (waits for every final chunk)."""
    out = []
    for request_id, at in sent.items():
        client.result(request_id, timeout_s=600)
        first = next(ms for ms, n in token_times(client, request_id) if n)
        out.append(first - at)
    return out


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) > 1 else values[0]


def flood(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    idle = ttfts(client, submit(client, "b", args.burst, args.output_len, "idle"))
    flood_sent: dict[str, float] = {}
    thread = threading.Thread(
        target=lambda: flood_sent.update(submit(client, "a", args.flood, args.output_len, "flood"))
    )
    thread.start()
    time.sleep(2.0)
    b_sent = submit(client, "b", args.burst, args.output_len, "busy")
    busy = ttfts(client, b_sent)
    thread.join()
    start = min(b_sent.values())
    end = max(ms for r in b_sent for ms, _ in token_times(client, r))
    tokens = {"a": 0, "b": 0}
    for tenant, ids in (("a", list(flood_sent)), ("b", list(b_sent))):
        for request_id in ids:
            tokens[tenant] += sum(
                n for ms, n in token_times(client, request_id) if start <= ms <= end
            )
    timeline = running_timeline(client, {"a": list(flood_sent), "b": list(b_sent)}, start, end)
    for request_id in flood_sent:  # let the flood drain before the next run
        client.result(request_id, timeout_s=1200)
    return {
        "idle_ttft_ms": {"p50": statistics.median(idle), "p95": p95(idle)},
        "flooded_ttft_ms": {"p50": statistics.median(busy), "p95": p95(busy)},
        "ttft_p95_ratio": p95(busy) / p95(idle),
        "b_active_ms": end - start,
        "tokens_while_b_active": tokens,
        "a_share": tokens["a"] / max(1, sum(tokens.values())),
        "decoding_per_20ms": timeline,
    }


def running_timeline(
    client: Client, ids: dict[str, list[str]], start: float, end: float
) -> list[dict[str, int]]:
    """Per 20 ms from `start` to `end`: each tenant's requests between their first token
    and their last (decoding then)."""
    buckets = [dict.fromkeys(ids, 0) for _ in range(int((end - start) // 20) + 1)]
    for tenant, request_ids in ids.items():
        for request_id in request_ids:
            times = [ms for ms, n in token_times(client, request_id) if n]
            if not times:
                continue
            for k, bucket in enumerate(buckets):
                at = start + 20 * k
                if times[0] <= at <= times[-1]:
                    bucket[tenant] += 1
    return buckets


def weights(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    per_tenant = int(args.weights_s * 60)  # more than the pool serves in the run
    heavy = submit(client, "heavy", per_tenant, args.weights_len, "heavy")
    light = submit(client, "light", per_tenant, args.weights_len, "light")
    start = max(min(heavy.values()), min(light.values()))
    time.sleep(args.weights_s)
    windows: list[dict[str, int]] = []
    bounds = [start + 10_000 * k for k in range(int(args.weights_s // 10) + 1)]
    counts = {name: [0] * (len(bounds) - 1) for name in ("heavy", "light")}
    for name, sent in (("heavy", heavy), ("light", light)):
        for request_id in sent:
            for ms, n in token_times(client, request_id):
                k = int((ms - start) // 10_000)
                if 0 <= k < len(bounds) - 1:
                    counts[name][k] += n
    for k in range(len(bounds) - 1):
        windows.append({"heavy": counts["heavy"][k], "light": counts["light"][k]})
    for request_id in [*heavy, *light]:
        client.cancel(request_id)
    after_first = windows[1:]
    return {
        "windows_10s": windows,
        "ratios_after_first": [w["heavy"] / max(1, w["light"]) for w in after_first],
    }


def planner_us(repeat: int = 2000) -> dict[str, float]:
    """`plan_step` on a full pool with one tenant and with 32, alternated five times."""
    found: dict[str, list[float]] = {"1": [], "32": []}
    for _ in range(5):
        for count in ("1", "32"):
            state = full_pool(int(count))
            runs = timeit.repeat(functools.partial(plan_step, state), number=repeat, repeat=3)
            found[count].append(min(runs) / repeat * 1e6)
    return {f"tenants_{k}": round(statistics.median(v), 1) for k, v in found.items()}


def full_pool(num_tenants: int) -> PoolState:
    """bench/planner.py's full pool (64 running, 64 waiting, 8 ranks of 8 slots), preemption
    on, its requests spread over `num_tenants` tenants of weights 1..4."""
    tenants = {f"t{i}": TenantShare(weight=float(1 + i % 4)) for i in range(num_tenants)}
    config = PlannerConfig(
        num_ranks=8,
        max_num_seqs=64,
        kv_slots_per_rank=8,
        decode_batch=8,
        prefill_chunk=128,
        prefill_slots=4,
        preempt_margin=3.0,
        tenants=tenants if num_tenants > 1 else {},
    )
    state = PoolState(config)
    for i in range(64):
        seq = Sequence(f"r{i}", 100, 10**9, i)
        seq.tenant = f"t{i % num_tenants}"
        state.waiting.append(seq)
    plan_step(state)
    for seq in state.running.values():
        seq.num_prefilled = seq.num_prompt_tokens
    state.waiting = []
    for i in range(64):
        seq = Sequence(f"w{i}", 300, 64, 64 + i)
        seq.tenant = f"t{i % num_tenants}"
        state.waiting.append(seq)
    for _ in range(20):  # apply the shares' preemptions: the pool full, fair, a backlog
        plan = plan_step(state)
        for seq in plan.preempted:
            finish(state, seq.request_id)
            again = Sequence(seq.request_id, 300, 64, seq.order)
            again.tenant = seq.tenant
            state.waiting.append(again)
        for seq in state.running.values():
            seq.num_prefilled = seq.num_prompt_tokens
        if not plan.preempted and not plan.admitted:
            break
    return state


if __name__ == "__main__":
    sys.exit(main())
