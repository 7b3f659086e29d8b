"""Text generation: ``yr.LLM(model).generate(prompt)``.

Tokenization and chat templates come from the model's own tokenizer (transformers);
sampling follows the usual order (temperature, then top-k, then top-p / nucleus,
Holtzman et al. 2019) like transformers' ``generate``. Decoding stops at the model's EOS
token(s), at a ``stop`` string, or after ``max_new_tokens`` / when the KV cache is full.

This module must never build graphs or touch kernels: models/llama.py and the runtime do.
"""
from __future__ import annotations

import collections
import math
import numbers
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from ..backends import Backend, get_backend_impl, resolve_backend
from ..backends.cpu.precision import warn_if_emulated
from . import freeze_loaded_objects
from ..dtypes import DType, as_dtype
from ..config import logger
from ..errors import GenerationError
from ..ir.ops import INT8_COMPUTE_WEIGHTS
from ..models.llama import LlamaModel, StepRunner
from ..models.loading import load_model
from ..models.sharding import plan_shard

DEFAULT_MODEL = "smollm2-135m-instruct"


#: the most alternatives per token ``logprobs`` may ask for (OpenAI's top_logprobs limit)
MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """A generated (or prompt) token's log-probability under the model: ``logprob`` is the
    log-softmax of the float32 logits at its position (before temperature, filters, biases or a
    grammar), ``top`` the ``k`` most likely tokens there as (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``TokenLogprob`` of ``token`` from ``logits`` [vocab] (any float dtype, any device)."""
    return _from_log_probs(torch.log_softmax(logits.float().cpu(), dim=-1), token, k)


def _from_log_probs(lp: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``TokenLogprob`` of ``token`` from float32 log-probabilities ``lp`` [vocab]."""
    top = torch.topk(lp, k) if k > 0 else None
    return TokenLogprob(int(token), float(lp[token]),
                        [] if top is None else [(int(i), float(v)) for v, i in zip(top.values, top.indices)])


@dataclass
class GenerationResult:
    """What ``LLM.generate`` returns.

    Attributes:
        text: the generated text (special tokens and the stop string removed).
        token_ids: generated token ids (EOS excluded).
        finish_reason: 'stop' (EOS or a stop string), 'length' (max_new_tokens or
            the KV cache is full) or 'cancelled' (``GenerationStream.cancel``).
        prefill_s: seconds from the call to the first new token (time to first token).
        decode_tokens_per_s: tokens/s over the decode steps after the first token
            (0.0 when fewer than two tokens were generated).
        prompt_tokens: number of prompt tokens.
        cached_tokens: how many of them were found in the KV cache and not prefilled (the
            batch engine's prefix reuse; 0 elsewhere).
        logprobs: with ``generate(logprobs=k)``, one ``TokenLogprob`` per token of
            ``token_ids`` (with its ``k`` most likely alternatives); else None.
        tool_calls: with ``generate(tools=...)``, the ``engines.tools.ToolCall``s parsed out of
            the reply (``text`` is then the rest of it); else None.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    prefill_s: float
    decode_tokens_per_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list | None = None

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "prefill_s": self.prefill_s, "decode_tokens_per_s": self.decode_tokens_per_s,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                **({} if self.tool_calls is None else {"tool_calls": [c.to_openai() for c in self.tool_calls]})}


#: Greedy decode steps per call of the persistent decode loop (then streamed one by one).
GREEDY_CHUNK = 16

@dataclass
class _Sampling:
    """The sampler of one sequence: temperature (0: greedy), top-k, top-p, its generator, and
    an optional grammar ``constraint`` (engines/structured.py ``TokenConstraint``) that masks the
    logits before every pick and advances with the token picked."""

    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None = field(default=None)
    constraint: object | None = field(default=None)
    #: (token ids int64 [k], biases float32 [k]) added to the logits before anything else
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None)
    #: None, or how many alternatives each pick records with its logprob (``last_logprob``)
    logprobs: int | None = field(default=None)
    last_logprob: TokenLogprob | None = field(default=None)

    def filtered(self, logits: torch.Tensor) -> torch.Tensor:
        """Scores [vocab] after temperature, top-k and top-p (-inf where filtered out);
        the same rules as transformers' TopKLogitsWarper and TopPLogitsWarper."""
        scores = logits[0].float().cpu() / self.temperature  # the CPU generator samples on the CPU
        if self.top_k is not None and self.top_k < scores.numel():
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            drop = probs.cumsum(-1) - probs >= self.top_p  # mass before a token; keeps the first always
            scores[order[drop]] = float("-inf")
        return scores

    def pick(self, logits: torch.Tensor, argmax: torch.Tensor) -> int:
        """The next token id from ``logits`` [1, vocab] (``argmax`` [1] their argmax, used by
        greedy decoding without a constraint). With a constraint, the tokens it forbids are
        masked out first (greedy: the best allowed token) and the constraint advances by the
        token picked. GenerationError when the constraint fails. A ``logit_bias`` is added to the
        logits first (before the constraint's mask and the sampling filters, as OpenAI's is).
        With ``logprobs``, the pick's ``TokenLogprob`` (of the raw logits) is ``last_logprob``."""
        raw = logits
        if self.logit_bias is not None:
            ids, bias = self.logit_bias
            logits = logits.float().clone()
            logits[0, ids] += bias
            argmax = logits.argmax(dim=-1)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
            argmax = logits.argmax(dim=-1)
        if self.temperature == 0.0:
            tok = int(argmax[0])
        else:
            probs = torch.softmax(self.filtered(logits), dim=-1)
            tok = int(torch.multinomial(probs, 1, generator=self.generator)[0])
        if self.constraint is not None:
            self.constraint.accept(tok)
        if self.logprobs is not None:
            self.last_logprob = token_logprob(raw[0], tok, self.logprobs)
        return tok


