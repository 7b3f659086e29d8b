"""The CPU backend's library ops: GEMM/GEMV, embedding, RoPE, attention and argmax, and the
encoder ops of the embedding engine (attention_bidir: torch's fused scaled_dot_product_attention;
attention_varlen: embed.py). Linear layers with float32 activations and float32, bfloat16 or
int8 (``linear_w8a8``) weights run on the provider chosen by measurement for their shape class
(providers.py: yirage's packed GEMMs, MKL, oneDNN).

Quantized linear layers, embeddings, RoPE, attention (and their batched-step forms rope_rows
and attention_rows) and argmax call the hand-written C++
of the CPU library, ``yirage/kernels/cpu/library.cpp`` and its other translation units
(``library_core.h``: q4_1/q8_0; the other GGML block formats of ``GGML_FORMATS`` in
``ggml_quants.h``, read in place the same way; built once by runtime/toolchain.py, bound through
ctypes with the ``SIGNATURES`` of native.py); ``matmul`` uses torch (BLAS). ``supports`` says
which (op, dtype) cases have a kernel here; the executor runs every other case as the op's
torch reference. Binders run once per plan and return a thunk; they never allocate per
call (outputs are given).
"""
from __future__ import annotations

import ctypes
import functools
import struct
from typing import Callable

import torch

from ...dtypes import DType
from ...ir.ops import PLAIN_TYPES, ROW_GROUP, ROW_GROUP_TYPES, linear_nk
from ...runtime import distributed
from ...runtime.task_graph import TaskOp, split_range, task_op
from ...tuning import profile as tuning
from ..base import bind_linear_stack_parts
from . import conv, embed, indexing, native, providers, strided
from .native import GGML_FORMATS, library
from .threadblock import bind_customized, customized_ok


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _types(node, graph):
    return [graph.tensors[i] for i in node.inputs]


# ---- which cases have a kernel here -------------------------------------------------------
_QUANT = (DType.q4_1, DType.q8_0, DType.q4_1r16, DType.q8_0r16, *(DType(t) for t in GGML_FORMATS))


def _linear_ok(node, graph) -> bool:
    x, w = _types(node, graph)[:2]
    return (w.dtype in _QUANT and x.dtype == DType.float32) or not w.dtype.is_quantized


def _embedding_ok(node, graph) -> bool:
    ids, table = _types(node, graph)
    return ids.dtype == DType.int64 and table.dtype in (*_QUANT, DType.float32)   # q4_1r16: refused by the IR


def _float32_first(node, graph) -> bool:
    return _types(node, graph)[0].dtype == DType.float32


# ---- binders: (node, graph, args, out, status) -> thunk -----------------------------------
# ``status`` is the int64 [4] slot the executor gives ops that index with run-time values
# (OpDef.index_input); the C++ kernel records a violation there.
def _linear(node, graph, args, out, status):
    x, w = args[0], args[1]
    bias = args[2] if len(args) == 3 else None
    wt = graph.tensors[node.inputs[1]]
    layout = node.attrs.get("weight_layout", "nk")
    N, K = linear_nk(wt.shape, node.attrs)
    M = x.numel() // K
    if node.attrs.get("compute_dtype") == "int8":   # q4_1/q8_0 with x quantized: yirage's kernel only
        fn, xp, wp, bp, op = (getattr(library(), f"yr_linear_{wt.dtype.value}_q8"), x.data_ptr(), w.data_ptr(),
                              _ptr(bias), out.data_ptr())
        return lambda: fn(xp, wp, bp, op, M, N, K)
    quant = (wt.dtype.value, N, K) if wt.dtype.is_quantized else None
    # float32 x: the provider chosen by measurement (float32, bfloat16 or GGUF-block weights)
    thunk = providers.bind_linear("linear", args, out, quant=quant,
                                  compute_dtype=node.attrs.get("compute_dtype"), layout=layout)
    if thunk is not None:
        return thunk
    x2, o2, w_t = x.view(M, K), out.view(M, N), (w if layout == "kn" else w.t())
    if bias is None:
        return lambda: torch.mm(x2, w_t, out=o2)
    return lambda: torch.addmm(bias, x2, w_t, out=o2)


