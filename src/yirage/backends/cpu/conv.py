"""The CPU backend's convolutional-network ops (ir/conv.py), over NCHW tensors:

- ``conv2d`` with its epilogue (folded batch norm, residual, activation), NCHW or NHWC: torch's
  convolution plus in-place epilogue ops, or oneDNN on a folded, reordered weight with the
  epilogue as post-ops, or yirage's own kernels (the packed GEMM for 1x1 convolutions, an
  implicit GEMM on the same packed GEMM for other ungrouped ones, a direct NHWC kernel for
  depthwise ones, all with the epilogue fused), chosen with their tile sizes by measurement
  (``tuning.choose``);
- ``max_pool2d``, ``avg_pool2d``, ``adaptive_avg_pool2d`` and ``batch_norm`` (inference):
  hand-written C++ (kernels/cpu/conv.cpp), float32/float16/bfloat16.

Binders run once per plan and return a thunk; they never allocate per call. This module must
never run a kernel on a tensor whose shape differs from the graph's.
"""
from __future__ import annotations

import ctypes
import functools
import math
import struct
from typing import Callable

import torch

from ...tuning import profile as tuning
from ...dtypes import DType
from ...ir.conv import ACTIVATIONS_INPLACE, ConvInputs, bn_scale_shift, conv_class, conv_inputs
from ...runtime.machine import Needs
from ...runtime.toolchain import load_kernel_library
from . import embed, native

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

#: entry points of conv.cpp and their argtypes (restype None)
SIGNATURES: dict[str, tuple] = {
    # x, y, N, C, H, W, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo, dtype
    "yr_max_pool2d": (_P, _P, *([_I] * 14), _I),
    # x, y, N, C, H, W, kh, kw, sh, sw, ph, pw, Ho, Wo, count_include_pad, dtype
    "yr_avg_pool2d": (_P, _P, *([_I] * 12), _I, _I),
    "yr_adaptive_avg_pool2d": (_P, _P, _I, _I, _I, _I, _I, _I, _I),   # x, y, N, C, H, W, oh, ow, dtype
    # x, y, mean, var, weight|None, bias|None, N, C, S, eps, dtype
    "yr_batch_norm": (_P, _P, _P, _P, _P, _P, _I, _I, _I, _F, _I),
    "yr_conv_epilogue": (_P, _I, _I),   # args {y, r, rows, cols, act, lo, hi}, rows lo..hi (a GEMM's row epilogue)
    "yr_conv_epilogue_parts": (_P, _I, _I),   # args {count, then yr_conv_epilogue's 7 words per part}, lo, hi
    # x, wt [kh*kw, C], bias|None, res|None, y, N, H, W, C, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw, act, lo, hi
    "yr_depthwise_nhwc_f32": (_P, _P, _P, _P, _P, *([_I] * 15), _F, _F),
}
#: activation codes of yr_conv_epilogue
_EPILOGUE_ACT = {None: 0, "relu": 1, "hardtanh": 2, "silu": 3, "sigmoid": 4, "tanh": 5}
#: element type codes of conv.cpp
DTYPE_CODES = {DType.float32: 0, DType.float16: 1, DType.bfloat16: 2}


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """conv.cpp, built on first use (cached on disk), with signatures set.

    Raises ToolchainError: no C++ compiler, or it rejected the source."""
    lib = load_kernel_library("conv", symbols=tuple(SIGNATURES))
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes = list(argtypes)
        getattr(lib, name).restype = None
    return lib


def _typed(node, graph) -> bool:
    return graph.tensors[node.inputs[0]].dtype in DTYPE_CODES


#: the same activations in place on torch tensors


def _bn_scale_shift(c: ConvInputs, eps: float):
    """Inference batch norm as ``y * scale + shift`` per channel (float32 [O] each)."""
    return bn_scale_shift(c.mean, c.var, c.bn_weight, c.bn_bias, eps)


def _deps(c: ConvInputs) -> tuple:
    """The tensors a convolution's packed weight is derived from besides the weight itself."""
    return tuple(t for t in (c.bias, c.mean, c.var, c.bn_weight, c.bn_bias) if t is not None)