def make_sampling(temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                  seed: int | None = None, constraint=None, logit_bias=None, vocab_size: int | None = None,
                  logprobs: int | None = None) -> _Sampling:
    """The sampler of one sequence, as ``LLM.generate`` makes it (for ``BatchEngine.add``):
    temperature (0, or below 1e-30: greedy), top-k, top-p, a CPU ``torch.Generator``
    seeded with ``seed`` (None: torch's default generator), an optional grammar
    ``constraint`` (``ResponseFormat.constraint()``; one per sequence: it holds the sequence's
    grammar state), an optional ``logit_bias`` ({token id: bias}, checked against
    ``vocab_size`` by ``check_logit_bias``) and ``logprobs`` (None, or how many alternatives
    every pick records: ``check_logprobs``). Raises GenerationError for values
    ``check_generation_args``, ``check_logit_bias`` or ``check_logprobs`` rejects."""
    check_generation_args(1, temperature, top_k, top_p, seed)
    gen = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    return _Sampling(float(temperature) if temperature >= _GREEDY_BELOW else 0.0,
                     int(top_k) if top_k is not None else None, float(top_p) if top_p is not None else None, gen,
                     constraint, check_logit_bias(logit_bias, vocab_size), check_logprobs(logprobs))


def check_logprobs(logprobs) -> int | None:
    """``logprobs`` as the number of alternatives per token (None: no logprobs). GenerationError
    unless it is None or an integer in [0, ``MAX_TOP_LOGPROBS``]."""
    if logprobs is None:
        return None
    if isinstance(logprobs, bool) or not isinstance(logprobs, numbers.Integral) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise GenerationError(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives "
                              f"per token), got {logprobs!r}")
    return int(logprobs)


#: OpenAI's range of a logit bias; -100 bans a token, 100 all but forces it
LOGIT_BIAS_LIMIT = 100.0


def check_logit_bias(logit_bias, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``logit_bias`` ({token id: bias}; ids as ints or decimal strings, OpenAI's JSON form) as
    (ids int64 [k], biases float32 [k]), or None for None or {}. GenerationError for an id that
    is not an integer in [0, ``vocab_size``) or a bias that is not a number in [-100, 100]."""
    if logit_bias is None or (isinstance(logit_bias, Mapping) and not logit_bias):
        return None
    if not isinstance(logit_bias, Mapping):
        raise GenerationError(f"logit_bias must map token ids to biases, got {type(logit_bias).__name__}")
    ids, biases = [], []
    for key, value in logit_bias.items():
        tid = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        if isinstance(tid, bool) or not isinstance(tid, numbers.Integral) or not (
                vocab_size is None or 0 <= tid < vocab_size) or tid < 0:
            raise GenerationError(f"logit_bias: {key!r} is not a token id in [0, {vocab_size})")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                -LOGIT_BIAS_LIMIT <= float(value) <= LOGIT_BIAS_LIMIT):
            raise GenerationError(f"logit_bias: the bias of token {tid} must be a number in [-100, 100], got {value!r}")
        ids.append(int(tid))
        biases.append(float(value))
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(biases, dtype=torch.float32)


def _activation_dtype(dtype, backend) -> DType:
    """The LLM's activation DType: ``dtype`` checked, or the backend's default when None."""
    if dtype is None:
        return get_backend_impl(backend).default_dtype()
    try:
        d = as_dtype(dtype)
    except ValueError:
        d = None
    if d is None or not d.is_float:
        raise GenerationError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    return d


def _cpu_compute_dtype(option: str, value, allowed: DType, backend, dtype: DType, hint: str = "") -> DType | None:
    """The LLM's ``option`` (prefill_dtype, decode_dtype, kv_cache_dtype): None for None or float32 (the
    default), else ``allowed``, which applies to the CPU backend with float32 activations only
    (see ``LLM``). GenerationError for anything else; ``hint`` ends that message."""
    if value is None:
        return None
    try:
        d = as_dtype(value)
    except ValueError:
        d = None
    if d == DType.float32:
        return None
    if d != allowed:
        raise GenerationError(f"{option} must be None, 'float32' or '{allowed.value}', got {value!r}")
    if backend != Backend.CPU or dtype != DType.float32:
        raise GenerationError(f"{option}='{allowed.value}' applies to the CPU backend with float32 activations "
                              f"(this LLM: backend {backend.value}, dtype {dtype.value}){hint}")
    return d


SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes seeds up to this
# Below this a positive temperature makes float32 logits / temperature overflow to inf (and
# the softmax NaN); its limit, greedy decoding, is what such a temperature gets.
_GREEDY_BELOW = 1e-30


def _positive_int(name: str, value) -> int:
    """``value`` as an int if it is a positive integer (numpy integers too, bools not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise GenerationError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_generation_args(max_new_tokens, temperature, top_k, top_p, seed=None) -> None:
    """Raise GenerationError unless max_new_tokens is a positive integer; temperature is a
    finite number >= 0 (NaN and inf rejected); top_k is None or a positive integer; top_p
    is None or a number in (0, 1] (NaN rejected); seed is None or an integer in
    0 .. 2**64-1 (``torch.Generator.manual_seed``'s range). Bools are not numbers here."""
    _positive_int("max_new_tokens", max_new_tokens)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise GenerationError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    try:
        finite = math.isfinite(temperature)
    except OverflowError:  # an int too large for a float
        finite = False
    if not (temperature >= 0 and finite):  # NaN fails both
        raise GenerationError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None:
        _positive_int("top_k", top_k)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real)
                              or not 0.0 < top_p <= 1.0):
        raise GenerationError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not 0 <= seed <= SEED_MAX):
        raise GenerationError(f"seed must be an integer in 0..2**64-1 ({SEED_MAX}) or None, got {seed!r}")


