"""A Llama-family decoder (Llama 2/3, SmolLM, Qwen2, Mistral, Qwen3, Gemma 3) expressed as kernel graphs.

One graph covers one forward step over ``T`` new tokens at positions
``start_pos .. start_pos+T-1`` (prefill: T = prompt length; decode: T = 1) and returns the
logits of the last token [1, vocab] (float32) and their argmax [1] (int64):

    h = embedding(ids)
    per layer:  n = RMSNorm(h) * w_attn_norm                      (fused kernel)
                q, k, v = linear(n, Wq/Wk/Wv [+ bias, Qwen2])     (GEMV/GEMM)
                q, k = RMSNorm_head(q) * w_q_norm, RMSNorm_head(k) * w_k_norm   (Qwen3 only)
                q, k = RoPE(q), RoPE(k)                            (rotate-half, HF layout)
                a = attention(q, k, v, KV cache, start_pos)        (causal, GQA; sliding window: layer_window)
                h = h + linear(a, Wo);  n = RMSNorm(h) * w_mlp_norm    (fused kernel)
                h = h + linear(silu(linear(n, Wg)) * linear(n, Wu), Wd)   (SwiGLU)
    logits = linear(RMSNorm(h[-1]) * w_norm, W_lm_head or W_embed (tied))

References: Touvron et al. 2023 (Llama), Zhang & Sennrich 2019 (RMSNorm), Su et al. 2021
(RoPE), Ainslie et al. 2023 (GQA), Shazeer 2020 (SwiGLU); transformers' modeling_llama.py
is the numerical reference the tests compare against.

Qwen3 (Yang et al. 2025, the Qwen3 technical report; transformers' modeling_qwen3.py) is Qwen2
without q/k/v biases (unless its config's ``attention_bias``) plus a per-head RMSNorm on q and k:
each head's q and k vector (``head_dim`` wide; Qwen3's config gives ``head_dim`` explicitly and it
may differ from hidden / heads) is RMS-normalised with ``rms_norm_eps`` and scaled by the weights
``self_attn.q_norm`` / ``self_attn.k_norm`` [head_dim] after the projection, before RoPE.

Gemma 3 text models (Gemma Team 2025, the Gemma 3 technical report; transformers'
modeling_gemma3.py, ``Gemma3ForCausalLM``) differ where ``ModelConfig`` says so:

    h = embedding(ids) * sqrt(hidden)             (embed_scale, in the activation dtype)
    per layer:  n = RMSNorm(h) * (1 + w_input)    (every Gemma RMSNorm scales by 1 + w: the
                                                   weights are stored here as 1 + w, float32 sums)
                q, k = RMSNorm_head(q) * (1 + w_q_norm), ... (1 + w_k_norm)  (before RoPE)
                q, k = RoPE(q), RoPE(k)           (sliding layers: base rope_local_base_freq,
                                                   local_cos/local_sin; full layers: rope_theta)
                a = attention(..., scale = query_pre_attn_scalar^-0.5, window = layer_window(i))
                h = h + RMSNorm(linear(a, Wo)) * (1 + w_post_attn)       (before the residual add)
                n = RMSNorm(h) * (1 + w_pre_ff)
                h = h + RMSNorm(linear(gelu_tanh(linear(n, Wg)) * linear(n, Wu), Wd)) * (1 + w_post_ff)
    logits = linear(RMSNorm(h[-1]) * (1 + w_norm), W_embed)             (tied, unscaled)

This module builds graphs and owns the KV cache tensors; it must never launch kernels
itself (the executor does) or parse model files (models/loading.py does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import Backend, get_backend_impl
from ..dtypes import DType, as_dtype
from ..errors import GenerationError
from ..ir.ops import INT8_COMPUTE_WEIGHTS, OPS, PLAIN_TYPES
from ..kernel import KNGraph
from ..persistent_kernel import PersistentKernel
from .sharding import TensorParallelShard, shard_weights, vocab_lookup

#: forward passes of fewer tokens keep float32 GEMMs under ``prefill_dtype='bfloat16'``: their
#: quantized projections read the blocks in place (GEMV), which a bfloat16 GEMM cannot beat
PREFILL_BF16_MIN_T = 16


@dataclass
class BatchKVCache:
    """The KV cache of continuous batching (``LlamaModel.new_batch_cache``): ``slots`` sequence
    slots plus a scratch slot (index ``slots``) for padding rows; ``k``/``v`` one tensor per
    layer [slots + 1, max_seq_length, Hkv, Dh]."""

    slots: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]


class LlamaModel:
    """Weights, RoPE tables and KV cache of a loaded decoder, on one backend's device.

    Args:
        loaded: a ``models.loading.LoadedModel``.
        backend: the backend the graphs run on.
        max_seq_length: KV-cache length in tokens (prompt + generated).
        dtype: activation dtype (float32, float16 or bfloat16): float weights and the KV
            cache are stored in it; norms, softmax and GEMM accumulation compute in float32.
        prefill_dtype: None, or bfloat16: the block-quantized projections of a forward pass of
            at least ``PREFILL_BF16_MIN_T`` tokens compute as bfloat16 GEMMs (``linear``'s
            ``compute_dtype``: x and the decoded weights rounded to bfloat16); decode steps and
            the LM head keep float32.
        decode_dtype: None, or int8: every projection and the LM head of a decode step (T = 1:
            ``build_graph(1)``, ``decode_kernel``) on q4_1/q8_0 weights quantizes its input to
            int8 per block of 32 values (``linear``'s ``compute_dtype='int8'``: llama.cpp's
            decode numerics; other weight formats keep float32). CPU backend only.
        kv_cache_dtype: None (the KV cache in ``dtype``) or float16 with float32 activations:
            the model's cache, ``new_batch_cache``'s slots and the decode kernel's keep keys
            and values as float16 (rounded to nearest even as they are written, read back as
            float32), half the bytes a long-context decode step reads (llama.cpp's default
            cache type).

    Block-quantized weights (q4_1, q8_0) stay in their blocks and are decoded inside the
    GEMV/GEMM kernels; the backend may keep the projections and a tied embedding table in its
    kernels' layout (``BackendImpl.linear_weight_layout``: q4_1 / q8_0 as q4_1r16 / q8_0r16 on
    AVX-512 VNNI CPUs, for float32 or int8 decode activations); RoPE tables stay float32
    ([max_seq_length, head_dim / 2]: ``cos``/``sin``, and Gemma 3's sliding layers'
    ``local_cos``/``local_sin``). Gemma's norm weights (``cfg.norm_weight_offset``) are stored as
    ``1 + w`` computed in float32, exactly as transformers' ``Gemma3RMSNorm`` computes
    ``1.0 + weight.float()``, then cast to ``dtype`` (exact for float32; for float16/bfloat16
    rounded like the activations).

    With ``shard`` (``models.sharding.plan_shard``: tensor parallelism) the model keeps rank
    ``shard.rank``'s share of the weights (its q/KV heads and intermediate rows; the rest
    replicated), its embedding table only the rows ``shard.vocab`` (a vocab-parallel lookup:
    ``sharding.vocab_lookup``'s tables ``model.embed_tokens.rows`` / ``.mask``, zero rows for the
    tokens other ranks hold, then an allreduce), its KV cache holds only its KV heads
    (``num_kv_heads`` = ``shard.num_kv_heads``),
    and the graphs sum the o and down projections' partial outputs over the ranks with
    ``allreduce`` (``runtime.distributed``'s group, joined before the first run). Both the
    launch-per-op plans (``build_graph``, ``build_batch_graph``) and ``decode_kernel`` (the
    persistent kernel: ``allreduce_layer``, a host step between its task segments; rank 0 adds
    the residual) take the allreduce; Gemma 3's sandwich norms only on the plans. The LM head is
    vocab-parallel (``lm_head.shard.weight``: rows ``shard.vocab``), its logits gathered into every
    rank's [R, vocab] (a pad to the rank's offset and an allreduce).
    """

    def __init__(self, loaded, backend: Backend, max_seq_length: int, dtype: DType = DType.float32,
                 prefill_dtype: DType | None = None, decode_dtype: DType | None = None,
                 kv_cache_dtype: DType | None = None, shard: TensorParallelShard | None = None):
        cfg = loaded.config
        self.shard = shard
        self.num_heads = shard.num_heads if shard else cfg.num_heads
        self.num_kv_heads = shard.num_kv_heads if shard else cfg.num_kv_heads
        self.intermediate_size = shard.ffn[1] - shard.ffn[0] if shard else cfg.intermediate_size
        source = shard_weights(loaded.weights, cfg, shard) if shard else loaded.weights
        self.cfg = cfg
        self.backend = backend
        self.max_seq_length = max_seq_length
        self.dtype = dtype
        self.prefill_dtype = prefill_dtype
        self.decode_dtype = decode_dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.device = get_backend_impl(backend).torch_device
        self.weights: dict[str, tuple[torch.Tensor, DType, tuple]] = {}
        offset = cfg.norm_weight_offset
        for name, w in source.items():
            data, wtype = w.data, w.dtype
            if offset and name.endswith("norm.weight"):  # Gemma: RMSNorm scales by (1 + w), as transformers
                data = data.float() + offset             # computes it: in float32 (a new tensor, not in place)
            if not wtype.is_quantized:
                data, wtype = data.to(dtype.torch_dtype), dtype
            self.weights[name] = (data.contiguous().to(self.device), wtype, tuple(w.shape))
        # the backend may keep the projections, and a table that is also the LM head, in its
        # kernels' layout
        impl, compute = get_backend_impl(backend), (decode_dtype or dtype).value
        tied = "lm_head.weight" not in self.weights
        head_view = shard is not None and "lm_head.weight" not in loaded.weights   # a shard of a tied table
        for name, (data, wtype, shape) in self.weights.items():
            table = name == "model.embed_tokens.weight"
            if wtype.is_quantized and len(shape) == 2 and (tied or not table) and not (
                    head_view and name == "lm_head.shard.weight"):
                data, wtype = impl.linear_weight_layout(data, wtype, compute, embedding=table)
                self.weights[name] = (data, wtype, shape)
        if head_view:   # the head's rows are the table's rows as it is kept (one copy)
            self.weights["lm_head.shard.weight"] = self.weights["model.embed_tokens.weight"]
        if shard is not None:   # the vocab-parallel embedding's lookup tables (sharding.vocab_lookup)
            rows, mask = vocab_lookup(shard, cfg.vocab_size)
            self.weights["model.embed_tokens.rows"] = (rows.to(self.device), DType.int64, tuple(rows.shape))
            self.weights["model.embed_tokens.mask"] = (mask.to(self.device), DType.float32, tuple(mask.shape))
        self.cos, self.sin = self._rope_cos_sin(cfg.inv_freq, cfg.attention_scaling)
        self.local_cos = self.local_sin = None  # Gemma 3's sliding layers: their own RoPE base
        if cfg.local_inv_freq is not None:
            self.local_cos, self.local_sin = self._rope_cos_sin(cfg.local_inv_freq, cfg.local_attention_scaling)
        # Gemma: embeddings times sqrt(hidden), a float32 scalar cast to the activation dtype (transformers'
        # Gemma3TextScaledWordEmbedding: embed_scale.to(weight.dtype))
        self.embed_scale = (float(torch.tensor(cfg.embed_scale, dtype=torch.float32).to(dtype.torch_dtype))
                            if cfg.embed_scale is not None else None)
        shape = (max_seq_length, self.num_kv_heads, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.kv_cache_dtype.torch_dtype, device=self.device)
                        for _ in range(cfg.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.kv_cache_dtype.torch_dtype, device=self.device)
                        for _ in range(cfg.num_layers)]

    def weight_bytes(self) -> int:
        """Bytes of the weights this model keeps, each byte once (a tied table that is also the LM
        head, or holds a shard's head rows, counted once), RoPE tables and KV cache excluded."""
        spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t, _, _ in self.weights.values())
        total, end = 0, 0
        for lo, hi in spans:   # the union of the byte ranges
            total += max(0, hi - max(lo, end))
            end = max(end, hi)
        return total

    def _rope_cos_sin(self, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [max_seq_length, head_dim // 2] float32 of a RoPE table, on the device."""
        freqs = torch.arange(self.max_seq_length, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        return (freqs.cos() * scaling).to(self.device), (freqs.sin() * scaling).to(self.device)

    def layer_uses_local_rope(self, i: int) -> bool:
        """Layer ``i`` rotates q/k with the sliding layers' RoPE table (``local_cos``/``local_sin``,
        base ``rope_local_base_freq``): Gemma 3's 'sliding_attention' layers."""
        return self.local_cos is not None and self.cfg.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i``'s attention (``KernelGraph.attention``'s ``window``:
        the query at position p attends keys p - W < j <= p, transformers' sliding-window causal
        mask), or None for full causal attention. Mistral: ``config.sliding_window`` in every
        layer; Qwen2/Qwen3 only with ``use_sliding_window`` (the loader leaves ``sliding_window``
        None otherwise); a config's per-layer ``layer_types`` ('sliding_attention' /
        'full_attention'), when the loader keeps it, picks the layers."""
        window = self.cfg.sliding_window or None
        types = (self.cfg.hf_config or {}).get("layer_types")
        if window and types:
            return window if types[i] == "sliding_attention" else None
        return window

    def build_graph(self, T: int) -> tuple[KNGraph, list[torch.Tensor]]:
        """The forward graph for T new tokens, and the tensors for every input except
        the first two (``ids`` [T] int64 and ``start_pos`` [1] int64)."""
        g = KNGraph(self.backend.value)
        ids = g.new_input((T,), DType.int64, "ids")
        start = g.new_input((1,), DType.int64, "start_pos")
        bf16 = self.prefill_dtype == DType.bfloat16 and T >= PREFILL_BF16_MIN_T
        scale = self.cfg.attention_scale
        h, tensors, weight = self._trunk(
            g, ids, T, bf16, lambda x, c, s: g.rope(x, c, s, start),
            lambda i, q, k, v, kc, vc: g.attention(q, k, v, kc, vc, start, scale, window=self.layer_window(i)),
            self.k_cache, self.v_cache)
        self._head(g, weight, h if T == 1 else g.slice_rows(h, T - 1, T))
        if T == 1 and self.decode_dtype == DType.int8:
            _int8_activations(g)
        return g, tensors

    def new_batch_cache(self, slots: int) -> "BatchKVCache":
        """A zeroed KV cache for continuous batching (``build_batch_graph``): per layer
        [slots + 1, max_seq_length, Hkv, Dh] keys and values in ``kv_cache_dtype``, on the
        device. Slot ``slots`` is the scratch slot that padding rows write. Costs
        2 * layers * (slots + 1) * max_seq_length * Hkv * Dh elements. GenerationError unless
        ``slots`` is a positive integer."""
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise GenerationError(f"slots must be a positive integer, got {slots!r}")
        cfg = self.cfg
        shape = (slots + 1, self.max_seq_length, self.num_kv_heads, cfg.head_dim)

        def zeros():
            return [torch.zeros(shape, dtype=self.kv_cache_dtype.torch_dtype, device=self.device)
                    for _ in range(cfg.num_layers)]
        return BatchKVCache(slots, zeros(), zeros())

    def build_batch_graph(self, T: int, R: int, cache: "BatchKVCache") -> tuple[KNGraph, list[torch.Tensor]]:
        """The forward graph of one continuous-batching step: T rows from any number of
        sequences (decode rows and chunks of prompts in prefill), each at its own position in
        its own slot of ``cache`` (``new_batch_cache``), one GEMM per projection over all T
        rows; logits only for R of the rows.

        Graph inputs, in order: ``ids`` [T] int64 (token ids), ``positions`` [T] int64 (each
        row's position in its sequence), ``slots`` [T] int64 (each row's KV-cache slot; padding
        rows use the scratch slot ``cache.slots``), ``sample_rows`` [R] int64 (the rows whose
        logits are needed, in [0, T)); then the returned tensors (tables, weights, caches).
        Outputs: logits [R, vocab] (float32 with float32 activations, else the activation
        dtype) and their argmax [R] int64. Out-of-range ids, positions, slots or sample rows
        raise IndexOutOfRangeError when the plan runs. Projections compute in float32 whatever
        ``prefill_dtype`` is; with ``decode_dtype`` int8, those on a row-group weight
        (``INT8_BATCH_WEIGHTS``: a multi-row int8 kernel, ~2.5x the float32 one at 16 rows; x
        quantized once per projection by an op of its own) quantize every row's input, prompt
        chunks included (one GEMM over all the step's rows, as
        llama.cpp's batches quantize theirs), so a row computes the same whatever shares its step."""
        g = KNGraph(self.backend.value)
        ids = g.new_input((T,), DType.int64, "ids")
        positions = g.new_input((T,), DType.int64, "positions")
        slots = g.new_input((T,), DType.int64, "slots")
        sample_rows = g.new_input((R,), DType.int64, "sample_rows")
        scale = self.cfg.attention_scale
        h, tensors, weight = self._trunk(
            g, ids, T, False, lambda x, c, s: g.rope_rows(x, c, s, positions),
            lambda i, q, k, v, kc, vc: g.attention_rows(q, k, v, kc, vc, slots, positions, scale,
                                                        window=self.layer_window(i)),
            cache.k, cache.v)
        self._head(g, weight, g.embedding(sample_rows, h))  # the sampled rows of h [T, H] (checked ids)
        if self.decode_dtype == DType.int8:
            _int8_activations(g, INT8_BATCH_WEIGHTS)
        return g, tensors

    def _trunk(self, g: KNGraph, ids, T: int, bf16: bool, rope, attend, k_caches, v_caches):
        """Embedding and every decoder layer over T rows: (h [T, hidden], the tensors of the
        inputs it added, the ``weight(name)`` input maker). ``rope(x, cos, sin)`` rotates q or
        k; ``attend(layer, q, k, v, k_cache, v_cache)`` is the attention of a layer."""
        cfg = self.cfg
        tensors: list[torch.Tensor] = []

        def inp(t: torch.Tensor, dtype=None, shape=None, name=None):
            tensors.append(t)
            return g.new_input(shape or tuple(t.shape), dtype or as_dtype(t.dtype), name)

        added: dict[str, object] = {}

        def weight(name: str):  # one graph input per weight (the tied LM head reuses the embedding's)
            if name not in added:
                data, dtype, shape = self.weights[name]
                added[name] = inp(data, dtype, shape, name)
            return added[name]

        cos, sin = inp(self.cos, name="rope_cos"), inp(self.sin, name="rope_sin")
        if self.local_cos is not None:  # Gemma 3's sliding layers
            local_cos = inp(self.local_cos, name="rope_cos_local")
            local_sin = inp(self.local_sin, name="rope_sin_local")
        H, Dh, hq, hkv = cfg.hidden_size, cfg.head_dim, self.num_heads, self.num_kv_heads
        eps = cfg.rms_norm_eps

        def norm(x, w):
            return g.mul(g.rms_norm(x, (H,), eps), weight(w))

        def proj(x, prefix):
            bias = weight(prefix + ".bias") if prefix + ".bias" in self.weights else None
            quantized = self.weights[prefix + ".weight"][1].is_quantized
            return g.linear(x, weight(prefix + ".weight"), bias,
                            compute_dtype="bfloat16" if bf16 and quantized else None)

        if self.shard is None:
            h = g.embedding(ids, weight("model.embed_tokens.weight"))
        else:   # vocab-parallel: this rank's rows, zeros for the tokens another rank holds, summed over the ranks
            h = g.embedding(g.index_select(weight("model.embed_tokens.rows"), 0, ids),
                            weight("model.embed_tokens.weight"))
            mask = g.embedding(ids, weight("model.embed_tokens.mask"))
            h = g.allreduce(g.mul(h, mask if mask.dtype == h.dtype else g.cast(mask, h.dtype)))
        if h.dtype != self.dtype:  # a quantized table decodes to float32
            h = g.cast(h, self.dtype)
        if self.embed_scale is not None:  # Gemma: times sqrt(hidden)
            h = g.scale(h, self.embed_scale)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            n = norm(h, f"{p}.input_layernorm.weight")
            q = g.reshape(proj(n, f"{p}.self_attn.q_proj"), (T, hq, Dh))
            k = g.reshape(proj(n, f"{p}.self_attn.k_proj"), (T, hkv, Dh))
            v = g.reshape(proj(n, f"{p}.self_attn.v_proj"), (T, hkv, Dh))
            if f"{p}.self_attn.q_norm.weight" in self.weights:  # Qwen3, Gemma 3: per-head RMSNorm of q and k
                q = g.mul(g.rms_norm(q, (Dh,), eps), weight(f"{p}.self_attn.q_norm.weight"))
                k = g.mul(g.rms_norm(k, (Dh,), eps), weight(f"{p}.self_attn.k_norm.weight"))
            rc, rs = (local_cos, local_sin) if self.layer_uses_local_rope(i) else (cos, sin)
            q, k = rope(q, rc, rs), rope(k, rc, rs)
            kc, vc = inp(k_caches[i], name=f"k_cache.{i}"), inp(v_caches[i], name=f"v_cache.{i}")
            a = attend(i, q, k, v, kc, vc)
            o = proj(g.reshape(a, (T, hq * Dh)), f"{p}.self_attn.o_proj")
            if self.shard is not None:   # row-parallel: the partial sums of every rank's heads
                o = g.allreduce(o)
            if cfg.sandwich_norms:  # Gemma: the attention output normalised before the residual add
                h = g.add(h, norm(o, f"{p}.post_attention_layernorm.weight"))
                n = norm(h, f"{p}.pre_feedforward_layernorm.weight")
            else:
                h = g.add(h, o)
                n = norm(h, f"{p}.post_attention_layernorm.weight")
            gate, up = proj(n, f"{p}.mlp.gate_proj"), proj(n, f"{p}.mlp.up_proj")
            gated = g.gelu_tanh(gate) if cfg.hidden_act == "gelu_pytorch_tanh" else g.silu(gate)
            m = proj(g.mul(gated, up), f"{p}.mlp.down_proj")
            if self.shard is not None:   # row-parallel: the partial sums of every rank's rows
                m = g.allreduce(m)
            if cfg.sandwich_norms:  # Gemma: the MLP output normalised before the residual add
                m = norm(m, f"{p}.post_feedforward_layernorm.weight")
            h = g.add(h, m)
        return h, tensors, weight

    def _head(self, g: KNGraph, weight, rows) -> None:
        """Final RMSNorm and LM head of ``rows`` [R, hidden]: marks logits [R, vocab] and their
        argmax [R] as the graph's outputs."""
        cfg = self.cfg
        last = g.mul(g.rms_norm(rows, (cfg.hidden_size,), cfg.rms_norm_eps), weight("model.norm.weight"))
        if self.shard is not None:   # vocab-parallel: this rank's rows, at their offset, summed over the ranks
            v0, v1 = self.shard.vocab
            local = g.linear(last, weight("lm_head.shard.weight"))
            logits = g.allreduce(g.pad(local, [(0, 0), (v0, cfg.vocab_size - v1)]))
        else:
            head = "lm_head.weight" if "lm_head.weight" in self.weights else "model.embed_tokens.weight"
            logits = g.linear(last, weight(head))
        g.mark_output(logits)
        g.mark_output(g.argmax(logits, -1))

    def decode_kernel(self, num_workers: int | None = None, profiler_tensor: torch.Tensor | None = None,
                      adaptive_workers: bool = False, k_cache: list[torch.Tensor] | None = None,
                      v_cache: list[torch.Tensor] | None = None) -> PersistentKernel:
        """The decode step (T = 1) built with ``yr.PersistentKernel``'s layers and compiled:
        the same computation as ``build_graph(1)`` (``run_step(token, pos)`` returns the
        logits [1, vocab] and the argmax [1]); on the CPU one task graph per step. It reads and
        writes the model's own KV cache, or ``k_cache``/``v_cache``: one [max_seq_length, Hkv,
        Dh] tensor per layer in ``kv_cache_dtype`` (a slot of a ``BatchKVCache``). Qwen3's
        and Gemma 3's per-head q/k RMSNorm is ``attention_layer``'s ``q_norm``/``k_norm``; Gemma 3's
        post-attention / post-feedforward norms are the ``post_norm`` of
        ``linear_with_residual_layer`` / ``gelu_mul_linear_with_residual_layer`` (fused with the
        residual add and the next RMSNorm into one row kernel), its embedding scale
        ``embed_layer``'s ``scale``."""
        cfg, shard = self.cfg, self.shard
        if shard is not None and cfg.sandwich_norms:
            raise GenerationError(f"tensor parallelism (rank {shard.rank} of {shard.world_size}): the persistent "
                                  "decode kernel cannot split Gemma's post-attention / post-feedforward norms (they "
                                  "normalise the summed projection); use persistent=False")
        H, Dh, hq, hkv, eps = cfg.hidden_size, cfg.head_dim, self.num_heads, self.num_kv_heads, cfg.rms_norm_eps
        dt = self.dtype
        k_cache, v_cache = k_cache or self.k_cache, v_cache or self.v_cache
        meta = [torch.zeros(1, dtype=torch.int64), torch.zeros(self.max_seq_length, dtype=torch.int64)]
        mpk = PersistentKernel(world_size=shard.world_size if shard else 1, mpi_rank=shard.rank if shard else 0,
                               num_workers=num_workers, max_seq_length=self.max_seq_length,
                               eos_token_id=list(cfg.eos_token_ids), meta_tensors=meta, profiler_tensor=profiler_tensor,
                               backend=self.backend.value, adaptive_workers=adaptive_workers)
        attached: dict[str, object] = {}

        def W(name: str):
            if name not in attached:
                data, dtype, _ = self.weights[name]
                attached[name] = mpk.attach_input(data, name, dtype if dtype.is_quantized else None)
            return attached[name]

        def bias(prefix: str):
            return W(prefix + ".bias") if prefix + ".bias" in self.weights else None

        def act(name: str, n: int, dtype=dt):
            return mpk.new_tensor((1, n), dtype, name)

        h = act("h.embed", H)
        if shard is None:
            mpk.embed_layer(mpk.input_token, W("model.embed_tokens.weight"), h, scale=self.embed_scale)
        else:   # vocab-parallel: this rank's rows (zeros for another rank's token), summed over the ranks
            partial = act("h.embed_partial", H)
            mpk.embed_layer(mpk.input_token, W("model.embed_tokens.weight"), partial, scale=self.embed_scale,
                            vocab_rows=W("model.embed_tokens.rows"), vocab_mask=W("model.embed_tokens.mask"))
            mpk.allreduce_layer(partial, None, h)
        cos, sin = mpk.attach_input(self.cos, "rope_cos"), mpk.attach_input(self.sin, "rope_sin")
        if self.local_cos is not None:  # Gemma 3's sliding layers
            local = (mpk.attach_input(self.local_cos, "rope_cos_local"),
                     mpk.attach_input(self.local_sin, "rope_sin_local"))
        sandwich = cfg.sandwich_norms
        # tensor parallelism: o and down are row-parallel; rank 0 adds the residual to its partial
        # sum, the others a zero row, and an allreduce after each gives every rank residual + o
        zeros = None
        if shard is not None and shard.rank > 0:
            zeros = mpk.attach_input(torch.zeros(1, H, dtype=dt.torch_dtype, device=self.device), "zero_residual")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            qkv = [act(f"{p}.{x}", n * Dh) for x, n in (("q", hq), ("k", hkv), ("v", hkv))]
            projs = [f"{p}.self_attn.{x}_proj" for x in "qkv"]
            biases = [bias(x) for x in projs]
            mpk.rmsnorm_linear_layer(h, W(f"{p}.input_layernorm.weight"), [W(x + ".weight") for x in projs], qkv,
                                     eps=eps, bias=biases if any(b is not None for b in biases) else None)
            a = act(f"{p}.attn", hq * Dh)
            q_norm = k_norm = None
            if f"{p}.self_attn.q_norm.weight" in self.weights:  # Qwen3, Gemma 3: per-head RMSNorm of q and k
                q_norm, k_norm = W(f"{p}.self_attn.q_norm.weight"), W(f"{p}.self_attn.k_norm.weight")
            rc, rs = local if self.layer_uses_local_rope(i) else (cos, sin)
            mpk.attention_layer(tuple(qkv), mpk.attach_input(k_cache[i], f"k_cache.{i}"),
                                mpk.attach_input(v_cache[i], f"v_cache.{i}"), q_norm, k_norm, rc, rs, a,
                                scale=cfg.attention_scale, eps=eps, window=self.layer_window(i))
            h_attn = act(f"{p}.h_attn", H)
            post_attn = W(f"{p}.post_attention_layernorm.weight") if sandwich else None  # Gemma: before the add
            partial = act(f"{p}.h_attn_partial", H) if shard is not None else h_attn
            mpk.linear_with_residual_layer(a, W(f"{p}.self_attn.o_proj.weight"), h if zeros is None else zeros, partial,
                                           post_norm=post_attn, eps=eps)
            if shard is not None:
                mpk.allreduce_layer(partial, None, h_attn)
            gate_up = [act(f"{p}.{x}", self.intermediate_size) for x in ("gate", "up")]
            mlp_norm = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
            mpk.rmsnorm_linear_layer(h_attn, W(f"{p}.{mlp_norm}.weight"),
                                     [W(f"{p}.mlp.gate_proj.weight"), W(f"{p}.mlp.up_proj.weight")], gate_up, eps=eps)
            h = act(f"{p}.h_out", H)
            mlp = (mpk.gelu_mul_linear_with_residual_layer if cfg.hidden_act == "gelu_pytorch_tanh"
                   else mpk.silu_mul_linear_with_residual_layer)
            post_ff = W(f"{p}.post_feedforward_layernorm.weight") if sandwich else None  # Gemma: before the add
            partial = act(f"{p}.h_out_partial", H) if shard is not None else h
            mlp(tuple(gate_up), W(f"{p}.mlp.down_proj.weight"), h_attn if zeros is None else zeros, partial,
                post_norm=post_ff, eps=eps)
            if shard is not None:
                mpk.allreduce_layer(partial, None, h)
        last = act("final_norm", H)
        mpk.rmsnorm_layer(h, W("model.norm.weight"), last, eps=eps)
        logits_dtype = DType.float32 if dt == DType.float32 else dt
        logits = act("logits", cfg.vocab_size, logits_dtype)
        if shard is not None:   # vocab-parallel: this rank's rows, gathered into every rank's logits
            local = act("logits_shard", shard.vocab[1] - shard.vocab[0], logits_dtype)
            mpk.linear_layer(last, W("lm_head.shard.weight"), local)
            mpk.allgather_layer(local, logits, shard.vocab[0])
        else:
            head = W("lm_head.weight" if "lm_head.weight" in self.weights else "model.embed_tokens.weight")
            mpk.linear_layer(last, head, logits)
        mpk.mark_output(logits)
        partial = (act("argmax_values", 1), act("argmax_indices", 1, DType.int64))
        mpk.argmax_partial_layer(logits, partial)
        mpk.argmax_reduce_layer(partial, mpk.new_tensor((1,), DType.int64, "next_token"))
        if self.decode_dtype == DType.int8:
            _int8_activations(mpk.kn_graph)
        mpk.compile()
        return mpk


#: the weights whose batched steps (``build_batch_graph``) quantize x with ``decode_dtype`` int8:
#: the row-group layouts, which have a multi-row int8 kernel (kernels/cpu/row_groups.h); the plain
#: formats' int8 GEMV runs row by row, slower than their float32 row tiles
INT8_BATCH_WEIGHTS = tuple(PLAIN_TYPES)


def _int8_activations(g: KNGraph, weights=INT8_COMPUTE_WEIGHTS) -> None:
    """Gives every ``linear`` of ``g`` on a weight of ``weights`` (default: every q4_1/q8_0
    format) with float32 x ``compute_dtype='int8'`` (``decode_dtype``); the op's shape rule
    checks the result."""
    for node in g.ops:
        if node.op != "linear" or node.attrs.get("compute_dtype"):
            continue
        types = [g.tensors[i] for i in node.inputs]
        if types[0].dtype == DType.float32 and types[1].dtype in weights:
            node.attrs["compute_dtype"] = "int8"
            OPS["linear"].infer(types, node.attrs)


class StepRunner:
    """Compiled forward steps of a LlamaModel: one plan per token count T, reused.

    ``run(token_ids, start_pos)`` writes the KV cache rows start_pos.. and returns
    (logits [1, vocab] in the model's dtype, argmax [1] int64), both on the model's device and
    owned by the plan (copy to keep). With ``persistent`` the decode step (T = 1) is a
    ``PersistentKernel`` (``LlamaModel.decode_kernel``: one task graph on the CPU's worker
    pool of ``num_workers``); otherwise the decode plan is captured by the backend (CUDA
    graphs on CUDA/ROCm), so a decode step is one replay.
    """

    def __init__(self, model: LlamaModel, max_plans: int = 4, persistent: bool = False,
                 num_workers: int | None = None, profiler_tensor: torch.Tensor | None = None):
        self.model = model
        self.plans: dict[int, tuple] = {}
        self.max_plans = max_plans
        self.persistent = persistent
        self.num_workers = num_workers
        self.profiler_tensor = profiler_tensor
        self.decode: PersistentKernel | None = None

    def prepare(self, T: int) -> None:
        """Build, compile and bind the step for T tokens ahead of time."""
        self._plan(T)

    def _plan(self, T: int):
        if T == 1 and self.persistent:
            if self.decode is None:
                self.decode = self.model.decode_kernel(self.num_workers, self.profiler_tensor)
            return self.decode
        if T not in self.plans:
            if len(self.plans) >= self.max_plans:  # keep decode (T=1), drop an old prefill plan
                self.plans.pop(next(t for t in self.plans if t != 1))
            g, tensors = self.model.build_graph(T)
            ids = torch.zeros(T, dtype=torch.int64, device=self.model.device)
            start = torch.zeros(1, dtype=torch.int64, device=self.model.device)
            plan = g.compile(self.model.backend.value).plan([ids, start, *tensors])
            if T == 1:
                plan.capture()
            self.plans[T] = (plan, ids, start)
        return self.plans[T]

    def run_greedy(self, token: int, start_pos: int, n: int) -> list[int]:
        """Greedy decode of up to ``n`` tokens in one call, ``token`` first fed at position
        ``start_pos``: the persistent kernel's decode loop (``mpk()``: on the CPU the steps
        follow one another inside the scheduler, Python is not called between them). Returns
        the new token ids, the last one an EOS token if one came; the KV cache then holds
        positions start_pos .. start_pos + len - 1. Raises GenerationError without
        ``persistent``, IndexOutOfRangeError for a token id outside the vocabulary."""
        if not self.persistent:
            raise GenerationError("run_greedy needs the persistent decode kernel (persistent=True)")
        mpk = self._plan(1)
        n = max(0, min(int(n), self.model.max_seq_length - 1 - int(start_pos)))
        mpk.tokens[start_pos] = int(token)
        mpk.step[0] = int(start_pos)
        got = mpk(prompt_length=start_pos + 1, max_new_tokens=n)
        return mpk.tokens[start_pos + 1:start_pos + 1 + got].tolist()

    def run(self, token_ids: list[int], start_pos: int):
        if len(token_ids) == 1 and self.persistent:
            return self._plan(1).run_step(token_ids[0], start_pos)
        plan, ids, start = self._plan(len(token_ids))
        ids.copy_(torch.tensor(token_ids, dtype=torch.int64))
        start.fill_(start_pos)
        return plan.run()
