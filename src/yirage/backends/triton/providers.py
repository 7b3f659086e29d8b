"""Kernel choice on the GPU backends: yirage's Triton kernel or torch's own op, by measurement.

The Triton backends have their own kernel for every library op (``backends/triton/backend.py``). For
the GEMMs, convolutions, attention and layout copies the GPU's vendor libraries, reached
through torch, are candidates too, and the faster of the two per shape class runs, as the CPU
chooses among its providers (``cpu/providers.py``, ``cpu/conv.py``):

| op        | ``yirage`` (kernels/triton)                 | ``torch`` (the vendor library through torch)  |
|-----------|---------------------------------------------|-----------------------------------------------|
| ``linear``  | GEMV / tiled GEMM (``linear.py``, ``matmul.py`` for [K, N] weights) | ``torch.addmm`` (cuBLASLt, hipBLASLt), or ``torch.mm`` then the bias (``torch-mm``) |
| ``matmul``  | batched tiled GEMM (``matmul.py``)          | ``torch.matmul`` (cuBLAS, hipBLAS)            |
| ``conv2d``  | implicit GEMM / direct depthwise with the fused epilogue (``conv.py``) | ``aten.convolution.out`` (cuDNN, MIOpen) with the BatchNorm folded in, then the residual and activation in place |
| ``sdpa``    | FlashAttention forward (``sdpa.py``)        | ``F.scaled_dot_product_attention`` (flash / memory-efficient / cuDNN attention) |
| layout ops (``permute``, ``expand``, ``slice``, ``select``, ``cat``, ``pad``) | strided copies (``strided.py``) | ``Tensor.copy_`` between strided views |

Only float weights of x's dtype have a ``torch`` candidate for ``linear`` (q4_1/q8_0 blocks and
``compute_dtype`` stay yirage's). Both compute what the op's reference computes, up to the
order of the sums; ``torch``'s float32 GEMMs and convolutions follow torch's own settings, as
eager does: ``torch.backends.cuda.matmul.allow_tf32`` is off by default (IEEE float32, like
yirage's kernels), ``torch.backends.cudnn.allow_tf32`` on (convolutions in TF32). ``torch``'s
``conv2d`` folds a BatchNorm into the weight and bias (``BatchNormFold``: once, and again only
when the statistics or weights are written; it keeps that folded copy of the weight while the
plan lives), so cuDNN's convolution adds the bias itself.

The shape class is ``tuning.shape_class`` with the GPU's name in the dtype field
(``linear|NVIDIA-H100-80GB-HBM3/float32|m1024|n768|k768|t0``): a choice is never read on
another GPU, and the profile file is already per host and library versions (``tuning``). Each
candidate is timed on random activations of the class and the real weights, with the device
synchronized after every sample. ``YIRAGE_TUNE=off`` gives ``yirage``. Triton's interpreter
('triton-interpret') does not measure: it exists to test the Triton kernels, so they always run
there; tests reach this module's providers through ``bind_provider``.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ...ir.conv import ACTIVATIONS_INPLACE, bn_scale_shift, conv_class, conv_inputs
from ...ir.ops import OPS, linear_nk
from ...tuning import profile as tuning
from ..strided_views import copies

#: the layout ops (strided copies)
LAYOUT_OPS = ("permute", "expand", "slice", "select", "cat", "pad")
#: the ops with a ``torch`` candidate
VENDOR_OPS = ("linear", "matmul", "conv2d", "sdpa", *LAYOUT_OPS)
#: the provider with YIRAGE_TUNE=off, and the only one where torch's does not apply
DEFAULT = "yirage"

Binder = Callable   # (node, graph, args, out, status) -> thunk


def vendor_applies(node, graph) -> bool:
    """Does ``node`` have a ``torch`` candidate? (``linear``: a float weight of x's dtype, no
    ``compute_dtype``.)"""
    if node.op not in VENDOR_OPS:
        return False
    if node.op == "linear":
        x, w = (graph.tensors[i] for i in node.inputs[:2])
        return x.dtype.is_float and w.dtype == x.dtype and not node.attrs.get("compute_dtype")
    return True


def _linear_torch(node, graph, args, out, status, split_bias: bool = False):
    """x @ W^T (+ bias) with ``torch.addmm`` (cuBLASLt's bias epilogue), or with ``split_bias``
    ``torch.mm`` then the bias added in place (cuBLAS's plain GEMM, whose kernel choice differs);
    W [N, K], or [K, N] (``kn``)."""
    x, w = args[0], args[1]
    bias = args[2] if len(args) == 3 else None
    kn = node.attrs.get("weight_layout") == "kn"
    N, K = linear_nk(w.shape, node.attrs)
    o2 = out.view(-1, N)
    x2 = x.view(-1, K) if x.is_contiguous() else None   # else reshaped at each call (reads x then)

    def run():
        xm = x2 if x2 is not None else x.reshape(-1, K)
        wt = w if kn else w.t()   # now: a weight whose storage was replaced is read where it is
        if bias is None or split_bias:
            torch.mm(xm, wt, out=o2)
            if bias is not None:
                o2.add_(bias)
        else:
            torch.addmm(bias, xm, wt, out=o2)
    return run


def _linear_torch_mm(node, graph, args, out, status):
    return _linear_torch(node, graph, args, out, status, split_bias=True)


def _matmul_torch(node, graph, args, out, status):
    a, b = args
    return lambda: torch.matmul(a, b, out=out)


def _reference_torch(node, graph, args, out, status):
    """The op's torch reference (``ir`` op table), copied into ``out``."""
    ref, attrs = OPS[node.op].reference, node.attrs
    return lambda: out.copy_(ref(args, attrs))


class BatchNormFold:
    """A convolution's inference BatchNorm (attr ``bn``) as a per-channel ``scale`` and
    ``shift`` (``ir.conv.bn_scale_shift``), or folded into the convolution's weight and bias
    (``folded``: ``w * scale``, ``bias * scale + shift``). Each is computed once and again only
    when a tensor it comes from is written (its version counter) or replaced (its storage), so
    frozen statistics cost nothing per call and writes stay visible; during a CUDA graph capture
    it is computed by the captured kernels themselves, so that replays read the tensors."""

    def __init__(self, c, eps: float):
        self.c, self.eps, self._ss, self._fold = c, eps, (None, None), (None, None)

    @classmethod
    def of(cls, c, attrs: dict) -> "BatchNormFold | None":
        """The fold of ``c`` (``ir.conv.ConvInputs``) if ``attrs`` has a BatchNorm, else None."""
        return cls(c, attrs["bn"]["eps"]) if attrs.get("bn") else None

    @staticmethod
    def _state(tensors) -> tuple:
        return tuple((t.data_ptr(), t._version) for t in tensors if t is not None)

    @staticmethod
    def _capturing(t: torch.Tensor) -> bool:
        return t.is_cuda and torch.cuda.is_current_stream_capturing()

    def scale_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift), float32 [O] each."""
        c = self.c
        stats = (c.mean, c.var, c.bn_weight, c.bn_bias)
        if self._capturing(c.mean):
            return bn_scale_shift(*stats, self.eps)
        key = self._state(stats)
        if self._ss[0] != key:
            self._ss = (key, bn_scale_shift(*stats, self.eps))
        return self._ss[1]

    def folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [O, C/groups, kh, kw], bias [O]) in the weight's dtype, the BatchNorm folded in."""
        c = self.c
        tensors = (c.weight, c.bias, c.mean, c.var, c.bn_weight, c.bn_bias)
        capturing = self._capturing(c.weight)
        key = None if capturing else self._state(tensors)
        if capturing or self._fold[0] != key:
            scale, shift = bn_scale_shift(c.mean, c.var, c.bn_weight, c.bn_bias, self.eps)
            w = (c.weight.float() * scale.view(-1, 1, 1, 1)).to(c.weight.dtype)
            b = shift if c.bias is None else c.bias.float() * scale + shift
            if capturing:
                return w, b.to(c.weight.dtype)
            self._fold = (key, (w, b.to(c.weight.dtype)))
        return self._fold[1]


def _conv_torch(node, graph, args, out, status):
    """torch's convolution (``aten.convolution.out``: cuDNN) into ``out`` with a BatchNorm folded
    into its weight and bias, then the residual and the activation in place (NHWC buffers as
    channels-last views)."""
    a = node.attrs
    c = conv_inputs(list(args), a)
    nhwc = a.get("layout", "nchw") == "nhwc"

    def nchw(t):
        return None if t is None else t.permute(0, 3, 1, 2) if nhwc else t
    x, y, r = nchw(c.x), nchw(out), nchw(c.residual)
    bn = BatchNormFold.of(c, a)
    conv, stride, padding, dilation = (torch.ops.aten.convolution.out, list(a["stride"]), list(a["padding"]),
                                       list(a["dilation"]))
    act, act_args = ACTIVATIONS_INPLACE.get(a.get("activation")), a.get("act_args") or []

    def run():
        w, b = bn.folded() if bn else (c.weight, c.bias)
        conv(x, w, b, stride, padding, dilation, False, [0, 0], a["groups"], out=y)
        if r is not None:
            y.add_(r)
        if act:
            act(y, act_args)
    return run


def _layout_torch(node, graph, args, out, status):
    """A layout op as ``Tensor.copy_`` between strided views of its input(s) and ``out`` (the
    copies of ``strided_views.copies``; pad's borders filled first)."""
    pairs = []
    for c in copies(node, graph):
        src = args[c.input]
        pairs.append((out.as_strided(c.sizes, c.dst_strides, out.storage_offset() + c.dst_offset),
                      src.as_strided(c.sizes, c.src_strides, src.storage_offset() + c.src_offset)))
    fill = node.attrs["value"] if node.op == "pad" else None

    def run():
        if fill is not None:
            out.fill_(fill)
        for dst, src in pairs:
            dst.copy_(src)
    return run


VENDOR: dict[str, Binder] = {"linear": _linear_torch, "matmul": _matmul_torch, "conv2d": _conv_torch,
                             "sdpa": _reference_torch, **{op: _layout_torch for op in LAYOUT_OPS}}


def _activations(node, args) -> list[int]:
    """Positions of the inputs that are activations (random in a measurement; the rest, the
    weights, stay real)."""
    if node.op == "linear":
        return [0]
    if node.op == "conv2d":
        c = conv_inputs(list(args), node.attrs)
        return [0] + ([len(args) - 1] if c.residual is not None else [])
    return list(range(len(args)))   # matmul's two operands; sdpa's q, k, v and mask


def _like(t: torch.Tensor, fill: bool) -> torch.Tensor:
    """A tensor with ``t``'s sizes, strides, dtype and device over storage of its own: uniform
    [0, 1) values (no denormals, no NaN) if ``fill``, else uninitialized."""
    span = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    base = torch.empty(span, dtype=t.dtype, device=t.device)
    if fill and span:
        base.uniform_() if t.is_floating_point() else base.zero_()
    return base.as_strided(t.shape, t.stride())


@functools.lru_cache(maxsize=None)
def _device_tag(device: str) -> str:
    """The GPU's name for shape classes ('NVIDIA-H100-80GB-HBM3'), or the device type."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev).replace(" ", "-")
    if dev.type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.xpu.get_device_name(dev).replace(" ", "-")
    return dev.type


def shape_key(node, graph, args, out) -> str:
    """The shape class ``node`` is measured and recorded under (see the module docstring):
    ``linear``: M x N x K, the weight layout and a bias; ``matmul``: the batch, M, N, K;
    ``conv2d``: N*Ho*Wo x O x (C/groups)*kh*kw with the kernel size, stride, groups, layout and
    residual; ``sdpa``: B*H*S x T x D with the head counts, mask and causality; layout ops: the
    output's elements x the inputs x the output's rank, with the op (and permute's dims)."""
    x = args[0]
    what = f"{_device_tag(str(x.device))}/{x.dtype}".replace("torch.", "")
    a = node.attrs
    if node.op in LAYOUT_OPS:
        what += f"/{node.op}" + ("/" + "".join(map(str, a["dims"])) if node.op == "permute" else "")
        return tuning.shape_class("layout", what, out.numel(), len(node.inputs), out.dim(), 0)
    if node.op == "linear":
        N, K = linear_nk(args[1].shape, a)
        what += ("/kn" if a.get("weight_layout") == "kn" else "") + ("/bias" if len(args) == 3 else "")
        return tuning.shape_class("linear", what, x.numel() // max(1, K), N, K, 0)
    if node.op == "matmul":
        M, K, N = x.shape[-2], x.shape[-1], args[1].shape[-1]
        return tuning.shape_class("matmul", f"{what}/b{out.numel() // max(1, M * N)}", M, N, K, 0)
    if node.op == "conv2d":
        c = conv_inputs(list(args), a)
        O, cg, kh, kw = c.weight.shape
        rows = out.numel() // max(1, O)
        what += conv_class(c, a) + ("/bn" if a.get("bn") else "")
        return tuning.shape_class("conv2d", what, rows, O, cg * kh * kw, 0)
    B, H, S, D = x.shape
    k = args[1]
    what += f"/h{H}-{k.shape[1]}" + ("/mask" if len(args) == 4 else "") + ("/causal" if a.get("causal") else "")
    return tuning.shape_class(node.op, what, B * H * S, k.shape[2], D, 0)


def providers(node, graph) -> tuple[str, ...]:
    """The candidate providers of ``node``: 'yirage', 'torch', and for a biased ``linear``
    'torch-mm' (the GEMM, then the bias: which is faster varies with the shape)."""
    if node.op == "linear" and len(node.inputs) == 3:
        return ("yirage", "torch", "torch-mm")
    return ("yirage", "torch")


def bind_provider(name: str, node, graph, args, out, status, bind_yirage: Binder):
    """The thunk of provider ``name`` (one of ``providers(node, graph)``: 'yirage' is
    ``bind_yirage``, the Triton kernel's binder; 'torch' and 'torch-mm' the vendor op) for
    ``node``. KeyError for another name."""
    if name not in providers(node, graph):
        raise KeyError(f"no provider {name!r} for this {node.op} on the Triton backends "
                       f"({', '.join(providers(node, graph))})")
    if name == "yirage":
        return bind_yirage(node, graph, args, out, status)
    if name == "torch-mm":
        return _linear_torch_mm(node, graph, args, out, status)
    return VENDOR[node.op](node, graph, args, out, status)


def bind(node, graph, args, out, status, bind_yirage: Binder, sync: Callable[[], None]):
    """The thunk for ``node`` on the provider chosen for its shape class (``tuning.choose``:
    the profile, a template, or a measurement now, each sample followed by ``sync``);
    ``thunk.provider`` says which and how it was chosen. Ops without a ``torch`` candidate get
    ``bind_yirage``'s thunk."""
    if not vendor_applies(node, graph):
        return bind_yirage(node, graph, args, out, status)
    act = _activations(node, args)

    def factory(name):
        def make():   # random activations (the plan's buffers hold garbage now), the real weights
            sample = [_like(t, fill=True) if i in act else t for i, t in enumerate(args)]
            so = _like(out, fill=False)
            thunk = bind_provider(name, node, graph, sample, so, status, bind_yirage)
            thunk.samples = (sample, so)   # kept alive with the thunk
            return thunk
        return make
    choice = tuning.choose(shape_key(node, graph, args, out), {n: factory(n) for n in providers(node, graph)},
                           DEFAULT, sync=sync)
    thunk = bind_provider(choice.provider, node, graph, args, out, status, bind_yirage)
    try:
        thunk.provider = f"{choice.provider} ({choice.source})"
    except AttributeError:   # a builtin or bound method: wrapped so it can carry the attribute
        inner = thunk

        def thunk():
            return inner()
        thunk.provider = f"{choice.provider} ({choice.source})"
    return thunk


__all__ = ["VENDOR_OPS", "LAYOUT_OPS", "DEFAULT", "BatchNormFold", "vendor_applies", "providers", "shape_key",
           "bind_provider", "bind"]