def _linear_stack(node, graph, args, out, status):
    """``linear_stack``: one packed float32 GEMM over the stacked weights, each output plane
    written in place (embed.bind_linear_stack_f32), when x is float32, the weights and
    biases are constant (declared by the caller: torch.compile's frozen parameters) and the
    out features a multiple of 32; otherwise each part as the ``linear`` it stands for, into
    its plane."""
    k, has_bias = node.attrs["parts"], node.attrs.get("bias")
    layout = node.attrs.get("weight_layout", "nk")
    x, weights, biases = args[0], list(args[1:1 + k]), (list(args[1 + k:]) if has_bias else None)
    N, K = linear_nk(graph.tensors[node.inputs[1]].shape, node.attrs)
    if (x.dtype == torch.float32 and N % embed._PANEL == 0
            and all(embed.is_constant(t) for t in weights + (biases or []))):
        return embed.bind_linear_stack_f32(x.view(-1, K), weights, biases, out, layout)
    return bind_linear_stack_parts(node, graph, args, out, status, _linear)


def merge_linears(case) -> bool:
    """Should the parallel linear layers ``case`` (transforms.parallel.LinearGroup) run as one
    ``linear_stack``? Chosen by measurement per shape class (``tuning.choose``, cached in the
    profile): the k linears, each on the provider chosen for it, against the stacked packed
    GEMM, on random constant weights of the case's shapes. Only float32 cases whose out
    features are a multiple of 32 (the stacked kernel's planes) and whose weights take at most
    ``embed.MERGE_MAX_WEIGHT_BYTES`` are measured; others: False."""
    if (case.dtype != "float32" or case.N % embed._PANEL or case.M == 0
            or case.parts * case.N * case.K * 4 > embed.MERGE_MAX_WEIGHT_BYTES):
        return False
    kn = case.layout == "kn"
    what = f"float32/{case.layout}/x{case.parts}" + ("/bias" if case.bias else "")
    key = tuning.shape_class("linear_stack", what, case.M, case.N, case.K, torch.get_num_threads())

    def sample():
        x = torch.randn(case.M, case.K)
        ws = [torch.randn((case.K, case.N) if kn else (case.N, case.K)) / case.K ** 0.5 for _ in range(case.parts)]
        bs = [torch.randn(case.N) for _ in range(case.parts)] if case.bias else None
        for t in ws + (bs or []):
            embed.mark_constant(t)
        return x, ws, bs, torch.empty(case.parts, case.M, case.N)

    def separate():
        x, ws, bs, out = sample()
        runs = []
        for i, w in enumerate(ws):
            args = [x, w] + ([bs[i]] if bs else [])
            run = providers.bind_linear("linear", args, out[i], layout=case.layout)
            if run is None:
                raise RuntimeError("no packed provider for this linear")
            runs.append(run)

        def run_all():
            for r in runs:
                r()
        run_all.samples = (x, ws, bs, out)   # the kernels hold raw pointers into them
        return run_all

    def stacked():
        x, ws, bs, out = sample()
        run = embed.bind_linear_stack_f32(x, ws, bs, out, case.layout)
        run.samples = (x, ws, bs, out)
        return run
    return tuning.choose(key, {"separate": separate, "stacked": stacked}, "separate").provider == "stacked"


def bind_with_epilogue(node, graph, args, out, kernel, kernel_args):
    """A float32-activation ``linear`` (float32 or bfloat16 weight) or ``linear_w8a8`` on its
    chosen provider with ``kernel`` (a CppKernel: its task entry runs rows lo..hi-1, bound to
    ``kernel_args``) as the GEMM's row epilogue (providers.py); None for anything else."""
    task_fn = getattr(kernel, "task_fn", None)
    if task_fn is None or node.op not in ("linear", "linear_w8a8"):
        return None
    if node.op == "linear" and graph.tensors[node.inputs[1]].dtype.is_quantized:
        return None
    words = kernel.arg_words(kernel_args)
    ptrs = (ctypes.c_int64 * len(words))(*words)
    run = providers.bind_linear(node.op, args, out, int(node.attrs.get("group_size", 0)),
                                (task_fn, ctypes.addressof(ptrs)),
                                compute_dtype=node.attrs.get("compute_dtype"),
                                layout=node.attrs.get("weight_layout", "nk"))
    if run is not None:
        run.epilogue_args = ptrs  # the pointer array lives as long as the thunk
    return run