def _check_text(what: str, text: str) -> None:
    """GenerationError if ``text`` holds lone surrogates (undecodable bytes read with
    errors='surrogateescape', e.g. a non-UTF-8 command-line argument): no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GenerationError(f"{what} is not valid Unicode text: {text[e.start]!r} at index {e.start} "
                              "(undecodable bytes?); pass UTF-8 text, e.g. decode the bytes with "
                              "errors='replace'") from None


def _check_prompt(prompt) -> None:
    """GenerationError unless ``prompt`` is a string or a non-empty list of chat messages
    (mappings with a 'role' string) whose text is valid Unicode."""
    if isinstance(prompt, str):
        _check_text("the prompt", prompt)
        return
    if isinstance(prompt, (bytes, bytearray, Mapping)) or not isinstance(prompt, Sequence) or not prompt:
        hint = ": decode bytes first" if isinstance(prompt, (bytes, bytearray)) else ""
        raise GenerationError("the prompt must be a string or a non-empty list of chat messages "
                              f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}{hint}")
    for i, m in enumerate(prompt):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise GenerationError(f"chat message {i} must be a dict with a 'role' string and a "
                                  f"'content', got {' '.join(repr(m).split()):.80}")
        for key, value in m.items():
            if isinstance(value, str):
                _check_text(f"chat message {i} ({key!r})", value)


class LLM:
    """A decoder-only language model compiled for one backend.

    Args:
        model: a short name (``yirage.models.registry.list_models()``), a GGUF file, a
            Hugging Face directory or a hub id.
        backend: backend name, 'auto', or None (the default) for ``yr.get_backend()``:
            the ``yr.set_backend`` choice, else ``YIRAGE_BACKEND``, else 'auto'.
        max_seq_length: KV-cache capacity in tokens (prompt + generated); must be positive.
            Capped at the model's ``max_position_embeddings`` (with a warning), not at a
            sliding window: a sliding-window model (Mistral) keeps every position in its KV
            cache and each query attends the window's last ``sliding_window`` positions.
        dtype: activation dtype, 'float32', 'float16' or 'bfloat16' (a name, ``yr.float16``
            or a torch dtype); None picks the backend's default: float32 on the CPU,
            bfloat16 on GPUs that have it, else float16 (the autocast practice). Float
            weights and the KV cache are stored in it; norms, softmax and GEMM accumulation
            compute in float32; quantized weights stay in their blocks.
        progress: show loading progress on stderr.
        allow_nonfinite_weights: load a model whose weights (or quantized block scales) hold
            NaN or inf with a warning instead of refusing it (ModelLoadError) — its outputs
            will likely be NaN.
        persistent: run each decode step as a ``yr.PersistentKernel`` (on the CPU: one task
            graph on persistent worker threads); None (the default) means True on the CPU and
            False elsewhere; False keeps the launch-per-op plan (for comparison).
        num_workers: worker threads of the persistent kernel (default: the cores this process
            may use).
        profiler_tensor: int64 [capacity, 6] CPU tensor recording every decode task (see
            ``yr.PersistentKernel``); ``write_trace(path)`` saves it as a Chrome/Perfetto trace.
        prefill_dtype: None (the default: float32 GEMMs, the exact decoded weights) or
            'bfloat16': on the CPU, prompts of at least 16 tokens run their block-quantized
            projections as bfloat16 GEMMs (x and the decoded weights rounded to bfloat16,
            float32 sums rounded to bfloat16: oneDNN's GEMM, with AMX or AVX512-BF16 where the
            CPU has them). Faster prefill where the CPU has bfloat16 units, at bfloat16's
            precision (logits then differ from float32 by about 1e-2, as llama.cpp's 8-bit
            activations do); decode steps stay float32. ``yirage optimize`` measures it.
        decode_dtype: None (the default: float32 GEMVs on the exact decoded weights) or 'int8':
            on the CPU, single-sequence decode steps quantize each projection's and the LM
            head's input to int8 per block of 32 values (scale max|x| / 127) where the weight is
            q4_1 or q8_0, and sum the products in integers (AVX512-VNNI / AVX-VNNI vpdpbusd where
            the CPU has it): llama.cpp's decode numerics, so greedy tokens can differ from
            float32's (and from transformers'). Faster where the float32 GEMV is bound by its
            own instructions rather than memory. Weights of other formats and a single
            sequence's prompt keep float32 activations. On CPUs with AVX-512 VNNI the q4_1 and
            q8_0 projections (and a tied q8_0 embedding table) are kept repacked in groups of 16
            rows (``q4_1r16`` / ``q8_0r16``, once at load and in one copy, whatever decode_dtype:
            their GEMVs read 1.4-2.4x the GB/s of the plain formats'); there ``generate([...])``
            batches (and ``yirage serve``'s steps) quantize every row of those projections too,
            prompt chunks included, as llama.cpp's batches do: 1.4-1.5x the float32 batch's
            tokens/s at 16 sequences on a 2-core Xeon.
        kv_cache_dtype: None (the default: the KV cache in the activation dtype) or 'float16':
            on the CPU with float32 activations, keys and values are stored as float16 (rounded
            to nearest even as they are written, read back as float32; llama.cpp's default
            cache type). It halves the cache's memory and the bytes a decode step reads from it,
            which grow with the context; logits then differ from float32's by about float16's
            rounding of k and v (greedy tokens can differ).
        max_batch: the most sequences ``generate([p1, p2, ...])`` runs together (slots of its
            continuous-batching KV cache, allocated on the first batch call: 2 * layers *
            (max_batch + 1) * max_seq_length * kv_heads * head_dim elements); more prompts wait
            for a free slot.
        max_batch_tokens: the token budget of one batched step (decode rows plus prefill
            chunks); default min(max_seq_length, max(128, max_batch)); it must lie in
            [max_batch, max_seq_length].
        tensor_parallel_size: the ranks the model is split over (default 1: this process runs
            it). N > 1 starts N rank processes on this host (``engines.tensor_parallel``: gloo on
            127.0.0.1, each rank ``num_workers`` threads, default this process's threads / N),
            each keeping its share of the heads and intermediate rows, the o and down projections
            summed by an allreduce; this process tokenizes and samples. CPU backend only; the
            ranks decode with the persistent kernel unless ``persistent=False`` (its allreduces
            run between task segments; Gemma 3 needs ``persistent=False``); no
            ``profiler_tensor``. ``generate`` of a list of prompts (and ``yirage serve``)
            batches on the ranks: the continuous-batching engine schedules and samples here and
            every rank runs each batched step on its shard and its share of the batch KV cache
            (``engines.tensor_parallel.RankBatchForward``). ``prompt_logprobs`` is refused.
            ``close()`` stops the ranks.

    Raises:
        ModelLoadError: the model cannot be found or parsed.
        BackendUnavailableError: the backend is unknown or unavailable.
        GenerationError: max_seq_length, max_batch or max_batch_tokens is not a positive
            integer, dtype is not one of
            float32, float16, bfloat16, or prefill_dtype is not None/'float32'/'bfloat16', is
            'bfloat16' off the CPU backend, with non-float32 activations, or for a model
            without block-quantized weights; decode_dtype is not None/'float32'/'int8', is
            'int8' off the CPU backend, with non-float32 activations, or for a model without
            q4_1/q8_0 weights; kv_cache_dtype is not None/'float32'/'float16', or is 'float16'
            off the CPU backend or with non-float32 activations.
        DistributedError: tensor_parallel_size cannot split the model's heads or intermediate
            rows (the message gives the sizes), or a rank failed to start.
    """

    def __init__(self, model: str = DEFAULT_MODEL, backend: str | None = None,
                 max_seq_length: int = 2048, dtype=None, progress: bool = False,
                 allow_nonfinite_weights: bool = False, persistent: bool | None = None,
                 num_workers: int | None = None, profiler_tensor: torch.Tensor | None = None,
                 prefill_dtype=None, max_batch: int = 8, max_batch_tokens: int | None = None,
                 decode_dtype=None, kv_cache_dtype=None, tensor_parallel_size: int = 1):
        max_seq_length = _positive_int("max_seq_length", max_seq_length)
        self.tensor_parallel_size = _positive_int("tensor_parallel_size", tensor_parallel_size)
        self.max_batch = _positive_int("max_batch", max_batch)
        if max_batch_tokens is not None:
            max_batch_tokens = _positive_int("max_batch_tokens", max_batch_tokens)
        self.backend = resolve_backend(backend)
        self.dtype = _activation_dtype(dtype, self.backend)
        self.prefill_dtype = _cpu_compute_dtype("prefill_dtype", prefill_dtype, DType.bfloat16, self.backend,
                                                self.dtype, "; on a GPU use dtype='bfloat16'")
        self.decode_dtype = _cpu_compute_dtype("decode_dtype", decode_dtype, DType.int8, self.backend, self.dtype)
        self.kv_cache_dtype = _cpu_compute_dtype("kv_cache_dtype", kv_cache_dtype, DType.float16, self.backend,
                                                 self.dtype, "; with dtype='float16' the cache is float16 already")
        loaded = load_model(model, progress=progress, allow_nonfinite=bool(allow_nonfinite_weights))
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name or str(loaded.path)
        # only the position limit caps the context: a sliding-window model (Mistral) attends its
        # window in every step (LlamaModel.layer_window), however long the KV cache
        limits = [n for n in (self.config.max_position_embeddings,) if n]
        self.max_seq_length = min([max_seq_length, *limits])
        if self.max_seq_length < max_seq_length:
            logger.warning("max_seq_length capped at %d by the model's context (max_position_embeddings)",
                           self.max_seq_length)
        if self.prefill_dtype is not None and not any(w.dtype.is_quantized for w in loaded.weights.values()):
            raise GenerationError(f"prefill_dtype='bfloat16' computes the GEMMs of GGUF block-quantized weights in "
                                  f"bfloat16; {self.name} has float weights: load it with dtype='bfloat16' instead")
        if self.decode_dtype is not None and not any(w.dtype in INT8_COMPUTE_WEIGHTS for w in loaded.weights.values()):
            raise GenerationError(f"decode_dtype='int8' quantizes the inputs of GEMVs on q4_1/q8_0 weights; "
                                  f"{self.name} has none: leave decode_dtype at None")
        if self.prefill_dtype is not None:
            warn_if_emulated("bfloat16", "LLM(prefill_dtype='bfloat16')")
        if self.decode_dtype is not None:
            warn_if_emulated("int8", "LLM(decode_dtype='int8')")
        if self.tensor_parallel_size > 1:
            self._start_ranks(loaded, persistent, num_workers, profiler_tensor, bool(allow_nonfinite_weights))
        else:
            self.model = LlamaModel(loaded, self.backend, self.max_seq_length, self.dtype, self.prefill_dtype,
                                    self.decode_dtype, self.kv_cache_dtype)
            if persistent is None:
                persistent = self.backend == Backend.CPU
            if profiler_tensor is not None and not persistent:
                raise GenerationError("profiler_tensor records the tasks of the persistent decode kernel: "
                                      "it needs persistent=True")
            self.persistent = bool(persistent)
            self.steps = StepRunner(self.model, persistent=self.persistent, num_workers=num_workers,
                                    profiler_tensor=profiler_tensor)
            self.steps.prepare(1)  # build and compile the decode step now, not inside the first timing
        # one sequence at a time: a generation owns the KV cache and the step plans from its
        # prompt to its last token (GenerationStream.__iter__ holds the lock)
        self._sequence_lock = threading.Lock()
        self._sequence_thread: int | None = None
        self.eos_token_ids = set(self.config.eos_token_ids)
        # generate([p1, p2, ...]): a continuous-batching engine, made on the first batch (it
        # allocates its own KV cache); one batch call at a time
        self._max_batch_tokens = max_batch_tokens
        self._batch_engine = None
        self._batch_lock = threading.Lock()
        self._score_cache = None   # prompt_logprobs' KV cache (one slot), made on first use
        logger.info("loaded %s on %s (max_seq_length=%d, dtype=%s)", self.name, self.backend.value,
                    self.max_seq_length, self.dtype.value)
        freeze_loaded_objects()

    def _start_ranks(self, loaded, persistent, num_workers, profiler_tensor, allow_nonfinite: bool) -> None:
        """``tensor_parallel_size`` > 1: check the split here, then start the ranks
        (``engines.tensor_parallel.TensorParallelSteps``); ``self.model`` stays None."""
        from .tensor_parallel import TensorParallelSteps
        n = self.tensor_parallel_size
        if self.backend != Backend.CPU:
            raise GenerationError(f"tensor_parallel_size={n} runs on the CPU backend (gloo) only so far, "
                                  f"not {self.backend.value}")
        if profiler_tensor is not None:
            raise GenerationError(f"tensor_parallel_size={n}: profiler_tensor records one process's tasks; "
                                  "leave it unset")
        if persistent and self.config.sandwich_norms:
            raise GenerationError(f"tensor_parallel_size={n}: the persistent decode kernel cannot split Gemma's "
                                  "post-attention / post-feedforward norms; use persistent=False")
        for rank in range(n):   # a split that cannot be made is refused before any process starts
            plan_shard(loaded.config, loaded.weights, rank, n)
        self.model = None
        self.persistent = not self.config.sandwich_norms if persistent is None else bool(persistent)
        self.steps = TensorParallelSteps(str(loaded.path), n, self.max_seq_length, self.dtype, self.prefill_dtype,
                                         self.decode_dtype, self.kv_cache_dtype, threads_per_rank=num_workers,
                                         allow_nonfinite=allow_nonfinite, persistent=self.persistent)

    def _single_process(self, what: str) -> None:
        if self.model is None:
            raise GenerationError(f"{what} is not available with tensor_parallel_size={self.tensor_parallel_size} "
                                  "yet: use tensor_parallel_size=1")

    def close(self) -> None:
        """Stop the tensor-parallel ranks (``tensor_parallel_size`` > 1); a no-op otherwise."""
        if self.model is None:
            self.steps.close()

    def write_trace(self, path) -> int:
        """Write the decode tasks recorded in ``profiler_tensor`` as a Chrome/Perfetto JSON
        trace (one track per worker); returns the number of task events. Raises
        GenerationError when the LLM was made without a profiler_tensor."""
        if self.steps.profiler_tensor is None or self.steps.decode is None:
            raise GenerationError("no trace: create the LLM with profiler_tensor=... (CLI: --trace FILE)")
        return self.steps.decode.write_trace(path)

    # ---- prompts ------------------------------------------------------------------------
    def encode_prompt(self, prompt: "str | Sequence[dict]", chat: bool = True, tools: list[dict] | None = None,
                      chat_template: str | None = None) -> list[int]:
        """Token ids of ``prompt``: a string (wrapped as one user message when ``chat`` and
        the tokenizer has a chat template) or a list of {'role', 'content'} messages (OpenAI's:
        assistant turns may carry ``tool_calls``, whose JSON ``arguments`` the template gets as a
        dict, and ``tool`` turns a ``tool_call_id``). ``tools``: function definitions the
        template renders (``engines.tools.check_tools``' form); ``chat_template``: a jinja2
        template used instead of the model's.

        Raises GenerationError: the prompt is neither a string nor a non-empty list of
        messages, holds invalid Unicode (lone surrogates), is a message list for a model
        without a chat template, or the model's chat template fails to render it (a jinja2
        error, ``raise_exception`` in the template, ...).
        """
        _check_prompt(prompt)
        tok = self.tokenizer
        template = chat_template or getattr(tok, "chat_template", None)
        if isinstance(prompt, str) and not (chat and template):
            return list(tok.encode(prompt, add_special_tokens=True))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not template:
            raise GenerationError("this model's tokenizer has no chat template: pass a plain string prompt")
        from .tools import messages_for_template

        messages = messages_for_template(messages)
        try:
            ids = tok.apply_chat_template(messages, tools=tools, chat_template=chat_template,
                                          add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template is the model's code: any failure is the template's
            detail = " ".join(f"{type(exc).__name__}: {exc}".split()).rstrip(".")
            raise GenerationError(f"the model's chat template failed: {detail}; pass chat=False (a plain "
                                  "string prompt; CLI: --no-chat) or fix the template") from exc
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    # ---- generation ---------------------------------------------------------------------
    def prompt_ids(self, prompt, chat: bool = True, tools: list[dict] | None = None,
                   chat_template: str | None = None) -> list[int]:
        """The token ids ``generate`` feeds for ``prompt``: ``encode_prompt``'s (with ``tools``
        and ``chat_template`` as there), or a list of token ids as given (each checked against
        the vocabulary). GenerationError for a prompt that is not text, messages or token ids, is
        empty, or does not fit in max_seq_length."""
        if isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes, bytearray)) and prompt and all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            vocab = self.config.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise GenerationError(f"token id {bad} in the prompt is out of range [0, {vocab}): the "
                                      "model's vocabulary")
            ids = [int(t) for t in prompt]
        else:
            ids = self.encode_prompt(prompt, chat, tools, chat_template)
        if not ids:
            raise GenerationError("the prompt encodes to 0 tokens: give a non-empty prompt")
        if len(ids) >= self.max_seq_length:
            raise GenerationError(f"the prompt is {len(ids)} tokens but max_seq_length is "
                                  f"{self.max_seq_length}: shorten the prompt or raise max_seq_length")
        return ids

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: "str | Sequence[str] | None" = None, stream: bool = False, chat: bool = True,
                 ignore_eos: bool = False, response_format=None, logit_bias=None, logprobs: int | None = None,
                 tools: list[dict] | None = None, tool_choice=None, parallel_tool_calls: bool | None = None,
                 chat_template: str | None = None):
        """Generate a continuation of ``prompt``.

        Args:
            prompt: a string, a non-empty list of chat messages ({'role', 'content'}), or a
                non-empty list of token ids (fed as they are). A batch: a non-empty list of
                strings, of message lists or of token-id lists runs every prompt on the
                continuous-batching engine (up to ``max_batch`` at once, the others joining as
                slots free up) and returns a list of GenerationResult in prompt order, each
                the result the prompt gets alone (the same seed seeds every prompt's sampler).
            max_new_tokens: positive integer, upper bound on generated tokens.
            temperature: finite, >= 0: 0 for greedy decoding (so are positive values below
                1e-30, where the scaled logits would overflow: greedy is their limit), > 0
                to sample.
            top_k: optional sampling filter, a positive integer.
            top_p: optional sampling filter, 0 < top_p <= 1.
            seed: None or an integer in 0 .. 2**64-1; seeds the sampler (results repeat
                for the same seed).
            stop: a string or a list of strings that end generation; they are not included
                in the text.
            stream: if True, return an iterator of text pieces; its ``result`` attribute
                holds the GenerationResult once it is exhausted.
            chat: apply the chat template to a string prompt.
            ignore_eos: keep generating past end-of-sequence tokens (benchmarks): only
                ``max_new_tokens`` and ``stop`` end the generation.
            response_format: constrain the text to JSON, as OpenAI's API does (llguidance's
                grammars; ``pip install 'yirage[structured]'``): ``{'type': 'json_object'}`` for
                any JSON object, ``{'type': 'json_schema', 'json_schema': {'name': ...,
                'schema': {...}}}`` for JSON valid against the schema, None or
                ``{'type': 'text'}`` for free text. Every token is picked (greedy or sampled)
                among those the grammar allows; the generation ends ('stop') when the JSON is
                complete, or is cut by ``max_new_tokens`` ('length': then not valid JSON).
                Not with ``ignore_eos``.
            logit_bias: None or {token id: bias in [-100, 100]} (OpenAI's; ids may be decimal
                strings): added to the float32 logits before every pick, before the grammar's
                mask and the sampling filters; -100 in effect bans a token.
            logprobs: None, or k in [0, 20]: the result's ``logprobs`` holds every generated
                token's log-probability (the log-softmax of its float32 logits) and the k most
                likely tokens at its position.
            tools: OpenAI's tool calling (``engines.tools``), with ``tool_choice`` and
                ``parallel_tool_calls``:
                the chat template renders the function definitions; the calls the model makes
                are parsed out of its reply into the result's ``tool_calls`` (``text`` keeps the
                rest; ``finish_reason`` 'tool_calls'); ``tool_choice`` 'required' or
                {'type': 'function', 'function': {'name': ...}} forces a call with a grammar.
                A template without a tool format is refused.
            tool_choice: 'auto', 'none', 'required' or one named function (see ``tools``).
            parallel_tool_calls: whether the model may make several calls (see ``tools``).
            chat_template: a jinja2 chat template used instead of the model's.

        Returns: GenerationResult, or a GenerationStream when ``stream`` is True; a list of
            GenerationResult for a batch.
        Raises: GenerationError for bad arguments (see ``check_generation_args``), a prompt
            that is not text, is empty or does not fit in max_seq_length, a chat template
            that fails to render (see ``encode_prompt``), ``stream`` with a batch, a second
            generation started in a thread whose earlier stream on this LLM is still open, or
            a bad ``response_format`` (see ``engines.structured.compile_response_format``) or
            ``logit_bias`` (see ``check_logit_bias``).

        Safe to call from several threads: each call gets the answer it would get alone.
        Generations run one at a time (a call waits for the one before to finish; a stream
        holds the model from its first piece until it is exhausted or closed).
        """
        check_generation_args(max_new_tokens, temperature, top_k, top_p, seed)
        if stop is not None and not isinstance(stop, str) and not (
                isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop)):
            raise GenerationError(f"stop must be a string, a list of strings or None, got {stop!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        fmt = self.response_format(response_format)
        calling = self.tool_calling(tools, tool_choice, parallel_tool_calls, chat_template)
        if calling is not None and calling.response_format is not None:
            if fmt is not None:
                raise GenerationError("a response_format cannot be combined with a tool_choice that forces a call")
            fmt = calling.response_format
        if fmt is not None and ignore_eos:
            raise GenerationError("ignore_eos cannot be combined with a JSON response_format: the JSON ends the "
                                  "generation")

        check_logit_bias(logit_bias, self.config.vocab_size)
        check_logprobs(logprobs)

        def sampling() -> _Sampling:
            return make_sampling(temperature, top_k, top_p, seed, None if fmt is None else fmt.constraint(),
                                 logit_bias, self.config.vocab_size, logprobs)

        if is_batch(prompt):
            if stream:
                raise GenerationError("stream=True takes one prompt; a batch of prompts returns a list of results")
            rendered_tools = None if calling is None else calling.tools
            all_ids = [self.prompt_ids(p, chat, rendered_tools, chat_template) for p in prompt]
            results = self._generate_batch(all_ids, int(max_new_tokens), sampling, stops, bool(ignore_eos))
            return [_with_tool_calls(r, calling) for r in results]
        ids = self.prompt_ids(prompt, chat, None if calling is None else calling.tools, chat_template)
        sampling = sampling()
        stream_obj = GenerationStream(self, ids, int(max_new_tokens), sampling, stops, bool(ignore_eos), calling)
        if stream:
            return stream_obj
        for _ in stream_obj:
            pass
        return stream_obj.result

    def tool_calling(self, tools, tool_choice=None, parallel_tool_calls: bool | None = None,
                     chat_template: str | None = None):
        """OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` checked and compiled for
        this model and its chat template (or ``chat_template``): an ``engines.tools.ToolCalling``
        (what ``generate`` does with them), or None without tools. GenerationError as
        ``engines.tools.compile_tools`` raises it (a template without a tool format, ...)."""
        from .tools import compile_tools

        return compile_tools(self, tools, tool_choice, parallel_tool_calls, chat_template)


    def prompt_logprobs(self, prompt, k: int = 0, chat: bool = False) -> list[TokenLogprob | None]:
        """The log-probability of every prompt token given the ones before it (the first, with
        nothing before it, None), with the ``k`` most likely tokens at each position: a forward
        pass over the whole prompt that keeps every position's logits (a plan of the batch
        graph with all rows sampled, on a KV cache of its own; float32 log-softmax). For
        scoring: OpenAI's ``echo`` with ``logprobs``, lm-evaluation-harness' log-likelihoods.

        Raises GenerationError for a bad prompt (as ``generate``) or ``k`` (``check_logprobs``).
        Runs one prompt at a time, like ``generate``."""
        k = check_logprobs(k)
        self._single_process("prompt_logprobs")
        ids = self.prompt_ids(prompt, chat)
        T = len(ids)
        with self._sequence_lock:
            if self._score_cache is None:
                self._score_cache = self.model.new_batch_cache(1)
            g, tensors = self.model.build_batch_graph(T, T, self._score_cache)
            dev = self.model.device
            rows = torch.arange(T, dtype=torch.int64, device=dev)
            inputs = [torch.tensor(ids, dtype=torch.int64, device=dev), rows,
                      torch.zeros(T, dtype=torch.int64, device=dev), rows]
            logits = g.compile(self.model.backend.value).plan([*inputs, *tensors]).run()[0]
        lp = torch.log_softmax(logits.float().cpu(), dim=-1)
        return [None, *(_from_log_probs(lp[t - 1], ids[t], k) for t in range(1, T))]

    def response_format(self, response_format):
        """``response_format`` (OpenAI's dict, see ``generate``) checked and compiled for this
        model: an ``engines.structured.ResponseFormat`` (whose ``constraint()`` is what
        ``make_sampling`` takes), or None for free text. Compile once, then pass the result to
        ``generate`` as its ``response_format`` to skip the check. GenerationError for a bad
        format or schema, or without llguidance."""
        from .structured import compile_response_format
        return compile_response_format(self, response_format)

    def batch_engine(self):
        """This LLM's continuous-batching engine (``engines.batching.BatchEngine`` with
        ``max_batch`` slots), made on first use. Callers that drive it hold no lock of the LLM:
        one thread must step it at a time (``generate`` of a batch does, under its own lock)."""
        if self._batch_engine is None:
            from .batching import BatchEngine
            tokens = self._max_batch_tokens or min(self.max_seq_length, max(128, self.max_batch))
            self._batch_engine = BatchEngine(self, self.max_batch, tokens)
        return self._batch_engine

    def _generate_batch(self, all_ids: list[list[int]], max_new_tokens: int, sampling, stops: list[str],
                        ignore_eos: bool) -> list[GenerationResult]:
        """Every prompt of ``all_ids`` through the batch engine, to the end; results in order."""
        with self._batch_lock:
            engine = self.batch_engine()
            seqs = [engine.add(ids, sampling(), max_new_tokens, stops, ignore_eos) for ids in all_ids]
            try:
                while not all(s.finished for s in seqs):
                    engine.step()
            finally:
                if not all(s.finished for s in seqs):   # an error mid-way: free this call's slots
                    for s in seqs:
                        engine.cancel(s)
                    engine.step()   # only cancelled sequences left: it drops them, runs nothing
            failed = next((s for s in seqs if s.finish_reason == "error"), None)
            if failed is not None:
                raise GenerationError(failed.error)
            return [s.result() for s in seqs]


def is_batch(prompt) -> bool:
    """True when ``prompt`` is a batch for ``LLM.generate``: a non-empty list (or tuple) of
    strings, of chat-message lists or of token-id lists. A list of messages (mappings) and a
    list of token ids are single prompts."""
    if isinstance(prompt, (str, bytes, bytearray, Mapping)) or not isinstance(prompt, Sequence) or not prompt:
        return False
    if all(isinstance(p, str) for p in prompt):
        return True
    return all(isinstance(p, Sequence) and not isinstance(p, (str, bytes, bytearray)) and p
               and (all(isinstance(m, Mapping) for m in p)
                    or all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in p))
               for p in prompt)


class GenerationStream:
    """Iterator of decoded text pieces; ``result`` is set when generation ends. While it is
    open (started, not exhausted or closed) it holds its LLM: other threads' generations wait,
    and a new generation in the same thread is a GenerationError."""

    def __init__(self, llm: LLM, prompt_ids: list[int], max_new_tokens: int, sampling: _Sampling,
                 stops: list[str], ignore_eos: bool = False, tool_calling=None):
        self.llm, self.prompt_ids, self.max_new_tokens = llm, prompt_ids, max_new_tokens
        self.tool_calling = tool_calling   # with tools: the result's text is parsed for calls
        self.sampling, self.stops, self.ignore_eos = sampling, stops, ignore_eos
        self.result: GenerationResult | None = None
        #: with logprobs asked for: a TokenLogprob per token generated so far (grows as it runs)
        self.logprobs: list[TokenLogprob] | None = None if sampling.logprobs is None else []
        self._pieces: Iterator[str] | None = None
        self._cancelled = threading.Event()
        self.generated = 0   # new tokens so far (the KV cache holds prompt + generated - 1 rows)

    def cancel(self) -> None:
        """Ask the generation to end after the token being computed (from any thread); its
        ``result`` then has finish_reason 'cancelled'."""
        self._cancelled.set()

    def __iter__(self) -> Iterator[str]:
        if self._pieces is None:
            self._pieces = self._locked()
        return self._pieces

    def close(self) -> None:
        """Stop the generation early (``result`` stays None) and free the model for the next."""
        if self._pieces is not None:
            self._pieces.close()

    def _locked(self) -> Iterator[str]:
        llm, me = self.llm, threading.get_ident()
        if llm._sequence_thread == me:
            raise GenerationError("another generation on this LLM is still streaming in this thread: exhaust "
                                  "or close() it before starting the next (one yr.LLM runs one sequence at a "
                                  "time; calls from other threads wait their turn)")
        with llm._sequence_lock:
            llm._sequence_thread = me
            try:
                yield from self._generate()
            finally:
                llm._sequence_thread = None

    def _generate(self) -> Iterator[str]:
        llm, t0 = self.llm, time.perf_counter()
        budget = min(self.max_new_tokens, llm.max_seq_length - len(self.prompt_ids))
        out: list[int] = []
        text, emitted, finish = "", 0, "length"
        pos, feed = 0, self.prompt_ids
        prefill_s, t_first = 0.0, t0
        # Greedy decode on the persistent kernel runs GREEDY_CHUNK steps per call (the
        # decode loop inside the scheduler); the tokens are then streamed one by one.
        chunked = (self.sampling.temperature == 0 and llm.steps.persistent and self.sampling.constraint is None
                   and self.sampling.logit_bias is None and self.sampling.logprobs is None)
        logprobs = self.logprobs
        pending: collections.deque[int] = collections.deque()
        chunked = chunked and not self.ignore_eos   # the greedy loop stops at EOS by itself
        while len(out) < budget:
            if self._cancelled.is_set():
                finish = "cancelled"
                break
            if not pending:
                if chunked and out and len(feed) == 1:
                    got = llm.steps.run_greedy(feed[0], pos, min(GREEDY_CHUNK, budget - len(out)))
                    if not got:
                        break
                    pending.extend(got)
                    pos += len(got)
                else:
                    logits, argmax = llm.steps.run(feed, pos)
                    pending.append(self.sampling.pick(logits, argmax))
                    pos += len(feed)
            tok = pending.popleft()
            if not out:
                t_first = time.perf_counter()
                prefill_s = t_first - t0
            feed = [tok]
            if tok in llm.eos_token_ids and not self.ignore_eos:
                finish = "stop"
                break
            out.append(tok)
            if logprobs is not None:
                logprobs.append(self.sampling.last_logprob)
            self.generated = len(out)
            text = llm.tokenizer.decode(out, skip_special_tokens=True)
            cut = _first_stop(text, self.stops)
            if cut is not None:
                text, finish = text[:cut], "stop"
            safe = len(text) if finish == "stop" else _stable_len(text, self.stops)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            if finish == "stop":
                break
        if emitted < len(text):
            yield text[emitted:]
        decode_s = time.perf_counter() - t_first
        tps = (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else 0.0
        self.result = _with_tool_calls(GenerationResult(text, out, finish, prefill_s, tps, len(self.prompt_ids), 0,
                                                        None if logprobs is None else list(logprobs)),
                                       self.tool_calling)


def _with_tool_calls(result: GenerationResult, calling) -> GenerationResult:
    """``result`` with the tool calls in its text parsed out (``engines.tools.ToolCalling``):
    ``tool_calls`` the calls, ``text`` the rest, ``finish_reason`` 'tool_calls' when the model
    stopped after making some. Unchanged without tools."""
    if calling is None:
        return result
    content, calls = calling.parse(result.text)
    result.tool_calls = calls
    if calls:
        result.text = content or ""
        if result.finish_reason == "stop":
            result.finish_reason = "tool_calls"
    return result


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def _stable_len(text: str, stops: list[str]) -> int:
    """Length of the prefix safe to print: hold back an incomplete UTF-8 character and
    any tail that could be the start of a stop string."""
    n = len(text) - 1 if text.endswith("\ufffd") else len(text)
    for s in stops:
        for k in range(min(len(s) - 1, n), 0, -1):
            if text[:n].endswith(s[:k]):
                n -= k
                break
    return n