def _packed_kind(provider: str, c: ConvInputs, x) -> str:
    """The packed-weight cache kind of ``provider`` (``embed._cached``): per input shape for
    oneDNN's reorder, and per set of folded tensors, so a weight shared by two convolutions
    with different BatchNorms keeps one packed form for each instead of repacking at every call."""
    folded = "/".join(str(id(t)) for t in _deps(c))
    if provider in ("onednn-packed", "onednn-copy"):
        return f"onednn-conv/{tuple(x.shape)}/{folded}"
    return f"{provider.split('/')[0]}/{folded}"   # one packed weight for all tile sizes of a kernel


def _folded(c: ConvInputs, attrs: dict):
    """The convolution's weight and bias with its batch norm folded in (Ioffe & Szegedy 2015,
    as inference frameworks fold it): ``w * scale[o]`` and ``b * scale + shift``, in w's dtype
    (bias None when there is neither bias nor batch norm)."""
    if not attrs.get("bn"):
        return c.weight, c.bias
    scale, shift = _bn_scale_shift(c, attrs["bn"]["eps"])
    w = (c.weight.float() * scale.view(-1, 1, 1, 1)).to(c.weight.dtype)
    b = shift if c.bias is None else c.bias.float() * scale + shift
    return w, b.to(c.weight.dtype)


def _conv_aten(c: ConvInputs, x, y, r, attrs, via_nchw: bool = False):
    """torch's convolution (``aten.convolution.out``: oneDNN, with the weight reordered at every
    call) into ``y``, then the epilogue as in-place torch ops. Any layout and weights.
    ``via_nchw``: channels-last x and y are copied through contiguous NCHW buffers around the
    convolution (torch's channels-last convolution of an NCHW weight is slow on small images)."""
    conv = torch.ops.aten.convolution.out
    stride, padding, dilation = list(attrs["stride"]), list(attrs["padding"]), list(attrs["dilation"])
    bn, act = attrs.get("bn"), attrs.get("activation")
    act_args = attrs.get("act_args") or []
    xs, ys = (torch.empty(x.shape, dtype=x.dtype), torch.empty(y.shape, dtype=y.dtype)) if via_nchw else (x, y)

    def run():
        if via_nchw:
            xs.copy_(x)
        conv(xs, c.weight, c.bias, stride, padding, dilation, False, [0, 0], attrs["groups"], out=ys)
        if via_nchw:
            y.copy_(ys)
        if bn:   # in float32, rounded once to y's dtype (as eager's batch norm of a bfloat16 input)
            scale, shift = _bn_scale_shift(c, bn["eps"])
            if y.dtype == torch.float32:
                y.mul_(scale.view(-1, 1, 1)).add_(shift.view(-1, 1, 1))
            else:
                y.copy_(y.float().mul_(scale.view(-1, 1, 1)).add_(shift.view(-1, 1, 1)))
        if r is not None:
            y.add_(r)
        if act:
            ACTIVATIONS_INPLACE[act](y, act_args)
    return run


#: oneDNN's name for each conv2d activation as a post-op of its plain (not in-place) convolution
_ONEDNN_UNARY = {None: "none", "relu": "relu", "hardtanh": "hardtanh", "silu": "swish", "sigmoid": "sigmoid",
                 "tanh": "tanh"}


