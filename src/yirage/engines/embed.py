"""The embedding engine: ``yr.EmbeddingModel(name).encode(sentences)``, sentence-transformers'
API on compiled kernel graphs.

    m = yr.EmbeddingModel("all-minilm-l6-v2")
    m.encode("a sentence")            # float32 [dim]
    m.encode(["one", "two"])          # float32 [2, dim]

Sentences are tokenized (the model's own Hugging Face tokenizer, truncated at
``max_seq_length``), sorted by length (longest first, as sentence-transformers does) and
*packed*: a batch holds its sentences' tokens back to back (no padding between them; attention
stays inside each sentence: ``attention_varlen``). A call's token budget is the packed length of
its ``batch_size`` longest sentences, rounded up to a token bucket (``bucket_tokens``: a multiple
of 16, at most 3.2% padding); every batch takes sentences, longest first, while they fit the
budget, so shorter sentences go more to a batch (``token_batches``). One compiled plan
(``models/bert.py``'s encoder graph, fused and compiled for the backend) serves each budget, and
the last, partial batch gets the plan of its own bucket: a call builds one or two plans, never
one per batch (a plan takes ~6 ms to build; before token budgets the first ``encode`` of 512
sentences built 15, 0.09 s of the 1.17 s call at YIRAGE_ISA=avx2 on an AMD EPYC Zen 5). Plans are
kept for later calls. A plan for T token rows takes up to T sentences (``offsets`` [T + 1]; the
unused ones are empty). Pooling and the Normalize module follow sentence-transformers'
``Pooling`` and ``Normalize`` (Reimers & Gurevych 2019, Sentence-BERT): mean over the
sentence's tokens (sum / max(count, 1e-9)), the CLS token, the max over tokens, or
mean * sqrt(len), concatenated in that module's order; Normalize is L2 with eps 1e-12.

On the CPU, each linear layer runs on the provider measured fastest for its shape on this machine
(``backends/cpu/providers.py``: yirage's AVX-512 GEMM on weights packed once, ~2.3x torch's BLAS
on an AMD EPYC, or MKL / oneDNN, which use AMX on Intel Xeons that have it), the fused row kernel after each
GEMM (residual + LayerNorm, GELU) runs as its epilogue on each block of finished rows (the
executor's epilogue fusion), and attention over the packed sentences is a C++ kernel
(``kernels/cpu/embed_kernels.h``).

``quantization="int8"``: every linear layer runs as ``linear_w8a8`` (per-output-channel int8
weights; activations quantized at run time per token and per group of 64 features, integer
dot products: AVX-512 VNNI vpdpbusd, AVX-VNNI vpdpbusd on ymm without AVX-512, AVX2
vpmaddubsw otherwise); the rest stays float32.
Measured on all-MiniLM-L6-v2: cosine to float32 >= 0.994 on every sentence of the tests (the
worst is the empty string, [CLS] [SEP] only; whole-row activation scales gave 0.986 there),
mean 0.999.

This module must never build graph ops itself (models/bert.py does) or parse model files.
"""
from __future__ import annotations

import itertools
import sys
import threading
from collections import OrderedDict
from typing import Sequence

import torch
import torch.nn.functional as F

from ..backends import Backend, get_backend_impl, resolve_backend
from ..backends.cpu.precision import warn_if_emulated
from . import freeze_loaded_objects
from ..config import logger
from ..errors import ModelLoadError, YirageError
from ..kernel import KNGraph
from ..models.bert import (build_encoder, linear_weights_to, load_bert_weights, quantize_weights,
                           read_sentence_transformer, weight_order)
from ..models.registry import DEFAULT_EMBEDDING_MODEL, resolve_embedding_model

PLAN_TOKENS = 32768  # compiled plans are kept (least recently used dropped first) while their token
                     # rows add up to at most this (a plan holds its activations, ~12 KiB per token
                     # row); rebuilding one takes ~25 ms: its C++ is cached on disk by content hash


