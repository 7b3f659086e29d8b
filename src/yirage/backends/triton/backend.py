"""The Triton half of the backend contract, shared by CUDA, ROCm, XPU and Triton's interpreter.

Fused row kernels are rendered by codegen/triton.py and loaded by runtime/triton_kernels.py
(Triton's JIT compiles and caches them); library ops run the hand-written Triton kernels
of ``yirage/kernels/triton``: linear (float or q4_1/q8_0 blocks), batched matmul,
embedding, RoPE, attention (flash-decoding for T == 1, FlashAttention for prefill),
argmax, the W8A8 int8 linear layer (``linear_w8a8``), packed-sentence bidirectional
attention (``attention_varlen``), and the conv-net ops conv2d (implicit GEMM, direct
depthwise) and max/avg pooling. One source serves every Triton
target; a subclass only says how to find its device.

``TritonInterpreterBackend`` ('triton-interpret') runs the same kernels on CPU tensors
with Triton's interpreter (numpy, one program instance at a time). It exists to test
kernels on machines without a GPU: it is available only when ``TRITON_INTERPRET=1`` was
set before Python started, it is slow, and 'auto' never picks it.

This module must never run a kernel on a device it did not check, and never fall back to
another backend: an op without a Triton kernel is reported by ``supports`` and the
executor runs its torch reference on the same device.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

from ...dtypes import DType
from ...transforms.parallel import linear_stack_parts
from ..strided_views import contiguous_strides, copies, mid_view, reduced_dims
from ..base import (Backend, BackendImpl, BackendInfo, Kernel, MemoryInfo, Thunk, bind_conv2d_stack_parts,
                   bind_linear_stack_parts)
from .threadblock import bind_customized, customized_ok


@functools.lru_cache(maxsize=1)
def triton_missing_reason() -> str | None:
    """Why Triton cannot be imported here, or None when it can."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"the 'triton' package is not importable ({error}); install it with 'pip install triton'"
    return None


def _lib():
    """The Triton library kernels (imported on first bind: importing decorates the kernels,
    which reads TRITON_INTERPRET)."""
    from ...kernels import triton as lib
    return lib


_QUANT = (DType.q4_1, DType.q8_0)


def _types(node, graph):
    return [graph.tensors[i] for i in node.inputs]


def _linear_ok(node, graph) -> bool:
    """Float x with a same-dtype or q4_1/q8_0 weight; not ``compute_dtype='bfloat16'`` (a CPU
    prefill option: it runs as the op's torch reference here)."""
    x, w = _types(node, graph)[:2]
    return x.dtype.is_float and (w.dtype in _QUANT or w.dtype == x.dtype) and not node.attrs.get("compute_dtype")


def _embedding_ok(node, graph) -> bool:
    table = _types(node, graph)[1]
    return table.dtype in _QUANT or table.dtype.is_float


def _float_first(node, graph) -> bool:
    return _types(node, graph)[0].dtype.is_float


def _linear(node, graph, args, out, status):
    x, w = args[0], args[1]
    bias = args[2] if len(args) == 3 else None
    if node.attrs.get("weight_layout") == "kn":   # x @ w: the matmul kernel, then the bias
        K, N = w.shape
        x2, o2, mm = x.reshape(-1, K), out.view(-1, N), _lib().matmul
        if bias is None:
            return lambda: mm(x2, w, o2)

        def run():
            mm(x2, w, o2)
            o2.add_(bias)
        return run
    w_type = graph.tensors[node.inputs[1]].dtype
    kind = w_type.value if w_type.is_quantized else "float"
    fn = _lib().linear
    return lambda: fn(x, w, bias, out, kind)


def _linear_stack_ok(node, graph) -> bool:
    return all(_linear_ok(part, graph) for part, _ in linear_stack_parts(node))


def _linear_stack(node, graph, args, out, status):
    """``linear_stack``: each part as the ``linear`` it stands for, into its output plane."""
    return bind_linear_stack_parts(node, graph, args, out, status, _linear)


def _matmul(node, graph, args, out, status):
    a, b = args
    fn = _lib().matmul
    return lambda: fn(a, b, out)


def _embedding(node, graph, args, out, status):
    ids, table = args
    t = graph.tensors[node.inputs[1]].dtype
    kind = t.value if t.is_quantized else "float"
    fn = _lib().embedding
    return lambda: fn(ids, table, out, kind, status=status)


def _rope(node, graph, args, out, status):
    x, cos, sin, pos = args
    fn = _lib().rope
    return lambda: fn(x, cos, sin, pos, out, status=status)