def _conv_onednn(c: ConvInputs, x, y, r, attrs, copy: bool = False):
    """oneDNN's convolution on a weight folded (batch norm) and reordered once for this input
    shape, with the bias, the residual add and the activation as post-ops, writing in place
    into ``y`` (``mkldnn._convolution_pointwise_.binary``: ``y = relu(conv(x) + y)``; ``y`` is
    first zeroed, or set to the residual; oneDNN fuses no other activation after the add, so
    those run in place after it). ``copy`` (no residual): oneDNN's plain convolution with the
    activation fused, into a new tensor copied into ``y``. Channels-last x and y; constant
    weights only."""
    stride, padding, dilation, groups = (list(attrs["stride"]), list(attrs["padding"]), list(attrs["dilation"]),
                                         attrs["groups"])
    act = attrs.get("activation")
    act_args = attrs.get("act_args") or []
    unary = act if act == "relu" else None   # oneDNN fuses only relu after the add; others run after it
    deps, kind = _deps(c), _packed_kind("onednn-packed", c, x)

    def pack(w):
        wf, bf = _folded(c, attrs)
        wf = wf.contiguous(memory_format=torch.channels_last)
        return torch.ops.mkldnn._reorder_convolution_weight(wf, padding, stride, dilation, groups, list(x.shape)), bf
    embed._cached(c.weight, kind, pack, deps)   # folded and reordered now, once
    conv = torch.ops.mkldnn._convolution_pointwise_.binary
    if copy:
        plain, name = torch.ops.mkldnn._convolution_pointwise, _ONEDNN_UNARY[act]
        scalars = list(act_args) if act == "hardtanh" else []

        def run_copy():
            wp, b = embed._cached(c.weight, kind, pack, deps)
            y.copy_(plain(x, wp, b, padding, stride, dilation, groups, name, scalars, ""))
        return run_copy

    def run():
        wp, b = embed._cached(c.weight, kind, pack, deps)
        if r is None:
            y.zero_()
        else:
            y.copy_(r)
        conv(y, x, wp, b, padding, stride, dilation, groups, "add", None, unary, [], None)
        if act and unary is None:
            ACTIVATIONS_INPLACE[act](y, act_args)
    return run


def _f32_bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", float(v)))[0]


def _row_epilogue(y2, r2, attrs):
    """The residual add and activation of a convolution run as a GEMM, as that GEMM's row
    epilogue (conv.cpp ``yr_conv_epilogue`` over the output rows ``y2`` [M, O], ``r2`` the
    residual rows or None): ``((fn, args), keep)`` with ``keep`` what must live as long as the
    thunk (the argument array and the buffers its pointers point at), or ``(None, ())``."""
    if not attrs.get("activation") and r2 is None:
        return None, ()
    words = _epilogue_words(y2, r2, attrs)
    ptrs = (ctypes.c_int64 * len(words))(*words)
    return (ctypes.cast(library().yr_conv_epilogue, ctypes.c_void_p).value, ctypes.addressof(ptrs)), (ptrs, y2, r2)


def _epilogue_words(y2, r2, attrs) -> list[int]:
    """``yr_conv_epilogue``'s 7 argument words for the rows ``y2`` [M, O] (``r2``: the residual
    rows or None) and the activation in ``attrs``."""
    act, act_args = attrs.get("activation"), list(attrs.get("act_args") or [0.0, 0.0])
    return [y2.data_ptr(), 0 if r2 is None else r2.data_ptr(), y2.shape[0], y2.shape[1], _EPILOGUE_ACT[act],
            _f32_bits(act_args[0]), _f32_bits(act_args[1])]


def _nhwc_rows(t, cols: int):
    """The NHWC buffer behind a channels-last NCHW view, as [N*H*W, cols] rows (None stays None)."""
    return None if t is None else t.permute(0, 2, 3, 1).view(-1, cols)


def _conv_gemm(c: ConvInputs, x, y, r, attrs):
    """A 1x1, stride-1, ungrouped NHWC convolution as the GEMM it is, on yirage's packed float32
    GEMM (kernels/cpu/embed_kernels.h): x [N*H*W, C] times the folded weight [O, C] packed
    once, the bias in the GEMM, and the residual add and the activation as its row epilogue
    (conv.cpp's ``yr_conv_epilogue``, on each block of rows while they are in cache)."""
    O, C = c.weight.shape[:2]
    x2, y2, r2 = _nhwc_rows(x, C), _nhwc_rows(y, O), _nhwc_rows(r, O)
    deps, kind = _deps(c), _packed_kind("yirage-gemm", c, x)
    epilogue, keep = _row_epilogue(y2, r2, attrs)

    def pack(w):
        wf, bf = _folded(c, attrs)
        return embed.pack_f32(wf.reshape(O, C).contiguous()), None if bf is None else bf.float().contiguous()
    embed._cached(c.weight, kind, pack, deps)   # folded and packed now, once
    run = embed.bind_gemm_f32(x2, y2, lambda: embed._cached(c.weight, kind, pack, deps),
                              epilogue)
    run.epilogue_args = keep   # the kernel reads them through raw pointers
    return run


