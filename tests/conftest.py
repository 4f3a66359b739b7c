"""Shared fixtures: a real embedded Redis server, flushed around each test, and pool launchers."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

# Keep the tiny model, imported GGUF models (SmolLM2: ~540 MB) and any Redis record out of
# the user's own cache directory; a directory made here is removed when the session ends.
OWN_HOME = None if "NPUPOOL_HOME" in os.environ else tempfile.mkdtemp(prefix="npupool-tests-")
if OWN_HOME is not None:
    os.environ["NPUPOOL_HOME"] = OWN_HOME
# Exactness and parity tests compare the pool with float32 references (`transformers`, a
# request run alone): they run in float32 even where `--dtype auto` picks bfloat16 (a CPU
# with native bfloat16); the bfloat16 path has tests of its own that ask for it.
os.environ.setdefault("NPUPOOL_DTYPE", "float32")
os.environ.pop("REDIS_URL", None)
os.environ.pop("NPUPOOL_REDIS_URL", None)

from npu_pool.embedded import EmbeddedRedis  # noqa: E402
from npu_pool.launcher import PoolProcesses  # noqa: E402
from producer.client import Client  # noqa: E402
from schemas.config import Settings  # noqa: E402

POOL_FIXTURES = frozenset({"start_pool", "start_gateway"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that starts a pool or a gateway `pool`; one marked `fast` may not."""
    for item in items:
        if not POOL_FIXTURES & set(getattr(item, "fixturenames", ())):
            continue
        if item.get_closest_marker("fast") is not None:
            raise pytest.UsageError(f"{item.nodeid} is marked fast but starts a pool")
        item.add_marker(pytest.mark.pool)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if OWN_HOME is not None:
        shutil.rmtree(OWN_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def kernels() -> Any:
    """The CPU kernels' library, built for this machine (skipped without a C compiler)."""
    from npu_worker.kernels.cpu.library import load_cpu_kernels

    built = load_cpu_kernels()
    if built is None:
        pytest.skip("no C compiler on this machine")
    return built


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(data_dir=tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.flushall()
    client.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def client(redis_url: str) -> Iterator[Client]:
    with Client(redis_url) as c:
        yield c


@dataclass
class RunningPool:
    """A pool started by a test: its settings and its supervised processes."""

    settings: Settings
    processes: PoolProcesses
    supervised: bool = True


StartPool = Callable[..., RunningPool]


@pytest.fixture
def start_pool(redis_url: str, tmp_path: Path) -> Iterator[StartPool]:
    """Start a pool (batcher + ranks as processes) on the test Redis, supervised like `up`
    does (a dead process is restarted); everything is stopped after the test."""
    started: list[RunningPool] = []
    done = threading.Event()

    def supervise() -> None:
        while not done.wait(0.1):
            for pool in list(started):
                if pool.supervised:
                    pool.processes.supervise()

    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()

    def start(
        supervised: bool = True, wait: bool = True, url: str | None = None, **overrides: object
    ) -> RunningPool:
        values: dict[str, object] = {"model": "tiny", "device": "cpu", "threads_per_rank": 1}
        values.update(overrides)
        url = url or redis_url
        settings = Settings(redis_url=url, **values)
        logs = tmp_path / "logs" / settings.pool
        processes = PoolProcesses(settings, url, log_dir=logs)
        processes.start()
        pool = RunningPool(settings, processes, supervised)
        started.append(pool)
        if wait:
            with Client(url, settings.namespace) as c:
                c.wait_ready(timeout_s=120, pool=settings.pool)
        return pool

    yield start
    done.set()
    supervisor.join()
    for pool in started:
        pool.processes.stop(timeout_s=15)
    for log in sorted((tmp_path / "logs").glob("*/*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            print(f"--- {log} ---\n{text[-4000:]}")


@dataclass
class RunningGateway:
    """An `npu-pool gateway` process started by a test, and its base URL."""

    url: str
    process: subprocess.Popen[bytes]


StartGateway = Callable[..., RunningGateway]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def start_gateway(redis_url: str, tmp_path: Path) -> Iterator[StartGateway]:
    """Start `npu-pool gateway` processes on the test Redis; `ready=True` waits until /health
    is 200 (a ready pool), else only until it answers. Stopped after the test."""
    started: list[tuple[RunningGateway, Path]] = []

    def start(*flags: str, ready: bool = True, env: dict[str, str] | None = None) -> RunningGateway:
        port = _free_port()
        log_path = tmp_path / f"gateway-{port}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "npu_pool.cli", "gateway", "--port", str(port)]
                + ["--redis-url", redis_url, *flags],
                env={**os.environ, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        gateway = RunningGateway(f"http://127.0.0.1:{port}", process)
        started.append((gateway, log_path))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            try:
                status = httpx.get(gateway.url + "/health", timeout=2).status_code
                if status == 200 or not ready:
                    return gateway
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"gateway did not come up: {log_path.read_text()[-2000:]}")

    yield start
    for gateway, log_path in started:
        gateway.process.terminate()
        try:
            gateway.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            gateway.process.kill()
            gateway.process.wait()
        text = log_path.read_text(errors="replace")
        if "Traceback" in text:
            print(f"--- {log_path} ---\n{text[-4000:]}")