def _rotary_emb(node, graph, args, out, status):
    """rotary_emb (kernels/triton/rope.py): x may be a strided view (``strided_io``)."""
    x, cos, sin = args
    fn = _lib().rotary_emb
    return lambda: fn(x, cos, sin, out)


def _attention_rows(node, graph, args, out, status):
    """attention_rows: each row over its own KV-cache slot (kernels/triton/attention_rows.py)."""
    q, k, v, kc, vc, slots, pos = args
    fn, scale, window = _lib().attention_rows, node.attrs["scale"], node.attrs.get("window", 0)
    return lambda: fn(q, k, v, kc, vc, slots, pos, out, scale, window, status=status)


def _rope_rows(node, graph, args, out, status):
    x, cos, sin, pos = args
    fn = _lib().rope_rows
    return lambda: fn(x, cos, sin, pos, out, status=status)


def _attention(node, graph, args, out, status):
    q, k, v, kc, vc, pos = args
    lib = _lib()
    workspace = lib.attention_workspace(q, kc) if q.shape[0] == 1 else None  # made once, here
    fn, scale, window = lib.attention, node.attrs["scale"], node.attrs.get("window", 0)
    return lambda: fn(q, k, v, kc, vc, pos, out, scale, workspace, status=status, window=window)


def _linear_w8a8_ok(node, graph) -> bool:
    ts = _types(node, graph)
    x, w = ts[0], ts[1]
    if x.dtype != DType.float32 or w.dtype != DType.int8 or len(w.shape) != 2 or len(ts) not in (3, 4):
        return False
    K, N = w.shape
    G = node.attrs.get("group_size", 0)
    return (x.shape[-1] == K and all(t.dtype == DType.float32 and tuple(t.shape) == (N,) for t in ts[2:])
            and isinstance(G, int) and G >= 0 and (G == 0 or K % G == 0))


def _linear_w8a8(node, graph, args, out, status):
    x, w_t, w_scale = args[0], args[1], args[2]
    bias = args[3] if len(args) == 4 else None
    lib = _lib()
    workspace = lib.linear_w8a8_workspace(x, node.attrs.get("group_size", 0))  # made once, here
    fn = lib.linear_w8a8
    return lambda: fn(x, w_t, w_scale, bias, out, workspace)


def _attention_varlen(node, graph, args, out, status):
    qkv, offsets = args
    fn, h, scale = _lib().attention_varlen, node.attrs["num_heads"], node.attrs["scale"]
    # offsets checked on the device into the executor's status slot: no host sync, capturable
    return lambda: fn(qkv, offsets, out, h, scale, status=status, check_offsets=False)


def _argmax(node, graph, args, out, status):
    x = args[0]
    x2, o1 = x.reshape(-1, x.shape[-1]), out.reshape(-1)
    fn = _lib().argmax
    return lambda: fn(x2, o1)


def _reduce_mid(node, graph, args, out, status):
    """reduction/sum/mean/amax/amin/var over non-trailing dims (kernels/triton/strided.py)."""
    outer, n, inner = mid_view(graph.tensors[node.inputs[0]].shape, reduced_dims(node, graph))
    fn, x, corr = _lib().reduce_mid, args[0], float(node.attrs.get("correction", 0.0))
    return lambda: fn(x, out, outer, n, inner, node.op, corr)


def _softmax_mid(node, graph, args, out, status):
    """softmax/log_softmax over a non-last dim (kernels/triton/strided.py)."""
    outer, n, inner = mid_view(graph.tensors[node.inputs[0]].shape, reduced_dims(node, graph))
    fn, x, log = _lib().softmax_mid, args[0], node.op == "log_softmax"
    return lambda: fn(x, out, outer, n, inner, log)


def _sdpa(node, graph, args, out, status):
    """sdpa: FlashAttention forward with the mask, causal and GQA (kernels/triton/sdpa.py)."""
    q, k, v = args[:3]
    mask = args[3] if len(args) == 4 else None
    fn, causal, scale = _lib().sdpa, node.attrs["causal"], node.attrs["scale"]
    return lambda: fn(q, k, v, mask, out, causal, scale)


def _sdpa_ok(node, graph) -> bool:
    q, _, v = _types(node, graph)[:3]
    return q.dtype.is_float and v.shape[3] == q.shape[3]


def _cumsum(node, graph, args, out, status):
    """cumsum along any dim (kernels/triton/strided.py)."""
    outer, n, inner = mid_view(graph.tensors[node.inputs[0]].shape, [node.attrs["dim"]])
    fn, x = _lib().cumsum_mid, args[0]
    return lambda: fn(x, out, outer, n, inner)