#: (mc, kc) tiles of yirage's implicit-GEMM convolution: output pixels per gathered block, and
#: its k-block. Each is a candidate of its own (``yirage-igemm/<mc>x<kc>``), so measurement
#: per shape class picks the tile along with the provider, and the tuning profile caches it.
#: On the Zen 4 the best of these was within 3% of the best of 12 (mc 48-192, kc 128-768) on
#: ResNet's 3x3 and stem shapes, and the fixed 192x384 up to 10% slower than the best.
IGEMM_TILES = ((48, 768), (96, 768), (192, 384))


def _conv_igemm(c: ConvInputs, x, y, r, attrs, mc: int = 192, kc: int = 384):
    """An ungrouped float32 NHWC convolution of any window, stride, padding and dilation as an
    implicit GEMM on yirage's packed GEMM (kernels/cpu/conv_gemm.h): blocks of ``mc`` output
    pixels gather their receptive fields into cache-resident rows, multiplied by the folded
    weight [O, kh*kw*C] packed once; the bias in the GEMM, the residual add and activation as
    its row epilogue."""
    O, C, kh, kw = c.weight.shape
    N, _, H, W = x.shape
    Ho, Wo = y.shape[2:]
    xb, y2, r2 = x.permute(0, 2, 3, 1), _nhwc_rows(y, O), _nhwc_rows(r, O)
    deps, kind = _deps(c), _packed_kind("yirage-igemm", c, x)
    epilogue, keep = _row_epilogue(y2, r2, attrs)
    epi_fn, epi_args = epilogue or (None, None)
    geo = torch.tensor([N, H, W, C, O, Ho, Wo, kh, kw, *attrs["stride"], *attrs["padding"], *attrs["dilation"], mc, kc],
                       dtype=torch.int64)

    def pack(w):
        wf, bf = _folded(c, attrs)
        wk = wf.float().permute(0, 2, 3, 1).reshape(O, kh * kw * C).contiguous()   # (ky, kx, c) order
        return embed.pack_f32(wk), None if bf is None else bf.float().contiguous()
    embed._cached(c.weight, kind, pack, deps)   # folded and packed now, once
    lib, st = native._lib(), native._status()

    def run():
        P, b = embed._cached(c.weight, kind, pack, deps)
        lib.yr_conv_igemm_f32(xb.data_ptr(), P.data_ptr(), None if b is None else b.data_ptr(), y2.data_ptr(),
                              geo.data_ptr(), xb.numel(), P.numel(), y2.numel(), epi_fn, epi_args, st.data_ptr())
        if st[0]:
            native._raise_status(st, "conv2d (implicit GEMM)")
    run.epilogue_args = (keep, geo)   # the kernel reads them through raw pointers
    return run


def _conv_depthwise(c: ConvInputs, x, y, r, attrs):
    """A float32 NHWC depthwise convolution (groups == C == O) on yirage's direct kernel
    (conv.cpp ``yr_depthwise_nhwc_f32``): the weight folded (BatchNorm) and transposed to
    [kh*kw, C] once, the bias, residual and activation in the same pass."""
    O, _, kh, kw = c.weight.shape
    N, C, H, W = x.shape
    Ho, Wo = y.shape[2:]
    deps, kind = _deps(c), _packed_kind("yirage-depthwise", c, x)
    act, act_args = attrs.get("activation"), list(attrs.get("act_args") or [0.0, 0.0])

    def pack(w):
        wf, bf = _folded(c, attrs)
        return wf.float().reshape(O, kh * kw).t().contiguous(), None if bf is None else bf.float().contiguous()
    embed._cached(c.weight, kind, pack, deps)   # folded and transposed now, once
    fn = library().yr_depthwise_nhwc_f32
    xb, yb = x.permute(0, 2, 3, 1), y.permute(0, 2, 3, 1)   # the NHWC buffers
    rb = None if r is None else r.permute(0, 2, 3, 1)
    geometry = (N, H, W, C, Ho, Wo, kh, kw, *attrs["stride"], *attrs["padding"], *attrs["dilation"],
                _EPILOGUE_ACT[act], float(act_args[0]), float(act_args[1]))

    def run():
        wt, b = embed._cached(c.weight, kind, pack, deps)
        fn(xb.data_ptr(), wt.data_ptr(), None if b is None else b.data_ptr(), None if rb is None else rb.data_ptr(),
           yb.data_ptr(), *geometry)
    return run


