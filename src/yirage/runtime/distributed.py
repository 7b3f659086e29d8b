"""The process group of tensor parallelism: torch.distributed (gloo) between the ranks of one model.

``ProcessGroup`` joins (or forms) the default torch.distributed group of ``world_size`` ranks,
either from the launcher's environment (torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``: ``ProcessGroup.from_env()``) or from explicit arguments, with a timeout that
bounds every collective: a peer that dies or hangs makes ``all_reduce_`` raise
``DistributedError`` within ``timeout_s`` seconds instead of blocking for ever. ``active()`` is
the group the plans' ``allreduce`` kernels sum over (backends/cpu/library.py), None outside
tensor parallelism; the IR's reference of ``allreduce`` sums over torch.distributed's default
group too, so a plan and its reference agree.

Transports (one group per process): gloo over TCP, and, for ranks on one host, a shared-memory
allreduce (``SharedMemoryAllreduce``: the design of vLLM's and DeepSpeed's CPU allreduce: each rank
writes its tensor into its slot of a file in /dev/shm, raises its flag, spins until every rank's
flag is up, then sums the slots in rank order, so every rank gets the same bits). ``transport=
'auto'`` times both at ``init`` over a decode-sized tensor and keeps the faster (rank 0's figures
decide, every rank follows); the figures stay in ``transport_us``.

This module must never build graphs, load models or start processes (engines/tensor_parallel.py
starts the ranks); it only joins, uses and leaves the group.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import mmap
import os
import platform
import tempfile
import time
import uuid

import torch
import torch.distributed as dist

from ..errors import DistributedError
from .toolchain import load_kernel_library

#: seconds a collective (and forming the group) may take before it fails (torch's default is 30 min)
DEFAULT_TIMEOUT_S = 60.0

_ACTIVE: "ProcessGroup | None" = None

#: the transports ``ProcessGroup`` takes
TRANSPORTS = ("auto", "gloo", "shm")

#: float32 values per rank slot of the shared-memory allreduce (larger tensors go over gloo)
SHM_CAPACITY = 1 << 16

#: polls of the peers' flags before the shared-memory allreduce starts yielding the core at each
#: poll (kernels/cpu/allreduce.cpp)
_SPINS = 2000

#: float32 values of the tensor 'auto' times both transports on (a decode step's hidden state is
#: 576..8192 values), and how many allreduces of it
_PROBE_VALUES, _PROBE_ITERS = 1024, 200


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
        transport: 'gloo', 'shm' (shared memory: the ranks on one x86-64 or aarch64 host) or
            'auto' (the faster of the two by measurement at ``init`` where shm can run, else gloo).

    Use ``init()`` (or ``from_env()``) to join; ``shutdown()`` to leave (idempotent).

    Raises:
        DistributedError: a rank outside [0, world_size), a world_size below 1, a port outside
            [1, 65535], a non-positive timeout, an unknown transport or 'shm' on another
            architecture; on ``init``, a group already joined in this process or one that could not
            form within the timeout (naming the address).
    """

    def __init__(self, rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                 timeout_s: float = DEFAULT_TIMEOUT_S, transport: str = "auto"):
        if transport not in TRANSPORTS:
            raise DistributedError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if transport == "shm" and not _shm_capable():
            raise DistributedError(f"transport='shm' runs on x86-64 and aarch64 hosts (kernels/cpu/allreduce.cpp); "
                                   f"this one is {platform.machine()}: use 'gloo'")
        self.transport = transport
        self.transport_us: dict[str, float] = {}
        self._shm: SharedMemoryAllreduce | None = None
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
        try:
            self._pick_transport()
        except BaseException:
            self.shutdown()
            raise
        return self

    def _pick_transport(self) -> None:
        """Set up shared memory where asked (or 'auto' and possible) and, for 'auto', keep the
        faster transport by rank 0's timing."""
        if self.world_size == 1 or self.transport == "gloo" or not _shm_capable():
            self.transport = "gloo"
            return
        self._shm = SharedMemoryAllreduce(self, self._store)
        if self.transport == "auto":
            probe = torch.zeros(_PROBE_VALUES)
            timed = {"gloo": self._time(self._gloo_all_reduce_, probe), "shm": self._time(self._shm.all_reduce_, probe)}
            agreed = [timed]
            dist.broadcast_object_list(agreed, src=0)
            self.transport_us = agreed[0]
            self.transport = min(self.transport_us, key=self.transport_us.get)
        if self.transport == "gloo":
            self._shm.close()
            self._shm = None

    def _time(self, reduce, x: torch.Tensor) -> float:
        """Median microseconds of one allreduce of ``x`` by ``reduce`` (after a warm-up)."""
        dist.barrier()
        times = []
        for i in range(_PROBE_ITERS + 20):
            t0 = time.perf_counter()
            reduce(x)
            if i >= 20:
                times.append(time.perf_counter() - t0)
        times.sort()
        return round(times[len(times) // 2] * 1e6, 2)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (a CPU tensor, any float dtype, contiguous) over every rank, in place;
        returns it. DistributedError naming this rank when a peer died or did not answer within
        ``timeout_s``."""
        if not self.joined:
            raise DistributedError(f"rank {self.rank}: all_reduce_ on a group not joined (call init())")
        if self._shm is not None and self._shm.fits(t):
            return self._shm.all_reduce_(t)
        return self._gloo_all_reduce_(t)

    def _gloo_all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
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
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self.joined:
            self.joined = False
            if _ACTIVE is self:
                _ACTIVE = None
            if dist.is_initialized():
                dist.destroy_process_group()
            self._store = None


@functools.lru_cache(maxsize=1)
def _allreduce_library():
    """kernels/cpu/allreduce.cpp, built and loaded once (``runtime.toolchain``)."""
    lib = load_kernel_library("allreduce", symbols=("yr_shm_allreduce_f32",))
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.yr_shm_allreduce_f32.argtypes = (p, p, i, i, i, i, p, i, i, i)
    lib.yr_shm_allreduce_f32.restype = i
    return lib


def _shm_capable() -> bool:
    """Whether the shared-memory allreduce can run here: the architectures its kernel is built and
    tested for (x86-64, aarch64)."""
    return platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")


class SharedMemoryAllreduce:
    """The float32 sum of the ranks of ``group`` (on one host) through a file in /dev/shm.

    Layout: a flag per rank (int64, one 64-byte line each), then two buffers [world_size,
    SHM_CAPACITY] float32. Allreduce number s writes buffer s % 2: a rank reaching s + 2 has seen
    every flag at s + 1, so every rank has finished reading s's buffer (two buffers suffice).
    Rank 0 creates the file, the others open it by the name rank 0 puts in the store, and rank 0
    unlinks it once all have mapped it (nothing is left behind, even after a crash).
    """

    def __init__(self, group: ProcessGroup, store):
        self.rank, self.world_size, self.timeout_s = group.rank, group.world_size, group.timeout_s
        W = self.world_size
        flag_bytes = W * 64
        size = flag_bytes + 2 * W * SHM_CAPACITY * 4
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        if self.rank == 0:
            path = os.path.join(directory, f"yirage-allreduce-{uuid.uuid4().hex}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
            store.set("yirage/shm_allreduce", path)
        else:
            path = store.get("yirage/shm_allreduce").decode()
            fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        dist.barrier()
        if self.rank == 0:
            os.unlink(path)
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8)   # keeps the mapping's address
        self._flags_ptr = self._data.data_ptr()
        self._data_ptr = self._flags_ptr + flag_bytes
        self._lib = _allreduce_library()
        self._step = 0

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes through shared memory: float32, contiguous, at most SHM_CAPACITY values."""
        return t.dtype == torch.float32 and t.is_contiguous() and t.numel() <= SHM_CAPACITY and t.device.type == "cpu"

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place (rank order: every rank gets the same bits), in one
        call of kernels/cpu/allreduce.cpp; DistributedError naming the first rank that did not
        arrive within ``timeout_s``."""
        self._step += 1
        late = self._lib.yr_shm_allreduce_f32(self._flags_ptr, self._data_ptr, self.rank, self.world_size,
                                              SHM_CAPACITY, self._step, t.data_ptr(), t.numel(), _SPINS,
                                              int(self.timeout_s * 1e9))
        if late == 1:
            raise DistributedError(f"rank {self.rank} of {self.world_size}: the shared-memory allreduce refused its "
                                   f"sizes ({t.numel()} values, {SHM_CAPACITY} per slot)")
        if late:
            raise DistributedError(f"rank {self.rank} of {self.world_size}: rank(s) [{-late - 1}] did not reach "
                                   f"shared-memory allreduce #{self._step} within {self.timeout_s:g} s (died or hung)")
        return t

    def close(self) -> None:
        """Unmap the file (idempotent)."""
        self._data = None
        with contextlib.suppress(BufferError, ValueError, AttributeError):
            self._mm.close()
