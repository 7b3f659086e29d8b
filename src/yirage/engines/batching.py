"""Continuous batching: many sequences decoded together, one forward step for all of them.

``BatchEngine`` keeps up to ``max_slots`` sequences in flight, each in its own slot of the
batch KV cache (``LlamaModel.new_batch_cache``). Each ``step()`` builds one batch (as
llama.cpp's server slots and vLLM's scheduler do):

- one row per decoding sequence (its last sampled token, at its next position);
- then, while the token budget ``max_batch_tokens`` lasts, chunks of the prompts of sequences
  still in prefill (chunked prefill), oldest first;
- the rows run as one forward graph (``LlamaModel.build_batch_graph``): every projection is one
  GEMM over all rows (weights read once per step), each row has its own RoPE position and KV
  slot, attention runs per sequence, and logits are computed only for the rows that sample
  (decode rows, and the last row of a prompt's final chunk).

Prefix reuse (llama-server's prompt cache, per slot): each slot remembers the tokens whose K/V
it holds from the sequence that used it last. A new request takes the free slot whose tokens
share the longest prefix with its prompt and prefills only the rest (at least its last prompt
token, whose logits it samples from). Attention at position p reads keys 0..p only, so the
stale rows past the shared prefix are overwritten before they are read.

On the CPU (``LLM.persistent``) a step of up to ``TASK_GRAPH_MAX_ROWS`` rows runs as a task
graph on the persistent kernel's worker pool (``runtime.task_graph``: the small-batch row tiles
or GEMVs of the projections, RoPE and attention of the rows as tasks), not as a launch per op
whose OpenMP fork/joins cost a third of a 16-row step (62 -> 42 ms on SmolLM2-135M, 2-core
Zen 4). On q4_1/q8_0 weights it computes the launches' values bit for bit; float32 projections of 2-5 rows run as GEMV tasks instead of the
provider measured for the launch (last-bit differences), and projections the tasks have no
better kernel for (float32 from 6 rows, other GGUF formats from 6 rows) are launched between
task-graph segments.

A step of one row (a sequence decoding alone, as at concurrency 1 or at the tail of a batch)
runs on the persistent decode kernel instead, where the LLM has one (``LLM.persistent``, the
CPU): ``LlamaModel.decode_kernel`` bound to that row's KV-cache slot, the kernel that
``LLM.generate`` decodes one sequence with, so it computes the same logits and keeps the
same K/V rows. It is one task graph per step instead of a launch per op, whose OpenMP regions
cost more than the GEMVs of one row (SmolLM2-135M on 2 cores: 17 ms a step against 12 ms). Up
to ``MAX_SOLO_KERNELS`` such kernels are kept (one per slot; least recently used dropped). Not
with ``decode_dtype='int8'``: there the batch graph quantizes the rows' activations
(``LlamaModel.build_batch_graph``), and int8 rounding turns the decode kernel's last-bit
differences from it (its attention splits the keys) into different tokens, so a sequence's
answer would depend on whether it decoded alone; one-row steps stay on the batch graph's task
graph, as fast as the decode kernel there (a 2-core Xeon: 306 against 302 tokens/s).

Requests join between steps when a slot is free; a sequence leaves on EOS (unless
``ignore_eos``), a stop string, its token limit, the end of the KV cache or cancellation, and
frees its slot. Row counts are padded up to buckets (powers of two) so a few compiled plans
serve every step: padding rows write the scratch slot.

Sampling is per sequence with its own ``torch.Generator`` (engines/generate.py ``_Sampling``),
so a seeded sequence samples what ``LLM.generate`` with that seed samples alone.

The model side (the batch KV cache, the step plans, the one-row kernels) is ``BatchForward``;
under tensor parallelism each rank holds one and the engine's steps go to every rank
(``engines.tensor_parallel.RankBatchForward``), the scheduling and sampling staying here.

This module must never build graphs or touch kernels (models/llama.py and the runtime do), and
it is driven by one thread at a time (``add`` and ``cancel`` may come from any thread).
"""
from __future__ import annotations