#: what oneDNN's reordered convolution (``onednn-packed``, ``onednn-copy``) needs per dtype: a
#: bfloat16 weight reorder raises where oneDNN has no bfloat16 path on this CPU
ONEDNN_NEEDS = {torch.float32: Needs(library=("mkldnn",)), torch.bfloat16: Needs(library=("mkldnn", "mkldnn_bf16"))}


def _conv2d(node, graph, args, out, status):
    """``conv2d`` with its epilogue on the provider chosen by measurement per shape class:
    torch's convolution plus in-place epilogue ops (``aten``; for NHWC also ``aten-nchw``,
    through NCHW copies), or, for channels-last
    (``layout="nhwc"``) float32/bfloat16 convolutions whose weights (and folded batch-norm
    parameters) are constant, oneDNN on a reordered weight with fused post-ops
    (``onednn-packed``, in place; ``onednn-copy`` without a residual), for float32 depthwise
    ones yirage's direct kernel (``yirage-depthwise``), for 1x1 stride-1 float32 ones yirage's packed GEMM
    (``yirage-gemm``), and for other ungrouped float32 ones yirage's implicit GEMM in each of
    ``IGEMM_TILES`` (``yirage-igemm/<mc>x<kc>``). NHWC buffers are handed to torch as
    channels-last NCHW views."""
    a = node.attrs
    c = conv_inputs(list(args), a)
    nhwc = a.get("layout", "nchw") == "nhwc"
    x = c.x.permute(0, 3, 1, 2) if nhwc else c.x
    y = out.permute(0, 3, 1, 2) if nhwc else out
    r = None if c.residual is None else c.residual.permute(0, 3, 1, 2) if nhwc else c.residual
    cands = {"aten": _conv_aten}
    if nhwc:
        cands["aten-nchw"] = functools.partial(_conv_aten, via_nchw=True)
    weights = [t for t in (c.weight, c.bias, c.mean, c.var, c.bn_weight, c.bn_bias) if t is not None]
    if (nhwc and x.dtype in (torch.float32, torch.bfloat16) and ONEDNN_NEEDS[x.dtype].unmet() is None
            and all(embed.is_constant(t) for t in weights)):
        cands["onednn-packed"] = _conv_onednn
        if c.residual is None:
            cands["onednn-copy"] = functools.partial(_conv_onednn, copy=True)
        if x.dtype == torch.float32 and a["groups"] == c.weight.shape[0] == x.shape[1] and c.weight.shape[1] == 1:
            cands["yirage-depthwise"] = _conv_depthwise
        if x.dtype == torch.float32 and a["groups"] == 1:
            if c.weight.shape[2:] == (1, 1) and list(a["stride"]) == [1, 1] and list(a["padding"]) == [0, 0]:
                cands["yirage-gemm"] = _conv_gemm   # a plain GEMM over the NHWC buffer, nothing to gather
            else:
                for mc, kc in IGEMM_TILES:
                    cands[f"yirage-igemm/{mc}x{kc}"] = functools.partial(_conv_igemm, mc=mc, kc=kc)
    O, cg, kh, kw = c.weight.shape
    N, _, Ho, Wo = y.shape
    what = f"{x.dtype}".removeprefix("torch.") + conv_class(c, a)
    key = tuning.shape_class("conv2d", what, N * Ho * Wo, O, cg * kh * kw, torch.get_num_threads())

    def factory(bind):
        def make():   # the real weights; random activations of the class (plan buffers hold garbage now)
            xs = torch.randn(c.x.shape, dtype=c.x.dtype)
            ys = torch.empty(out.shape, dtype=out.dtype)
            rs = None if c.residual is None else torch.randn(c.residual.shape, dtype=c.residual.dtype)
            if nhwc:
                xs, ys, rs = xs.permute(0, 3, 1, 2), ys.permute(0, 3, 1, 2), None if rs is None else rs.permute(0, 3, 1, 2)
            thunk = bind(c, xs, ys, rs, a)
            thunk.samples = (xs, ys, rs)   # kernels hold raw pointers into them
            return thunk
        return make
    default = "onednn-packed" if "onednn-packed" in cands else "aten"
    choice = tuning.choose(key, {n: factory(b) for n, b in cands.items()}, default)
    for provider in ("onednn-packed", "yirage-gemm", "yirage-depthwise", "yirage-igemm"):
        if _packed_kind(provider, c, x) != _packed_kind(choice.provider, c, x):
            embed.forget_packed(c.weight, _packed_kind(provider, c, x))   # measured, not chosen
    thunk = cands[choice.provider](c, x, y, r, a)
    thunk.provider = f"{choice.provider} ({choice.source})"
    return thunk


