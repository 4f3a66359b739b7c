"""Shared fixtures: a real embedded Redis server, flushed around each test, and pool launchers."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

# Keep the tiny model, imported GGUF models (SmolLM2: ~540 MB) and any Redis record out of
# the user's own cache directory; a directory made here is removed when the session ends.
OWN_HOME = None if "NPUPOOL_HOME" in os.environ else tempfile.mkdtemp(prefix="npupool-tests-")
if OWN_HOME is not None:
    os.environ["NPUPOOL_HOME"] = OWN_HOME
os.environ.pop("REDIS_URL", None)
os.environ.pop("NPUPOOL_REDIS_URL", None)

from producer.client import Client  # noqa: E402
from producer.embedded import EmbeddedRedis  # noqa: E402
from producer.launcher import PoolProcesses  # noqa: E402
from schemas.config import Settings  # noqa: E402


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if OWN_HOME is not None:
        shutil.rmtree(OWN_HOME, ignore_errors=True)


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
