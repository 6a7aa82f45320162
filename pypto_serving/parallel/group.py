"""The process group of one replica's tensor-parallel ranks (torch.distributed).

Rank 0 is the device worker the scheduler talks to; it hosts the group's TCPStore at
`master_addr:master_port`. Every rank joins by writing its host name there; rank 0 waits for
all of them (naming the ranks, and their nodes, that did not come) and then each creates:
- the default group, gloo, without a deadline: the channel (parallel/channel.py) on which
  the other ranks wait, idle, for rank 0's next message;
- the model's group, with the backend's collective library (gloo on the CPU, nccl on CUDA,
  hccl on an NPU), for the forward's all-reduces and all-gathers.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time

import torch
import torch.distributed as dist

from pypto_serving.messages.worker import ParallelConfig
from pypto_serving.parallel.sharding import TensorParallel

COLLECTIVE_LIBRARIES = {"portable": "gloo", "cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
STEP_TIMEOUT = datetime.timedelta(minutes=10)  # a collective inside a step
FOREVER = datetime.timedelta(days=365)  # ranks waiting for rank 0's next message
JOIN_POLL_S = 0.05


class GroupError(RuntimeError):
    """The ranks could not form their group: the message says which did not join."""


def join(parallel: ParallelConfig, rank: int) -> dist.TCPStore:
    """Joins rank `rank` to its group's store and default group; returns the store."""
    if _is_loopback(parallel.master_addr):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo would look the host name up
    timeout = datetime.timedelta(seconds=parallel.timeout_s)
    try:
        store = dist.TCPStore(parallel.master_addr, parallel.master_port, parallel.tp, rank == 0,
                              timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        where = f"{parallel.master_addr}:{parallel.master_port}"
        raise GroupError(f"rank {rank} could not reach the master at {where} within "
                         f"{parallel.timeout_s:g} s ({type(exc).__name__})") from None
    store.set(f"joined/{rank}", socket.gethostname())
    if rank == 0:
        _wait_for_ranks(store, parallel)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=parallel.tp, timeout=FOREVER)
    return store


def _wait_for_ranks(store: dist.TCPStore, parallel: ParallelConfig) -> None:
    keys = [f"joined/{r}" for r in range(parallel.tp)]
    deadline = time.monotonic() + parallel.timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r in range(parallel.tp) if not store.check([f"joined/{r}"])]
            nodes = sorted({parallel.node_of(r) for r in missing})
            raise GroupError(f"tensor-parallel rank(s) {missing} (node(s) {nodes}) did not join "
                             f"within {parallel.timeout_s:g} s: start every node with the same "
                             f"--master-addr/--master-port and its own --node-rank")
        time.sleep(JOIN_POLL_S)


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


class RankGroup:
    """The collectives of one rank, for the model (`tensor_parallel`) and the worker."""

    def __init__(self, parallel: ParallelConfig, rank: int, backend: str) -> None:
        library = COLLECTIVE_LIBRARIES[backend]
        if library == "nccl" and not dist.is_nccl_available():
            raise GroupError("--tensor-parallel-size above 1 on cuda needs NCCL, which this torch "
                             "build lacks")
        if library == "hccl":
            import torch_npu  # noqa: F401  (registers the hccl backend)
        self.rank, self.size = rank, parallel.tp
        self.group = dist.new_group(backend=library, timeout=STEP_TIMEOUT)

    def tensor_parallel(self) -> TensorParallel:
        return TensorParallel(self.rank, self.size, self.all_reduce, self.all_gather)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)  # the default (gloo, host) group
        return int(t.item())


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