def _pool_nhwc(fn, node, args, out):
    """A window pool over NHWC buffers: torch's kernel on channels-last views, copied into ``out``."""
    x, y = args[0].permute(0, 3, 1, 2), out.permute(0, 3, 1, 2)
    a = node.attrs
    if fn is torch.nn.functional.max_pool2d:
        return lambda: y.copy_(fn(x, a["kernel"], a["stride"], a["padding"], a["dilation"]))
    return lambda: y.copy_(fn(x, a["kernel"], a["stride"], a["padding"], count_include_pad=a["count_include_pad"]))


def _max_pool2d(node, graph, args, out, status):
    if node.attrs.get("layout") == "nhwc":
        return _pool_nhwc(torch.nn.functional.max_pool2d, node, args, out)
    t = graph.tensors[node.inputs[0]]
    a, (N, C, H, W), (Ho, Wo) = node.attrs, t.shape, graph.tensors[node.output].shape[2:]
    p = (args[0].data_ptr(), out.data_ptr(), N, C, H, W, *a["kernel"], *a["stride"], *a["padding"],
         *a["dilation"], Ho, Wo, DTYPE_CODES[t.dtype])
    fn = library().yr_max_pool2d
    return lambda: fn(*p)


def _avg_pool2d(node, graph, args, out, status):
    if node.attrs.get("layout") == "nhwc":
        return _pool_nhwc(torch.nn.functional.avg_pool2d, node, args, out)
    t = graph.tensors[node.inputs[0]]
    a, (N, C, H, W), (Ho, Wo) = node.attrs, t.shape, graph.tensors[node.output].shape[2:]
    p = (args[0].data_ptr(), out.data_ptr(), N, C, H, W, *a["kernel"], *a["stride"], *a["padding"], Ho, Wo,
         int(a["count_include_pad"]), DTYPE_CODES[t.dtype])
    fn = library().yr_avg_pool2d
    return lambda: fn(*p)


def _adaptive_avg_pool2d(node, graph, args, out, status):
    t = graph.tensors[node.inputs[0]]
    p = (args[0].data_ptr(), out.data_ptr(), *t.shape, *node.attrs["output_size"], DTYPE_CODES[t.dtype])
    fn = library().yr_adaptive_avg_pool2d
    return lambda: fn(*p)


def _batch_norm(node, graph, args, out, status):
    t = graph.tensors[node.inputs[0]]
    N, C = t.shape[:2]
    S = 1
    for d in t.shape[2:]:
        S *= d
    stats = list(args[1:])
    f32 = [s if s.dtype == torch.float32 else torch.empty(s.shape) for s in stats]   # the kernel reads float32
    convert = [(a, b) for a, b in zip(f32, stats) if a is not b]
    w, b = (f32[2].data_ptr(), f32[3].data_ptr()) if node.attrs["affine"] else (None, None)
    p = (args[0].data_ptr(), out.data_ptr(), f32[0].data_ptr(), f32[1].data_ptr(), w, b, N, C, S,
         float(node.attrs["eps"]), DTYPE_CODES[t.dtype])
    fn = library().yr_batch_norm
    if not convert:
        return lambda: fn(*p)

    def run():
        for a, b in convert:
            a.copy_(b)
        fn(*p)
    return run


