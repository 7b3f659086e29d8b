"""The engine side of ``yirage serve``: one engine thread that runs the LLM's generations, and
one asyncio queue per request that carries its events back to the HTTP handler.

    handler ──submit(job)──► waiting queue (at most max_queue) ──► engine thread: job after job
    handler ◄── job.events (asyncio.Queue): ("piece", text) ... ("done", results) | ("error", msg)

The engine thread runs one generation at a time (``yr.LLM`` runs one sequence at a time); a
request waits in the queue until it gets the engine. A request that is cancelled (the client
went away, or its timeout passed) is dropped from the queue or stopped after its current token.
Metrics (``metrics.py``) are updated here, where the timings happen.

This module must never parse HTTP or JSON (``app.py`` and ``protocol.py`` do).
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..config import logger
from ..errors import YirageError
from .metrics import Metrics


class QueueFull(YirageError):
    """More requests are waiting than ``max_queue`` allows (HTTP 429)."""


@dataclass
class GenerationJob:
    """One request's generations: ``prompt`` (text, chat messages or token ids) with the
    ``generate`` keyword arguments ``kwargs``, ``n`` choices (choice i gets seed + i when a seed
    is given). ``events`` receives ("piece", choice index, text), ("done", [GenerationResult])
    or ("error", message); ``cancelled`` stops it (from any thread)."""

    prompt: Any
    kwargs: dict
    n: int = 1
    chat: bool = True
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def emit(self, *event) -> None:
        """Hand ``event`` to the request's handler (thread-safe); dropped once the server's
        event loop is closed (shutdown)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self.cancelled.set()


class LLMEngine:
    """The engine thread of one ``yr.LLM``.

    Args:
        llm: the model (``yr.LLM``).
        max_queue: the most requests waiting for the engine; more are refused (QueueFull).
        metrics: where request counts, tokens and latencies go.
    """

    def __init__(self, llm, max_queue: int, metrics: Metrics):
        self.llm, self.max_queue, self.metrics = llm, max_queue, metrics
        self._jobs: queue.Queue[GenerationJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="yirage-engine", daemon=True)
        self._thread.start()

    def submit(self, job: GenerationJob) -> GenerationJob:
        """Queue ``job`` (called on the event loop); QueueFull when ``max_queue`` are waiting."""
        if self._jobs.qsize() >= self.max_queue:
            raise QueueFull(f"{self._jobs.qsize()} requests are already waiting (--max-queue {self.max_queue}): "
                            "retry later")
        job.loop = asyncio.get_running_loop()
        self.metrics.waiting.inc()
        self._jobs.put(job)
        return job

    def close(self) -> None:
        """Stop the engine thread after the job it runs."""
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self.metrics.waiting.dec()
            if job.cancelled.is_set():
                continue
            self.metrics.running.inc()
            try:
                job.emit("done", self._generate(job))
            except YirageError as e:
                job.emit("error", str(e))
            except Exception as e:  # noqa: BLE001 - a bug must not stop the engine thread
                logger.exception("generation failed")
                job.emit("error", f"internal error: {type(e).__name__}: {e}")
            finally:
                self.metrics.running.dec()
                self.metrics.kv_usage.set(0.0)

    def _generate(self, job: GenerationJob) -> list:
        results = []
        for i in range(job.n):
            kwargs = dict(job.kwargs)
            if kwargs.get("seed") is not None:
                kwargs["seed"] = (kwargs["seed"] + i) % 2**64
            stream = self.llm.generate(job.prompt, stream=True, chat=job.chat, **kwargs)
            start, last = time.perf_counter(), None
            for piece in stream:
                now = time.perf_counter()
                if last is None:
                    self.metrics.ttft.observe(now - job.submitted)
                else:
                    self.metrics.inter_token.observe(now - last)
                last = now
                job.emit("piece", i, piece)
                self.metrics.kv_usage.set((len(stream.prompt_ids) + stream.generated) / self.llm.max_seq_length)
                if job.cancelled.is_set():
                    stream.cancel()
            r = stream.result
            if r is None:     # cancelled before the first token
                break
            results.append(r)
            self.metrics.prompt_tokens.inc(r.prompt_tokens)
            self.metrics.generation_tokens.inc(len(r.token_ids))
            self.metrics.finished.labels(finish_reason=r.finish_reason).inc()
            self.metrics.request_seconds.observe(time.perf_counter() - start)
            if job.cancelled.is_set():
                break
        return results
