"""Every command of the README, run in order as a new user runs them, against live pools with
the `tiny` model and small counts: a README edit that breaks a command fails here.

Each line of a ```bash block runs in bash, in a scratch directory, with the environment the
README builds: `NPUPOOL_HOME` in the scratch directory, and what a command exports carried
over to the next ones. ```python blocks run whole. The tables below name everything that is
not run exactly as written, and why.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from npu_pool.embedded import EmbeddedRedis
from producer.client import Client
from producer.lookup import find_request
from tests.conftest import _free_port
from tests.helpers import check_stream, interrupt_once_shown, wait_until
from tests.test_gguf_import import hf_checkpoint, write_gguf

README = Path(__file__).resolve().parent.parent / "README.md"
BIN = Path(sys.executable).parent  # npu-pool, redis-cli and rq of this environment

# Installing made this environment, and the test suite is what runs this test.
SKIPPED = ("python3 -m venv", "pip install", "python -m pytest")
# Services a user runs in another terminal: they run in the background until the end, then
# get Ctrl-C (SIGINT) and must exit 0.
SERVICES = ("npu-pool up", "npu-pool batcher", "npu-pool worker", "npu-pool gateway")
SERVICES += ("npu-pool batch worker",)
# Live views that run until Ctrl-C: interrupted once they have shown this many snapshots.
INTERRUPTED = {"npu-pool status --watch": 2}
# Small counts and the tiny model, as flags right after the command.
SMALLER = {
    "npu-pool demo": "--model tiny --requests 3 --max-tokens 8",
    "npu-pool bench --quick": "--concurrency 2 --requests 4 --prompt-len 3 9 --output-len 4 8 "
    "--no-peers --burst 0",
    "npu-pool bench --kernels": "--iters 3",
}
# "A Redis of your own": a second Redis server here, with that password (as user `default`,
# which `redis-cli` needs; see the README's wire protocol section).
OWN_REDIS = "redis://:password@redis-host:6379/0"
# The gateway's default port may be taken on a shared machine: a free one instead.
GATEWAY = "127.0.0.1:8000"
# Files the README's commands take as given.
GIVEN_FILES = {
    "model.Q4_1.gguf": lambda path: write_gguf(hf_checkpoint("llama"), "llama", "Q4_1", path)
}
COMMAND_TIMEOUT_S = 300
READY_TIMEOUT_S = 240


def readme_commands(readme: str) -> list[tuple[str, str]]:
    """(language, command) of every bash line and python block of the README, in order."""
    found = []
    for language, body in re.findall(r"```(bash|python)\n(.*?)```", readme, flags=re.S):
        lines = [body] if language == "python" else body.splitlines()
        found += [(language, line) for line in lines if line.strip()]
    return found


@dataclass
class Service:
    """A README command running in the background, and how to tell it is ready."""

    command: str
    process: subprocess.Popen[bytes]
    log: Path
    ready: Callable[[], bool]
    confirmed: bool = False

    def output(self) -> str:
        return f"{self.command}\n{self.log.read_text(errors='replace')[-3000:]}"


@dataclass
class Session:
    """The shell session the README's commands share, and the services they started."""

    work: Path
    env: dict[str, str]
    gateway_port: int
    services: list[Service] = field(default_factory=list)

    def run(self, language: str, command: str) -> None:
        """Run one README command as the tables above say."""
        if language == "python":
            self.wait_for_services()
            done = subprocess.run([sys.executable, "-c", command], **self._where())
            assert done.returncode == 0, f"{command}\n{done.stderr.decode()[-3000:]}"
            return
        if command.startswith(SKIPPED):
            return
        command = self.prepare(command)
        if command.startswith(SERVICES):
            self.start(command)
            return
        self.wait_for_services()
        for prefix, snapshots in INTERRUPTED.items():
            if command.startswith(prefix):
                self.interrupt_after(command, snapshots)
                return
        done = self.shell(command)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]!r}\n{done.stderr[-3000:]!r}"
        for prefix, check in CHECKS.items():
            if command.startswith(prefix):
                check(self, command, done)

    def prepare(self, command: str) -> str:
        """The command as run: placeholders replaced, small counts added."""
        command = command.replace(GATEWAY, f"127.0.0.1:{self.gateway_port}")
        if command.startswith("npu-pool gateway"):
            command = f"npu-pool gateway --port {self.gateway_port}{command[16:]}"
        for prefix, flags in SMALLER.items():
            if command.startswith(prefix):
                command = f"{prefix} {flags}{command[len(prefix) :]}"
        return command

    def shell(self, command: str) -> subprocess.CompletedProcess[bytes]:
        """Run one command in bash; what it exports stays for the next ones."""
        env_file = self.work.parent / "env"
        script = f"{command}\n__rc=$?\nenv -0 > {shlex.quote(str(env_file))}\nexit $__rc\n"
        done = subprocess.run(["bash", "-c", script], **self._where())
        pairs = (item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item)
        self.env = {k: v for k, v in pairs if k not in ("_", "SHLVL", "__rc")}
        return done

    def _where(self) -> dict[str, object]:
        return {"cwd": self.work, "env": self.env, "capture_output": True}

    def start(self, command: str) -> None:
        """Start a service in the background, in a session of its own."""
        log = self.work.parent / f"service-{len(self.services)}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                ["bash", "-c", f"exec {command}"],
                cwd=self.work,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.services.append(Service(command, process, log, self.ready_check(command)))

    def ready_check(self, command: str) -> Callable[[], bool]:
        """When the service a command starts is ready: its pool, or its HTTP front."""
        if command.startswith("npu-pool gateway"):
            url = f"http://127.0.0.1:{self.gateway_port}/health"
            return lambda: _answers(url)
        if command.startswith("npu-pool batch worker"):
            return lambda: True
        env = dict(self.env)
        return lambda: pool_ready(env)

    def wait_for_services(self) -> None:
        """Block until every service started so far is ready (or fail with its output)."""
        for service in self.services:
            if service.confirmed:
                continue

            def ready(service: Service = service) -> bool:
                assert service.process.poll() is None, f"exited early:\n{service.output()}"
                return service.ready()

            wait_until(ready, timeout_s=READY_TIMEOUT_S, what=service.command)
            service.confirmed = True

    def interrupt_after(self, command: str, snapshots: int) -> None:
        """Run a live view until it has shown the pool `snapshots` times, then Ctrl-C: it
        exits 0."""
        process = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=self.work,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = interrupt_once_shown(process, b"pool default", snapshots)
        assert process.returncode == 0, err.decode()[-2000:]
        assert out.count(b"pool default") >= snapshots, out.decode()[-2000:]

    def redis_url(self) -> str:
        """The URL the README's commands reach Redis at now (`npu-pool status --url`)."""
        done = subprocess.run([BIN / "npu-pool", "status", "--url"], **self._where(), check=True)
        return done.stdout.decode().strip()

    def close(self) -> list[str]:
        """Ctrl-C every service, newest first; the output of those that did not exit 0."""
        failures = []
        for service in reversed(self.services):
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGINT)
            try:
                code = service.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(service.process.pid, signal.SIGKILL)
                code = service.process.wait()
            if code != 0:
                failures.append(f"exit {code}: {service.output()}")
        return failures