import collections
import itertools
from collections import abc
import numbers
import threading
import time
from typing import NamedTuple

import torch

from ..errors import GenerationError
from ..runtime.task_graph import compiled_task_graph, get_pool
from .generate import GenerationResult, _first_stop, _positive_int, _Sampling, _stable_len, make_sampling

#: the most compiled step plans kept (one per (row bucket, sample-row bucket)); the oldest goes
MAX_PLANS = 16
#: steps of at most this many rows run as one task graph on the persistent kernel's workers
#: (the CPU), larger ones (prompt chunks) launch per op: the task forms of the projections are
#: the GEMV and the small-batch row tiles, not the packed GEMM of longer prompts
TASK_GRAPH_MAX_ROWS = 16
#: the most one-row decode kernels kept (one per slot; each about 50 ms to build), least recently used goes
MAX_SOLO_KERNELS = 8


def _bucket(n: int, cap: int) -> int:
    """The smallest power of two >= n, at most ``cap`` (n <= cap)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, cap)


class Sequence:
    """A handle on one request of a ``BatchEngine``.

    Attributes:
        prompt_ids: the prompt's token ids.
        token_ids: the generated token ids so far (EOS excluded, as ``GenerationResult``).
        text: their text so far (special tokens skipped, cut at a stop string).
        finish_reason: None while running; then 'stop' (EOS or a stop string, or the end of
            the JSON its response format asked for), 'length' (max_new_tokens or the KV cache
            end), 'cancelled', or 'error' (its grammar constraint failed: ``error`` says why).
        error: the message of an 'error' finish, else None.
        slot: its KV-cache slot while it runs, else None.
        computed: how many of its tokens the KV cache holds (prompt + fed generated tokens).
        cached_tokens: how many prompt tokens it found in its slot's KV cache (prefix reuse)
            and did not prefill.
    """

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], max_new_tokens: int, sampling: _Sampling, stops: list[str],
                 ignore_eos: bool):
        self.id = next(self._ids)
        self.prompt_ids, self.max_new_tokens = prompt_ids, max_new_tokens
        self.sampling, self.stops, self.ignore_eos = sampling, stops, ignore_eos
        self.token_ids: list[int] = []
        self.logprobs: list | None = None if sampling.logprobs is None else []   # a TokenLogprob per token
        self.text = ""
        self.finish_reason: str | None = None
        self.slot: int | None = None
        self.computed = 0
        self.cached_tokens = 0
        self._written = 0   # tokens of it whose K/V a finished forward step wrote (<= computed)
        self.cancelled = False
        self.error: str | None = None
        self._emitted = 0
        self._t_add = time.perf_counter()
        self._t_first: float | None = None
        self._t_end: float | None = None

    @property
    def finished(self) -> bool:
        """True once the sequence has left the engine (``finish_reason`` set)."""
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        """True while part of its prompt is not yet in the KV cache."""
        return self.computed < len(self.prompt_ids)

    def take_text(self) -> str:
        """The text generated since the last call that is safe to show: an incomplete UTF-8
        character and a tail that could start a stop string are held back until they resolve
        (all of it once the sequence has finished). For streaming from the engine thread."""
        safe = len(self.text) if self.finished else _stable_len(self.text, self.stops)
        if safe <= self._emitted:
            return ""
        piece, self._emitted = self.text[self._emitted:safe], safe
        return piece

    def result(self) -> GenerationResult:
        """The GenerationResult (as ``LLM.generate`` returns) of a finished sequence:
        prefill_s is the time from ``add`` to its first token. GenerationError while it runs."""
        if not self.finished:
            raise GenerationError("the sequence is still running: step() the engine until it finishes")
        first = self._t_first if self._t_first is not None else self._t_end
        n = len(self.token_ids)
        decode_s = self._t_end - first
        tps = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
        return GenerationResult(self.text, list(self.token_ids), self.finish_reason, first - self._t_add, tps,
                                len(self.prompt_ids), self.cached_tokens,
                                None if self.logprobs is None else list(self.logprobs))

    def __repr__(self) -> str:
        state = self.finish_reason or ("waiting" if self.slot is None else
                                       "prefill" if self.in_prefill else "decode")
        return f"Sequence(id={self.id}, {state}, prompt={len(self.prompt_ids)}, generated={len(self.token_ids)})"


class StepEvent(NamedTuple):
    """What one ``step`` did to one sequence: ``token`` the new token id appended to
    ``seq.token_ids`` (None when none was: an EOS token, a cancellation); ``finish`` the
    finish reason when the sequence left in this step, else None."""

    seq: Sequence
    token: int | None
    finish: str | None


class BatchEngine:
    """A continuous-batching scheduler over one ``yr.LLM``'s model (see the module docstring).

    Args:
        llm: a ``yr.LLM`` (its ``model``, tokenizer and EOS ids are used; its single-sequence
            KV cache and plans are not touched, so ``llm.generate`` of one prompt may run
            beside it).
        max_slots: the most sequences in flight (slots of the batch KV cache, allocated here:
            2 * layers * (max_slots + 1) * max_seq_length * kv_heads * head_dim elements).
        max_batch_tokens: the token budget of a step (rows: decode rows plus prefill chunks);
            at least ``max_slots``, at most the LLM's max_seq_length.

    Raises GenerationError for a non-positive max_slots or a max_batch_tokens out of range.
    Not thread-safe: one thread calls ``step`` (``add`` and ``cancel`` may come from others).
    """

    def __init__(self, llm, max_slots: int = 8, max_batch_tokens: int = 128):
        max_slots = _positive_int("max_slots", max_slots)
        max_batch_tokens = _positive_int("max_batch_tokens", max_batch_tokens)
        if not max_slots <= max_batch_tokens <= llm.max_seq_length:
            raise GenerationError(f"max_batch_tokens must be in [max_slots, max_seq_length] = [{max_slots}, "
                                  f"{llm.max_seq_length}], got {max_batch_tokens}")
        self.llm, self.model = llm, llm.model
        self.max_slots, self.max_batch_tokens = max_slots, max_batch_tokens
        if llm.model is None:   # tensor parallelism: every rank runs the steps on its shard
            self.forward = llm.steps.batch_forward(max_slots, max_batch_tokens)
        else:                   # this engine's own KV cache, plans and one-row kernels
            self.forward = BatchForward(llm.model, max_slots, max_batch_tokens, llm.persistent,
                                        llm.steps.num_workers)
        self._free = list(range(max_slots - 1, -1, -1))   # pop() hands out slot 0 first
        self._slot_tokens: dict[int, list[int]] = {}     # slot -> the tokens its K/V rows hold
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []                # in admission order
        self._lock = threading.Lock()                     # guards _waiting (add from other threads)
        self.steps = 0

    @property
    def cache(self):
        """The batch KV cache (``LlamaModel.new_batch_cache``; on the ranks under tensor parallelism)."""
        return self.forward.cache

    @property
    def solo_steps(self) -> int:
        """The steps of one row that ran on the persistent decode kernel."""
        return self.forward.solo_steps

    @property
    def _solo(self):
        return self.forward._solo

    # ---- requests ---------------------------------------------------------------------
    def add(self, prompt_ids, sampling: _Sampling | None = None, max_new_tokens: int = 128,
            stops: "list[str] | None" = None, ignore_eos: bool = False) -> Sequence:
        """Queue a request; it joins the batch at a step when a slot is free.

        Args:
            prompt_ids: non-empty list of token ids, each in [0, vocab), fewer than the LLM's
                max_seq_length.
            sampling: the sequence's sampler, ``make_sampling(temperature, top_k, top_p, seed,
                constraint)`` (its own seeded generator: repeatable; its own grammar constraint
                for a JSON response format); None for greedy.
            max_new_tokens: positive integer; also capped by the KV cache's end.
            stops: strings that end the sequence (not included in its text).
            ignore_eos: keep going past EOS tokens.
        Returns the Sequence handle. Raises GenerationError for a bad prompt, max_new_tokens or
        stops, or ignore_eos with a grammar constraint.
        """
        vocab = self.llm.config.vocab_size
        if (isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, abc.Sequence)
                or not prompt_ids or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                             and 0 <= t < vocab for t in prompt_ids)):
            raise GenerationError(f"prompt_ids must be a non-empty list of token ids in [0, {vocab})")
        if len(prompt_ids) >= self.llm.max_seq_length:
            raise GenerationError(f"the prompt is {len(prompt_ids)} tokens but max_seq_length is "
                                  f"{self.llm.max_seq_length}")
        if stops is not None and (isinstance(stops, str) or not all(isinstance(x, str) for x in stops)):
            raise GenerationError(f"stops must be a list of strings or None, got {stops!r}")
        if ignore_eos and sampling is not None and sampling.constraint is not None:
            raise GenerationError("ignore_eos cannot be combined with a grammar constraint: the JSON ends the "
                                  "sequence")
        seq = Sequence([int(t) for t in prompt_ids], _positive_int("max_new_tokens", max_new_tokens),
                       sampling or make_sampling(), list(stops or []), bool(ignore_eos))
        with self._lock:
            self._waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Ask ``seq`` to leave: at the next ``step`` it finishes with 'cancelled' (its token of a
        step already running is dropped) and frees its slot. No-op once it has finished."""
        seq.cancelled = True

    def has_work(self) -> bool:
        """True while a sequence waits or runs (``step`` has something to do)."""
        return bool(self._running or self._waiting)

    @property
    def running(self) -> list[Sequence]:
        """The sequences holding slots now (a copy), in admission order."""
        return list(self._running)

    @property
    def waiting(self) -> int:
        """How many requests wait for a slot."""
        return len(self._waiting)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """Run one batched forward step: admit waiting requests into free slots, drop cancelled
        sequences, feed one row per decoding sequence plus prefill chunks up to the token
        budget, and sample the rows that need it. Returns one StepEvent per sequence that got a
        token or finished (empty when there was nothing to do). Errors of the forward step
        (IndexOutOfRangeError) propagate."""
        events: list[StepEvent] = []
        self._drop_cancelled(events)
        self._admit(events)
        rows, samplers = self._schedule()
        if not rows:
            return events
        logits, argmax = self.forward.run(rows, self._sample_rows)
        for seq in self._running:   # the step's K/V rows are in the cache now
            seq._written = seq.computed
        for i, seq in enumerate(samplers):
            try:
                tok = seq.sampling.pick(logits[i:i + 1], argmax[i:i + 1])
            except GenerationError as e:   # its grammar failed: this sequence ends, the others go on
                seq.error = str(e)
                self._finish(seq, "error")
                events.append(StepEvent(seq, None, "error"))
                continue
            events.append(self._accept(seq, tok))
        self.steps += 1
        return events

    def _drop_cancelled(self, events: list[StepEvent]) -> None:
        with self._lock:
            gone = [s for s in self._waiting if s.cancelled]
            for s in gone:
                self._waiting.remove(s)
        for s in gone + [s for s in self._running if s.cancelled]:
            self._finish(s, "cancelled")
            events.append(StepEvent(s, None, "cancelled"))

    def _admit(self, events: list[StepEvent]) -> None:
        with self._lock:
            while self._free and self._waiting:
                seq = self._waiting.popleft()
                slot, shared = self._best_slot(seq.prompt_ids)
                self._free.remove(slot)
                seq.slot = slot
                # the shared prefix is in the cache; the last prompt token is always fed (its
                # logits give the first sampled token)
                seq.computed = seq._written = seq.cached_tokens = min(shared, len(seq.prompt_ids) - 1)
                self._running.append(seq)

    def _best_slot(self, prompt: list[int]) -> tuple[int, int]:
        """The free slot whose cached tokens share the longest prefix with ``prompt`` (the most
        recently freed one among equals, as before prefix reuse) and that prefix's length."""
        best, best_len = self._free[-1], -1
        for slot in reversed(self._free):
            held = self._slot_tokens.get(slot, ())
            n = 0
            for a, b in zip(held, prompt):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = slot, n
        return best, max(best_len, 0)

    def _schedule(self) -> tuple[list[tuple[int, int, int]], list[Sequence]]:
        """The rows (token id, position, slot) of this step and the sequences that sample, in
        the order of their sample rows (``self._sample_rows``); advances each sequence's
        ``computed`` past its rows (the step writes them into its KV-cache slot)."""
        rows: list[tuple[int, int, int]] = []
        self._sample_rows: list[int] = []
        samplers: list[Sequence] = []
        for seq in self._running:                 # decode: one row each (max_slots <= the budget)
            if not seq.in_prefill:
                rows.append((seq.token_ids[-1], seq.computed, seq.slot))
                seq.computed += 1
                self._sample_rows.append(len(rows) - 1)
                samplers.append(seq)
        for seq in self._running:                 # chunked prefill, oldest first
            budget = self.max_batch_tokens - len(rows)
            if budget <= 0:
                break
            if seq.in_prefill:
                n = min(budget, len(seq.prompt_ids) - seq.computed)
                rows += [(seq.prompt_ids[seq.computed + j], seq.computed + j, seq.slot) for j in range(n)]
                seq.computed += n
                if not seq.in_prefill:            # its prompt's last row: sample the first token
                    self._sample_rows.append(len(rows) - 1)
                    samplers.append(seq)
        return rows, samplers

    # ---- tokens ---------------------------------------------------------------------------
    def _accept(self, seq: Sequence, tok: int) -> StepEvent:
        """Take ``tok`` as ``seq``'s next token (the rules of ``GenerationStream``): EOS ends it
        ('stop', not appended) unless ignore_eos; else it is appended, the text re-decoded and
        cut at a stop string ('stop'); the token limit or the KV cache's end gives 'length'."""
        if seq._t_first is None:
            seq._t_first = time.perf_counter()
        if seq.cancelled:
            self._finish(seq, "cancelled")
            return StepEvent(seq, None, "cancelled")
        if tok in self.llm.eos_token_ids and not seq.ignore_eos:
            self._finish(seq, "stop")
            return StepEvent(seq, None, "stop")
        seq.token_ids.append(tok)
        if seq.logprobs is not None:
            seq.logprobs.append(seq.sampling.last_logprob)
        text = self.llm.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        cut = _first_stop(text, seq.stops)
        seq.text = text if cut is None else text[:cut]
        budget = min(seq.max_new_tokens, self.llm.max_seq_length - len(seq.prompt_ids))
        finish = "stop" if cut is not None else "length" if len(seq.token_ids) >= budget else None
        if finish:
            self._finish(seq, finish)
        return StepEvent(seq, tok, finish)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """``seq`` leaves: finish reason set, its slot freed, remembering the tokens whose K/V
        rows it wrote there (for the next request's prefix reuse)."""
        seq.finish_reason = reason
        seq._t_end = time.perf_counter()
        if seq.slot is not None:
            self._running.remove(seq)
            self._slot_tokens[seq.slot] = (seq.prompt_ids + seq.token_ids)[:seq._written]
            self._free.append(seq.slot)
            seq.slot = None


