"""Expert parallelism across a pool's ranks: the process group, found through the pool's
Redis, and the collectives a mixture-of-experts launch runs in it (docs/architecture.md §4a).

Ranks form a group per batcher epoch: when a rank's first plan of a new epoch arrives, rank
0 opens a `torch.distributed` store on a free port and publishes its address with the
epoch on the pool's rendezvous hash; the other ranks wait for that epoch's address and
join. A rank that dies or hangs makes the others' next collective fail (at once for a
closed connection, after `collective_timeout_s` for a hung peer); they drop their requests
and register anew, the batcher opens a new epoch, every rank forms the group again and the
requests resume from their streams. gloo on the CPU, NCCL on CUDA, HCCL on Ascend.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any, Protocol, cast

import redis
import torch
import torch.distributed as dist
from torch.distributed import AllToAllOptions

from npu_worker.models.moe import ExpertGroup, LocalExperts
from schemas.keys import Keys

log = logging.getLogger("npu_pool.worker")
LOOPBACK = "127.0.0.1"
MAX_FIRST_TIMEOUTS = 3  # rendezvous a rank may fail before its first group, then it gives up


class RendezvousTimeout(RuntimeError):
    """The group's other ranks did not all come within the timeout."""


def backend_for(device: torch.device) -> str:
    """The collective backend of a device type."""
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


