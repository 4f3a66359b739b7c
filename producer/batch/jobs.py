"""Offline batch jobs through RQ: a JSONL file of requests in, a JSONL file of completions out,
in input order (`npu-pool batch`). Lines are numbered from 1, as in an editor: errors and the
output's `line` field use the same numbers; blank lines are skipped.

A batch is one RQ job (JSON serializer, so nothing is pickled; `Retry` for a run that raises;
a job timeout). The job keeps at most `window` of its requests in the pool and appends each
completion as soon as every line before it is written, so the output is always a prefix of
the answer. Request ids are `{batch}-{line number}`: a run that resumes after a crash keeps
the lines already written, waits for the ones already sent, and sends nothing twice.

One run at a time holds the batch's lease, a redis-py `Lock` renewed from a thread; a run that
loses it stops before writing another line. `npu-pool batch worker` hands a batch whose lease
lapsed (its worker died) back to the queue within seconds, without spending a retry; a plain
`rq worker` gets it back through RQ's own abandoned-job cleanup, later.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast

import redis
from pydantic import ValidationError
from redis.exceptions import LockError
from rq import Queue, Retry, get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from producer.client import Client
from producer.requests import SAMPLING_FIELDS, QueueFull, build_request
from schemas.connection import hash_fields
from schemas.keys import DEFAULT_TENANT, Keys
from schemas.messages import TENANT_PATTERN

log = logging.getLogger("npu_pool.batch")

LEASE_S = 10.0
PROGRESS_EVERY_S = 0.5
MAX_STALLS = 3  # hand-backs in a row without a line written before a batch is failed
RESULT_TTL_S = 24 * 3600  # a line's result stream lives until written, or this long
PASSTHROUGH = "custom_id"  # an input field echoed on the output line, not sent to the pool
LINE_FIELDS = SAMPLING_FIELDS | {
    "prompt",
    "prompt_token_ids",
    "priority",
    "deadline_ms",
    "result_ttl_s",
    "metadata",
    "constraint",
    PASSTHROUGH,
}


class BatchError(Exception):
    """A batch that cannot be submitted or run, with the reason."""


class LeaseLost(Exception):
    """Another run of the batch took its lease: this one stops without writing."""


@dataclass
class BatchInfo:
    """The batch hash (`Keys.batch`)."""

    input: str
    output: str
    digest: str
    window: int
    total: int
    sent: int = 0
    done: int = 0
    state: str = "queued"  # queued | running | finished | failed
    stalls: int = 0
    done_at_handback: int = -1
    error: str = ""
    tenant: str = DEFAULT_TENANT  # the tenant its requests are queued for

    @classmethod
    def read(cls, client: redis.Redis, keys: Keys, batch_id: str) -> BatchInfo | None:
        raw = hash_fields(client.hgetall(keys.batch(batch_id)))
        if not raw:
            return None
        values: dict[str, Any] = {k.decode(): v.decode() for k, v in raw.items()}
        kinds = {f.name: f.type for f in fields(cls)}
        typed: dict[str, Any] = {
            k: int(v) if kinds[k] == "int" else v for k, v in values.items() if k in kinds
        }
        return cls(**typed)


@dataclass(frozen=True, slots=True)
class Line:
    """One request of a batch: its line number in the input file (from 1) and its text."""

    number: int
    text: str


def request_id(batch_id: str, line: Line) -> str:
    """The pool request id of one input line."""
    return f"{batch_id}-{line.number}"


def parse_line(text: str, number: int) -> dict[str, Any]:
    """One input line as `Client.submit` keywords; BatchError names the line and the field."""
    try:
        fields_ = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BatchError(f"line {number}: not JSON ({exc.msg})") from None
    if not isinstance(fields_, dict):
        raise BatchError(f"line {number}: a JSON object is expected")
    fields_.pop("id", None)
    unknown = sorted(set(fields_) - LINE_FIELDS)
    if unknown:
        raise BatchError(f"line {number}: unknown field(s) {', '.join(unknown)}")
    check = {k: v for k, v in fields_.items() if k != PASSTHROUGH}
    try:
        build_request(check.pop("prompt", None), check.pop("prompt_token_ids", None), "x", check)
    except (ValidationError, TypeError) as exc:
        detail = exc.errors()[0] if isinstance(exc, ValidationError) else None
        reason = f"`{'.'.join(map(str, detail['loc']))}`: {detail['msg']}" if detail else exc
        raise BatchError(f"line {number}: {reason}") from None
    return fields_


def read_input(path: Path) -> tuple[list[Line], str]:
    """The requests of an input file (its lines that are not blank) and the file's digest;
    every line is checked."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BatchError(f"cannot read {path}: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchError(f"{path} is not UTF-8 (byte {exc.start})") from None
    lines = [Line(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    for line in lines:
        parse_line(line.text, line.number)
    if not lines:
        raise BatchError(f"{path} holds no requests")
    return lines, hashlib.sha256(data).hexdigest()


def queue_of(connection: redis.Redis, keys: Keys) -> Queue:
    """The RQ queue batch jobs go on."""
    return Queue(keys.batch_queue, connection=connection, serializer=JSONSerializer)


def submit(
    client: Client,
    input_path: Path,
    output_path: Path,
    window: int = 32,
    job_timeout_s: int = 24 * 3600,
    retries: int = 3,
    tenant: str = DEFAULT_TENANT,
) -> str:
    """Check the input, record the batch and enqueue its job; returns the batch id."""
    check_tenant(client, tenant)
    lines, digest = read_input(input_path)
    if output_path.exists() and output_path.stat().st_size:
        raise BatchError(f"{output_path} exists and is not empty; choose another --out")
    if window < 1:
        raise BatchError("--window must be at least 1")
    batch_id = uuid.uuid4().hex[:16]
    info = BatchInfo(
        input=str(input_path.resolve()),
        output=str(output_path.resolve()),
        digest=digest,
        window=window,
        total=len(lines),
        tenant=tenant,
    )
    pipe = client.redis.pipeline(transaction=False)
    pipe.hset(client.keys.batch(batch_id), mapping=cast(Any, vars(info)))
    pipe.sadd(client.keys.batches, batch_id)
    pipe.execute()
    queue_of(client.redis, client.keys).enqueue(
        run_batch,
        batch_id,
        client.keys.ns,
        job_id=batch_id,
        job_timeout=job_timeout_s,
        retry=Retry(max=retries) if retries > 0 else None,
        result_ttl=7 * 86400,
        failure_ttl=7 * 86400,
        description=f"npu-pool batch {batch_id} ({len(lines)} requests)",
    )
    return batch_id


def check_tenant(client: Client, tenant: str) -> None:
    """BatchError unless the namespace would admit requests of `tenant` now."""
    if not re.fullmatch(TENANT_PATTERN, tenant):
        raise BatchError(f"--tenant={tenant!r}: must match {TENANT_PATTERN}")
    required = client.redis.hget(client.keys.limits, "tenants_required")
    named = tenant == DEFAULT_TENANT or client.redis.hexists(client.keys.tenants, tenant)
    if required == b"1" and not named:
        raise BatchError(f"--tenant={tenant!r}: the pool's tenants file does not name it")


def run_batch(batch_id: str, namespace: str) -> int:
    """The RQ job: write every line not yet in the output; returns the lines written."""
    job = get_current_job()
    client = Client(namespace=namespace, connection=job.connection if job else None)
    keys = client.keys
    info = BatchInfo.read(client.redis, keys, batch_id)
    if info is None:
        raise BatchError(f"no batch {batch_id}")
    if info.state == "finished":
        return info.done
    lease = client.redis.lock(
        keys.batch_lease(batch_id), timeout=LEASE_S, blocking=False, thread_local=False
    )
    if not lease.acquire():
        log.warning("batch %s: another run holds its lease; leaving it that run", batch_id)
        return -1
    lost = threading.Event()
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(lease, stop, lost), daemon=True)
    renewer.start()
    try:
        return _run(client, batch_id, info, lost)
    except LeaseLost:
        log.warning("batch %s: another run took its lease; this one stops", batch_id)
        return -1
    except Exception as exc:
        with contextlib.suppress(redis.RedisError):  # Redis may be why it failed
            _record_failure(client.redis, keys, batch_id, exc, not (job and job.retries_left))
        raise
    finally:
        stop.set()
        renewer.join()
        if not lost.is_set():
            with contextlib.suppress(LockError):
                lease.release()


def _record_failure(
    client: redis.Redis, keys: Keys, batch_id: str, exc: Exception, last: bool
) -> None:
    """Keep the reason a run failed; on its last try the batch is failed."""
    reason = f"{type(exc).__name__}: {exc}"
    if last:
        _fail(client, keys, batch_id, reason)
    else:
        client.hset(keys.batch(batch_id), "error", f"{reason} (retrying)")


def _renew(lease: Any, stop: threading.Event, lost: threading.Event) -> None:
    while not stop.wait(LEASE_S / 4):
        try:
            lease.reacquire()
        except LockError:
            lost.set()
            return
        except redis.RedisError as exc:
            log.warning("batch lease not renewed (%s); retrying", exc)


def _run(client: Client, batch_id: str, info: BatchInfo, lost: threading.Event) -> int:
    keys = client.keys
    lines, digest = read_input(Path(info.input))
    if digest != info.digest:
        raise BatchError(f"{info.input} changed since the batch was submitted")
    output = Path(info.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = lines_written(output)
    sent = max(info.sent, done)
    client.redis.hset(keys.batch(batch_id), mapping={"state": "running", "done": done})
    # lines a dead run wrote after its last progress report: their streams are not needed
    reported = 0.0
    written = [keys.result(request_id(batch_id, lines[i])) for i in range(info.done, done)]
    with output.open("ab") as out:
        while done < info.total:
            while sent < info.total and sent - done < info.window:
                _send(client, batch_id, sent, lines[sent], info.tenant)
                sent += 1
            record = _wait(client, batch_id, lines[done], lost)
            out.write(json.dumps(record).encode() + b"\n")
            out.flush()
            written.append(keys.result(record["id"]))
            done += 1
            if time.monotonic() - reported > PROGRESS_EVERY_S or done == info.total:
                os.fsync(out.fileno())
                _progress(client.redis, keys, batch_id, done, info.total, written)
                written, reported = [], time.monotonic()
    pipe = client.redis.pipeline(transaction=False)
    pipe.hset(
        keys.batch(batch_id), mapping={"state": "finished", "done": done, "stalls": 0, "error": ""}
    )
    pipe.srem(keys.batches, batch_id)
    for key in written:  # left when a dead run had written every line
        pipe.unlink(key)
    pipe.execute()
    log.info("batch %s: %d lines written to %s", batch_id, done, output)
    return done


def _send(client: Client, batch_id: str, index: int, line: Line, tenant: str) -> None:
    """Put one line's request in the pool and count it sent (`index` + 1 requests), in one
    atomic step."""
    fields_ = parse_line(line.text, line.number)
    fields_.pop(PASSTHROUGH, None)
    fields_["tenant"] = tenant
    fields_.setdefault("result_ttl_s", RESULT_TTL_S)
    prompt, ids = fields_.pop("prompt", None), fields_.pop("prompt_token_ids", None)
    request = build_request(prompt, ids, request_id(batch_id, line), fields_)
    while True:
        try:
            client.enqueue(request, mark=(client.keys.batch(batch_id), "sent", index + 1))
            return
        except QueueFull:
            time.sleep(0.5)  # the window bounds what this batch adds; wait for others


def _wait(client: Client, batch_id: str, line: Line, lost: threading.Event) -> dict[str, Any]:
    """The output record of one line, once its completion is final."""
    while True:  # sent lines are in the pool until written: their streams outlive a pause
        if lost.is_set():
            raise LeaseLost(batch_id)
        try:
            completion = client.result(request_id(batch_id, line), timeout_s=LEASE_S / 2)
            break
        except TimeoutError:
            continue
    if lost.is_set():
        raise LeaseLost(batch_id)
    record: dict[str, Any] = {"line": line.number}
    custom = json.loads(line.text).get(PASSTHROUGH)
    if custom is not None:
        record[PASSTHROUGH] = custom
    record.update(completion.model_dump(mode="json"))
    return record


def _progress(
    client: redis.Redis, keys: Keys, batch_id: str, done: int, total: int, written: list[str]
) -> None:
    """Record progress; drop the result streams whose lines are now in the output."""
    pipe = client.pipeline(transaction=False)
    pipe.hset(keys.batch(batch_id), "done", done)
    for key in written:
        pipe.unlink(key)
    pipe.execute()
    job = get_current_job()
    if job is not None:
        job.meta.update({"done": done, "total": total})
        job.save_meta()


def lines_written(output: Path) -> int:
    """Complete lines already in the output; a torn last line is cut off."""
    if not output.exists():
        return 0
    data = output.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with output.open("r+b") as out:
            out.truncate(len(complete))
    return complete.count(b"\n")


def hand_back_lapsed(connection: redis.Redis, keys: Keys) -> list[str]:
    """Re-enqueue every started batch job whose lease lapsed (its worker died).

    A hand-back spends no RQ retry; after MAX_STALLS hand-backs in a row without a line
    written the batch is failed instead."""
    handed = []
    queue = queue_of(connection, keys)
    for raw in cast(set[bytes], connection.smembers(keys.batches)):
        batch_id = raw.decode()
        info = BatchInfo.read(connection, keys, batch_id)
        if info is None or info.state in ("finished", "failed"):
            connection.srem(keys.batches, batch_id)
            continue
        if connection.exists(keys.batch_lease(batch_id)):
            continue
        try:
            job = Job.fetch(batch_id, connection=connection, serializer=JSONSerializer)
        except NoSuchJobError:
            _fail(connection, keys, batch_id, "its RQ job is gone")
            continue
        status = job.get_status()
        if status == JobStatus.FAILED:
            _fail(connection, keys, batch_id, "its RQ job failed (see `rq info`)")
            continue
        started = job.started_at.timestamp() if job.started_at else time.time()
        if status != JobStatus.STARTED or time.time() - started < LEASE_S:
            continue
        stalls = info.stalls + 1 if info.done == info.done_at_handback else 1
        if stalls > MAX_STALLS:
            _fail(connection, keys, batch_id, f"its worker died {stalls} times without progress")
            continue
        pipe = connection.pipeline(transaction=False)
        StartedJobRegistry(queue=queue).remove_executions(job, pipeline=pipe)
        pipe.hset(
            keys.batch(batch_id),
            mapping={"state": "queued", "stalls": stalls, "done_at_handback": info.done},
        )
        pipe.execute()
        queue.enqueue_job(job)  # a crash before this leaves it STARTED: the next sweep retries
        handed.append(batch_id)
    return handed


def _fail(connection: redis.Redis, keys: Keys, batch_id: str, reason: str) -> None:
    pipe = connection.pipeline(transaction=False)
    pipe.hset(keys.batch(batch_id), mapping={"state": "failed", "error": reason})
    pipe.srem(keys.batches, batch_id)
    pipe.execute()
    log.error("batch %s failed: %s", batch_id, reason)
