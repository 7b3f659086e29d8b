"""Several processes on this host encoding for one ``EmbeddingModel``: sentence-transformers'
multi-process pool (``start_multi_process_pool`` / ``encode_multi_process`` /
``stop_multi_process_pool``), with the same signatures and results.

Each worker is a process of its own (``multiprocessing`` with ``spawn``: forking a process whose
OpenMP and torch thread pools are running is unsafe). It loads the same model (name or path,
backend, quantization, dtype) with ``threads`` OpenMP/torch threads (the host's cores split
between the workers, set in its environment before torch starts), says it is ready, then embeds
the chunks it takes from a shared input queue. ``encode_multi_process`` cuts the sentences into
chunks, and puts the chunks' vectors back in input order. A worker that fails reports the
error; one that dies (killed, out of memory) is noticed within a second; both raise one
``YirageError`` in the caller, never a hang.

This module must never build graphs or touch kernels: the workers run ``EmbeddingModel``.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import sys
import time
from typing import Any

import numpy as np

from ..config import scoped_environ, thread_env
from ..errors import YirageError

#: seconds a new worker may take to import torch and load its model
START_TIMEOUT_S = 600.0
#: how often the caller checks that the workers are alive while it waits (seconds)
POLL_S = 1.0


def _worker(spec: dict, index: int, inq, outq) -> None:
    """A pool process: load the model of ``spec``, report ("ready", index) or ("error", index,
    message), then answer (chunk id, sentences, batch_size, normalize) items with (chunk id,
    float32 array) or (chunk id, None, message) until it takes None."""
    try:
        from .embed import EmbeddingModel

        model = EmbeddingModel(spec["name_or_path"], backend=spec["backend"], quantization=spec["quantization"],
                               dtype=spec["dtype"])
    except BaseException as e:  # noqa: BLE001 (reported to the caller, which raises it)
        outq.put(("error", index, f"{type(e).__name__}: {e}"))
        return
    outq.put(("ready", index))
    while True:
        item = inq.get()
        if item is None:
            return
        chunk, sentences, batch_size, normalize = item
        try:
            vectors = model.encode(sentences, batch_size=batch_size, normalize_embeddings=normalize)
            outq.put((chunk, np.ascontiguousarray(vectors, dtype=np.float32)))
        except BaseException as e:  # noqa: BLE001
            outq.put((chunk, None, f"{type(e).__name__}: {e}"))


def start_pool(spec: dict, target_devices: list[str] | None = None) -> dict:
    """Start one worker process per entry of ``target_devices`` (each 'cpu'; None: one per 2
    cores, at least 1 and at most 4, as sentence-transformers starts 4 CPU workers), each with
    the host's cores divided between them as its threads, and wait until every one has loaded
    the model.

    Returns: the pool, ``{"input": queue, "output": queue, "processes": [Process, ...],
    "threads": int}``. Raises YirageError: a device other than 'cpu', or a worker that could not
    load the model (its error), died, or took longer than ``START_TIMEOUT_S`` to start; the
    started workers are stopped first."""
    cores = os.cpu_count() or 1
    if target_devices is None:
        target_devices = ["cpu"] * max(1, min(4, cores // 2))
    if not isinstance(target_devices, (list, tuple)) or not target_devices:
        raise YirageError("start_multi_process_pool: target_devices must be a non-empty list such as ['cpu', 'cpu']")
    bad = [d for d in target_devices if d != "cpu"]
    if bad:
        raise YirageError(f"start_multi_process_pool: device {bad[0]!r} is not supported: the pool runs CPU "
                          "processes ('cpu' entries); on a GPU, call encode on one model")
    threads = max(1, cores // len(target_devices))
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    pool = {"input": inq, "output": outq, "processes": [], "threads": threads}
    with scoped_environ(thread_env(threads)):   # the children's, as they start
        for i in range(len(target_devices)):
            p = ctx.Process(target=_worker, args=(spec, i, inq, outq), daemon=True, name=f"yirage-embed-{i}")
            p.start()
            pool["processes"].append(p)
    ready: set[int] = set()
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while len(ready) < len(target_devices):
            msg = _get(pool, deadline, "start")
            if msg[0] == "error":
                raise YirageError(f"start_multi_process_pool: worker {msg[1]} could not load the model: {msg[2]}")
            ready.add(msg[1])
    except BaseException:
        stop_pool(pool)
        raise
    return pool


def _get(pool: dict, deadline: float, what: str):
    """The next message of the pool's output queue; YirageError when a worker has died or the
    deadline passes first."""
    while True:
        try:
            return pool["output"].get(timeout=POLL_S)
        except queue.Empty:
            dead = [p for p in pool["processes"] if not p.is_alive()]
            if dead:
                raise YirageError(f"the embedding pool's worker {dead[0].name} died (exit code {dead[0].exitcode}) "
                                  f"during {what}: stop the pool and start a new one") from None
            if time.monotonic() > deadline:
                raise YirageError(f"the embedding pool did not answer within the time limit during {what}") from None


def encode_with_pool(sentences, pool: dict, batch_size: int = 32, chunk_size: int | None = None,
                     show_progress_bar: bool | None = None, normalize_embeddings: bool = False,
                     timeout_s: float = 86400.0) -> np.ndarray:
    """float32 [len(sentences), dim] embeddings of ``sentences`` (a list of str) computed by the
    pool's workers, in input order: chunks of ``chunk_size`` sentences (None: about ten per
    worker, at most 5000, as sentence-transformers cuts them). Raises YirageError: a bad
    argument, a worker's error (the first one), a worker that died, or no answer within
    ``timeout_s`` seconds."""
    if isinstance(sentences, str):
        sentences = [sentences]
    sentences = list(sentences)
    bad = next((i for i, s in enumerate(sentences) if not isinstance(s, str)), None)
    if bad is not None:
        raise YirageError(f"encode_multi_process: sentence {bad} is a {type(sentences[bad]).__name__}, not a str")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise YirageError(f"encode_multi_process: batch_size must be a positive integer, got {batch_size!r}")
    workers = len(pool["processes"])
    if chunk_size is None:
        chunk_size = min(max(1, math.ceil(len(sentences) / workers / 10)), 5000)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise YirageError(f"encode_multi_process: chunk_size must be a positive integer, got {chunk_size!r}")
    if not sentences:
        return np.zeros((0, 0), dtype=np.float32)
    chunks = [sentences[i:i + chunk_size] for i in range(0, len(sentences), chunk_size)]
    for cid, chunk in enumerate(chunks):
        pool["input"].put((cid, chunk, batch_size, bool(normalize_embeddings)))
    results: dict[int, np.ndarray] = {}
    deadline = time.monotonic() + timeout_s
    error = None
    while len(results) < len(chunks):
        msg = _get(pool, deadline, "encode_multi_process")
        if len(msg) == 3:   # a chunk that failed: keep draining the others, then raise the first
            error = error or msg[2]
            results[msg[0]] = None
            continue
        results[msg[0]] = msg[1]
        if show_progress_bar:
            done = sum(len(chunks[c]) for c, v in results.items() if v is not None)
            print(f"\rencode_multi_process: {done}/{len(sentences)} sentences", end="", file=sys.stderr, flush=True)
    if show_progress_bar:
        print(file=sys.stderr, flush=True)
    if error is not None:
        raise YirageError(f"encode_multi_process: a worker failed: {error}")
    return np.concatenate([results[c] for c in range(len(chunks))])


def stop_pool(pool: dict) -> None:
    """Stop the pool's workers (each takes a None and exits; any still running after 10 s is
    terminated) and close its queues. Safe to call twice."""
    procs: list[Any] = pool.get("processes", [])
    for _ in procs:
        try:
            pool["input"].put(None)
        except (ValueError, OSError):   # the queue is closed already
            break
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.terminate()
            p.join(5)
    for q in (pool.get("input"), pool.get("output")):
        if q is not None:
            q.close()
            q.join_thread()
    pool["processes"] = []
