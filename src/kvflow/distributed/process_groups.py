"""Joining the ranks of one engine: a TCP store, a device group for the model's collectives (gloo
on CPU, NCCL on GPU) and a gloo group on the host for step messages.

The groups are plain process-group objects owned by the worker, not torch.distributed's global
default group: several engines can live in one process (tests do), and tearing one down leaves
nothing behind. Rank 0 hosts the store; with port 0 it picks a free port, which the ranks it
starts learn from it.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
from dataclasses import dataclass, replace
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

_PR_SET_PDEATHSIG = 1
IDLE_FOREVER = timedelta(days=365)


@dataclass(frozen=True)
class DistributedInit:
    """Where rank `rank` of `world_size` meets the others: tcp://host:port (rank 0 listens)."""

    host: str
    port: int
    world_size: int
    rank: int
    timeout_s: float = 60.0

    @classmethod
    def parse(cls, method: str, world_size: int, rank: int, timeout_s: float = 60.0) -> DistributedInit:
        url = urlparse(method)
        if url.scheme != "tcp" or not url.hostname or url.port is None:
            raise ValueError(f"distributed_init_method must be tcp://host:port; got {method!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"node_rank must be in [0, {world_size}) for {world_size} ranks; got {rank}")
        return cls(url.hostname, url.port, world_size, rank, timeout_s)

    @classmethod
    def from_torchrun(cls, timeout_s: float = 60.0) -> DistributedInit | None:
        """The rank torchrun started this process as (RANK, WORLD_SIZE, MASTER_ADDR/PORT), if any."""
        env = os.environ
        if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            return None
        # torchrun's own store already holds MASTER_PORT: ours listens on the next port.
        return cls(env["MASTER_ADDR"], int(env["MASTER_PORT"]) + 1, int(env["WORLD_SIZE"]), int(env["RANK"]), timeout_s)


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
    if store is None:
        store, init = create_store(init)
    timeout = timedelta(seconds=init.timeout_s)
    # Waiting for the next step is not a failure (an idle server sends none for hours): the host
    # group never times out. A rank that dies closes its connections, which gloo reports at once;
    # a rank that hangs inside a step is caught by the device group's timeout.
    cpu = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), init.rank, init.world_size, IDLE_FOREVER)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        torch.cuda.set_device(device)
        group = ProcessGroupNCCL(dist.PrefixStore("nccl/", store), init.rank, init.world_size)
    else:
        group = dist.ProcessGroupGloo(dist.PrefixStore("dev/", store), init.rank, init.world_size, timeout)
    return ProcessGroups(init, store, group, cpu)


def broadcast_object(group, obj, rank: int, src: int = 0):
    """`obj` from rank `src` to every rank (pickled; a length, then the bytes)."""
    if rank == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    group.broadcast([size], _root(src)).wait()
    if rank != src:
        payload = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast([payload], _root(src)).wait()
    return obj if rank == src else pickle.loads(payload.numpy().tobytes())


def _root(src: int) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    return opts


def die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies, so a killed engine leaves no
    worker rank behind holding memory."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
