"""The engine side of ``yirage serve``: one engine thread that runs the LLM's generations, and
one asyncio queue per request that carries its events back to the HTTP handler.

    handler ──submit(job)──► waiting queue (at most max_queue) ──► engine thread
    handler ◄── job.events (asyncio.Queue): ("piece", i, text) ... ("done", results) | ("error", msg)

Two engines behind one interface (``submit``, ``close``):
- ``BatchingEngine`` (``--parallel N`` > 1): continuous batching on ``engines.batching.BatchEngine``:
  each step runs one row per decoding sequence of every request plus prompt chunks, so new
  requests join between steps and leave at EOS, a stop string, their limit or cancellation;
- ``LLMEngine`` (``--parallel 1``): one generation at a time on ``yr.LLM.generate`` (the
  persistent decode kernel, the fastest single stream).
A request that is cancelled (the client went away, or its timeout passed) is dropped from the
queue or stopped after its current token. Metrics (``metrics.py``) are updated here, where the
timings happen.

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
    """More requests are waiting than ``max_queue`` allows (HTTP 503 with ``Retry-After``)."""


@dataclass
class GenerationJob:
    """One request's generations: ``prompt`` (text, chat messages or token ids) with the
    ``generate`` keyword arguments ``kwargs``, ``n`` choices (choice i gets seed + i when a seed
    is given). ``events`` receives ("piece", choice index, text, [TokenLogprob] of the tokens
    since the choice's last piece (empty without logprobs)), ("done", [GenerationResult]) or
    ("error", message); ``cancelled`` stops it (from any thread)."""

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
            start, last, sent = time.perf_counter(), None, 0
            for piece in stream:
                now = time.perf_counter()
                if last is None:
                    self.metrics.ttft.observe(now - job.submitted)
                else:
                    self.metrics.inter_token.observe(now - last)
                last = now
                new = stream.logprobs[sent:] if stream.logprobs is not None else []
                sent += len(new)
                job.emit("piece", i, piece, new)
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


#: the server's default step budget in rows (decode rows plus prompt chunks), at least one per
#: slot. A throughput choice: on the 2-core Zen 4 (16 slots, SmolLM2-135M; benchmarks/serve.py
#: against llama-server, 2026-11-26) a budget of 48 rows halved the inter-token latency p99 at
#: concurrency 16 with 128-token prompts (0.11-0.14 s against 0.21-0.26 s) at the same output
#: tokens/s, but with 512-token prompts it cut output tokens/s from 1.26x / 1.64x / 1.38x
#: llama-server's to 1.00x / 1.27x / 1.14x at concurrency 1 / 4 / 16 (prompts fill in more,
#: smaller steps). ``--max-batch-tokens`` picks the other side of that trade.
DEFAULT_BATCH_TOKENS = 128


def default_batch_tokens(max_slots: int) -> int:
    """The server's default step budget in rows: ``DEFAULT_BATCH_TOKENS``, or one per slot if
    there are more slots."""
    return max(DEFAULT_BATCH_TOKENS, max_slots)


class BatchingEngine:
    """The engine thread of one ``yr.LLM`` with continuous batching (``BatchEngine`` of
    ``max_slots`` sequences and ``max_batch_tokens`` rows per step).

    Args:
        llm: the model (``yr.LLM``).
        max_slots: sequences decoded together (``--parallel``).
        max_queue: the most requests waiting for a slot; more are refused (QueueFull).
        metrics: where request counts, tokens and latencies go.
        max_batch_tokens: rows per step (``BatchEngine``'s token budget); None:
            ``default_batch_tokens(max_slots)``, capped at the LLM's max_seq_length.
    """

    def __init__(self, llm, max_slots: int, max_queue: int, metrics: Metrics, max_batch_tokens: int | None = None):
        from ..engines.batching import BatchEngine

        budget = max_batch_tokens or min(llm.max_seq_length, default_batch_tokens(max_slots))
        self.engine = BatchEngine(llm, max_slots=max_slots, max_batch_tokens=budget)
        self.llm, self.max_queue, self.metrics = llm, max_queue, metrics
        self._inbox: queue.Queue[GenerationJob | None] = queue.Queue()
        self._jobs: dict[int, tuple[GenerationJob, list]] = {}   # id(job) -> (job, its sequences)
        self._owner: dict[int, tuple[GenerationJob, int]] = {}  # sequence id -> (job, choice index)
        self._last: dict[int, float] = {}                        # sequence id -> time of its last piece
        self._sent: dict[int, int] = {}                          # sequence id -> logprobs sent with its pieces
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="yirage-engine", daemon=True)
        self._thread.start()

    def submit(self, job: GenerationJob) -> GenerationJob:
        """Queue ``job`` (called on the event loop); QueueFull when ``max_queue`` requests wait."""
        waiting = self._inbox.qsize() + self.engine.waiting
        if waiting >= self.max_queue:
            raise QueueFull(f"{waiting} requests are already waiting (--max-queue {self.max_queue}): retry later")
        job.loop = asyncio.get_running_loop()
        self._inbox.put(job)
        return job

    def close(self) -> None:
        """Stop the engine thread after its current step."""
        self._closed = True
        self._inbox.put(None)

    def _run(self) -> None:
        while not self._closed:
            if not self._admit(block=not self.engine.has_work()):
                return
            for job, seqs in list(self._jobs.values()):
                if job.cancelled.is_set():
                    for seq in seqs:
                        self.engine.cancel(seq)
            try:
                events = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving the rest
                self._fail_running(e)
                continue
            self._deliver(events)
            self._update_gauges()

    def _admit(self, block: bool) -> bool:
        """Move queued jobs into the batch engine (waiting for one when ``block``); False on close."""
        while True:
            try:
                job = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if job is None:
                return False
            block = False
            if job.cancelled.is_set():
                continue
            try:
                self._add(job)
            except YirageError as e:
                job.emit("error", str(e))

    def _add(self, job: GenerationJob) -> None:
        """The job's ``n`` sequences into the batch engine, all or none (YirageError: none)."""
        from ..engines.generate import make_sampling

        kw = job.kwargs
        seed, fmt = kw.get("seed"), kw.get("response_format")
        samplings = [make_sampling(kw.get("temperature", 0.0), kw.get("top_k"), kw.get("top_p"),
                                   None if seed is None else (seed + i) % 2**64,
                                   None if fmt is None else fmt.constraint(), kw.get("logit_bias"),
                                   self.llm.config.vocab_size, kw.get("logprobs")) for i in range(job.n)]
        seqs = []
        try:
            for sampling in samplings:
                seqs.append(self.engine.add(job.prompt, sampling=sampling, max_new_tokens=kw["max_new_tokens"],
                                            stops=kw.get("stop"), ignore_eos=kw.get("ignore_eos", False)))
        except YirageError:
            for seq in seqs:   # dropped unseen at the next step
                self.engine.cancel(seq)
            raise
        for i, seq in enumerate(seqs):
            self._owner[seq.id] = (job, i)
        self._jobs[id(job)] = (job, seqs)

    def _deliver(self, events) -> None:
        """Emit the step's text pieces, then the ends of the jobs that finished: every piece of
        a step goes out before any "done" (choices of one job that finish in the same step)."""
        now = time.perf_counter()
        ended: dict[int, GenerationJob] = {}
        for ev in events:
            job, i = self._owner.get(ev.seq.id, (None, 0))
            if job is None:
                continue
            piece = ev.seq.take_text()
            if piece:
                sent = self._sent.get(ev.seq.id, 0)
                new = ev.seq.logprobs[sent:] if ev.seq.logprobs is not None else []
                self._sent[ev.seq.id] = sent + len(new)
                last = self._last.get(ev.seq.id)
                if last is None:
                    self.metrics.ttft.observe(now - job.submitted)
                else:
                    self.metrics.inter_token.observe(now - last)
                self._last[ev.seq.id] = now
                job.emit("piece", i, piece, new)
            if ev.finish is not None:
                ended[id(job)] = job
        for job in ended.values():
            self._finished(job)

    def _finished(self, job: GenerationJob) -> None:
        """Emit the job's results once every one of its sequences has finished (its error if one
        of them failed: the others are then cancelled)."""
        _, seqs = self._jobs.get(id(job), (None, []))
        failed = next((s for s in seqs if s.finish_reason == "error"), None)
        if failed is not None:
            for s in seqs:
                self.engine.cancel(s)
        if not seqs or not all(s.finished for s in seqs):
            return
        results = [s.result() for s in seqs]
        for s, r in zip(seqs, results):
            self._owner.pop(s.id, None)
            self._last.pop(s.id, None)
            self._sent.pop(s.id, None)
            self.metrics.prompt_tokens.inc(r.prompt_tokens)
            self.metrics.cached_prompt_tokens.inc(r.cached_tokens)
            self.metrics.generation_tokens.inc(len(r.token_ids))
            self.metrics.finished.labels(finish_reason=r.finish_reason).inc()
            self.metrics.request_seconds.observe(time.perf_counter() - job.submitted)
        del self._jobs[id(job)]
        if failed is not None:
            job.emit("error", failed.error)
        else:
            job.emit("done", [r for r in results if r.finish_reason != "cancelled"])

    def _fail_running(self, error: Exception) -> None:
        """A step failed (a bug or an out-of-range index): its requests get the error, their
        sequences are cancelled and dropped by one more step without a forward pass."""
        logger.exception("batched step failed")
        message = str(error) if isinstance(error, YirageError) else f"internal error: {type(error).__name__}: {error}"
        for job, seqs in list(self._jobs.values()):
            if any(s.slot is not None for s in seqs):
                for seq in seqs:
                    self.engine.cancel(seq)
                    self._owner.pop(seq.id, None)
                del self._jobs[id(job)]
                job.emit("error", message)
        try:
            self.engine.step()   # drops the cancelled sequences (no forward pass for them)
        except Exception:  # noqa: BLE001 - logged; the next loop steps again
            logger.exception("dropping the failed step's sequences failed")

    def _update_gauges(self) -> None:
        running = self.engine.running
        self.metrics.running.set(len(running))
        self.metrics.waiting.set(self.engine.waiting + self._inbox.qsize())
        held = sum(s.computed for s in running)
        self.metrics.kv_usage.set(held / (self.engine.max_slots * self.llm.max_seq_length))
