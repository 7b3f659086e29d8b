"""The process group of tensor parallelism: torch.distributed (gloo) between the ranks of one model.

``ProcessGroup`` joins (or forms) the default torch.distributed group of ``world_size`` ranks,
either from the launcher's environment (torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``: ``ProcessGroup.from_env()``) or from explicit arguments, with a timeout that
bounds every collective: a peer that dies or hangs makes ``all_reduce_`` raise
``DistributedError`` within ``timeout_s`` seconds instead of blocking for ever. ``active()`` is
the group the plans' ``allreduce`` kernels sum over (backends/cpu/library.py), None outside
tensor parallelism; the IR's reference of ``allreduce`` sums over torch.distributed's default
group too, so a plan and its reference agree.

The transport is gloo over TCP (CPU tensors); one group per process. A shared-memory allreduce
inside one host is not here yet (issue 45).

This module must never build graphs, load models or start processes (engines/tensor_parallel.py
starts the ranks); it only joins, uses and leaves the group.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..errors import DistributedError

#: seconds a collective (and forming the group) may take before it fails (torch's default is 30 min)
DEFAULT_TIMEOUT_S = 60.0

_ACTIVE: "ProcessGroup | None" = None


def active() -> "ProcessGroup | None":
    """The group this process joined (``ProcessGroup.init``), or None."""
    return _ACTIVE


def _int_env(name: str) -> int:
    value = os.environ.get(name)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{name}={value!r} in the environment is not an integer: the launcher "
                               "(torchrun) sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT") from None


def all_reduce_(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` in place over the active group (``active()``), else over torch.distributed's
    default group where one is initialized (a group the caller formed, e.g. under torchrun);
    unchanged on one process. Returns ``t``."""
    if _ACTIVE is not None:
        return _ACTIVE.all_reduce_(t)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


class ProcessGroup:
    """This process's place in a group of ``world_size`` ranks summing tensors over gloo.

    Args:
        rank: this process's rank, in [0, world_size).
        world_size: the number of ranks (>= 1).
        master_addr, master_port: where rank 0's TCP store listens (every rank gives the same).
        timeout_s: seconds forming the group and each collective may take (positive).

    Use ``init()`` (or ``from_env()``) to join; ``shutdown()`` to leave (idempotent).

    Raises:
        DistributedError: a rank outside [0, world_size), a world_size below 1, a port outside
            [1, 65535], a non-positive timeout; on ``init``, a group already joined in this
            process or one that could not form within the timeout (naming the address).
    """

    def __init__(self, rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise DistributedError(f"world_size must be a positive integer, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise DistributedError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
        if isinstance(master_port, bool) or not isinstance(master_port, int) or not 0 < master_port < 65536:
            raise DistributedError(f"master_port must be an integer in [1, 65535], got {master_port!r}")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise DistributedError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.rank, self.world_size = rank, world_size
        self.master_addr, self.master_port = str(master_addr), master_port
        self.timeout_s = float(timeout_s)
        self.joined = False

    @classmethod
    def from_env(cls, timeout_s: float = DEFAULT_TIMEOUT_S) -> "ProcessGroup":
        """The group torchrun describes: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` (default
        127.0.0.1), ``MASTER_PORT`` (default 29500). DistributedError when RANK or WORLD_SIZE is
        missing or not an integer."""
        return cls(_int_env("RANK"), _int_env("WORLD_SIZE"), os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   int(os.environ.get("MASTER_PORT", "29500")), timeout_s)

    def init(self) -> "ProcessGroup":
        """Join the group (blocks until every rank has joined, at most ``timeout_s``); returns self."""
        global _ACTIVE
        if _ACTIVE is not None or dist.is_initialized():
            raise DistributedError(f"rank {self.rank}: this process already belongs to a torch.distributed group; "
                                   "call shutdown() on it first")
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            store = dist.TCPStore(self.master_addr, self.master_port, self.world_size, self.rank == 0,
                                  timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        except (RuntimeError, ValueError, OSError) as e:   # torch's DistStoreError is a RuntimeError
            raise DistributedError(f"rank {self.rank} of {self.world_size}: the gloo group at "
                                   f"{self.master_addr}:{self.master_port} did not form within {self.timeout_s:g} s "
                                   f"(a rank missing, or the port taken): {e}") from e
        self._store = store
        self.joined = True
        _ACTIVE = self
        return self

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (a CPU tensor, any float dtype, contiguous) over every rank, in place;
        returns it. DistributedError naming this rank when a peer died or did not answer within
        ``timeout_s``."""
        if not self.joined:
            raise DistributedError(f"rank {self.rank}: all_reduce_ on a group not joined (call init())")
        try:
            dist.all_reduce(t)
        except (RuntimeError, dist.DistBackendError) as e:
            raise DistributedError(f"rank {self.rank} of {self.world_size}: allreduce of {tuple(t.shape)} failed: "
                                   f"a peer rank died or did not answer within {self.timeout_s:g} s ({e})") from e
        return t

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order; DistributedError as ``all_reduce_``."""
        out: list = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj)
        except (RuntimeError, dist.DistBackendError) as e:
            raise DistributedError(f"rank {self.rank} of {self.world_size}: all_gather failed: a peer rank died "
                                   f"or did not answer within {self.timeout_s:g} s ({e})") from e
        return out

    def shutdown(self) -> None:
        """Leave the group (destroys torch.distributed's default group); a no-op when not joined."""
        global _ACTIVE
        if self.joined:
            self.joined = False
            if _ACTIVE is self:
                _ACTIVE = None
            if dist.is_initialized():
                dist.destroy_process_group()
            self._store = None
