"""Joining the ranks of one engine: a TCP store, a device group for the model's collectives (gloo
on CPU, NCCL on GPU) and a gloo group on the host for step messages.

The groups are plain process-group objects owned by the worker, not torch.distributed's global
default group: several engines can live in one process (tests do), and tearing one down leaves
nothing behind. Rank 0 hosts the store; with port 0 it picks a free port, which the ranks it
starts learn from it.

The store also carries what the ranks need to know of each other before any group exists: each
rank marks itself joined as soon as it reaches the store (`announce_joined`), and every rank
polls for the others (`wait_for_joins`, at most the timeout) before it builds a group, instead
of blocking in the group's construction; a rank that fails leaves its exception there before
exiting (`report_failure`), for rank 0's error (`reported_failure`, executor/rank_watch.py).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A wait that is not a failure however long it lasts: a rank waiting for the next step (an idle
# server sends none for hours), or for the other ranks to finish loading their weights.
IDLE_FOREVER = timedelta(days=365)
JOIN_POLL_S = 0.05  # how often a rank waiting for the others looks at the store
MAX_REPORTED_CHARS = 2000  # of a failed rank's exception text: enough for a message, not a log


@dataclass(frozen=True)
class DistributedInit:
    """Where rank `rank` of `world_size` meets the others: tcp://host:port (rank 0 listens)."""

    host: str
    port: int
    world_size: int
    rank: int
    timeout_s: float = 60.0
    local_rank: int | None = None  # among the ranks on this machine (None: the rank: all ranks here)

    @property
    def machine_rank(self) -> int:
        return self.rank if self.local_rank is None else self.local_rank

    @classmethod
    def parse(cls, method: str, world_size: int, rank: int, timeout_s: float = 60.0) -> DistributedInit:
        url = urlparse(method)
        if url.scheme != "tcp" or not url.hostname or url.port is None:
            raise ValueError(f"distributed_init_method must be tcp://host:port; got {method!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"node_rank must be in [0, {world_size}) for {world_size} ranks; got {rank}")
        return cls(url.hostname, url.port, world_size, rank, timeout_s, local_rank=0)  # one rank per machine

    @classmethod
    def from_torchrun(cls, timeout_s: float = 60.0) -> DistributedInit | None:
        """The rank torchrun started this process as (RANK, WORLD_SIZE, MASTER_ADDR/PORT), if any."""
        env = os.environ
        if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            return None
        # torchrun's own store already holds MASTER_PORT: ours listens on the next port.
        rank = int(env["RANK"])
        return cls(env["MASTER_ADDR"], int(env["MASTER_PORT"]) + 1, int(env["WORLD_SIZE"]), rank, timeout_s,
                   local_rank=int(env.get("LOCAL_RANK", rank)))


def rank_device(device: str, machine_rank: int) -> str:
    """A rank's device: the CPU is shared; on CUDA the rank with `machine_rank` on its machine takes
    the GPU that many after the one `device` names (a data-parallel replica's ranks start at its own)."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + machine_rank}"


@dataclass
class ProcessGroups:
    init: DistributedInit
    store: object
    device_group: object  # the model's all-reduce / all-gather
    cpu_group: object  # step messages, agreeing on the KV pool size


def create_store(init: DistributedInit) -> tuple[object, DistributedInit]:
    """The TCP store (rank 0 listens); the init with the port the store really got."""
    store = dist.TCPStore(init.host, init.port, init.world_size, init.rank == 0,
                          timeout=timedelta(seconds=init.timeout_s), wait_for_workers=False)
    return store, replace(init, port=store.port)


def create_groups(init: DistributedInit, device: torch.device, store=None) -> ProcessGroups:
    """Both groups, each connected to every rank before this returns; a rank that does not come
    within `init.timeout_s` makes it raise. Collectives default to the same timeout; the waits
    that may legitimately last (the next step, the others' loading) pass IDLE_FOREVER per call.
    A rank that dies closes its connections, which gloo reports at once."""
    if store is None:
        store, init = create_store(init)
    timeout = timedelta(seconds=init.timeout_s)
    cpu = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), init.rank, init.world_size, timeout)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        torch.cuda.set_device(device)
        group = ProcessGroupNCCL(dist.PrefixStore("nccl/", store), init.rank, init.world_size)
    else:
        group = dist.ProcessGroupGloo(dist.PrefixStore("dev/", store), init.rank, init.world_size, timeout)
    return ProcessGroups(init, store, group, cpu)


def create_subgroup(groups: ProcessGroups, device: torch.device, name: str, first: int, size: int):
    """A device group of ranks first..first+size-1 (this rank among them), e.g. one pipeline stage's
    tensor-parallel ranks; every member calls this, other ranks do not."""
    init = groups.init
    store = dist.PrefixStore(f"{name}/", groups.store)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL
        return ProcessGroupNCCL(store, init.rank - first, size)
    return dist.ProcessGroupGloo(store, init.rank - first, size, timedelta(seconds=init.timeout_s))


def broadcast_object(group, obj, rank: int, src: int = 0, timeout: timedelta | None = None):
    """`obj` from rank `src` to every rank (pickled; a length, then the bytes). `timeout`: how long
    to wait for the others (the group's own timeout when None)."""
    if rank == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    group.broadcast([size], _root(src, timeout)).wait()
    if rank != src:
        payload = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast([payload], _root(src, timeout)).wait()
    return obj if rank == src else pickle.loads(payload.numpy().tobytes())


def _root(src: int, timeout: timedelta | None) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    if timeout is not None:
        opts.timeout = timeout
    return opts


# -- what the ranks learn from the store before the groups exist ----------------------------
def _joined_key(rank: int) -> str:
    return f"kvflow/rank{rank}/joined"


def _failure_key(rank: int) -> str:
    return f"kvflow/rank{rank}/failure"


def announce_joined(store, rank: int) -> None:
    store.set(_joined_key(rank), b"1")


def joined_ranks(store, world_size: int) -> set[int]:
    """The ranks other than 0 that have reached the store (a non-blocking look)."""
    return {rank for rank in range(1, world_size) if store.check([_joined_key(rank)])}


def wait_for_joins(store, init: DistributedInit, check: Callable[[], None] = lambda: None) -> None:
    """Poll until every rank has reached the store (rank 0 holds it), calling `check` between
    looks (rank 0 raises there for a spawned rank that died). Every rank waits for all before it
    builds a group, so the groups' connections are made together, within the groups' timeout,
    however the ranks' starts were spread; and none waits longer than `init.timeout_s`."""
    deadline = time.monotonic() + init.timeout_s
    while missing := sorted(set(range(1, init.world_size)) - joined_ranks(store, init.world_size)):
        check()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"tensor-parallel rank(s) {', '.join(map(str, missing))} of {init.world_size} did not join "
                f"tcp://{init.host}:{init.port} within distributed_timeout_s={init.timeout_s:g} "
                "(--distributed-timeout-s): start every rank within that time of rank 0")
        time.sleep(JOIN_POLL_S)


def report_failure(store, rank: int, error: BaseException) -> None:
    """Leave `error` where rank 0 reads it (`reported_failure`). Best effort: the store may be
    gone with rank 0, and the exception this rank is dying of matters more than this one."""
    text = f"{type(error).__name__}: {error}"[:MAX_REPORTED_CHARS]
    try:
        store.set(_failure_key(rank), text.encode())
    except Exception as e:  # noqa: BLE001 - whatever the store raises, the rank still exits with its own error
        logger.warning("rank %d: could not report its failure to rank 0 (%s)", rank, e)


def reported_failure(store, rank: int) -> str | None:
    """What rank `rank` reported before it failed, if it got that far."""
    key = _failure_key(rank)
    return store.get(key).decode(errors="replace") if store.check([key]) else None


def die_with_parent() -> None:
    """A process started by multiprocessing (a rank that rank 0 spawned) kills itself as soon as
    the process that started it is gone, so a killed engine leaves no rank behind holding memory.

    It watches the parent's sentinel (a pipe that reaches end-of-file when the parent process
    exits), not prctl(PR_SET_PDEATHSIG): that signal follows the parent *thread* that started
    the child, and an engine built on a thread that then ends (`build_on_fresh_thread`, as
    `kvflow serve` does) would lose its ranks the moment that thread returned."""
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_kill_self_after, args=(parent,), name="kvflow-parent-watch", daemon=True).start()


def _kill_self_after(parent) -> None:
    parent.join()  # returns once the parent process is gone (also if it already is)
    os.kill(os.getpid(), signal.SIGKILL)
