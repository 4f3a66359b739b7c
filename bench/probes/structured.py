"""Constrained output's goals (bench/RESULTS.md, "Structured output"):

- validity: `--answers` schema-constrained chat answers through the gateway with the
  `openai` package's `beta.chat.completions.parse` (four schemas: nested objects, enums,
  arrays with bounds, required fields; sampled, a seed each), counted as parsed and
  validated; meanwhile plain greedy requests run in the same launches and their tokens are
  compared with the same requests run before, alone;
- throughput: the same prompts twice at once, constrained (JSON schema) and then plain with
  each request's `max_tokens` set to the length its constrained answer had (`ignore_eos`),
  so both runs generate exactly the same number of tokens; tokens/s of each, from the
  first submit to the last final chunk (Redis's clock);
- mask cost: in this process, llguidance's mask for the schema over the model's vocabulary,
  per token of a valid answer (median, p90), and applying it to a row of logits.

Not part of CI:

    python -m bench.probes.structured --model smollm2 --json bench/out/structured.json
    python -m bench.probes.structured --model tiny --mtp
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import torch
from pydantic import BaseModel, Field, ValidationError

from npu_pool.embedded import EmbeddedRedis
from npu_pool.launcher import PoolProcesses
from npu_worker.constraints import Constraints
from npu_worker.logits import mask
from npu_worker.weights.presets import resolve_model_dir
from producer.client import Client
from schemas.config import Settings
from schemas.connection import Entry
from schemas.constraints import JsonSchema
from schemas.keys import Keys

KEYS = Keys()


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: Literal["NO", "SE", "DK", "FI", "other"]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    address: Address


class Inventory(BaseModel):
    items: list[Annotated[str, Field(max_length=30)]] = Field(min_length=1, max_length=4)
    counts: list[Annotated[int, Field(ge=0, le=1000)]] = Field(min_length=1, max_length=4)


class Verdict(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confidence: int = Field(ge=0, le=100)  # percent: a float's digits have no bound
    reasons: list[Annotated[str, Field(max_length=40)]] = Field(max_length=3)


class Event(BaseModel):
    title: str = Field(max_length=30)
    day: Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
    attendees: list[Person] = Field(max_length=2)


SCHEMAS: list[tuple[type[BaseModel], str]] = [
    (Person, "Describe a person as JSON."),
    (Inventory, "List what is in a kitchen as JSON."),
    (Verdict, "Is 'I loved this film' positive? Answer as JSON."),
    (Event, "Describe a meeting as JSON."),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.structured", description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--mtp", action="store_true")
    parser.add_argument("--answers", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--throughput-requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="alternated throughput pairs")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="npupool-structured-"))
    server = EmbeddedRedis(data_dir=workdir / "redis")
    url = server.start()
    settings = Settings(
        redis_url=url, model=args.model, ranks=1, mtp=args.mtp, max_num_seqs=32,
        kv_slots_per_rank=32, max_model_len=512,
    )  # fmt: skip
    report: dict[str, Any] = {"model": args.model, "mtp": args.mtp}
    report["mask"] = mask_cost(settings)
    print(f"mask: {report['mask']}", file=sys.stderr)
    processes = PoolProcesses(settings, url, log_dir=workdir / "logs")
    gateway = None
    try:
        processes.start()
        with Client(url) as client:
            client.wait_ready(timeout_s=600)
            gateway, base = start_gateway(url, workdir)
            report["validity"] = validity(client, base, args, settings.model)
            print(f"validity: {report['validity']}", file=sys.stderr)
            report["throughput"] = throughput(client, args)
            print(f"throughput: {report['throughput']}", file=sys.stderr)
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=10)
        processes.stop(timeout_s=30)
        server.stop()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


def start_gateway(url: str, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`npu-pool gateway` on a free port; (its process, its /v1 URL) once it is ready."""
    import socket

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(workdir / "gateway.log", "wb")  # noqa: SIM115 - lives as long as the gateway
    process = subprocess.Popen(
        [sys.executable, "-m", "npu_pool.cli", "gateway", "--port", str(port), "--redis-url", url],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return process, base + "/v1"
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the gateway did not come up")


def validity(client: Client, base: str, args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Constrained answers parsed and validated, and plain greedy rows beside them."""
    import openai

    api = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    plain = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(8)]
    alone = [client.generate(prompt_token_ids=p, max_tokens=48, ignore_eos=True) for p in plain]

    def ask(i: int) -> tuple[str, str]:
        schema, question = SCHEMAS[i % len(SCHEMAS)]
        try:
            reply = api.beta.chat.completions.parse(
                model=model,
                messages=[{"role": "user", "content": question}],
                response_format=schema,
                max_tokens=args.max_tokens,
                temperature=0.7,
                seed=i,
            )
        except openai.LengthFinishReasonError:
            return schema.__name__, "length"
        message = reply.choices[0].message
        try:
            ok = message.parsed is not None and schema.model_validate_json(message.content or "")
        except ValidationError:
            return schema.__name__, "invalid"
        return schema.__name__, "valid" if ok else "invalid"

    with ThreadPoolExecutor(args.concurrency) as pool:
        answers = pool.map(ask, range(args.answers))
        beside = [client.submit(prompt_token_ids=p, max_tokens=48, ignore_eos=True) for p in plain]
        outcomes = list(answers)
    same = sum(
        client.result(rid, timeout_s=600).token_ids == want.token_ids
        for rid, want in zip(beside, alone)
    )
    counts: dict[str, int] = {}
    by_schema: dict[str, dict[str, int]] = {}
    for name, outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
        mine = by_schema.setdefault(name, {})
        mine[outcome] = mine.get(outcome, 0) + 1
    return {
        "answers": len(outcomes),
        "outcomes": counts,
        "by_schema": by_schema,
        "plain_same_tokens": f"{same}/{len(plain)}",
    }


def throughput(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    """`--repeats` alternated pairs of runs; the median ratio and each pair's figures."""
    pairs = [throughput_pair(client, args, seed) for seed in range(args.repeats)]
    ratios = sorted(p["ratio"] for p in pairs)
    return {"median_ratio": statistics.median(ratios), "pairs": pairs}


def throughput_pair(client: Client, args: argparse.Namespace, seed0: int) -> dict[str, Any]:
    """Tokens/s constrained and plain, on the same prompts and the same token counts."""
    n = args.throughput_requests
    questions = [SCHEMAS[i % len(SCHEMAS)] for i in range(n)]
    started = time.time() * 1000
    ids = [
        client.submit(
            messages=[{"role": "user", "content": q}],
            max_tokens=args.max_tokens,
            temperature=0.7,
            seed=seed0 * n + i,
            constraint=schema,
        )
        for i, (schema, q) in enumerate(questions)
    ]
    done = [client.result(rid, timeout_s=1200) for rid in ids]
    lengths = [len(d.token_ids) for d in done]
    constrained = _rate(client, ids, started, sum(lengths))
    started = time.time() * 1000
    ids = [
        client.submit(
            messages=[{"role": "user", "content": q}],
            max_tokens=length,
            temperature=0.7,
            seed=seed0 * n + i,
            ignore_eos=True,
        )
        for i, ((_, q), length) in enumerate(zip(questions, lengths))
    ]
    plain_done = [client.result(rid, timeout_s=1200) for rid in ids]
    plain = _rate(client, ids, started, sum(len(d.token_ids) for d in plain_done))
    return {
        "requests": n,
        "tokens": sum(lengths),
        "constrained_tokens_per_s": round(constrained, 1),
        "plain_tokens_per_s": round(plain, 1),
        "ratio": round(constrained / plain, 3),
    }


def _rate(client: Client, ids: list[str], started_ms: float, tokens: int) -> float:
    last = 0.0
    for rid in ids:
        entries = cast(list[Entry], client.redis.xrevrange(KEYS.result(rid), count=1))
        last = max(last, float(entries[0][0].split(b"-")[0]))
    return tokens / ((last - started_ms) / 1000)


def mask_cost(settings: Settings) -> dict[str, Any]:
    """llguidance's mask per token of a valid answer, and applying one to a logits row."""
    from tokenizers import Tokenizer

    model_dir = resolve_model_dir(settings.model)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    constraints = Constraints(
        tokenizer.to_str(), vocab, (tokenizer.token_to_id("<|im_end|>") or 0,)
    )
    built = time.perf_counter()
    _ = constraints.tokenizer
    setup_ms = (time.perf_counter() - built) * 1000
    grammar = JsonSchema(json_schema=Person.model_json_schema(), strict=True).compiled()
    text = '{"name":"Ann Berg","age":31,"address":{"city":"Oslo","country":"NO"}}'
    tokens = tokenizer.encode(text, add_special_tokens=False).ids
    per_token: list[float] = []
    for _ in range(20):
        matcher = constraints.matcher(grammar, [])
        for token in tokens:
            t0 = time.perf_counter()
            allowed = constraints.masks([matcher])
            per_token.append((time.perf_counter() - t0) * 1e6)
            if not bool(allowed[0, token]):
                break  # a non-canonical split; the walk stops, what it timed stays
            matcher.consume_token(token)
    logits = torch.randn(vocab)
    allowed_row = constraints.masks([constraints.matcher(grammar, [])])[0]
    apply_us = []
    for _ in range(200):
        row = logits.clone()
        t0 = time.perf_counter()
        mask(row, allowed_row)
        apply_us.append((time.perf_counter() - t0) * 1e6)
    per_token.sort()
    return {
        "vocab": vocab,
        "tokenizer_setup_ms": round(setup_ms, 1),
        "mask_us_median": round(statistics.median(per_token), 1),
        "mask_us_p90": round(per_token[int(len(per_token) * 0.9)], 1),
        "apply_us_median": round(statistics.median(apply_us), 1),
        "tokens_walked": len(per_token),
    }


if __name__ == "__main__":
    raise SystemExit(main())