def pool_ready(env: dict[str, str]) -> bool:
    """Whether the Redis these settings reach has a pool with every rank ready."""
    done = subprocess.run([BIN / "npu-pool", "status", "--json"], env=env, capture_output=True)
    if done.returncode != 0:
        return False
    pools = json.loads(done.stdout)["pools"]
    return any(
        p["state"] == "ready" and p["ranks"] and all(r["state"] == "ready" for r in p["ranks"])
        for p in pools
    )


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


# -- what a command's output must show, computed independently on the same pool ----------


def check_submit(session: Session, command: str, done: subprocess.CompletedProcess[bytes]) -> None:
    """`submit` names its request (stdout with --no-wait, else stderr) and prints its text."""
    with Client(session.redis_url()) as client:
        if "--no-wait" in command:
            request_id = done.stdout.decode().strip()
            assert find_request(client.redis, client.keys, request_id).state != "unknown"
            return
        first = done.stderr.decode().splitlines()[0]
        assert first.startswith("request "), done.stderr
        completion = client.result(first.split()[1], timeout_s=60)
    assert done.stdout.decode() == completion.text + "\n"


def check_cancel(session: Session, command: str, done: subprocess.CompletedProcess[bytes]) -> None:
    """`cancel` of the request just submitted: requested, or it had already finished."""
    said = done.stdout.decode()
    assert said.startswith("cancel requested: story-1") or "already finished" in said, said


