"""Tensor-parallel decoding on one host: ``yr.LLM(model, tensor_parallel_size=N)``'s ranks.

``TensorParallelSteps`` starts N rank processes (torch.multiprocessing, spawn) on this host; each
joins a gloo group on 127.0.0.1 (``runtime.distributed``), loads the model, keeps its shard
(``models.sharding``: q/k/v and gate/up by output rows, o and down by input columns, the rest
replicated) and compiles its decode steps (the persistent kernel by default, else the
launch-per-op plans), whose allreduces sum the o and down projections over the ranks. The caller's process is the coordinator: it holds the tokenizer and
the sampling loop (``engines.generate``), sends each step's token ids and start position to every
rank, and gets rank 0's logits and argmax back; it has the same ``run`` / ``prepare`` as
``models.llama.StepRunner``, so ``LLM.generate`` drives either.

Continuous batching (``generate`` of a list of prompts, ``yirage serve``): the coordinator's
``engines.batching.BatchEngine`` schedules and samples; ``batch_forward`` gives it a
``RankBatchForward`` in place of its ``BatchForward``: every rank keeps a ``BatchForward`` of its
own (its batch KV cache of its KV heads, plans, one-row decode kernels) and each step's rows
(token id, position, slot) and sample rows go to every rank, so the ranks' caches get the same
writes as one process's would; rank 0's logits come back. Nothing else touches the caches (a
slot's prefix reuse only reads what the steps wrote).

Faults: a rank that exits makes the coordinator stop every rank and raise DistributedError naming
it (its exit code) as soon as the process is gone; a rank that hangs makes the others' allreduce
time out (``timeout_s``) and the coordinator raise naming the ranks that did not answer; ranks
that disagree on the model or the world size refuse at start.

The ranks run the persistent decode kernel (its allreduces are host steps between task segments)
or the launch-per-op plans (``persistent``). This module must never build graphs itself or import a launcher beyond
torch.multiprocessing; the ranks' work is models/llama.py's.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
import weakref
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from ..backends import Backend
from ..dtypes import DType
from ..errors import DistributedError, GenerationError
from ..models.llama import LlamaModel, StepRunner
from ..models.loading import load_model
from ..models.sharding import plan_shard
from ..runtime.distributed import DEFAULT_TIMEOUT_S, ProcessGroup

#: seconds a rank may take to load, shard and compile before the coordinator gives up on it
START_TIMEOUT_S = 300.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the gloo store's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_bytes() -> int:
    """This process's resident set size in bytes (Linux /proc; 0 elsewhere)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


def check_agreement(group: ProcessGroup, identity: tuple) -> None:
    """Refuse to start unless every rank of ``group`` gives the same ``identity`` (model path,
    layers, hidden size, world size): DistributedError listing each rank's."""
    seen = group.all_gather_object(identity)
    if any(x != identity for x in seen):
        raise DistributedError(f"rank {group.rank}: the ranks disagree on the model or the world size "
                               f"(model path, layers, hidden size, world size per rank: {seen})")


