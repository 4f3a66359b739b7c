"""Offline batch jobs through RQ: every result in input order and none twice, across a killed
RQ worker; a plain `rq worker` serves batches too; bad input files are refused whole."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.client import Client
from schemas.keys import Keys
from tests.helpers import wait_until

KEYS = Keys()


def batch_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", "batch", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def start_worker(env: dict[str, str], log: Path, *command: str) -> subprocess.Popen[bytes]:
    command = command or (sys.executable, "-m", "npu_pool.cli", "batch", "worker")
    return subprocess.Popen(command, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def batch_field(client: redis.Redis, batch_id: str, field: str) -> str:
    value = client.hget(KEYS.batch(batch_id), field)
    return value.decode() if value is not None else ""


def write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_batch_of_200_survives_a_killed_rq_worker_in_order_and_without_repeats(
    start_pool, client: Client, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    start_pool(ranks=2, max_num_seqs=32)
    prompts = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"prompt_token_ids": [5, 6, 2 + i % 250], "max_tokens": 24, "ignore_eos": True}
            for i in range(200)
        ],
    )
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, REDIS_URL=redis_url)
    submitted = batch_cli(env, "submit", str(prompts), "--out", str(out), "--window", "16")
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    log = tmp_path / "worker.log"

    first = start_worker(env, log)
    second = None
    try:
        wait_until(
            lambda: int(batch_field(redis_client, batch_id, "done") or 0) >= 60,
            timeout_s=180,
            what="the batch to be under way",
        )
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        written_at_kill = len(out.read_bytes().splitlines())
        assert written_at_kill < 200
        assert batch_field(redis_client, batch_id, "state") == "running"
        second = start_worker(env, log)
        wait_until(
            lambda: batch_field(redis_client, batch_id, "state") == "finished",
            timeout_s=240,
            what="the batch to finish after the restart",
        )
        second.send_signal(signal.SIGTERM)  # idle: RQ's warm shutdown exits at once
        assert second.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in records] == list(range(1, 201))  # numbered as in an editor
    assert [r["id"] for r in records] == [f"{batch_id}-{i}" for i in range(1, 201)]
    assert all(len(r["token_ids"]) == 24 and r["finish_reason"] == "length" for r in records)
    for line in (0, 61, 199):  # greedy tokens equal the same request run alone
        alone = client.generate(
            prompt_token_ids=[5, 6, 2 + line % 250], max_tokens=24, ignore_eos=True, timeout_s=60
        )
        assert records[line]["token_ids"] == alone.token_ids
    # each line went to the pool exactly once (sending and counting it sent are one step),
    # and every result stream was dropped once its line was in the output
    wait_until(  # the 200 lines and the 3 lone requests above
        lambda: client.redis.hget(KEYS.pool("default"), "finished") == b"203",
        what="203 finished requests",
    )
    assert redis_client.xlen(KEYS.dead) == 0
    assert not list(redis_client.scan_iter(match=KEYS.result(f"{batch_id}-*")))
    job = Job.fetch(batch_id, connection=redis_client, serializer=JSONSerializer)
    assert job.meta == {"done": 200, "total": 200} and job.get_status() == "finished"
    assert "handed back" in log.read_text()
    result = batch_cli(env, "result", batch_id)
    assert result.returncode == 0 and result.stdout.strip() == str(out.resolve())
    shown = batch_cli(env, "status", batch_id)
    assert shown.returncode == 0 and "200/200" in shown.stdout and "finished" in shown.stdout
    meta = json.loads(batch_cli(env, "status", batch_id, "--json").stdout)
    assert (meta["done"], meta["total"], meta["state"]) == (200, 200, "finished")
    assert not redis_client.sismember(KEYS.batches, batch_id)


def test_plain_rq_worker_runs_a_batch_and_a_rejected_line_keeps_its_place(
    start_pool, client: Client, redis_url: str, tmp_path: Path
) -> None:
    start_pool(ranks=1)
    lines: list[dict[str, object]] = [
        {"prompt": f"hello {i}", "max_tokens": 6, "custom_id": f"c{i}"} for i in range(5)
    ]
    lines[2] = {"prompt_token_ids": [7] * 5000, "max_tokens": 4, "custom_id": "too-long"}
    lines[3]["constraint"] = {"type": "regex", "pattern": "[0-9]{4}"}
    out = tmp_path / "sub" / "out.jsonl"
    env = dict(os.environ, REDIS_URL=redis_url)
    text = [json.dumps(r) for r in lines]
    text[2:2] = [""]  # blank lines (one of them last) are skipped, not refused
    text[5:5] = ["  "]
    (tmp_path / "in.jsonl").write_text("\n".join(text) + "\n\n")
    submitted = batch_cli(env, "submit", str(tmp_path / "in.jsonl"), "--out", str(out))
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    pending = batch_cli(env, "result", batch_id)
    assert pending.returncode == 3 and "queued" in pending.stderr
    rq = Path(sys.executable).with_name("rq")
    worker_env = {k: v for k, v in env.items() if k != "REDIS_URL"}  # only its --url
    worker = subprocess.run(
        [
            str(rq),
            "worker",
            "--burst",
            "--url",
            redis_url,
            "--serializer",
            "rq.serializers.JSONSerializer",
            KEYS.batch_queue,
        ],
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert worker.returncode == 0, worker.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["c0", "c1", "too-long", "c3", "c4"]
    assert [r["line"] for r in records] == [1, 2, 4, 5, 7]  # the input's own line numbers
    assert records[2]["finish_reason"] == "rejected" and "max_model_len" in str(records[2]["error"])
    for record, alone in zip(records, lines):
        if record["finish_reason"] != "rejected":
            constraint = alone.get("constraint")
            direct = client.generate(
                alone["prompt"], max_tokens=6, constraint=constraint, timeout_s=60
            )
            assert record["token_ids"] == direct.token_ids
    assert re.fullmatch("[0-9]{4}", records[3]["text"]), records[3]
    assert batch_cli(env, "result", batch_id).returncode == 0


def test_submit_refuses_a_bad_file_whole_and_names_the_line(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    env = dict(os.environ, REDIS_URL=redis_url)
    good = {"prompt": "hi", "max_tokens": 4}
    cases = {
        "not JSON": "{'prompt': 'hi'}",
        "unknown field": json.dumps({"prompt": "hi", "max_tokenz": 4}),
        "max_tokens": json.dumps({"prompt": "hi", "max_tokens": 0}),
        "exactly one of": json.dumps({"max_tokens": 3}),
        "JSON object": json.dumps(["hi"]),
        "does not compile": json.dumps(
            {"prompt": "hi", "constraint": {"type": "regex", "pattern": "("}}
        ),
    }
    for expected, bad in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(good) + "\n\n" + bad + "\n")  # counted as in an editor
        refused = batch_cli(env, "submit", str(path), "--out", str(tmp_path / "o.jsonl"))
        assert refused.returncode == 2, (expected, refused.stderr)
        assert "line 3" in refused.stderr and expected in refused.stderr, refused.stderr
    existing = write_jsonl(tmp_path / "done.jsonl", [good])
    refused = batch_cli(env, "submit", str(existing), "--out", str(existing))
    assert refused.returncode == 2 and "not empty" in refused.stderr
    assert redis_client.scard(KEYS.batches) == 0
    assert not [k for k in redis_client.keys("rq:job:*")]
    assert batch_cli(env, "status", "nope").returncode == 1
    bare = {k: v for k, v in env.items() if k != "REDIS_URL"}  # the URL after the subcommand
    after = batch_cli(bare, "status", "nope", "--redis-url", redis_url)
    assert (after.returncode, after.stderr) == (1, "npu-pool batch: no batch nope\n")


def test_a_batch_that_cannot_write_its_output_fails_after_its_retries_with_the_reason(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    env = dict(os.environ, REDIS_URL=redis_url)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi", "max_tokens": 2}])
    out = blocker / "out.jsonl"
    submitted = batch_cli(env, "submit", str(prompts), "--out", str(out), "--retries", "1")
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    worker = batch_cli(env, "worker", "--burst")
    assert worker.returncode == 0, worker.stderr[-2000:]
    assert worker.stderr.count("exception raised while executing") == 2  # a try and a retry
    shown = batch_cli(env, "status", batch_id)
    assert shown.returncode == 1 and "failed" in shown.stdout
    assert "FileExistsError" in shown.stdout and blocker.name in shown.stdout
    result = batch_cli(env, "result", batch_id)
    assert result.returncode == 3 and "failed" in result.stderr
    assert not redis_client.sismember(KEYS.batches, batch_id)
