"""torch.distributed set-up for tensor parallelism: one process per rank.

Owns: `DistContext` (this process's rank, the world, the two process groups, the timeout)
and `init_distributed` / `destroy_distributed`.

Two groups, both spanning all ranks:
- the default group (NCCL on CUDA, gloo on CPU) carries the model's collectives (the
  sharded layers' all-reduce / all-gather) and each step's input tensors; it has a bounded
  timeout (`dist_timeout_s`), so a dead or hung peer makes the collective fail, not hang;
- a gloo "control" group on CPU carries the small step header that wakes the worker
  ranks. Workers wait in it while the engine is idle, which may be for hours, so it has a
  very long timeout; rank 0 never waits on it unbounded (it waits on each of its
  operations with `dist_timeout_s`, see `wait`).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

_JOINED = "nanoserve/ranks_joined"
IDLE_TIMEOUT = datetime.timedelta(days=365)  # workers may sit idle this long between steps


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device  # where the model's collectives' tensors live
    control: object  # the gloo ProcessGroup for step headers
    timeout: datetime.timedelta

    def wait(self, work) -> None:
        """Wait for an async control-group operation at most `timeout`."""
        work.wait(timeout=self.timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def init_distributed(
    rank: int,
    world_size: int,
    local_rank: int,
    init_addr: str,
    device: torch.device,
    timeout_s: float,
    check_peers: Callable[[], None] | None = None,
) -> DistContext:
    """Join the rendezvous at `init_addr` (host:port; rank 0 hosts the TCP store there) and
    build both groups. Blocks until every rank has joined, at most `timeout_s`; while rank 0
    waits for the others to check in it calls `check_peers` (which raises if a local worker
    process died), so a rank that crashes while starting fails the start at once."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized in this process: one tensor-parallel engine per process"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host, port = split_addr(init_addr)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    if rank == 0:
        deadline = time.monotonic() + timeout_s
        while store.add(_JOINED, 0) < world_size - 1:
            if check_peers is not None:
                check_peers()
            if time.monotonic() > deadline:
                joined = store.add(_JOINED, 0)
                raise TimeoutError(
                    f"only {joined} of {world_size - 1} worker ranks joined {init_addr} within {timeout_s:g} s"
                )
            time.sleep(0.05)
    else:
        store.add(_JOINED, 1)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return DistContext(rank, world_size, local_rank, device, control, timeout)


def destroy_distributed(teardown: str = "abort") -> None:
    """End this process's process groups (no-op when there are none); errors of a broken group
    (a dead peer) are swallowed: the process is ending its part either way. `teardown`
    (KernelSwitches.tp_teardown): "abort" (each communicator aborted, which is local;
    2 x H200, TP=2: shutdown 1.2 s) or "destroy" (destroy_process_group: NCCL finalizes its
    communicators, which can wait on the peers; 20.2 s, two grace periods)."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if teardown == "abort" and abort is not None:
            # Each group aborted on its own first, newest first: torch's abort of all groups
            # at once wraps them in one NCCL group call, which on 2 x H200 outlived a 2 s
            # bound at rank 0, while one group at a time took 0.55 s. The call after it only
            # forgets the already aborted groups.
            world = dist.distributed_c10d._world
            for group in sorted(world.pg_names, key=world.pg_names.get, reverse=True):
                group.abort()
            abort()
        else:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001, S110 - a broken group (dead peer) may fail to tear down
        pass


def cpu_threads_per_rank(local_world: int) -> int:
    """CPU ranks on one host share its cores; oversubscribing them makes the lock-step
    collectives crawl."""
    return max(1, (os.cpu_count() or 1) // local_world)