def _rank_main(rank: int, world_size: int, port: int, spec: str, options: dict, threads: int, conn) -> None:
    """One rank: join the group, check the ranks agree, build its shard and serve steps until
    told to stop. Replies on ``conn``: ('ready', rss bytes, transport, its timing, weight bytes),
    then per step ('ok', logits, argmax) (numpy arrays on rank 0, None elsewhere) or per greedy
    run ('ok', token ids, None), per batch step ('ok', logits, argmax, solo steps) (rank 0's);
    ('error', message) on any failure."""
    from .batching import BatchForward

    torch.set_num_threads(threads)
    group, batches = None, {}
    try:
        group = ProcessGroup(rank, world_size, "127.0.0.1", port, options["timeout_s"], options["transport"]).init()
        loaded = load_model(spec, progress=False, allow_nonfinite=options["allow_nonfinite"])
        check_agreement(group, (str(loaded.path), loaded.config.num_layers, loaded.config.hidden_size, world_size))
        shard = plan_shard(loaded.config, loaded.weights, rank, world_size)
        model = LlamaModel(loaded, Backend.CPU, options["max_seq_length"], options["dtype"],
                           options["prefill_dtype"], options["decode_dtype"], options["kv_cache_dtype"], shard=shard)
        del loaded
        steps = StepRunner(model, persistent=options["persistent"], num_workers=threads)
        steps.prepare(1)
        conn.send(("ready", _rss_bytes(), group.transport, group.transport_us, model.weight_bytes()))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "hang":   # tests: a rank that stops answering
                time.sleep(10 ** 6)
            if msg[0] == "exit":   # tests: a rank that dies
                os._exit(9)
            if msg[0] == "greedy":
                conn.send(("ok", steps.run_greedy(msg[1], msg[2], msg[3]), None))
                continue
            if msg[0] == "batch_free":   # BatchEngines the coordinator dropped (no reply)
                for key in msg[1]:
                    batches.pop(key, None)
                continue
            if msg[0] == "batch_new":
                batches[msg[1]] = BatchForward(model, msg[2], msg[3], options["persistent"], threads)
                conn.send(("ok", None, None))
                continue
            if msg[0] == "batch":
                forward = batches[msg[1]]
                logits, argmax = forward.run(msg[2], msg[3])
                conn.send(("ok", logits.numpy().copy(), argmax.numpy().copy(), forward.solo_steps) if rank == 0
                          else ("ok", None, None, None))
                continue
            logits, argmax = steps.run(msg[1], msg[2])
            conn.send(("ok", logits.float().numpy().copy(), argmax.numpy().copy()) if rank == 0 else ("ok", None, None))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the coordinator
        with contextlib.suppress(OSError, BrokenPipeError):
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))
    finally:
        if group is not None:
            group.shutdown()