def check_result_stream(
    session: Session, command: str, done: subprocess.CompletedProcess[bytes]
) -> None:
    """`XRANGE` shows every chunk: the greedy tokens of the same request sent by the client."""
    with Client(session.redis_url()) as client:
        chunks = list(client.stream("cli-1", timeout_s=10))
        alone = client.generate("Hi", max_tokens=5, timeout_s=60)
    assert check_stream(chunks) == alone.token_ids and chunks[-1].is_final
    assert done.stdout.count(b"finish_reason") == len(chunks)
    assert done.stdout.rstrip().endswith(b"final\n1")


def check_batch_output(
    session: Session, command: str, done: subprocess.CompletedProcess[bytes]
) -> None:
    """The batch's output: one line per input line, numbered as the input's lines."""
    inputs = (session.work / "prompts.jsonl").read_text().splitlines()
    records = [
        json.loads(line) for line in Path(done.stdout.decode().strip()).read_text().splitlines()
    ]
    assert [r["line"] for r in records] == [i + 1 for i, line in enumerate(inputs) if line.strip()]
    assert all(r["finish_reason"] in ("length", "stop") for r in records)


def check_demo(session: Session, command: str, done: subprocess.CompletedProcess[bytes]) -> None:
    """Off a terminal the demo prints its table once, when every stream has ended."""
    assert done.stdout.count(b"live result streams") == 1, done.stdout.decode()[-3000:]
    assert b"summary" in done.stdout


def check_status(session: Session, command: str, done: subprocess.CompletedProcess[bytes]) -> None:
    """`status` names the Redis it reads and shows the pool `up` started, ready."""
    shown = done.stdout.decode()
    assert f"redis: {session.redis_url()}" in shown and "pool default — ready" in shown, shown


CHECKS = {
    "npu-pool demo": check_demo,
    "npu-pool status": check_status,
    "npu-pool submit": check_submit,
    "npu-pool cancel": check_cancel,
    'redis-cli -u "$REDIS_URL" XRANGE': check_result_stream,
    "npu-pool batch result": check_batch_output,
}


def test_every_readme_command_runs_as_written_in_order(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for name, make in GIVEN_FILES.items():
        make(work / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "OPENAI_"))}
    env.pop("NPUPOOL_REDIS_URL", None)
    env |= {"NPUPOOL_HOME": str(tmp_path / "home"), "PATH": f"{BIN}:{env.get('PATH', '')}"}
    own_redis = EmbeddedRedis(data_dir=tmp_path / "own-redis", password="password")
    own_url = own_redis.start().replace("redis://:", "redis://default:")
    session = Session(work, env, _free_port())
    failures: list[str] = []
    try:
        for language, command in readme_commands(README.read_text()):
            session.run(language, command.replace(OWN_REDIS, own_url))
    finally:
        failures = session.close()
        own_redis.stop()
    assert not failures, "\n\n".join(failures)