def _layout(node, graph, args, out, status):
    """permute, expand, slice, select, cat: strided copies (strided_views.copies; strided.py),
    their metadata made once here."""
    lib, calls = _lib(), []
    for c in copies(node, graph):
        meta = lib.strided_copy_meta(c.sizes, c.src_strides, c.dst_strides, out.device)
        total = 1
        for n in c.sizes:
            total *= n
        idx32 = lib.fits_int32(c.sizes, c.src_strides, c.dst_strides, c.src_offset, c.dst_offset)
        calls.append((args[c.input], meta, total, c.src_offset, c.dst_offset, idx32))
    fn = lib.strided_copy
    fill = node.attrs["value"] if node.op == "pad" else None   # pad: the borders (a fill first)

    def run():
        if fill is not None:
            out.fill_(fill)
        for src, meta, total, so, do, idx32 in calls:
            fn(src, out, meta, total, so, do, idx32)
    return run


def _index_copy(node, graph, args, out, status):
    """index_select, gather (kernels/triton/indexing.py): every index checked on the device into
    the executor's status slot; the metadata made once here."""
    x, index = args
    lib, dim = _lib(), node.attrs["dim"]
    meta = lib.index_copy_meta(out.shape, contiguous_strides(x.shape), out.device)
    fn, gather = lib.index_copy, node.op == "gather"
    return lambda: fn(x, index, out, meta, dim, gather, status=status)


def _index_ok(node, graph) -> bool:
    return len(graph.tensors[node.inputs[0]].shape) <= 8


def _always(node, graph) -> bool:
    return True


def _conv2d(node, graph, args, out, status):
    """conv2d with its epilogue (kernels/triton/conv.py): the implicit GEMM, or the direct
    depthwise kernel; a folded BatchNorm runs as the epilogue's per-channel scale and shift,
    computed from the statistics when they change (``BatchNormFold``)."""
    from ...ir.conv import conv_inputs
    from .providers import BatchNormFold
    a = node.attrs
    c = conv_inputs(list(args), a)
    fn, bn = _lib().conv2d, BatchNormFold.of(c, a)
    geometry = (list(a["stride"]), list(a["padding"]), list(a["dilation"]), a["groups"])
    act, act_args, nhwc = a.get("activation"), a.get("act_args") or (0.0, 0.0), a.get("layout") == "nhwc"

    def run():
        scale, shift = bn.scale_shift() if bn else (None, None)
        fn(c.x, c.weight, c.bias, out, *geometry, scale, shift, c.residual, act, act_args, nhwc)
    return run


def _conv2d_stack(node, graph, args, out, status):
    """``conv2d_stack``: each part as the ``conv2d`` it stands for, into its view of ``out``."""
    return bind_conv2d_stack_parts(node, graph, args, out, status, _conv2d)


def _pool(node, graph, args, out, status):
    """max_pool2d / avg_pool2d (kernels/triton/conv.py)."""
    a, fn = node.attrs, _lib().pool2d
    is_max, nhwc = node.op == "max_pool2d", a.get("layout") == "nhwc"
    dilation = list(a.get("dilation", (1, 1)))
    count = bool(a.get("count_include_pad", True))
    return lambda: fn(args[0], out, list(a["kernel"]), list(a["stride"]), list(a["padding"]), dilation, is_max,
                      count, nhwc)


#: op -> (supported?(node, graph), binder(node, graph, args, out, status) -> thunk)
OPS: dict[str, tuple[Callable, Callable]] = {
    "linear": (_linear_ok, _linear),
    "linear_stack": (_linear_stack_ok, _linear_stack),
    "matmul": (_float_first, _matmul),
    "embedding": (_embedding_ok, _embedding),
    "rope": (_float_first, _rope),
    "rope_rows": (_float_first, _rope_rows),
    "rotary_emb": (_float_first, _rotary_emb),
    "attention_rows": (_float_first, _attention_rows),
    "attention": (_float_first, _attention),
    "attention_varlen": (_float_first, _attention_varlen),  # kernels/triton/attention_varlen.py
    "argmax": (_float_first, _argmax),
    "linear_w8a8": (_linear_w8a8_ok, _linear_w8a8),
    "customized": (customized_ok, bind_customized),  # threadblock graphs (threadblock.py)
    **{op: (_float_first, _reduce_mid) for op in ("reduction", "sum", "mean", "amax", "amin", "var")},
    "softmax": (_float_first, _softmax_mid),
    "cumsum": (_always, _cumsum),
    "sdpa": (_sdpa_ok, _sdpa),
    "log_softmax": (_float_first, _softmax_mid),
    **{op: (_always, _layout) for op in ("permute", "expand", "slice", "select", "cat", "pad")},
    "conv2d": (_float_first, _conv2d),   # kernels/triton/conv.py
    "conv2d_stack": (_float_first, _conv2d_stack),
    "max_pool2d": (_float_first, _pool),
    "avg_pool2d": (_float_first, _pool),
    "index_select": (_index_ok, _index_copy),  # kernels/triton/indexing.py
    "gather": (_index_ok, _index_copy),
}