class EmbeddingModel:
    """A sentence-transformers embedding model (BERT family) compiled for one backend.

    Args:
        name_or_path: a registry short name (``all-minilm-l6-v2``, the default), a local
            sentence-transformers directory, or a Hugging Face hub id (network permitting).
        backend: backend name, 'auto', or None for ``yr.get_backend()``.
        quantization: None (float32) or ``"int8"``: every linear layer with per-channel int8
            weights and int8 activations (per token, groups of 64 features), integer GEMMs
            (``linear_w8a8``); attention, LayerNorm, GELU and pooling stay float32.
        dtype: ``"float32"`` (the default) or ``"bfloat16"``: every linear layer's weight is
            kept in bfloat16 only and the layer runs as a bfloat16 GEMM with float32
            accumulation (activations rounded to bfloat16 at its input, its sum rounded to
            bfloat16, float32 bias); LayerNorm, softmax, GELU and pooling stay float32. On
            all-MiniLM-L6-v2 the cosine to float32 is >= 0.9999 (tests/engines/test_embed.py).

    Raises:
        ModelLoadError: unknown model, missing files or pooling config, a model type the
            engine does not know, weights holding NaN/inf.
        BackendUnavailableError: unknown or unavailable backend.
        YirageError: an unsupported ``quantization`` or ``dtype``, or both int8 and bfloat16.
    """

    def __init__(self, name_or_path: str = DEFAULT_EMBEDDING_MODEL, backend: str | None = None,
                 quantization: str | None = None, dtype: str = "float32"):
        if quantization not in (None, "int8"):
            raise YirageError(f"EmbeddingModel: quantization must be None or 'int8', got {quantization!r}")
        if dtype not in ("float32", "bfloat16"):
            raise YirageError(f"EmbeddingModel: dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        if quantization == "int8" and dtype != "float32":
            raise YirageError("EmbeddingModel: quantization='int8' has int8 linear layers; it cannot also be "
                              f"dtype={dtype!r} (drop one of the two)")
        self.quantization, self.dtype = quantization, dtype
        self.name_or_path = name_or_path
        directory = resolve_embedding_model(name_or_path)
        self.spec = read_sentence_transformer(directory)
        self.config = self.spec.config
        self.max_seq_length = self.spec.max_seq_length
        self.backend = resolve_backend(backend)
        self.device = get_backend_impl(self.backend).torch_device
        if self.backend == Backend.CPU and quantization == "int8":
            warn_if_emulated("int8", "EmbeddingModel(quantization='int8')")
        elif self.backend == Backend.CPU and dtype == "bfloat16":
            warn_if_emulated("bfloat16", "EmbeddingModel(dtype='bfloat16')")
        self.tokenizer = _load_tokenizer(directory)
        self._fast_tokenizer = _truncating_backend(self.tokenizer, self.max_seq_length)
        weights = load_bert_weights(directory, self.config)
        if quantization == "int8":
            weights = quantize_weights(weights, self.config)
        elif dtype == "bfloat16":
            weights = linear_weights_to(weights, self.config, torch.bfloat16)
        # [max_pos, H]: position embeddings plus token type 0 (sentence-transformers passes no token types)
        self._pos_type = (weights["position"] + weights["token_type"][0]).to(self.device)
        self._weights = weights
        self._inputs = [weights[n].to(self.device) for n in weight_order(self.config, quantization == "int8")]
        if self.device.type == "cpu":
            _declare_constant_weights(self._inputs)
        self._plans: OrderedDict[tuple[int, int], tuple] = OrderedDict()
        self._lock = threading.Lock()  # one batch at a time: plans own their input/output buffers
        self.plan_shapes: set[tuple[int, int]] = set()  # every (batch, padded length) compiled so far
        logger.info("loaded embedding model %s on %s (dim %d, max_seq_length %d)", directory,
                    self.backend.value, self.spec.embedding_dim, self.max_seq_length)
        freeze_loaded_objects()

    # ---- several processes (sentence-transformers' multi-process pool) --------------------
    def start_multi_process_pool(self, target_devices: list[str] | None = None) -> dict:
        """Start worker processes that each load this model (same name, backend, quantization
        and dtype) and share this host's cores: one per ``target_devices`` entry ('cpu'; None:
        one per 2 cores, 1 to 4). sentence-transformers' API: pass the pool to
        ``encode_multi_process``, then to ``stop_multi_process_pool``. Workers are started with
        ``spawn``, so a script that starts a pool needs the ``if __name__ == "__main__":``
        guard, as with sentence-transformers.

        Returns: the pool (a dict). Raises YirageError: a device other than 'cpu', or a worker
        that could not load the model or died while starting (``engines.embed_pool``)."""
        from .embed_pool import start_pool

        return start_pool({"name_or_path": self.name_or_path, "backend": self.backend.value,
                           "quantization": self.quantization, "dtype": self.dtype}, target_devices)

    def encode_multi_process(self, sentences: list[str], pool: dict, prompt_name: str | None = None,
                             prompt: str | None = None, batch_size: int = 32, chunk_size: int | None = None,
                             show_progress_bar: bool | None = None, precision: str = "float32",
                             normalize_embeddings: bool = False) -> np.ndarray:
        """float32 numpy [len(sentences), dim] embeddings of ``sentences`` computed by ``pool``'s
        workers (sentence-transformers' signature), equal to ``encode``'s: chunks of
        ``chunk_size`` sentences (None: about ten per worker, at most 5000) go to whichever
        worker is free. ``prompt`` is prepended to every sentence. Raises YirageError:
        ``prompt_name`` (this model defines no prompts), a ``precision`` other than 'float32'
        (quantize with ``EmbeddingModel(quantization='int8')`` instead), bad sentences or
        sizes, or a worker that failed or died."""
        from .embed_pool import encode_with_pool

        if prompt_name is not None:
            raise YirageError(f"encode_multi_process: prompt_name {prompt_name!r}: this model defines no prompts; "
                              "pass the text as prompt=...")
        if precision != "float32":
            raise YirageError(f"encode_multi_process: precision must be 'float32', got {precision!r} (for int8 "
                              "vectors' speed use EmbeddingModel(quantization='int8'))")
        items = _as_list([sentences] if isinstance(sentences, str) else sentences)
        if prompt is not None:
            items = [prompt + s for s in items]
        return encode_with_pool(items, pool, batch_size, chunk_size, show_progress_bar, normalize_embeddings)

    @staticmethod
    def stop_multi_process_pool(pool: dict) -> None:
        """Stop ``pool``'s workers and close its queues (safe to call twice)."""
        from .embed_pool import stop_pool

        stop_pool(pool)

    def get_sentence_embedding_dimension(self) -> int:
        """Length of the embedding vectors (hidden size times the number of pooling modes)."""
        return self.spec.embedding_dim

    # ---- encoding -------------------------------------------------------------------------
    def encode(self, sentences: str | Sequence[str], batch_size: int = 32, normalize_embeddings: bool = False,
               convert_to_numpy: bool = True, convert_to_tensor: bool = False, show_progress_bar: bool | None = None):
        """Embed ``sentences`` (sentence-transformers' ``SentenceTransformer.encode`` meanings).

        Args:
            sentences: one str (returns one vector [dim]) or a sequence of str (returns [n, dim]).
            batch_size: sets the token budget of a compiled launch: the packed length of the
                ``batch_size`` longest sentences (a positive integer). Shorter sentences go
                more to a launch, up to that budget (``token_batches``); the embeddings do not
                depend on it.
            normalize_embeddings: L2-normalize every vector (as the Normalize module does).
            convert_to_numpy: return a float32 numpy array (with ``convert_to_tensor`` and
                both False: a list of torch tensors).
            convert_to_tensor: return a torch tensor (takes precedence over
                ``convert_to_numpy``).
            show_progress_bar: print batch progress on stderr (None: off).
        Returns: float32 embeddings, in the order of ``sentences``.
        Raises:
            YirageError: an item that is not a str, or a bad ``batch_size``.

        Safe to call from several threads: each call gets the embeddings it would get alone
        (the batches of concurrent calls run one at a time).
        """
        single = isinstance(sentences, str)
        items = [sentences] if single else _as_list(sentences)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise YirageError(f"encode: batch_size must be a positive integer, got {batch_size!r}")
        out = self._encode_ids(self.tokenize(items), batch_size, normalize_embeddings, show_progress_bar)
        if single:
            out = out[0]
        if convert_to_tensor:
            return out
        if convert_to_numpy:
            return out.numpy()
        return list(out) if not single else out

    def tokenize(self, sentences: Sequence[str]) -> list[list[int]]:
        """Token ids of each sentence as ``encode`` feeds them: special tokens added, cut to
        ``max_seq_length``. YirageError for an item that is not a str."""
        items = _as_list(sentences)
        if not items:
            return []
        return [e.ids for e in self._fast_tokenizer.encode_batch(items, add_special_tokens=True)]

    def encode_ids(self, ids: Sequence[Sequence[int]], batch_size: int = 32,
                   normalize_embeddings: bool = False) -> torch.Tensor:
        """Embeddings, float32 [len(ids), dim], of token id lists given as they are (with the
        model's special tokens if it expects them: ``tokenize`` adds them to text).

        Raises YirageError for an empty list, an id outside the vocabulary, a list longer than
        ``max_seq_length``, or a bad ``batch_size``."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise YirageError(f"encode: batch_size must be a positive integer, got {batch_size!r}")
        vocab = self.config.vocab_size
        rows = []
        for i, seq in enumerate(ids):
            seq = list(seq)
            if not seq or len(seq) > self.max_seq_length:
                raise YirageError(f"token list {i} has {len(seq)} tokens: give 1 to {self.max_seq_length} "
                                  "(the model's max_seq_length)")
            bad = next((t for t in seq if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise YirageError(f"token list {i} holds {bad!r}: token ids are integers in [0, {vocab})")
            rows.append(seq)
        return self._encode_ids(rows, batch_size, normalize_embeddings)

    def _encode_ids(self, ids: list[list[int]], batch_size: int, normalize: bool,
                    show_progress_bar: bool | None = None) -> torch.Tensor:
        """Pooled float32 [len(ids), dim] embeddings of checked token id lists, packed longest
        first into ``token_batches``; one batch at a time runs on the model's plans (the lock)."""
        out = torch.empty((len(ids), self.spec.embedding_dim), dtype=torch.float32)
        batches = token_batches([len(x) for x in ids], batch_size)
        n_batches = len(batches)
        for b, (idx, T) in enumerate(batches):
            with self._lock:
                out[idx] = self._embed_batch([ids[i] for i in idx], T)
            if show_progress_bar:
                print(f"\rembedding: batch {b + 1}/{n_batches}", end="", file=sys.stderr, flush=True)
        if show_progress_bar and n_batches:
            print(file=sys.stderr, flush=True)
        if self.spec.normalize or normalize:
            out = F.normalize(out, p=2, dim=1)
        return out

    def _embed_batch(self, ids: list[list[int]], rows: int) -> torch.Tensor:
        """Pooled embeddings [len(ids), dim] (float32, CPU) of one batch of token id lists, run
        packed on the plan of ``rows`` token rows (a bucket at least their total): the
        sentences back to back, then empty sentences up to the plan's ``rows``."""
        lengths = [len(x) for x in ids]
        T = sum(lengths)
        plan, ids_buf, pos_buf, off_buf = self._plan(rows)
        flat = torch.tensor([t for seq in ids for t in seq], dtype=torch.int64)
        pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
        ids_buf[:T].copy_(flat)
        ids_buf[T:].zero_()
        pos_buf[:T].copy_(pos)
        pos_buf[T:].zero_()
        off_buf[:len(offsets)].copy_(offsets)
        off_buf[len(offsets):].fill_(T)   # the plan's unused sentences: empty, at the end
        hidden = plan.run()[0][:T]  # [T, H], the plan's buffer: pooling makes new tensors from it
        if hidden.device.type != "cpu":
            hidden = hidden.to("cpu")
        return _pool(hidden, torch.tensor(lengths), offsets, self.spec.pooling)

    def _plan(self, T: int):
        """The compiled plan for up to T sentences in T token rows and its ids/pos/offsets
        input buffers (built once, kept while the plans' token rows fit PLAN_TOKENS)."""
        B = T   # every sentence has a token: T rows never hold more than T sentences
        key = (B, T)
        if key in self._plans:
            self._plans.move_to_end(key)
            return self._plans[key]
        g = KNGraph(self.backend.value)
        build_encoder(g, self.config, B, T, self._weights, int8=self.quantization == "int8")
        ids_buf = torch.zeros(T, dtype=torch.int64, device=self.device)
        pos_buf = torch.zeros(T, dtype=torch.int64, device=self.device)
        off_buf = torch.zeros(B + 1, dtype=torch.int64, device=self.device)
        plan = g.compile().plan([ids_buf, pos_buf, off_buf, self._pos_type, *self._inputs])
        self._plans[key] = (plan, ids_buf, pos_buf, off_buf)
        self.plan_shapes.add(key)
        while len(self._plans) > 1 and sum(t for _, t in self._plans) > PLAN_TOKENS:
            self._plans.popitem(last=False)
        logger.debug("embedding plan for %d sentences in %d token rows compiled", B, T)
        return self._plans[key]


def _declare_constant_weights(inputs: list[torch.Tensor]) -> None:
    """Declare the encoder's 2-D weights constant, so that the CPU backend's kernel providers may
    keep them packed in their own layouts (backends/cpu/providers.py)."""
    from ..backends.cpu.embed import mark_constant

    for t in inputs:
        if t.dim() == 2:
            mark_constant(t)


def token_batches(lengths: Sequence[int], batch_size: int) -> list[tuple[list[int], int]]:
    """Packed batches of sentences with token counts ``lengths`` (each >= 1), longest first:
    a list of (sentence indices, plan rows). The token budget is the bucket of the
    ``batch_size`` longest sentences' total (``bucket_tokens``); each batch takes the next
    sentences while their total fits it, so every batch but the last runs on the budget's plan,
    with less padding than one sentence (sorted: the next one is at most as long as the last
    taken). The last batch runs on its own bucket, or on the budget's when that bucket would
    pad it by less than an eighth of the budget."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if not order:
        return []
    budget = bucket_tokens(max(1, sum(lengths[i] for i in order[:batch_size])))
    batches: list[tuple[list[int], int]] = []
    idx: list[int] = []
    total = 0
    for i in order:
        # a plan of T rows takes at most T sentences (empty token lists count too)
        if idx and (total + lengths[i] > budget or len(idx) == budget):
            batches.append((idx, budget))
            idx, total = [], 0
        idx.append(i)
        total += lengths[i]
    rows = bucket_tokens(max(total, len(idx)))
    batches.append((idx, budget if budget - total <= budget // 8 else rows))
    return batches


def bucket_tokens(n: int) -> int:
    """``n`` tokens rounded up to a bucket: a multiple of 16, or of 1/32 of the power of two
    below ``n`` for larger ``n`` (at most 3.2% padding, 32 buckets per doubling). Padding rows
    cost as much as real ones in every GEMM, and a plan for a new bucket takes ~5 ms to build."""
    step = max(16, 1 << max(0, n.bit_length() - 6))
    return -(-n // step) * step


def _as_list(sentences) -> list[str]:
    """``sentences`` as a list of str; YirageError naming the first item that is not a str."""
    if isinstance(sentences, (bytes, dict)) or not hasattr(sentences, "__iter__"):
        raise YirageError(f"encode: sentences must be a str or a list of str, got {type(sentences).__name__}")
    items = list(sentences)
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise YirageError(f"encode: sentence {i} is a {type(s).__name__} ({s!r:.40}), not a str")
    return items


def _pool(hidden: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """sentence-transformers' Pooling over packed hidden states [T, H] of sentences of
    ``lengths`` starting at ``offsets``: the modes' vectors concatenated, [B, H * len(modes)]."""
    outs = []
    for mode in modes:
        if mode == "cls":
            outs.append(hidden[offsets[:-1]])
        elif mode == "max":
            outs.append(torch.segment_reduce(hidden, "max", lengths=lengths))
        else:
            count = torch.clamp(lengths.to(hidden.dtype), min=1e-9).unsqueeze(1)
            total = torch.segment_reduce(hidden, "sum", lengths=lengths)
            outs.append(total / (count if mode == "mean" else torch.sqrt(count)))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def _truncating_backend(tokenizer, max_length: int):
    """A copy of the fast tokenizer's ``tokenizers.Tokenizer`` that truncates at ``max_length``
    (longest first, like ``tokenizer(..., truncation=True, max_length=...)``) and never pads:
    the same ids without transformers' per-sentence Python overhead."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ModelLoadError("the embedding engine needs a fast (tokenizers) tokenizer: tokenizer.json")
    tok = Tokenizer.from_str(backend.to_str())
    tok.no_padding()
    tok.enable_truncation(max_length, strategy="longest_first")
    return tok


def _load_tokenizer(directory):
    """The model's Hugging Face tokenizer (fast). ModelLoadError if it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # missing or malformed tokenizer files: one clear error
        raise ModelLoadError(f"{directory}: cannot load the tokenizer ({type(e).__name__}: {e})") from None


__all__ = ["EmbeddingModel", "bucket_tokens", "token_batches"]