class BatchForward:
    """The model side of a ``BatchEngine``: its batch KV cache (``max_slots`` slots and the
    scratch slot), the compiled step plans and the one-row decode kernels, and ``run(rows,
    sample_rows)``, the forward step of the rows the engine scheduled. It holds no scheduling
    state: under tensor parallelism (``engines.tensor_parallel``) every rank runs one on its
    shard with the rows the coordinator's engine sends, so their KV caches stay the same.

    Attributes: ``cache``, ``scratch_slot``, ``solo_steps`` (the one-row steps that ran on the
    persistent decode kernel).
    """

    def __init__(self, model, max_slots: int, max_batch_tokens: int, persistent: bool,
                 num_workers: int | None):
        self.model, self.max_slots, self.max_batch_tokens = model, max_slots, max_batch_tokens
        self.persistent, self.num_workers = bool(persistent), num_workers
        self.cache = model.new_batch_cache(max_slots)
        self.scratch_slot = max_slots
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._solo: collections.OrderedDict = collections.OrderedDict()   # slot -> its decode kernel
        self.solo_steps = 0

    def run(self, rows: list[tuple[int, int, int]], sample_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the rows (token id, position, slot; padded to their buckets) through the batch
        graph: logits [R, vocab] float32 and argmax [R] of the rows ``sample_rows`` (indices into
        ``rows``), copied out of the plan."""
        T, R = len(rows), len(sample_rows)
        if T == 1 and self.persistent and self.model.decode_dtype is None:
            return self._forward_solo(rows[0], R)
        Tb, Rb = _bucket(T, self.max_batch_tokens), _bucket(R, self.max_slots)
        plan, ids, positions, slots, sample = self._plan(Tb, Rb)
        pad = Tb - T
        ids_l = [r[0] for r in rows] + [0] * pad
        pos_l = [r[1] for r in rows] + list(range(pad))
        slot_l = [r[2] for r in rows] + [self.scratch_slot] * pad
        sample_l = list(sample_rows) + [0] * (Rb - R)
        ids.copy_(torch.tensor(ids_l, dtype=torch.int64))
        positions.copy_(torch.tensor(pos_l, dtype=torch.int64))
        slots.copy_(torch.tensor(slot_l, dtype=torch.int64))
        sample.copy_(torch.tensor(sample_l, dtype=torch.int64))
        logits, argmax = plan.run()
        return logits[:R].float().cpu(), argmax[:R].cpu()

    def _forward_solo(self, row: tuple[int, int, int], R: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One row (token, position, slot) on the persistent decode kernel of its slot: logits
        [R, vocab] and argmax [R] (R is 0 or 1), as ``run`` returns them."""
        token, position, slot = row
        mpk = self._solo.get(slot)
        if mpk is None:
            if len(self._solo) >= MAX_SOLO_KERNELS:
                self._solo.popitem(last=False)
            mpk = self._solo[slot] = self.model.decode_kernel(
                self.num_workers, k_cache=[k[slot] for k in self.cache.k],
                v_cache=[v[slot] for v in self.cache.v])
        self._solo.move_to_end(slot)
        logits, argmax = mpk.run_step(token, position)
        self.solo_steps += 1
        return logits[:R].float().cpu(), argmax[:R].cpu()

    def _plan(self, T: int, R: int):
        """The compiled plan of (T rows, R sample rows) and its index input tensors, built on
        first use (at most MAX_PLANS kept, least recently used dropped)."""
        key = (T, R)
        if key in self._plans:
            self._plans.move_to_end(key)
            return self._plans[key]
        if len(self._plans) >= MAX_PLANS:
            self._plans.popitem(last=False)
        g, tensors = self.model.build_batch_graph(T, R, self.cache)
        dev = self.model.device
        idx = [torch.zeros(n, dtype=torch.int64, device=dev) for n in (T, T, T, R)]
        cg = g.compile(self.model.backend.value)
        if self.persistent and T <= TASK_GRAPH_MAX_ROWS:
            plan = compiled_task_graph(cg, [*idx, *tensors], get_pool(self.num_workers))
        else:
            plan = cg.plan([*idx, *tensors])
        self._plans[key] = entry = (plan, *idx)
        return entry