class TritonBackend(BackendImpl):
    """Shared implementation for every backend whose kernels are Triton programs."""

    codegen = "triton"

    def supports(self, node, graph) -> bool:
        """Library ops with a Triton kernel: see ``OPS``."""
        entry = OPS.get(node.op)
        return entry is not None and entry[0](node, graph)

    def strided_io(self, node, graph) -> bool:
        """RoPE (``rotary_emb``, kernels/triton/rope.py) and attention (``sdpa``, sdpa.py) read
        (and attention writes) heads through their strides."""
        return node.op in ("rotary_emb", "sdpa") and self.supports(node, graph)

    def compile(self, kernels: list) -> list[Kernel]:
        """Fused kernels as Triton (codegen/triton.py), compiled by Triton's JIT on first launch."""
        from ...runtime.triton_kernels import compile_triton
        return compile_triton(kernels)

    #: choose between the Triton kernel and torch's own op by measurement (providers.py);
    #: off for the interpreter, which exists to test the Triton kernels
    measures_vendor = True

    def bind_library_op(self, node, graph, args, out, status=None) -> Thunk:
        """The Triton library kernel for ``node`` (yirage/kernels/triton), or for ``linear``,
        ``matmul``, ``conv2d``, ``sdpa`` and the layout ops the faster of it and torch's op
        (cuBLAS, cuDNN, ...) for the shape class, measured (``providers``)."""
        bind = OPS[node.op][1]
        if not self.measures_vendor:
            return bind(node, graph, args, out, status)
        from . import providers
        if node.op == "linear_stack":   # each part chooses as the linear it stands for
            def bind_part(n, g, a, o, s):
                return providers.bind(n, g, a, o, s, _linear, self.synchronize)
            return bind_linear_stack_parts(node, graph, args, out, status, bind_part)
        if node.op == "conv2d_stack":   # each part chooses as the conv2d it stands for
            def bind_conv(n, g, a, o, s):
                return providers.bind(n, g, a, o, s, _conv2d, self.synchronize)
            return bind_conv2d_stack_parts(node, graph, args, out, status, bind_conv)
        return providers.bind(node, graph, args, out, status, bind, self.synchronize)

    def bind_customized_group(self, nodes, graph, args, outs):
        """All outputs of one block graph as one Triton kernel (threadblock.py)."""
        from .threadblock import bind_customized_group
        return bind_customized_group(nodes, graph, args, outs)


class TritonInterpreterBackend(TritonBackend):
    """Triton kernels on CPU tensors under Triton's interpreter ('triton-interpret').

    For testing kernels without a GPU; slow. Available when ``TRITON_INTERPRET=1`` is set
    (before Python starts, since Triton reads it when kernels are decorated).
    """

    name = Backend.TRITON_INTERPRET
    device_type = "cpu"
    measures_vendor = False

    def unavailable_reason(self) -> str | None:
        # the environment first: importing Triton costs ~0.3 s that a CPU-only 'auto' must not pay
        if os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("1", "true", "yes", "on", "y"):
            return ("TRITON_INTERPRET=1 is not set (set it before starting Python to run Triton "
                    "kernels on the CPU with Triton's interpreter; for testing, slow)")
        missing = triton_missing_reason()
        if missing:
            return missing
        import triton
        if not triton.knobs.runtime.interpret:
            return ("TRITON_INTERPRET=1 is not set (set it before starting Python to run Triton "
                    "kernels on the CPU with Triton's interpreter; for testing, slow)")
        return None

    def _device_info(self) -> BackendInfo:
        from ..cpu import cpu_model_name, usable_cpu_count, system_memory
        import triton
        return BackendInfo(
            name=self.name, available=True, device_name=f"Triton interpreter on {cpu_model_name()}",
            compute_units=usable_cpu_count(), memory_total_bytes=system_memory().total_bytes,
            versions={**self.versions(), "triton": triton.__version__},
        )

    def _device_memory_info(self) -> MemoryInfo:
        from ..cpu import system_memory
        return system_memory()
