"""The README's gateway examples (`curl` and `openai`), run verbatim against a live pool."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from producer.client import Client
from tests.conftest import StartGateway, StartPool

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_block(language: str, marker: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)
    return next(b for b in blocks if marker in b)


def sse_data(text: str) -> list[dict[str, object]]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def test_readme_curl_examples_complete_and_replay_a_request(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    start_pool(ranks=1)
    gateway = start_gateway()
    env = dict(os.environ, OPENAI_BASE_URL=gateway.url + "/v1", OPENAI_API_KEY="none")
    lines = [ln for ln in readme_block("bash", "OPENAI_BASE_URL/completions").splitlines() if ln]
    complete, replay, resume = (
        subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=60)
        for line in lines
    )
    expected = client.result("readme-1", timeout_s=30)
    assert json.loads(complete.stdout)["choices"][0]["text"] == expected.text
    chunks = [c.model_dump(mode="json") for c in client.stream("readme-1", timeout_s=30)]
    assert sse_data(replay.stdout) == chunks
    assert sse_data(resume.stdout) == [c for c in chunks if int(c["seq"]) > 3]


def test_readme_openai_example_prints_the_pools_replies(
    start_pool: StartPool, start_gateway: StartGateway, client: Client
) -> None:
    start_pool(ranks=1)
    gateway = start_gateway()
    env = dict(os.environ, OPENAI_BASE_URL=gateway.url + "/v1", OPENAI_API_KEY="none")
    code = readme_block("python", "from openai import OpenAI")
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    chat = client.chat([{"role": "user", "content": "Hello"}], max_tokens=16, temperature=0.0)
    completion = client.generate("Hello", max_tokens=16, temperature=0.0)
    assert done.stdout == chat.text + "\n" + completion.text


def test_readme_structured_output_examples_run_and_validate(
    start_pool: StartPool, start_gateway: StartGateway, redis_url: str
) -> None:
    start_pool(ranks=1)
    gateway = start_gateway()
    env = dict(os.environ, OPENAI_BASE_URL=gateway.url + "/v1", OPENAI_API_KEY="none")
    code = readme_block("python", "beta.chat.completions.parse")
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    city, call = done.stdout.splitlines()
    assert city.startswith("name=") and " country=" in city
    name, arguments = call.split(" ", 1)
    assert name == "get_weather" and set(json.loads(arguments)) == {"city"}
    code = readme_block("python", "constraint=Pet")
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, REDIS_URL=redis_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    pet, answers = done.stdout.splitlines()
    assert pet.startswith("name=") and " kind=" in pet
    phone, choice = answers.split(" ")
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", phone) and choice in ("yes", "no")