def _linear_w8a8(node, graph, args, out, status):
    """``linear_w8a8`` on the provider chosen for its shape class (providers.py)."""
    return providers.bind_linear("linear_w8a8", args, out, int(node.attrs.get("group_size", 0)))


def _matmul(node, graph, args, out, status):
    a, b = args
    return lambda: torch.matmul(a, b, out=out)


def _embedding(node, graph, args, out, status):
    ids, table = args
    tt = graph.tensors[node.inputs[1]]
    fn = getattr(library(), "yr_embedding_" + ("f32" if tt.dtype == DType.float32 else tt.dtype.value))
    p = (_ptr(ids), _ptr(table), _ptr(out), ids.numel(), tt.shape[1], tt.shape[0], _ptr(status))
    return lambda: fn(*p)


def _rope(node, graph, args, out, status):
    x, cos, sin, pos = args
    T, H, Dh = x.shape
    fn = library().yr_rope
    p = (_ptr(x), _ptr(cos), _ptr(sin), _ptr(pos), _ptr(out), T, H, Dh, cos.shape[0], _ptr(status))
    return lambda: fn(*p)


def _kv_suffix(cache: torch.Tensor) -> str:
    """The attention kernels' name suffix for a KV cache: '' (float32) or '_f16kv' (float16)."""
    return "_f16kv" if cache.dtype == torch.float16 else ""


def _attention(node, graph, args, out, status):
    """yr_attention_window: full causal (attrs window 0) or sliding-window GQA attention, over
    float32 or float16 (``_f16kv``) caches."""
    q, k, v, kc, vc, pos = args
    T, Hq, Dh = q.shape
    fn = getattr(library(), "yr_attention_window" + _kv_suffix(kc))
    p = (*map(_ptr, (q, k, v, kc, vc, pos, out)), T, Hq, k.shape[1], Dh, kc.shape[0], node.attrs["scale"],
         node.attrs.get("window", 0), _ptr(status))
    return lambda: fn(*p)


def _rope_rows(node, graph, args, out, status):
    """yr_rope_rows: each row of x at its own position (continuous batching)."""
    x, cos, sin, pos = args
    T, H, Dh = x.shape
    fn = library().yr_rope_rows
    p = (_ptr(x), _ptr(cos), _ptr(sin), _ptr(pos), _ptr(out), T, H, Dh, cos.shape[0], _ptr(status))
    return lambda: fn(*p)


def _span(t: torch.Tensor) -> int:
    """Elements from a view's first one to the end of its storage (what a kernel reading it
    through strides may reach)."""
    return t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()


#: the element types yr_rotary_emb takes, by its dtype code
_ROTARY_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _rotary_emb(node, graph, args, out, status):
    """yr_rotary_emb (float32, bfloat16 or float16): x (a strided view too: ``strided_io``), cos
    and sin read through the strides of their broadcast to x's shape (stride 0 where they
    repeat), the dims padded to 4."""
    x, cos, sin = args
    pad = 4 - x.dim()
    geo = [1] * pad + list(x.shape)
    for t in (x, cos.expand(x.shape), sin.expand(x.shape), out):
        geo += [0] * pad + list(t.stride())
    geo = torch.tensor(geo, dtype=torch.int64)
    fn, st = library().yr_rotary_emb, torch.zeros(4, dtype=torch.int64)
    p = (_ptr(x), _ptr(cos), _ptr(sin), _ptr(out), geo.data_ptr(), geo.numel(), _ROTARY_DTYPES[x.dtype], _span(x),
         _span(cos), _span(sin), _span(out), st.data_ptr())

    def run():
        fn(*p)
        if st[0]:
            native._raise_status(st, "rotary_emb")
    run.keep = (geo, st)
    return run


def _attention_rows(node, graph, args, out, status):
    """yr_attention_rows: each row over its own slot of the KV caches (continuous batching),
    float32 or float16 (``_f16kv``)."""
    q, k, v, kc, vc, slots, pos = args
    T, Hq, Dh = q.shape
    fn = getattr(library(), "yr_attention_rows" + _kv_suffix(kc))
    p = (*map(_ptr, (q, k, v, kc, vc, slots, pos, out)), T, Hq, k.shape[1], Dh, kc.shape[0], kc.shape[1],
         node.attrs["scale"], node.attrs.get("window", 0), _ptr(status))
    return lambda: fn(*p)


