"""The README's redis-cli example, run verbatim against a live pool on the embedded Redis."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from producer.client import Client
from tests.helpers import check_stream

README = Path(__file__).resolve().parent.parent / "README.md"


def redis_cli_lines() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    block = next(b for b in blocks if "redis-cli" in b and "XADD" in b)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_redis_cli_example_submits_a_request_and_reads_its_stream(
    start_pool, client: Client, redis_url: str
) -> None:
    start_pool(ranks=1)
    submit, read = redis_cli_lines()
    env = dict(os.environ, REDIS_URL=redis_url)
    added = subprocess.run(
        ["bash", "-c", submit], env=env, capture_output=True, text=True, timeout=30
    )
    assert added.returncode == 0 and re.match(r"\d+-\d+", added.stdout.strip()), added
    chunks = list(client.stream("cli-1", timeout_s=60))
    tokens = check_stream(chunks)
    assert len(tokens) == 5 and chunks[-1].finish_reason in ("length", "stop")
    shown = subprocess.run(["bash", "-c", read], env=env, capture_output=True, timeout=30)
    assert shown.returncode == 0  # raw msgpack when piped; escaped on a terminal
    assert b"npupool:result:cli-1" in shown.stdout and b"finish_reason" in shown.stdout
