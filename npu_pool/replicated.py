"""A replicated Redis on loopback, for the failover tests and `bench/probes/soak.py
--failover-every`: a primary, two replicas and three Sentinels, real `redis-server`
processes (Debian's package; `redis-server --sentinel` runs a Sentinel), and the failures
inflicted on the primary (kill -9, or a pause until a replica is promoted)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import redis

SERVICE = "npupool"
DOWN_AFTER_MS = 1500  # at 1000 a freshly promoted primary is now and then failed over again


def free_port() -> int:
    """A TCP port on loopback nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SentinelDeployment:
    """Three data servers (one primary at first) and three Sentinels watching them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.server = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.data_ports = [free_port() for _ in range(3)]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.failed_at_ms = 0.0  # when the last failure was inflicted (wall clock)

    @property
    def url(self) -> str:
        """The Sentinel URL every part of the pool takes."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def start(self) -> None:
        """Start the primary, its replicas, then the Sentinels; wait until they see them."""
        first = self.data_ports[0]
        for port in self.data_ports:
            replica_of = [] if port == first else ["--replicaof", "127.0.0.1", str(first)]
            self._spawn(port, ["--appendonly", "yes", "--save", "", *replica_of])
        self._wait(
            lambda: all(self._role(p) == "slave" and self._linked(p) for p in self.data_ports[1:])
        )
        for port in self.sentinel_ports:
            config = self.root / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.root}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {first} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} 6000\n"
                f"sentinel parallel-syncs {SERVICE} 2\n"
                f"logfile {self.root / f'sentinel-{port}.log'}\n"
            )
            self.processes[port] = subprocess.Popen(
                [self.server, str(config), "--sentinel"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        self._wait(lambda: all(self._sees_replicas(p) for p in self.sentinel_ports))

    def primary_port(self) -> int:
        """The port of the primary the Sentinels name now."""
        client = redis.Redis(port=self.sentinel_ports[0], socket_timeout=2)
        try:
            _, port = cast(tuple[str, int], client.sentinel_get_master_addr_by_name(SERVICE))
            return int(port)
        finally:
            client.close()

    def kill_primary(self) -> int:
        """SIGKILL the primary; wait for the Sentinels to promote a replica; its port."""
        old = self.primary_port()
        self.failed_at_ms = time.time() * 1000
        self.processes[old].kill()
        self.processes[old].wait()
        new = self._promoted(old)
        self._spawn(
            old, ["--appendonly", "yes", "--save", "", "--replicaof", "127.0.0.1", str(new)]
        )  # the dead primary comes back as a replica
        return new

    def pause_primary(self) -> int:
        """SIGSTOP the primary; once the Sentinels have promoted a replica, SIGCONT it (a
        stale primary that still holds its clients' connections, until the Sentinels demote
        it to a replica of the new one); the new primary's port."""
        old = self.primary_port()
        self.failed_at_ms = time.time() * 1000
        os.kill(self.processes[old].pid, signal.SIGSTOP)
        try:
            new = self._promoted(old)
        finally:
            os.kill(self.processes[old].pid, signal.SIGCONT)
        self._wait(lambda: self._role(old) == "slave", timeout_s=60)
        return new

    def stop(self) -> None:
        """Stop every server."""
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()

    def _spawn(self, port: int, flags: list[str]) -> None:
        data = self.root / f"data-{port}"
        data.mkdir(exist_ok=True)
        self.processes[port] = subprocess.Popen(
            [self.server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)]
            + ["--logfile", str(data / "redis.log"), *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait(lambda: self._role(port) is not None)

    def _promoted(self, old: int) -> int:
        self._wait(lambda: self.primary_port() != old, timeout_s=30)
        new = self.primary_port()
        self._wait(lambda: self._role(new) == "master")
        return new

    def _role(self, port: int) -> str | None:
        try:
            client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
            try:
                return str(client.info("replication")["role"])
            finally:
                client.close()
        except redis.RedisError:
            return None

    def _linked(self, port: int) -> bool:
        client = redis.Redis(port=port, socket_timeout=1)
        try:
            return client.info("replication").get("master_link_status") == "up"
        finally:
            client.close()

    def _sees_replicas(self, port: int) -> bool:
        try:
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                master = cast(dict[str, Any], client.sentinel_master(SERVICE))
                return (
                    int(master.get("num-slaves", 0)) >= 2
                    and int(master.get("num-other-sentinels", 0)) >= 2
                )
            finally:
                client.close()
        except redis.RedisError:
            return False

    def _wait(self, condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replicated Redis did not settle in {timeout_s}s")
            time.sleep(0.05)