def _sdpa_flash(q, k, v, mask, out, causal: bool, scale):
    """torch's fused scaled_dot_product_attention (its flash-attention CPU kernel), into ``out``."""
    sdpa, gqa = torch.nn.functional.scaled_dot_product_attention, k.shape[1] != q.shape[1]
    return lambda: out.copy_(sdpa(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa))


def _sdpa_gemm(q, k, v, mask, out, causal: bool, scale):
    """The same as two batched GEMMs around a safe softmax (a fully masked row gives 0, as the
    fused kernel does): the scores [B, H, S, T] materialized in a buffer made here (and the
    result too, where ``out`` is a strided view)."""
    B, H, S, D = q.shape
    T = k.shape[2]
    scores, kt = torch.empty((B, H, S, T), dtype=q.dtype), k.transpose(-1, -2)
    res = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
    bias = (torch.full((S, T), float("-inf"), dtype=q.dtype).triu(1) if causal else None)
    s = float(scale) if scale is not None else D ** -0.5
    softmax = torch.ops.aten._safe_softmax.default

    def run():
        torch.matmul(q, kt, out=scores)
        scores.mul_(s)
        if mask is not None:
            scores.add_(mask)
        if bias is not None:
            scores.add_(bias)
        torch.matmul(softmax(scores, -1), v, out=res)
        if res is not out:
            out.copy_(res)
    return run