class ProcessGroupExperts:
    """An ExpertGroup over a formed process group of the pool's ranks."""

    def __init__(self, group: Any, rank: int, size: int) -> None:  # a c10d backend
        self.group, self.rank, self.size = group, rank, size
        self.seconds = 0.0  # in collectives, since the engine last took it

    def gather(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each rank's rows for this rank's experts: the counts first (every rank's for every
        rank), then the rows, each rank sending only what is routed to the other's experts."""
        started = time.perf_counter()
        received = torch.empty_like(counts)
        self.group.alltoall_base(received, counts.contiguous(), [], [], AllToAllOptions()).wait()
        out = rows.new_empty((int(received.sum()), *rows.shape[1:]))
        self._exchange(out, rows, received.sum(1).tolist(), counts.sum(1).tolist())
        self.seconds += time.perf_counter() - started
        return out, received

    def combine(
        self, outputs: torch.Tensor, sent: torch.Tensor, received: torch.Tensor
    ) -> torch.Tensor:
        """The outputs of the rows this rank sent, back from the ranks that computed them."""
        started = time.perf_counter()
        back = outputs.new_empty((int(sent.sum()), *outputs.shape[1:]))
        self._exchange(back, outputs, sent.sum(1).tolist(), received.sum(1).tolist())
        self.seconds += time.perf_counter() - started
        return back

    def _exchange(
        self, out: torch.Tensor, rows: torch.Tensor, into: list[int], out_of: list[int]
    ) -> None:
        """One all-to-all of rows: `out_of[r]` of `rows` go to rank r, `into[r]` come from it."""
        self.group.alltoall_base(out, rows.contiguous(), into, out_of, AllToAllOptions()).wait()


def process_group(
    backend: str, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta
) -> Any:
    """A process group of its own (not torch's global default group, whose hidden counters
    would differ between a rank that re-formed groups and one that just started)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"expert parallelism over {backend} is not supported yet (gloo, nccl)")


class Rendezvous:
    """Forms (and re-forms) this rank's process group, through the pool's Redis."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        pool: str,
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float,
        host: str = LOOPBACK,
    ) -> None:
        self.client, self.key = client, keys.rendezvous(pool)
        self.rank, self.size = rank, size
        self.backend = backend_for(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.host = host
        self.store: dist.TCPStore | None = None  # rank 0 hosts it; kept while the group lives
        self.generation: int | None = None
        self.group: Any = None  # the c10d backend of the current generation
        if host == LOOPBACK:  # every rank on this host: gloo's own sockets stay on loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    def form(self, generation: int) -> ProcessGroupExperts:
        """The group of `generation` (a batcher epoch), every rank in it; raises
        RendezvousTimeout if the others do not all join in time, or the store cannot open."""
        self.leave()
        try:
            store = self._store(generation)
            group = process_group(
                self.backend,
                dist.PrefixStore(f"generation-{generation}/", store),
                self.rank,
                self.size,
                self.timeout,
            )
        except RuntimeError as exc:  # c10d's own errors: a refused or timed-out connection
            if isinstance(exc, RendezvousTimeout):
                raise
            raise RendezvousTimeout(
                f"expert-parallel group {generation} did not form: {exc}"
            ) from exc
        self.generation, self.group = generation, group
        log.info("rank %d in expert-parallel group %d (%d ranks)", self.rank, generation, self.size)
        return ProcessGroupExperts(group, self.rank, self.size)

    def _store(self, generation: int) -> dist.Store:
        """Rank 0 opens the group's store on a free port and publishes where it is; the other
        ranks connect to the address published for this generation."""
        if self.rank == 0:
            self.store = dist.TCPStore(
                self.host,
                0,
                self.size,
                is_master=True,
                timeout=self.timeout,
                wait_for_workers=False,
            )
            address = f"{self.host}:{self.store.port}"
            self.client.hset(self.key, mapping={"generation": generation, "address": address})
            return self.store
        host, port = self._address(generation)
        return dist.TCPStore(host, port, self.size, is_master=False, timeout=self.timeout)

    def leave(self) -> None:
        """Drop the current group, if any (after a failed collective, or to re-form)."""
        self.group = None
        self.generation = None

    def _address(self, generation: int) -> tuple[str, int]:
        deadline = time.monotonic() + self.timeout.total_seconds()
        while time.monotonic() < deadline:
            found = cast(list[bytes | None], self.client.hmget(self.key, ["generation", "address"]))
            if found[0] is not None and int(found[0]) == generation and found[1]:
                host, port = found[1].decode().rsplit(":", 1)
                return host, int(port)
            time.sleep(0.05)
        raise RendezvousTimeout(
            f"rank 0 published no address for expert-parallel group {generation} within "
            f"{self.timeout.total_seconds():.0f}s"
        )


class SplitsExperts(Protocol):
    """A model whose routed experts can be split over an ExpertGroup."""

    def use_experts(self, group: ExpertGroup) -> None:
        """Run the experts' collectives in `group` (LocalExperts: none)."""
        ...


class ExpertParallel:
    """A rank's side of expert parallelism: the group of the current epoch, and what a
    failed collective leaves (no group, the rank re-registers)."""

    def __init__(self, rendezvous: Rendezvous, model: SplitsExperts) -> None:
        self.rendezvous, self.model = rendezvous, model
        self.group: ProcessGroupExperts | None = None
        self.formed = False  # a group has formed at least once: later failures re-form
        self.timeouts = 0  # rendezvous that failed in a row

    def join(self, epoch: int) -> None:
        """Be in the group of `epoch` before running its plans (forming it on its first)."""
        if self.rendezvous.generation != epoch:
            self.group = None
            self.model.use_experts(LocalExperts())
            self.group = self.rendezvous.form(epoch)
            self.model.use_experts(self.group)
            self.formed, self.timeouts = True, 0

    @property
    def hopeless(self) -> bool:
        """The rank has never been in a group and its last rendezvous all timed out: a
        configuration no retry fixes (a rank that never joins, an unreachable address)."""
        return not self.formed and self.timeouts >= MAX_FIRST_TIMEOUTS

    def take_ms(self) -> float:
        """Milliseconds in collectives since the last call."""
        if self.group is None:
            return 0.0
        seconds, self.group.seconds = self.group.seconds, 0.0
        return seconds * 1000

    def fail(self, exc: BaseException) -> None:
        """A collective (or the rendezvous) failed: leave the group; the caller drops its
        requests and registers anew, so the batcher forms a new epoch."""
        log.warning(
            "rank %d: expert-parallel step failed (%s); re-forming", self.rendezvous.rank, exc
        )
        self.timeouts += isinstance(exc, RendezvousTimeout)
        self.rendezvous.leave()
        self.group = None
        self.model.use_experts(LocalExperts())