# ---- conv2d_stack: parallel 1x1 convolutions of one x as one GEMM --------------------------

def _stack_gemm_takes(x_shape, float32: bool, parts) -> bool:
    """Can convolutions of an x of ``x_shape`` (all float32: ``float32``), ``parts`` their
    ``(attrs, weight shape)``, run as one GEMM (``_conv_stack_gemm``)? All NHWC 1x1 stride-1
    unpadded ungrouped convolutions without a residual."""
    return float32 and len(x_shape) == 4 and all(
        a.get("layout") == "nhwc" and tuple(w[1:]) == (x_shape[3], 1, 1) and list(a["stride"]) == [1, 1]
        and list(a["padding"]) == [0, 0] and list(a["dilation"]) == [1, 1] and a["groups"] == 1
        and not a.get("residual") for a, w in parts)


def _stack_gemm_ok(parts: list[tuple[dict, ConvInputs]]) -> bool:
    """``_stack_gemm_takes`` for bound parts (``(attrs, ConvInputs)`` each)."""
    x = parts[0][1].x
    return _stack_gemm_takes(tuple(x.shape), all(c.x.dtype == c.weight.dtype == torch.float32 for _, c in parts),
                             [(a, tuple(c.weight.shape)) for a, c in parts])


def _conv_stack_gemm(parts: list[tuple[dict, ConvInputs]], out: torch.Tensor):
    """The parallel 1x1 convolutions ``parts`` of one NHWC x as one packed float32 GEMM
    (embed_kernels.h ``yr_emb_gemm_f32_parts``): x [N*H*W, C] read once for every part, each
    part's folded weight packed and the packs concatenated once (again when any of their
    tensors is written), part i's rows written to its own contiguous [N*H*W, O_i] stretch of
    the flat ``out``, and each part's activation as the GEMM's row epilogue
    (``yr_conv_epilogue_parts``). ``_stack_gemm_ok(parts)`` must hold."""
    x = parts[0][1].x
    C = x.shape[3]
    M = x.numel() // C
    widths = [c.weight.shape[0] for _, c in parts]
    first = parts[0][1].weight
    deps = tuple(t for _, c in parts for t in (c.weight, *_deps(c)) if t is not first)
    kind = "yirage-gemm-stack/" + "/".join(str(id(t)) for t in deps)

    def pack(_):
        Ps, biases = [], []
        for a, c in parts:
            wf, bf = _folded(c, a)
            O = wf.shape[0]
            Ps.append(embed.pack_f32(wf.float().reshape(O, C).contiguous()).view(-1))
            b = torch.zeros(-(-O // embed._PANEL) * embed._PANEL)
            if bf is not None:
                b[:O] = bf.float()
            biases.append(b)
        has_bias = any(a.get("bias") or a.get("bn") for a, _ in parts)
        return torch.cat(Ps), torch.cat(biases) if has_bias else None
    embed._cached(first, kind, pack, deps)   # folded and packed now, once
    words, offset = [], 0
    for (a, _), O in zip(parts, widths):
        if a.get("activation"):
            words += _epilogue_words(out[offset:offset + M * O].view(M, O), None, a)
        offset += M * O
    epilogue, ptrs = None, None
    if words:
        ptrs = (ctypes.c_int64 * (1 + len(words)))(len(words) // 7, *words)
        epilogue = (ctypes.cast(library().yr_conv_epilogue_parts, ctypes.c_void_p).value, ctypes.addressof(ptrs))
    run = embed.bind_gemm_f32_parts(x.view(M, C), out, widths,
                                    lambda: embed._cached(first, kind, pack, deps), epilogue)
    run.epilogue_args = ptrs   # the kernel reads them through a raw pointer
    return run


def _conv2d_stack(node, graph, args, out, status):
    """``conv2d_stack``: parallel float32 NHWC 1x1 convolutions as one GEMM (``_conv_stack_gemm``;
    transforms/parallel.py merged them because ``merge_convs`` measured it faster), any other
    stack as its ``conv2d`` parts, each on its own chosen provider, into its view of ``out``."""
    from ...ir.conv import conv2d_stack_parts
    parts = [(a, conv_inputs(ins, a)) for a, ins in conv2d_stack_parts(list(args), node.attrs)]
    if _stack_gemm_ok(parts):
        return _conv_stack_gemm(parts, out)
    from ..base import bind_conv2d_stack_parts
    return bind_conv2d_stack_parts(node, graph, args, out, status, _conv2d)


def stack_candidates(case) -> dict[str, Callable] | None:
    """The two ways to run the parallel convolutions ``case`` (transforms.parallel.ConvGroup), as
    ``tuning.choose`` candidates on random constant weights of the case's shapes: "separate"
    (each convolution on the provider chosen for it) and "stacked" (the one GEMM,
    ``_conv_stack_gemm``); None for groups the GEMM does not take (``_stack_gemm_takes``:
    float32 NHWC 1x1 stride 1) or whose weights exceed ``embed.MERGE_MAX_WEIGHT_BYTES``."""
    from ...ir.graph import OpNode
    if (not _stack_gemm_takes(case.x_shape, case.dtype == "float32", list(zip(case.parts, case.weights)))
            or math.prod(case.x_shape) == 0 or sum(math.prod(w) for w in case.weights) * 4 > embed.MERGE_MAX_WEIGHT_BYTES):
        return None

    def sample():
        x = torch.randn(case.x_shape)
        parts, outs = [], []
        for a, shape in zip(case.parts, case.weights):
            O = shape[0]
            ins = [x, torch.randn(shape) * (2.0 / math.prod(shape[1:])) ** 0.5]
            if a.get("bias"):
                ins.append(torch.randn(O))
            if a.get("bn"):
                ins += [torch.randn(O), torch.rand(O) + 0.5] + ([torch.randn(O), torch.randn(O)] if a["bn"]["affine"] else [])
            for t in ins[1:]:
                embed.mark_constant(t)
            parts.append((a, conv_inputs(ins, a)))
            outs.append(torch.empty(*case.x_shape[:3], O))
        return parts, outs

    def separate():
        parts, outs = sample()
        runs = [_conv2d(OpNode("conv2d", [], a, 0), None, [c.x, *(t for t in (c.weight, c.bias, c.mean, c.var,
                                                                           c.bn_weight, c.bn_bias) if t is not None)],
                        y, None) for (a, c), y in zip(parts, outs)]

        def run_all():
            for r in runs:
                r()
        run_all.samples = (parts, outs)   # the kernels hold raw pointers into them
        return run_all

    def stacked():
        parts, outs = sample()
        run = _conv_stack_gemm(parts, torch.empty(sum(y.numel() for y in outs)))
        run.samples = parts
        return run
    return {"separate": separate, "stacked": stacked}


def merge_convs(case) -> bool:
    """Should the parallel convolutions ``case`` (transforms.parallel.ConvGroup) run as one
    ``conv2d_stack``? Chosen by measurement per shape class (``tuning.choose``, cached in the
    profile) between ``stack_candidates(case)``: the convolutions apart, each on the provider
    chosen for it, and the one GEMM. Groups without candidates: False."""
    cands = stack_candidates(case)
    if cands is None:
        return False
    epilogues = ";".join("+".join([k for k in ("bias", "bn") if a.get(k)] + [a.get("activation") or "id"])
                         for a in case.parts)
    widths = "+".join(str(w[0]) for w in case.weights)
    M, C = math.prod(case.x_shape[:3]), case.x_shape[3]
    key = tuning.shape_class("conv2d_stack", f"float32/nhwc/1x1/w{widths}/{epilogues}", M,
                             sum(w[0] for w in case.weights), C, torch.get_num_threads())
    return tuning.choose(key, cands, "separate").provider == "stacked"


#: op -> (supported?(node, graph), binder(node, graph, args, out, status))
OPS: dict[str, tuple[Callable, Callable]] = {
    "conv2d": (_typed, _conv2d),
    "conv2d_stack": (_typed, _conv2d_stack),
    "max_pool2d": (_typed, _max_pool2d),
    "avg_pool2d": (_typed, _avg_pool2d),
    "adaptive_avg_pool2d": (_typed, _adaptive_avg_pool2d),
    "batch_norm": (_typed, _batch_norm),
}
