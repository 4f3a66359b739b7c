"""Shared fixtures: a real embedded Redis server, flushed around each test, and pool launchers."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

# Keep the tiny model and any Redis record out of the user's own cache directory.
os.environ.setdefault("NPUPOOL_HOME", tempfile.mkdtemp(prefix="npupool-tests-"))
os.environ.pop("REDIS_URL", None)
os.environ.pop("NPUPOOL_REDIS_URL", None)

from producer.client import Client  # noqa: E402
from producer.embedded import EmbeddedRedis  # noqa: E402
from producer.launcher import PoolProcesses  # noqa: E402
from schemas.config import Settings  # noqa: E402


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


StartPool = Callable[..., Settings]


@pytest.fixture
def start_pool(redis_url: str, tmp_path: Path) -> Iterator[StartPool]:
    """Start a pool (batcher + ranks as processes) on the test Redis; stopped after the test."""
    started: list[PoolProcesses] = []

    def start(**overrides: object) -> Settings:
        values: dict[str, object] = {"model": "tiny", "device": "cpu", "threads_per_rank": 1}
        values.update(overrides)
        settings = Settings(redis_url=redis_url, **values)
        processes = PoolProcesses(settings, redis_url, log_dir=tmp_path / "logs")
        processes.start()
        started.append(processes)
        with Client(redis_url, settings.namespace) as c:
            c.wait_ready(timeout_s=120, pool=settings.pool)
        return settings

    yield start
    for processes in started:
        processes.stop(timeout_s=15)
    for log in sorted((tmp_path / "logs").glob("*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            print(f"--- {log.name} ---\n{text[-4000:]}")