class TensorParallelSteps:
    """``world_size`` ranks of one model on this host, stepped together (see the module doc).

    Args:
        spec: the model (as ``yr.LLM`` takes it).
        world_size: the number of ranks (>= 2).
        max_seq_length, dtype, prefill_dtype, decode_dtype, kv_cache_dtype: as ``LlamaModel``.
        threads_per_rank: torch/OpenMP threads of each rank (default: this process's
            ``torch.get_num_threads()`` divided by the ranks, at least 1).
        timeout_s: seconds a collective may wait for a peer before the ranks fail.
        allow_nonfinite: as ``load_model``.
        transport: the allreduce's ('auto', 'gloo', 'shm': ``runtime.distributed.ProcessGroup``).
        persistent: the ranks decode with the persistent kernel (``LlamaModel.decode_kernel``,
            its allreduces host steps between task segments) rather than the launch-per-op plan;
            ``run_greedy`` then runs greedy chunks on every rank.

    ``run(token_ids, start_pos)`` returns (logits [1, vocab] float32, argmax [1] int64) on the
    CPU, as ``StepRunner.run``; ``batch_forward(max_slots, max_batch_tokens)`` a
    ``RankBatchForward`` for a ``BatchEngine`` (continuous batching on the ranks); calls from
    several threads (a batch engine's and a single sequence's) take turns; ``rss_bytes`` each
    rank's resident memory once ready and ``weight_bytes`` the bytes of its weights
    (``LlamaModel.weight_bytes``);
    ``transport`` the allreduce the ranks chose (and ``transport_us`` rank 0's timing of both
    under 'auto'); ``close()`` stops the ranks (also when the object is collected).

    Raises:
        DistributedError: a rank failed to start, died or hung (the message names it), or the
            ranks disagree on the model or the world size.
    """

    def __init__(self, spec: str, world_size: int, max_seq_length: int, dtype: DType = DType.float32,
                 prefill_dtype: DType | None = None, decode_dtype: DType | None = None,
                 kv_cache_dtype: DType | None = None, threads_per_rank: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, allow_nonfinite: bool = False, transport: str = "auto",
                 persistent: bool = False):
        self.world_size = world_size
        self.persistent = bool(persistent)
        self.timeout_s = float(timeout_s)
        self._turn = threading.Lock()   # one exchange with the ranks at a time
        self._batch_keys = itertools.count()
        self._freed_batches: list[int] = []   # RankBatchForwards collected: freed on the ranks at the next batch call
        threads = threads_per_rank or max(1, torch.get_num_threads() // world_size)
        options = dict(max_seq_length=max_seq_length, dtype=dtype, prefill_dtype=prefill_dtype,
                       decode_dtype=decode_dtype, kv_cache_dtype=kv_cache_dtype, timeout_s=self.timeout_s,
                       allow_nonfinite=allow_nonfinite, transport=transport, persistent=self.persistent)
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        with _thread_env(threads):
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_rank_main, args=(rank, world_size, port, spec, options, threads, child),
                                daemon=True, name=f"yirage-tp-rank{rank}")
                p.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(p)
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.procs)
        ready = self._gather(range(world_size), START_TIMEOUT_S + self.timeout_s, "ready")
        self.rss_bytes = [r[1] for r in ready]
        self.transport, self.transport_us = ready[0][2], ready[0][3]
        self.weight_bytes = [r[4] for r in ready]

    def _gather(self, ranks, timeout_s: float, what: str) -> list:
        """The next reply of each rank in ``ranks``, in rank order; DistributedError (after
        stopping every rank) when one fails, exits or does not answer within ``timeout_s``."""
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(ranks):
            waiting = [r for r in ranks if r not in got]
            ready = wait([self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting],
                         timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail(f"rank(s) {waiting} did not answer ({what}) within {timeout_s:g} s: hung")
            for r in waiting:
                conn = self.conns[r]
                if conn in ready or conn.poll():
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        continue   # its sentinel says why
                    if msg[0] == "error":
                        silent = [x for x in waiting if x != r and x not in got and not self.conns[x].poll()]
                        note = f"; rank(s) {silent} had not answered ({what})" if silent else ""
                        self._fail(self._dead_ranks_note(r) + msg[1] + note)
                    got[r] = msg
                elif self.procs[r].sentinel in ready:
                    self.procs[r].join(timeout=1.0)   # its exit code
                    hint = ("; the ranks are spawned processes that import the caller's main module: a script "
                            "that starts them must do so under `if __name__ == '__main__':`") if what == "ready" else ""
                    self._fail(f"rank {r} (pid {self.procs[r].pid}) exited with code {self.procs[r].exitcode} "
                               f"({what}){hint}")
        return [got[r] for r in ranks]

    def _dead_ranks_note(self, reporter: int) -> str:
        """'rank N (pid P) exited with code C; ' for each rank but ``reporter`` (the one that
        reported a failure, and exits after it) gone a moment after the report."""
        others = [(r, p) for r, p in enumerate(self.procs) if r != reporter]
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and all(p.is_alive() for _, p in others):
            time.sleep(0.05)
        return "".join(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}; " for r, p in others if not p.is_alive())

    def _fail(self, message: str):
        for p in self.procs:   # a failed group: no rank can finish a step, so no grace to wait out
            if p.is_alive():
                p.kill()
        self.close()
        raise DistributedError(f"tensor parallelism ({self.world_size} ranks): {message}")

    def prepare(self, T: int) -> None:
        """Nothing to do: every rank compiled its decode step at start; prefill plans are
        compiled on first use."""

    def _send(self, msg: tuple) -> None:
        if not self._finalizer.alive:
            raise GenerationError("the tensor-parallel ranks were stopped (close(), or a rank failed)")
        for conn in self.conns:
            try:
                conn.send(msg)
            except (BrokenPipeError, OSError):
                pass   # the rank is gone: _gather names it

    def _exchange(self, msg: tuple, timeout_s: float, what: str) -> list:
        """Send ``msg`` to every rank and gather their replies, one exchange at a time."""
        with self._turn:
            if self._freed_batches and msg[0].startswith("batch"):
                freed, self._freed_batches[:] = list(self._freed_batches), []
                self._send(("batch_free", freed))
            self._send(msg)
            return self._gather(range(self.world_size), timeout_s, what)

    def run(self, token_ids: list[int], start_pos: int):
        """One forward step on every rank: (logits [1, vocab] float32, argmax [1] int64)."""
        replies = self._exchange(("run", list(token_ids), int(start_pos)), self.timeout_s + 30.0,
                                 f"step at position {start_pos}")
        return torch.from_numpy(replies[0][1]), torch.from_numpy(replies[0][2])

    def batch_forward(self, max_slots: int, max_batch_tokens: int) -> "RankBatchForward":
        """A ``BatchEngine``'s forward steps on the ranks: each rank makes a ``BatchForward`` of
        ``max_slots`` slots (its KV heads' batch cache) for the steps of the ``RankBatchForward``
        returned; freed on the ranks once that is collected."""
        key = next(self._batch_keys)
        self._exchange(("batch_new", key, int(max_slots), int(max_batch_tokens)), START_TIMEOUT_S + self.timeout_s,
                       "a batch KV cache")
        forward = RankBatchForward(self, key)
        weakref.finalize(forward, self._freed_batches.append, key)
        return forward

    def run_greedy(self, token: int, start_pos: int, n: int) -> list[int]:
        """Up to ``n`` greedy steps on every rank's persistent kernel (``StepRunner.run_greedy``):
        rank 0's new token ids. DistributedError if the ranks' tokens differ; GenerationError
        without ``persistent``."""
        if not self.persistent:
            raise GenerationError("run_greedy needs the persistent decode kernel (persistent=True)")
        replies = self._exchange(("greedy", int(token), int(start_pos), int(n)), n * (self.timeout_s + 30.0),
                                 f"greedy steps from {start_pos}")
        if any(r[1] != replies[0][1] for r in replies):
            self._fail(f"the ranks' greedy tokens differ from position {start_pos}: {[r[1] for r in replies]}")
        return replies[0][1]

    def send_fault(self, rank: int, kind: str) -> None:
        """Tests: make ``rank`` die ('exit') or stop answering ('hang') at its next message."""
        self.conns[rank].send((kind,))

    def close(self) -> None:
        """Stop every rank (idempotent)."""
        self._finalizer()


class RankBatchForward:
    """``engines.batching.BatchForward``'s ``run`` on every rank of a ``TensorParallelSteps``
    (made by its ``batch_forward``): each step's rows and sample rows go to every rank, whose
    ``BatchForward`` runs them on its shard; rank 0's logits [R, vocab] float32 and argmax [R]
    come back. ``solo_steps``: rank 0's one-row steps on its persistent decode kernel. The
    KV cache lives on the ranks: ``cache`` is a GenerationError."""

    def __init__(self, steps: TensorParallelSteps, key: int):
        self.steps, self.key = steps, key
        self.solo_steps = 0
        self._solo: dict = {}   # the one-row kernels are the ranks'

    @property
    def cache(self):
        raise GenerationError(f"the batch KV cache lives on the {self.steps.world_size} tensor-parallel ranks "
                              "(each holds its KV heads' share)")

    def run(self, rows: list[tuple[int, int, int]], sample_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [(int(t), int(p), int(s)) for t, p, s in rows]
        what = f"batch step of {len(rows)} rows"
        reply = self.steps._exchange(("batch", self.key, rows, [int(i) for i in sample_rows]),
                                     self.steps.timeout_s + 60.0, what)[0]
        self.solo_steps = reply[3]
        return torch.from_numpy(reply[1]), torch.from_numpy(reply[2])


def _stop(conns, procs) -> None:
    for conn in conns:
        with contextlib.suppress(OSError, BrokenPipeError):
            conn.send(("stop",))
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    for conn in conns:
        conn.close()


@contextlib.contextmanager
def _thread_env(threads: int):
    """OMP_NUM_THREADS=threads for the processes started inside (restored after)."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
