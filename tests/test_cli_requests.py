"""`npu-pool submit`, `cancel` and `status` as a user meets them: request ids printed, bad
values in one line, unknown ids refused, starting pools shown as starting."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

from rich.console import Console

from producer.client import Client
from producer.lookup import PAGE, find_request
from producer.status import collect_status
from producer.status_view import render
from schemas.keys import Keys
from tests.helpers import wait_until

KEYS = Keys()


def cli(redis_url: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "NPUPOOL_REDIS_URL")}
    if redis_url is not None:
        env["REDIS_URL"] = redis_url
    return subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bad_submit_values_are_one_line_naming_the_flag_and_the_rule(redis_url: str) -> None:
    cases = {
        ("--temperature", "-1"): "--temperature=-1.0: must be greater than or equal to 0\n",
        ("--max-tokens", "0"): "--max-tokens=0: must be greater than or equal to 1\n",
        ("--top-p", "1.5"): "--top-p=1.5: must be less than or equal to 1\n",
        ("--id", "a b"): "--id='a b': must match pattern '^[A-Za-z0-9._:-]{1,128}$'\n",
    }
    for flags, said in cases.items():
        done = cli(redis_url, "submit", "hi", *flags)
        assert done.returncode == 2, done.stderr
        assert done.stderr == f"npu-pool submit: {said}"
    empty = cli(redis_url, "submit", "")
    assert (empty.returncode, empty.stderr) == (2, "npu-pool submit: `prompt` is empty\n")
    with Client(redis_url) as client:
        assert sum(client.redis.xlen(s) for s in KEYS.request_streams) == 0


def test_submit_no_wait_prints_the_id_and_cancel_tells_queued_unknown_and_many_apart(
    redis_url: str, client: Client
) -> None:
    given = cli(redis_url, "submit", "hello", "--id", "mine-1", "--no-wait")
    assert (given.returncode, given.stdout) == (0, "mine-1\n")
    generated = cli(redis_url, "submit", "hello", "--no-wait").stdout.strip()
    urgent = client.submit("urgent", priority=5)  # on the class stream npupool:requests:p5
    for i in range(PAGE + 10):  # the lookup pages through a long queue
        client.submit("filler", request_id=f"filler-{i}")
    assert find_request(client.redis, KEYS, f"filler-{PAGE + 9}").state == "queued"
    done = cli(redis_url, "cancel", "mine-1", generated, urgent, "nope")
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        f"cancel requested: {request_id} (was queued)"
        for request_id in ("mine-1", generated, urgent)
    ]
    assert done.stderr == (
        "npu-pool cancel: no request nope is known (not queued, not running, no result kept)\n"
    )
    assert client.redis.zscore(KEYS.cancelled, "nope") is None  # nothing recorded for it


def test_cancel_of_a_running_request_ends_it_and_of_a_finished_one_says_so(
    start_pool, client: Client, redis_url: str, tmp_path
) -> None:
    start_pool(ranks=1)
    done = client.generate("short", max_tokens=3, request_id="done-1", timeout_s=60)
    finished = cli(redis_url, "cancel", "done-1")
    assert finished.returncode == 0
    assert finished.stdout == f"done-1 already finished ({done.finish_reason}); nothing to cancel\n"
    client.submit("long", request_id="long-1", max_tokens=900, ignore_eos=True)
    wait_until(lambda: client.redis.xlen(KEYS.result("long-1")) > 0, what="long-1 to run")
    running = cli(redis_url, "cancel", "long-1")
    assert (running.returncode, running.stdout) == (0, "cancel requested: long-1 (was running)\n")
    assert client.result("long-1", timeout_s=60).finish_reason == "cancelled"


def test_an_id_submitted_again_after_it_finished_is_logged_as_kept_not_as_a_fault(
    start_pool, client: Client, tmp_path
) -> None:
    start_pool(ranks=1)
    first = client.generate("again", max_tokens=4, request_id="twice", timeout_s=60)
    client.submit("again", max_tokens=4, request_id="twice")
    logs = [tmp_path / "logs" / "default" / name for name in ("rank0.log", "batcher.log")]

    def kept() -> str | None:  # the rank says so, or the batcher when the second entry came
        # before the first's step result (its final chunk written already)
        return next(
            (t for p in logs if "already complete, result kept" in (t := p.read_text())), None
        )

    wait_until(lambda: kept() is not None, what="the rank or the batcher to log it")
    text = kept() or ""
    assert "moved on" not in text and "twice" in text
    assert client.result("twice", timeout_s=10).token_ids == first.token_ids
    wait_until(
        lambda: sum(client.redis.xlen(s) for s in KEYS.request_streams) == 0,
        what="the second entry to be settled",
    )


def test_status_shows_a_starting_pool_as_starting_never_unresponsive(
    start_pool, redis_url: str
) -> None:
    start_pool(ranks=2, wait=False)
    seen_pools, seen_ranks, shown = set(), set(), ""
    with Client(redis_url) as client:

        def ready() -> bool:
            nonlocal shown
            status = collect_status(client.redis, client.keys)
            for pool in status["pools"]:
                seen_pools.add(pool["state"])
                seen_ranks.update(rank["state"] for rank in pool["ranks"])
                if pool["state"] == "starting" and not shown:
                    console = Console(file=io.StringIO(), width=200)
                    console.print(render(status, url=redis_url))
                    shown = console.file.getvalue()
            pools = status["pools"]
            return bool(pools) and all(r["state"] == "ready" for r in pools[0]["ranks"])

        wait_until(ready, timeout_s=120, what="the pool to be ready")
    assert "unresponsive" not in seen_pools | seen_ranks
    assert "starting" in seen_pools and seen_ranks <= {"starting", "loading", "warming", "ready"}
    assert re.search(r"pool default — starting, [01]/2 ranks ready \(batcher pid \d+", shown)
    assert f"redis: {redis_url}" in shown


def test_status_url_prints_the_url_in_use_bare_and_the_view_hides_a_password(
    redis_url: str,
) -> None:
    assert cli(redis_url, "status", "--url").stdout == f"{redis_url}\n"
    secret = "redis://:s3cret@127.0.0.1:1/0"
    assert cli(None, "status", "--url", "--redis-url", secret).stdout == f"{secret}\n"
    refused = cli(None, "status", "--redis-url", secret)
    assert refused.returncode == 1 and "redis://:***@127.0.0.1:1/0" in refused.stderr
    assert "s3cret" not in refused.stderr