def _sdpa_yirage(q, k, v, mask, out, causal: bool, scale):
    """yirage's attention kernel (kernels/cpu/embed_kernels.h ``yr_sdpa_f32``: K transposed per
    head, Q K^T and P V in register tiles, the mask and causal bias added to the scores, GQA by
    head index), float32 with v's head dim equal to q's. q, k, v and out may be strided views
    (the executor's layout aliases), e.g. [B, S, H, D] buffers read as [B, H, S, D]."""
    B, H, S, D = q.shape
    Hk, T = k.shape[1], k.shape[2]
    strides = [0, 0, 0]
    if mask is not None:
        st = mask.stride()
        strides = [0 if mask.shape[i] == 1 else st[i] for i in range(3)]
    views = [t.stride()[:3] for t in (q, k, v, out)]
    geo = torch.tensor([B, H, Hk, S, T, D, int(causal), *strides, *(x for st in views for x in st)], dtype=torch.int64)
    s = float(scale) if scale is not None else D ** -0.5
    fn, st = library().yr_sdpa_f32, torch.zeros(4, dtype=torch.int64)
    p = (q.data_ptr(), k.data_ptr(), v.data_ptr(), _ptr(mask), out.data_ptr(), geo.data_ptr(), geo.numel(), s,
         _span(q), min(_span(k), _span(v)), 0 if mask is None else _span(mask), _span(out), st.data_ptr())

    def run():
        fn(*p)
        if st[0]:
            native._raise_status(st, "sdpa (yirage kernel)")
    run.keep = (geo, st, q, k, v, mask, out)   # the kernel reads them through raw pointers
    return run


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Is ``t`` [B, H, T, D] strided over its first three dims with contiguous D-rows (what
    yirage's attention kernel reads and writes)?"""
    return t.stride(3) == 1 or t.shape[3] == 1


def _sdpa(node, graph, args, out, status):
    """``sdpa`` on the provider chosen by measurement for its shape class: torch's fused
    flash-attention CPU kernel, two batched GEMMs (MKL) around a softmax (q and k heads equal
    only), or yirage's kernel (float32, v's head dim equal to q's). q, k, v and ``out`` may be
    strided views (the executor's layout aliases, ``strided_io``): the measurement uses tensors
    with the same strides."""
    q, k, v = args[:3]
    mask = args[3] if len(args) == 4 else None
    causal, scale = node.attrs["causal"], node.attrs["scale"]
    B, H, S, D = q.shape
    cands = {"flash": _sdpa_flash}
    if k.shape[1] == H:
        cands["gemm"] = _sdpa_gemm
    if q.dtype == torch.float32 and v.shape[3] == D and all(map(_rows_contiguous, (q, k, v, out))) and (
            mask is None or mask.stride(-1) == 1):
        cands["yirage"] = _sdpa_yirage
    strided = not all(t.is_contiguous() for t in (q, k, v, out))
    key = tuning.shape_class("sdpa", f"{q.dtype}".removeprefix("torch.") + ("/mask" if mask is not None else "")
                             + ("/causal" if causal else "") + ("/strided" if strided else ""),
                             B * H * S, k.shape[2], D, torch.get_num_threads())

    def like(t, fill):   # a tensor of t's shape and strides, in storage of its own
        return fill(_span(t), dtype=t.dtype).as_strided(t.shape, t.stride())

    def factory(bind):
        def make():   # random inputs of the class (the plan's buffers hold garbage at bind time)
            xs = [like(t, torch.randn) for t in (q, k, v)]
            m = torch.zeros(mask.shape, dtype=mask.dtype) if mask is not None else None
            return bind(*xs, m, like(out, torch.empty), causal, scale)
        return make
    choice = tuning.choose(key, {n: factory(b) for n, b in cands.items()}, "flash")
    thunk = cands[choice.provider](q, k, v, mask, out, causal, scale)
    thunk.provider = f"{choice.provider} ({choice.source})"
    return thunk


def _attention_bidir(node, graph, args, out, status):
    """Encoder attention with a key-padding mask: torch's fused scaled_dot_product_attention
    (flash-attention CPU kernel) over views of the packed qkv, written into ``out``."""
    qkv, mask = args
    B, S, three_hd = qkv.shape
    h = node.attrs["num_heads"]
    dh = three_hd // (3 * h)
    q, k, v = qkv.view(B, S, 3, h, dh).permute(2, 0, 3, 1, 4)  # [B, H, S, Dh] views
    bias = mask.view(B, 1, 1, S)
    o4 = out.view(B, S, h, dh)
    scale = node.attrs["scale"]

    def run():
        o4.copy_(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
                 .transpose(1, 2))
    return run


def _argmax(node, graph, args, out, status):
    x = args[0]
    D = x.shape[-1]
    fn = library().yr_argmax
    p = (_ptr(x), _ptr(out), x.numel() // D, D)
    return lambda: fn(*p)


def _always(node, graph) -> bool:
    return True


def _allreduce(node, graph, args, out, status):
    """``out`` = the sum of ``x`` over the tensor-parallel group (``runtime.distributed.active()``:
    gloo; else torch.distributed's default group where one is initialized, as the op's reference),
    or a copy of ``x`` on one process. The group is looked up when the plan runs; DistributedError
    (naming this rank) when a peer of the active group died or timed out."""
    x = args[0]

    def run():
        out.copy_(x)
        distributed.all_reduce_(out)
    return run


#: op -> (supported?(node, graph), binder(node, graph, args, out, status))
OPS: dict[str, tuple[Callable, Callable]] = {
    "linear": (_linear_ok, _linear),
    "linear_stack": (_always, _linear_stack),
    "matmul": (_always, _matmul),
    "embedding": (_embedding_ok, _embedding),
    "rope": (_float32_first, _rope),
    "attention": (_float32_first, _attention),
    "rope_rows": (_float32_first, _rope_rows),
    "rotary_emb": (_always, _rotary_emb),   # float32, bfloat16, float16 (the op's rule)
    "attention_rows": (_float32_first, _attention_rows),
    "argmax": (_float32_first, _argmax),
    "allreduce": (_always, _allreduce),   # runtime/distributed.py: gloo
    "customized": (customized_ok, bind_customized),  # threadblock graphs (threadblock.py)
    "attention_bidir": (_float32_first, _attention_bidir),
    "sdpa": (_always, _sdpa),
    "attention_varlen": (_float32_first, embed.bind_attention_varlen),  # kernels/cpu/embed_kernels.h
    "linear_w8a8": (_float32_first, _linear_w8a8),
    **strided.OPS,  # reductions and softmax over a non-last dim (kernels/cpu/strided.cpp)
    **conv.OPS,     # conv2d (oneDNN), pooling and batch_norm (kernels/cpu/conv.cpp)
    **indexing.OPS,  # index_select, gather (kernels/cpu/indexing.cpp)
}


# ---- task forms for the persistent kernel (runtime/task_graph.py) -------------------------
# Each returns a list of TaskOp stages (library.cpp yr_task_*) with the work cut for
# ``num_workers`` workers, or None for the cases that only have a launch above.
_TASK_BYTES = 32 * 1024   # weight bytes per GEMV task at least (a task costs ~1 us to hand out)
_GEMV_ROWS = 8            # library.cpp GEMV_ROWS (8 with AVX-512, 4 otherwise): slices are whole row groups


def _fn(name: str) -> int:
    return ctypes.cast(getattr(library(), name), ctypes.c_void_p).value


def _float_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


@functools.lru_cache(maxsize=1)
def _task_linear_rows() -> tuple[int, int]:
    """(q4_1 / q8_0, every other weight format): the most x rows for which a linear's task form
    computes as its launch does (library.cpp ``yr_linear_task_rows``)."""
    out = torch.zeros(2, dtype=torch.int64)
    library().yr_linear_task_rows(out.data_ptr())
    return int(out[0]), int(out[1])


@functools.lru_cache(maxsize=1)
def row_groups_native() -> bool:
    """Whether this machine's library has the vector kernels of the row-group layouts
    (kernels/cpu/row_groups.h: AVX-512 with VNNI); elsewhere they run as scalar loops."""
    out = torch.zeros(1, dtype=torch.int64)
    library().yr_row_groups_native(out.data_ptr())
    return bool(out[0])


def simd_bits() -> int:
    """The widest SIMD path this machine's kernel library was built with: 512 (AVX-512), 256
    (AVX2/FMA/F16C), 128 (Arm NEON) or 0 (scalar); ``YIRAGE_ISA`` lowers it (toolchain flags)."""
    out = torch.zeros(1, dtype=torch.int64)
    library().yr_simd_bits(out.data_ptr())
    return int(out[0])


def to_row_groups(w: torch.Tensor, dtype: DType) -> torch.Tensor:
    """``ir.ops.to_row_groups`` (its reference) in one pass of C++ (``yr_repack_<layout>``): a
    model's weights load ~10x faster. Raises ValueError as it does."""
    N, nbytes = w.shape
    block = dtype.block[1] if dtype in ROW_GROUP_TYPES else 0
    if (not block or w.dtype != torch.uint8 or N % ROW_GROUP or nbytes % block or not w.is_contiguous()
            or w.device.type != "cpu"):
        raise ValueError(f"to_row_groups takes contiguous q4_1 or q8_0 storage [N, K/32 * block bytes] uint8 on "
                         f"the CPU with N a multiple of {ROW_GROUP}, got {tuple(w.shape)} {w.dtype} as {dtype.value}")
    out = torch.empty_like(w)
    getattr(library(), f"yr_repack_{ROW_GROUP_TYPES[dtype].value}")(w.data_ptr(), out.data_ptr(), N, nbytes // block)
    return out


def _linear_task(node, graph, args, out, status, num_workers):
    x, w = args[0], args[1]
    bias = args[2] if len(args) == 3 else None
    wt = graph.tensors[node.inputs[1]]
    compute = node.attrs.get("compute_dtype")
    if (x.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32)
            or node.attrs.get("weight_layout", "nk") != "nk" or compute not in (None, "int8")):
        return None
    N, K = wt.shape
    M = x.numel() // K
    if compute == "int8":   # x quantized once, by an op of its own (below)
        fn = f"yr_task_linear_{wt.dtype.value}_q8"
    elif wt.dtype.is_quantized:
        if wt.dtype not in _QUANT:
            return None
        fn = f"yr_task_linear_{wt.dtype.value}"
    elif wt.dtype == DType.float32:
        fn = "yr_task_linear_f32"
    else:
        return None
    if compute is None and M > _task_linear_rows()[0 if wt.dtype in (DType.q4_1, DType.q8_0, *PLAIN_TYPES) else 1]:
        return None   # launched: its packed GEMM beats a GEMV per row
    if compute is None and wt.dtype.is_quantized and M >= providers.VENDOR_QUANT_MIN_M:
        # a vendor GEMM competes for this shape class: tasks only where yirage's kernel won
        # (the launch would run the same row tiles); else the launch with the measured winner
        case = providers.case_of("linear", list(args), out, quant=(wt.dtype.value, N, K))
        if case is None or providers.choose(case, list(args))[0].name != "yirage":
            return None
    tasks = min(4 * num_workers, max(1, w.numel() * w.element_size() // _TASK_BYTES))
    ranges = split_range(N, tasks, ROW_GROUP if wt.dtype in PLAIN_TYPES else _GEMV_ROWS)
    # a task's GEMV prefetches on into the slice num_workers on (library.cpp YR_TASK_GROUPS), the
    # one its worker likely takes next
    stride = num_workers * (ranges[0][1] - ranges[0][0]) if len(ranges) > num_workers else 0
    quantize = []
    if compute == "int8":
        quantize = _quantize_rows_task(x, M, K, num_workers)
        if quantize is None:
            return None
        x, quantize = quantize.keep[0], [quantize]
    # One token (a GEMV): each task writes y[lo:hi] only, so it may be redone elsewhere.
    return [*quantize, task_op(f"linear {wt.dtype.value} {N}x{K}", _fn(fn),
                               (x.data_ptr(), w.data_ptr(), _ptr(bias) or 0, out.data_ptr(), M, N, K, stride),
                               ranges, redo_arg=3 if M == 1 else -1, elem=4, keep=[x] if quantize else [])]


def _quantize_rows_task(x: torch.Tensor, M: int, K: int, num_workers: int) -> TaskOp | None:
    """The op that quantizes x [M, K] float32 per block of 32 (``compute_dtype='int8'``) into a
    buffer of its own (``keep[0]``, uint8) that the int8 linear's tasks read: once per linear,
    where each task had quantized all of x (12-15% of a 16-row int8 step on 2 cores). None for
    sizes the buffer cannot hold (K not a multiple of 32: the IR refuses those)."""
    nbytes = torch.zeros(1, dtype=torch.int64)
    library().yr_quantized_rows_bytes(M, K, nbytes.data_ptr())
    if nbytes[0] <= 0:
        return None
    buf = torch.empty(int(nbytes[0]), dtype=torch.uint8)
    blocks = M * K // 32
    return task_op(f"quantize rows {M}x{K}", _fn("yr_task_quantize_rows_q8"), (x.data_ptr(), buf.data_ptr(), M, K),
                   split_range(blocks, num_workers if blocks >= 256 else 1), keep=[buf])


def _embedding_task(node, graph, args, out, status, num_workers):
    ids, table = args
    tt = graph.tensors[node.inputs[1]]
    fmt = {DType.float32: 0, DType.q8_0: 1, DType.q4_1: 2}.get(tt.dtype)
    symbol = "yr_task_embedding"
    if fmt is None and tt.dtype in _QUANT:   # ggml_quants.h: one entry per format (fmt unused)
        fmt, symbol = 0, f"yr_task_embedding_{tt.dtype.value}"
    if fmt is None or out.dtype != torch.float32:
        return None
    T, (V, D) = ids.numel(), tt.shape
    return [task_op("embedding", _fn(symbol),
                    (ids.data_ptr(), table.data_ptr(), out.data_ptr(), T, D, V, _ptr(status), fmt),
                    split_range(T, num_workers if T * D >= 65536 else 1))]


def _rope_task(node, graph, args, out, status, num_workers):
    """yr_task_rope (``rope``: one start position) or yr_task_rope_rows (``rope_rows``: a
    position per row, continuous batching's step), both with the argument block {x, cos, sin,
    positions, out, T, H, Dh, S, status} and (row, head) pairs sliced over the workers."""
    x, cos, sin, pos = args
    if x.dtype != torch.float32:
        return None
    T, H, Dh = x.shape
    return [task_op(node.op.replace("_", " "), _fn(f"yr_task_{node.op}"),
                    (x.data_ptr(), cos.data_ptr(), sin.data_ptr(), pos.data_ptr(), out.data_ptr(), T, H, Dh,
                     cos.shape[0], _ptr(status)),
                    split_range(T * H, num_workers if T * H * Dh >= 65536 else 1))]


def _attention_task(node, graph, args, out, status, num_workers):
    """Flash-decoding (Dao et al. 2023): the keys of each KV head are cut into ``splits``
    slices, each a task computing a partial softmax for the head's query group; a second op
    merges the slices. Splits are sized for the longest range of keys a step can attend (the
    cache's length, or ``window + T - 1`` keys with a sliding window: only those are split and
    read) at >= 256 keys each, and so that every worker gets about 4 tasks (the same number each
    where splits of >= 64 keys allow it)."""
    q, k, v, kc, vc, pos = args
    if q.dtype != torch.float32:
        return None
    T, Hq, Dh = q.shape
    Hkv, S = k.shape[1], kc.shape[0]
    window = node.attrs.get("window", 0)
    keys = min(S, window + T - 1) if window else S
    splits = max(1, min(-(-keys // 256), -(-4 * num_workers // Hkv)))
    # a multiple of the workers in all (while splits keep >= 64 keys): 9 tasks on 2 workers left
    # one worker a whole task behind at every layer's combine (Hkv = 3; 1.02x at 785 tokens)
    while (Hkv * splits) % num_workers and splits < keys // 64:
        splits += 1
    part = torch.empty((T, Hq, splits, Dh + 2), dtype=torch.float32)
    kv = _kv_suffix(kc)
    append = task_op("attention append", _fn("yr_task_attention_append" + kv),
                     (k.data_ptr(), v.data_ptr(), kc.data_ptr(), vc.data_ptr(), pos.data_ptr(), T, Hkv, Dh, S,
                      _ptr(status)), [(0, 1)])
    partial = task_op(f"attention {Hkv} kv heads x {splits} splits", _fn("yr_task_attention_partial" + kv),
                      (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), pos.data_ptr(), part.data_ptr(), T, Hq, Hkv,
                       Dh, S, _float_bits(node.attrs["scale"]), splits, window),
                      [(i, i + 1) for i in range(Hkv * splits)], keep=[part])
    combine = task_op("attention combine", _fn("yr_task_attention_combine"),
                      (part.data_ptr(), out.data_ptr(), T, Hq, Dh, splits),
                      split_range(T * Hq, num_workers if T * Hq * splits * Dh >= 65536 else 1), keep=[part])
    return [append, partial, combine]


def _attention_rows_task(node, graph, args, out, status, num_workers):
    """yr_attention_rows as two ops: one task checks the slots and positions and writes the
    rows' k, v into their slots; then (row, KV head) pairs, each with its group's query heads,
    sliced over the workers, each computed as yr_attention_rows computes it (the same results)."""
    q, k, v, kc, vc, slots, pos = args
    if q.dtype != torch.float32:
        return None
    T, Hq, Dh = q.shape
    Hkv, (num_slots, max_seq) = k.shape[1], kc.shape[:2]
    kv = _kv_suffix(kc)
    append = task_op("attention rows append", _fn("yr_task_attention_rows_append" + kv),
                     (k.data_ptr(), v.data_ptr(), kc.data_ptr(), vc.data_ptr(), slots.data_ptr(), pos.data_ptr(),
                      T, Hkv, Dh, num_slots, max_seq, _ptr(status)), [(0, 1)])
    attend = task_op(f"attention rows {T}x{Hq}", _fn("yr_task_attention_rows" + kv),
                     (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), slots.data_ptr(), pos.data_ptr(), out.data_ptr(),
                      T, Hq, Hkv, Dh, num_slots, max_seq, _float_bits(node.attrs["scale"]),
                      node.attrs.get("window", 0)),
                     split_range(T * Hkv, 4 * num_workers))
    return [append, attend]


def _argmax_task(node, graph, args, out, status, num_workers):
    x = args[0]
    if x.dtype != torch.float32:
        return None
    D = x.shape[-1]
    R = x.numel() // D
    chunks = max(1, min(4 * num_workers, D // 4096))
    vals = torch.empty(R * chunks, dtype=torch.float32)
    idx = torch.empty(R * chunks, dtype=torch.int64)
    partial = task_op("argmax partial", _fn("yr_task_argmax_partial"),
                      (x.data_ptr(), vals.data_ptr(), idx.data_ptr(), R, D, chunks),
                      [(i, i + 1) for i in range(R * chunks)], keep=[vals, idx])
    reduce = task_op("argmax reduce", _fn("yr_task_argmax_reduce"),
                     (vals.data_ptr(), idx.data_ptr(), out.data_ptr(), chunks), [(0, R)], keep=[vals, idx])
    return [partial, reduce]


#: op -> task binder(node, graph, args, out, status, num_workers) -> list[TaskOp] | None
TASKS: dict[str, Callable] = {
    "linear": _linear_task,
    "embedding": _embedding_task,
    "rope": _rope_task,
    "rope_rows": _rope_task,
    "attention": _attention_task,
    "attention_rows": _attention_rows_task,
    "argmax": _argmax_task,
}
