"""WebGPU library kernels for the convolutional-network ops, float32: ``conv2d`` (with its
fused epilogue), ``conv2d_stack``, ``max_pool2d``, ``avg_pool2d``, ``adaptive_avg_pool2d`` and
``batch_norm`` (inference).

The kernels are WGSL source files shipped with the package (``kernels/webgpu``):

- ``conv2d.wgsl``: conv2d as an implicit GEMM per group (``[N*Ho*Wo, O/groups] = patches @
  W^T``, the patch matrix never built: each K step decodes its columns into channel, kernel
  row and kernel column and loads the pixels they cover, zero in the padding), tiles in
  workgroup memory and a register block per thread as ``matmul.wgsl``;
- ``conv2d_direct.wgsl``: one output element per invocation summing its window directly: the
  kernel for depthwise and other convolutions with few output channels per group (up to
  ``DIRECT_MAX_OG``), where a GEMM tile over the channels would be mostly empty;
- both end in ``conv_common.wgsl``'s epilogue, as ir/conv.py's ``conv2d_epilogue`` computes it,
  in f32: + bias, an inference BatchNorm as ``y * scale + shift`` (``bn_fold.wgsl`` computes
  the per-channel scale and shift from the statistics, in a dispatch before each convolution,
  so statistics written between runs are seen), + residual, then the activation (relu,
  hardtanh, silu, sigmoid, tanh);
- ``pool.wgsl``: max / average / adaptive-average pooling, one output element per invocation;
- ``batch_norm.wgsl``: inference BatchNorm over dim 1 of any [N, C, ...], as torch's CPU kernel
  computes it (``x * alpha + beta``).

Layouts: ``conv2d`` and the window pools take ``layout="nhwc"`` (x, residual and output
[N, H, W, C], the channels-last pass of transforms/conv.py) as well as NCHW; the kernels take
every 4-d tensor's element strides in logical (n, c, h, w) order. The weight is always
contiguous [O, C / groups, kh, kw]. ``adaptive_avg_pool2d`` is NCHW (the op has no layout).

Every index is checked in the kernels (window taps against the image, tile rows and columns
against the GEMM's sizes), so any sizes run. The tile configuration of the implicit GEMM is
chosen from the shape (``conv_config``; no timing); ``config=`` pins one (tests, benchmarks).
Buffers are bound whole (``runtime.webgpu``): every shader adds the tensors' element offsets,
passed in its ``u32`` parameters; when ``out`` lies in an input's buffer (a plan's arena) the
inputs are bound writable too (``{{IN_ACCESS}}``: WebGPU forbids one buffer bound read-only and
writable in one dispatch); an ``out`` overlapping an input's elements is refused (YirageError),
except ``batch_norm``'s out exactly over x (elementwise, in place).

The backend reaches this module through ``OPS`` (op -> ``(supports, bind)``), or ``supports`` /
``bind``. This module may import the runtime, tuning, ir, dtypes and errors layers and the
backends' base; it must never import the front end (kernel, dynamo, engines).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ...dtypes import DType
from ...errors import YirageError
from ...ir.conv import conv2d_stack_parts, conv_inputs, out_size
from ...ir.graph import OpNode
from ...runtime import webgpu as wg
from ..base import bind_conv2d_stack_parts
from .library import render

Thunk = Callable[[], None]

#: activation codes of conv_common.wgsl's epilogue (ir/conv.py ``ACTIVATIONS``)
ACTIVATION_CODES = {None: 0, "relu": 1, "hardtanh": 2, "silu": 3, "sigmoid": 4, "tanh": 5}
#: workgroup size of the one-element-per-invocation kernels (direct conv, pools, batch_norm)
WG_SIZE = 64
#: convolutions with at most this many output channels per group run conv2d_direct.wgsl
DIRECT_MAX_OG = 4
#: -inf as float32 bits (pool.wgsl's max starts there)
_NEG_INF_BITS = 0xFF800000


# ---- configurations -------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvConfig:
    """A tile configuration of ``conv2d.wgsl``: each workgroup computes ``tile_m`` output
    pixels x ``tile_n`` output channels of one group, ``tile_k`` patch columns per step, each
    thread a ``reg_m`` x ``reg_n`` block ((tile_m / reg_m) * (tile_n / reg_n) threads, 256
    here: WebGPU's default max-compute-invocations-per-workgroup)."""

    tile_m: int
    tile_n: int
    tile_k: int
    reg_m: int
    reg_n: int

    @property
    def name(self) -> str:
        return f"c{self.tile_m}x{self.tile_n}k{self.tile_k}r{self.reg_m}x{self.reg_n}"

    @property
    def threads(self) -> int:
        return (self.tile_m // self.reg_m) * (self.tile_n // self.reg_n)

    def values(self) -> dict:
        return {"TILE_M": self.tile_m, "TILE_N": self.tile_n, "TILE_K": self.tile_k, "REG_M": self.reg_m,
                "REG_N": self.reg_n}


#: implicit-GEMM tiles (about 8 KiB of workgroup memory at most; the default limit is 16 KiB)
CONV_CONFIGS: dict[str, ConvConfig] = {c.name: c for c in (
    ConvConfig(64, 64, 16, 4, 4), ConvConfig(32, 32, 16, 2, 2), ConvConfig(64, 16, 16, 4, 1))}
#: the name that pins conv2d_direct.wgsl
DIRECT = "direct"


def conv_config(M: int, OG: int) -> str:
    """The kernel for a convolution of ``M`` output pixels and ``OG`` output channels per group:
    'direct' (conv2d_direct.wgsl) for OG <= DIRECT_MAX_OG (depthwise), else the
    ``CONV_CONFIGS`` tile that wastes least: 64x16 for OG <= 16, 64x64 when M and OG both
    reach 64, 32x32 otherwise."""
    if OG <= DIRECT_MAX_OG:
        return DIRECT
    if OG <= 16:
        return "c64x16k16r4x1"
    if M >= 64 and OG >= 64:
        return "c64x64k16r4x4"
    return "c32x32k16r2x2"


# ---- helpers --------------------------------------------------------------------------------
def f32_bits(x: float) -> int:
    """The bits of ``x`` as a float32, a ``u32`` parameter (the shaders ``bitcast<f32>`` it)."""
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def _noop() -> Thunk:
    """A new thunk that does nothing (an empty output), free to carry its own attributes."""
    return lambda: None


def _labelled(thunk: Thunk, label: str) -> Thunk:
    """``thunk`` with ``thunk.provider = label`` (wrapped when it cannot carry attributes)."""
    try:
        thunk.provider = label
        return thunk
    except AttributeError:
        def run():
            thunk()
        run.provider = label
        return run


def _overlap(a: wg.DeviceTensor, b: wg.DeviceTensor) -> bool:
    return (a.buffer is b.buffer and a.numel() > 0 and b.numel() > 0
            and a.offset < b.offset + b.numel() and b.offset < a.offset + a.numel())


def _check_buffers(what: str, inputs: Sequence[wg.DeviceTensor], out: wg.DeviceTensor,
                   in_place: wg.DeviceTensor | None = None) -> bool:
    """Check that every tensor is float32 and that ``out`` overlaps no input (``in_place``, if
    given, may be ``out``'s very elements); True when ``out`` shares a buffer with an input
    (then the inputs are bound writable). Raises YirageError otherwise."""
    for t in (*inputs, out):
        if t.dtype != torch.float32:
            raise YirageError(f"webgpu {what}: float32 tensors only, got {t.dtype}")
    aliased = False
    for t in inputs:
        if t.buffer is out.buffer:
            aliased = True
            exact = t is in_place and t.offset == out.offset and t.numel() == out.numel()
            if _overlap(t, out) and not exact:
                raise YirageError(f"webgpu {what}: the output (elements {out.offset}..{out.offset + out.numel()}) "
                                  f"overlaps an input (elements {t.offset}..{t.offset + t.numel()}) in one buffer; "
                                  "it cannot be computed in place")
    return aliased


def _access(aliased: bool) -> str:
    return "read_write" if aliased else "read"


def _strides(shape: Sequence[int], nhwc: bool) -> tuple[int, int, int, int]:
    """Element strides, in logical (n, c, h, w) order, of a contiguous 4-d tensor of ``shape``
    (NCHW, or [N, H, W, C] with ``nhwc``)."""
    _, a, b, c = shape
    if nhwc:   # [N, H, W, C]
        return a * b * c, 1, b * c, c
    return a * b * c, b * c, c, 1


def _dims(shape: Sequence[int], nhwc: bool) -> tuple[int, int, int, int]:
    """(N, C, H, W) of a 4-d ``shape`` (NCHW, or [N, H, W, C] with ``nhwc``)."""
    n, a, b, c = shape
    return (n, c, a, b) if nhwc else (n, a, b, c)


def _pair(v, what: str) -> tuple[int, int]:
    pair = tuple(int(x) for x in (v if isinstance(v, (tuple, list)) else (v, v)))
    if len(pair) != 2:
        raise YirageError(f"webgpu: {what} must be two integers, got {v!r}")
    return pair


# ---- launches -------------------------------------------------------------------------------
def conv2d(x: wg.DeviceTensor, w: wg.DeviceTensor, out: wg.DeviceTensor, *, stride=1, padding=0, dilation=1,
           groups: int = 1, bias: wg.DeviceTensor | None = None, bn: tuple | None = None,
           residual: wg.DeviceTensor | None = None, activation: str | None = None, act_args: Sequence = (),
           nhwc: bool = False, config: str | None = None) -> Thunk:
    """A thunk recording ``out = act(bn(conv2d(x, w) + bias) + residual)`` (ir/conv.py's
    ``conv2d_reference``): one dispatch of ``conv2d.wgsl`` or ``conv2d_direct.wgsl``, after one
    of ``bn_fold.wgsl`` when there is a BatchNorm.

    Args:
        x: float32 [N, C, H, W] (``nhwc``: [N, H, W, C]).
        w: float32 [O, C / groups, kh, kw].
        out: float32 [N, O, Ho, Wo] (``nhwc``: [N, Ho, Wo, O]), Ho and Wo torch's (floor mode),
            overlapping no input.
        stride, padding, dilation: an int or a pair each (padding >= 0, the others >= 1).
        groups: divides C and O.
        bias: float32 [O] or None.
        bn: an inference BatchNorm after the bias, ``(running_mean, running_var, weight, bias,
            eps)``: float32 [O] tensors (weight and bias None without affine parameters).
        residual: float32, out's shape, added after the BatchNorm.
        activation: None or a name of ``ACTIVATION_CODES``; ``act_args`` hardtanh's (lo, hi).
        config: 'direct' or a ``CONV_CONFIGS`` name instead of ``conv_config``'s choice.

    ``thunk.provider`` names the kernel (``webgpu-conv-<config>``). Raises YirageError for
    shapes or attributes that do not fit together, a dtype other than float32, an output
    overlapping an input, sizes past the device's limits, or an unknown activation or
    ``config``; BackendUnavailableError without a WebGPU adapter.
    """
    (SH, SW), (PH, PW), (DH, DW) = _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")
    mean, var, bn_w, bn_b, eps = bn if bn is not None else (None, None, None, None, 0.0)
    if len(x.shape) != 4 or len(w.shape) != 4 or len(out.shape) != 4:
        raise YirageError(f"webgpu conv2d: x {tuple(x.shape)}, w {tuple(w.shape)} and out {tuple(out.shape)} "
                          "must be 4-d")
    N, C, H, W = _dims(x.shape, nhwc)
    O, CG, KH, KW = w.shape
    Ho, Wo = out_size(H, KH, SH, PH, DH), out_size(W, KW, SW, PW, DW)
    want = (N, Ho, Wo, O) if nhwc else (N, O, Ho, Wo)
    if (groups < 1 or C % groups or O % groups or CG != C // groups or min(SH, SW, DH, DW) < 1 or min(PH, PW) < 0
            or Ho < 1 or Wo < 1 or tuple(out.shape) != want):
        raise YirageError(f"webgpu conv2d: x {tuple(x.shape)} ({'nhwc' if nhwc else 'nchw'}), w {tuple(w.shape)}, "
                          f"groups {groups}, stride {(SH, SW)}, padding {(PH, PW)}, dilation {(DH, DW)} and out "
                          f"{tuple(out.shape)} do not fit together (out should be {want})")
    for name, t in (("bias", bias), ("running_mean", mean), ("running_var", var), ("bn weight", bn_w),
                    ("bn bias", bn_b)):
        if t is not None and tuple(t.shape) != (O,):
            raise YirageError(f"webgpu conv2d: {name} must be [{O}], got {tuple(t.shape)}")
    if bn is not None and (mean is None or var is None or (bn_w is None) != (bn_b is None)):
        raise YirageError("webgpu conv2d: a BatchNorm needs running_mean and running_var, and weight and bias "
                          "both or neither")
    if residual is not None and tuple(residual.shape) != tuple(out.shape):
        raise YirageError(f"webgpu conv2d: the residual {tuple(residual.shape)} must have out's shape "
                          f"{tuple(out.shape)}")
    if activation not in ACTIVATION_CODES:
        raise YirageError(f"webgpu conv2d: activation must be one of {sorted(a for a in ACTIVATION_CODES if a)} "
                          f"or None, got {activation!r}")
    lo, hi = (0.0, 0.0)
    if activation == "hardtanh":
        if len(act_args) != 2:
            raise YirageError(f"webgpu conv2d: hardtanh takes (lo, hi), got {tuple(act_args)!r}")
        lo, hi = float(act_args[0]), float(act_args[1])
    OG, KG, M = O // groups, CG * KH * KW, N * Ho * Wo
    name = config or conv_config(M, OG)
    if name != DIRECT and name not in CONV_CONFIGS:
        raise YirageError(f"webgpu conv2d: no configuration {name!r}; one of {[DIRECT, *sorted(CONV_CONFIGS)]}")
    extras = [t for t in (bias, mean, var, bn_w, bn_b, residual) if t is not None]
    aliased = _check_buffers("conv2d", [x, w, *extras], out)
    label = f"webgpu-conv-{name}" + (" (pinned)" if config else "")
    if out.numel() == 0:
        return _labelled(_noop(), label)

    fold = None
    ss = None
    if bn is not None:
        ss = wg.DeviceTensor.empty((2 * O,), torch.float32)
        fold = _bn_fold(mean, var, bn_w, bn_b, eps, ss)
    sx, so = _strides(x.shape, nhwc), _strides(out.shape, nhwc)
    common = render("conv_common.wgsl", IN_ACCESS=_access(aliased))
    if name == DIRECT:
        tiles_m = tiles_n = 0
        groups_xy = wg.grid(-(-M * O // WG_SIZE))
        source = render("conv2d_direct.wgsl", WG=WG_SIZE, COMMON=common)
    else:
        cfg = CONV_CONFIGS[name]
        tiles_m, tiles_n = -(-M // cfg.tile_m), -(-OG // cfg.tile_n)
        groups_xy = wg.grid(groups * tiles_m * tiles_n)
        source = render("conv2d.wgsl", COMMON=common, **cfg.values())
    # (ss_off is 0: SS is a tensor of its own)
    params = [M, O, OG, CG, KG, groups, H, W, Ho, Wo, KH, KW, SH, SW, PH, PW, DH, DW,
              x.offset, w.offset, bias.offset if bias is not None else 0, 0,
              residual.offset if residual is not None else 0, out.offset, *sx, *so,
              int(bias is not None), int(bn is not None), int(residual is not None), ACTIVATION_CODES[activation],
              f32_bits(lo), f32_bits(hi), tiles_m, tiles_n, int(nhwc)]
    # absent tensors: w bound again in their place, never read
    tensors = [x, w, bias if bias is not None else w, ss if ss is not None else w,
               residual if residual is not None else w, out]
    conv = wg.Pipeline(source).bind(tensors, params, groups_xy)
    if fold is None:
        return _labelled(conv, label)

    def run():
        fold()
        conv()
    return _labelled(run, label)


def _bn_fold(mean, var, weight, bias, eps: float, ss: wg.DeviceTensor) -> Thunk:
    """A thunk recording ``bn_fold.wgsl``: ss[:C] = weight / sqrt(var + eps), ss[C:] = bias -
    mean * ss[:C] (float32 [C] statistics; weight and bias None without affine parameters)."""
    C = mean.numel()
    ins = [mean, var] + ([weight, bias] if weight is not None else [])
    aliased = _check_buffers("conv2d batch norm", ins, ss)
    affine = weight is not None
    params = [C, mean.offset, var.offset, weight.offset if affine else 0, bias.offset if affine else 0, ss.offset,
              int(affine), f32_bits(eps)]
    tensors = [mean, var, weight if affine else mean, bias if affine else mean, ss]
    source = render("bn_fold.wgsl", WG=WG_SIZE, IN_ACCESS=_access(aliased))
    return wg.Pipeline(source).bind(tensors, params, wg.grid(-(-C // WG_SIZE)))


def pool2d(x: wg.DeviceTensor, out: wg.DeviceTensor, *, kernel, stride=None, padding=0, dilation=1,
           is_max: bool = True, count_include_pad: bool = True, nhwc: bool = False) -> Thunk:
    """A thunk recording one dispatch of ``pool.wgsl``: ``F.max_pool2d`` (``is_max``; padding is
    -inf, a NaN in the window wins) or ``F.avg_pool2d`` (``count_include_pad``: the padding
    zeros count in the divisor) of x into out, floor mode.

    Args:
        x: float32 [N, C, H, W] (``nhwc``: [N, H, W, C]).
        out: float32 [N, C, Ho, Wo] (``nhwc``: [N, Ho, Wo, C]), overlapping x nowhere.
        kernel, stride (None: the kernel), padding, dilation: an int or a pair each; padding at
            most half the kernel (torch's rule).

    Raises YirageError for shapes or attributes that do not fit together, a dtype other than
    float32, an output overlapping x, or sizes past the device's limits."""
    (KH, KW) = _pair(kernel, "kernel")
    (SH, SW) = _pair(kernel if stride is None else stride, "stride")
    (PH, PW), (DH, DW) = _pair(padding, "padding"), _pair(dilation, "dilation")
    if len(x.shape) != 4 or len(out.shape) != 4:
        raise YirageError(f"webgpu pool2d: x {tuple(x.shape)} and out {tuple(out.shape)} must be 4-d")
    N, C, H, W = _dims(x.shape, nhwc)
    Ho, Wo = out_size(H, KH, SH, PH, DH), out_size(W, KW, SW, PW, DW)
    want = (N, Ho, Wo, C) if nhwc else (N, C, Ho, Wo)
    if (min(KH, KW, SH, SW, DH, DW) < 1 or min(PH, PW) < 0 or 2 * PH > KH or 2 * PW > KW
            or tuple(out.shape) != want):
        raise YirageError(f"webgpu pool2d: x {tuple(x.shape)} ({'nhwc' if nhwc else 'nchw'}), kernel {(KH, KW)}, "
                          f"stride {(SH, SW)}, padding {(PH, PW)}, dilation {(DH, DW)} and out {tuple(out.shape)} "
                          f"do not fit together (out should be {want}; padding at most half the kernel)")
    return _pool(x, out, "max_pool2d" if is_max else "avg_pool2d", 0 if is_max else 1, (KH, KW, SH, SW, PH, PW, DH, DW),
                 bool(count_include_pad), nhwc)


def adaptive_avg_pool2d(x: wg.DeviceTensor, out: wg.DeviceTensor) -> Thunk:
    """A thunk recording one dispatch of ``pool.wgsl``: ``F.adaptive_avg_pool2d`` of x
    [N, C, H, W] into out [N, C, oh, ow] (both float32 NCHW; out's size is the output size):
    output cell (i, j) averages rows floor(i * H / oh) .. ceil((i + 1) * H / oh) and the same
    for columns. Raises YirageError for shapes that do not fit, a dtype other than float32, an
    output overlapping x, or sizes past the device's limits."""
    if len(x.shape) != 4 or len(out.shape) != 4 or tuple(out.shape[:2]) != tuple(x.shape[:2]) or min(out.shape[2:]) < 1:
        raise YirageError(f"webgpu adaptive_avg_pool2d: x {tuple(x.shape)} and out {tuple(out.shape)} must be "
                          "[N, C, H, W] and [N, C, oh, ow] with oh, ow >= 1")
    return _pool(x, out, "adaptive_avg_pool2d", 2, (1, 1, 1, 1, 0, 0, 1, 1), False, False)


def _pool(x, out, what: str, mode: int, window: tuple, count_pad: bool, nhwc: bool) -> Thunk:
    aliased = _check_buffers(what, [x], out)
    if out.numel() == 0:
        return _labelled(_noop(), f"webgpu-{what}")
    N, C, H, W = _dims(x.shape, nhwc)
    _, _, Ho, Wo = _dims(out.shape, nhwc)
    total = out.numel()
    params = [total, C, H, W, Ho, Wo, *window, x.offset, out.offset, *_strides(x.shape, nhwc),
              *_strides(out.shape, nhwc), mode, int(count_pad), int(nhwc), _NEG_INF_BITS]
    source = render("pool.wgsl", WG=WG_SIZE, IN_ACCESS=_access(aliased))
    thunk = wg.Pipeline(source).bind([x, out], params, wg.grid(-(-total // WG_SIZE)))
    return _labelled(thunk, f"webgpu-{what}")


def batch_norm(x: wg.DeviceTensor, mean: wg.DeviceTensor, var: wg.DeviceTensor, weight: wg.DeviceTensor | None,
               bias: wg.DeviceTensor | None, out: wg.DeviceTensor, eps: float) -> Thunk:
    """A thunk recording one dispatch of ``batch_norm.wgsl``: inference BatchNorm over dim 1 of
    x [N, C, ...] into out (x's shape): ``x * alpha + beta`` with ``alpha = weight / sqrt(var +
    eps)`` and ``beta = bias - mean * alpha`` per channel (torch's CPU kernel's formula; weight
    and bias both None without affine parameters). All float32, the statistics [C]. ``out`` may
    be x itself (the same elements: in place) but overlap no input otherwise. Raises YirageError
    for shapes that do not fit, a dtype other than float32, an overlapping output, or sizes past
    the device's limits."""
    if len(x.shape) < 2 or tuple(out.shape) != tuple(x.shape) or (weight is None) != (bias is None):
        raise YirageError(f"webgpu batch_norm: x {tuple(x.shape)} must be [N, C, ...] and out {tuple(out.shape)} "
                          "the same; weight and bias both or neither")
    C = x.shape[1]
    stats = [mean, var] + ([weight, bias] if weight is not None else [])
    for t in stats:
        if tuple(t.shape) != (C,):
            raise YirageError(f"webgpu batch_norm: the statistics and affine parameters must be [{C}], got "
                              f"{tuple(t.shape)}")
    aliased = _check_buffers("batch_norm", [x, *stats], out, in_place=x)
    if out.numel() == 0:
        return _labelled(_noop(), "webgpu-batch_norm")
    affine = weight is not None
    total, inner = x.numel(), math.prod(x.shape[2:])
    params = [total, C, inner, x.offset, mean.offset, var.offset, weight.offset if affine else 0,
              bias.offset if affine else 0, out.offset, int(affine), f32_bits(eps)]
    tensors = [x, mean, var, weight if affine else mean, bias if affine else mean, out]
    source = render("batch_norm.wgsl", WG=WG_SIZE, IN_ACCESS=_access(aliased))
    thunk = wg.Pipeline(source).bind(tensors, params, wg.grid(-(-total // WG_SIZE)))
    return _labelled(thunk, "webgpu-batch_norm")


# ---- the ops ----------------------------------------------------------------------------------
def _all_float32(node, graph) -> bool:
    return (all(graph.tensors[i].dtype == DType.float32 for i in node.inputs)
            and graph.tensors[node.output].dtype == DType.float32)


def supports_conv2d(node, graph) -> bool:
    """Can ``bind_conv2d`` run this ``conv2d`` node? float32 inputs and output (the BatchNorm
    statistics too), layout 'nchw' or 'nhwc', an activation of ``ACTIVATION_CODES`` (hardtanh
    with its two bounds), inputs that match the epilogue attributes. Never raises for a
    ``conv2d`` node; False for any other op."""
    a = node.attrs
    if node.op != "conv2d" or not _all_float32(node, graph) or a.get("layout", "nchw") not in ("nchw", "nhwc"):
        return False
    if a.get("activation") not in ACTIVATION_CODES:
        return False
    if a.get("activation") == "hardtanh" and len(a.get("act_args") or ()) != 2:
        return False
    try:
        c = conv_inputs([graph.tensors[i] for i in node.inputs], a)
    except (ValueError, KeyError):
        return False
    return len(c.x.shape) == 4 and len(c.weight.shape) == 4


def bind_conv2d(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor, status=None, *,
                config: str | None = None) -> Thunk:
    """A thunk computing a ``conv2d`` node that ``supports_conv2d`` accepts (``conv2d``).

    Args:
        args: the node's inputs as float32 DeviceTensors, in ir/conv.py's ``ConvInputs``
            order: x, weight, [bias], [running_mean, running_var, [bn_weight, bn_bias]]
            (attr ``bn``), [residual] (attr ``residual``).
        out: float32 DeviceTensor of the node's output shape, overlapping no input.
        status: the executor's status slot (unused: these kernels check nothing at run time).
        config: 'direct' or a ``CONV_CONFIGS`` name to run instead of ``conv_config``'s.

    Raises YirageError for inputs that do not match the attributes or the shapes (see
    ``conv2d``); BackendUnavailableError without a WebGPU adapter."""
    a = node.attrs
    try:
        c = conv_inputs(list(args), a)
    except ValueError as e:
        raise YirageError(f"webgpu conv2d: {e}") from None
    bn = None
    if a.get("bn"):
        bn = (c.mean, c.var, c.bn_weight, c.bn_bias, float(a["bn"]["eps"]))
    return conv2d(c.x, c.weight, out, stride=a["stride"], padding=a["padding"], dilation=a["dilation"],
                  groups=a["groups"], bias=c.bias, bn=bn, residual=c.residual, activation=a.get("activation"),
                  act_args=a.get("act_args") or (), nhwc=a.get("layout", "nchw") == "nhwc", config=config)


def supports_conv2d_stack(node, graph) -> bool:
    """Can ``bind_conv2d_stack`` run this ``conv2d_stack`` node? Each part is a ``conv2d`` that
    ``supports_conv2d`` accepts. False for any other op."""
    if node.op != "conv2d_stack" or graph.tensors[node.output].dtype != DType.float32:
        return False
    try:
        parts = conv2d_stack_parts(list(node.inputs), node.attrs)
    except (ValueError, KeyError, TypeError):
        return False
    from ...ir.ops import OPS
    for attrs, ids in parts:
        try:
            t = OPS["conv2d"].infer([graph.tensors[i] for i in ids], attrs)
        except Exception:  # noqa: BLE001 - a part the shape rule refuses is not ours to run
            return False
        probe = _Probe(graph, ids, t)
        if not supports_conv2d(OpNode("conv2d", list(ids), attrs, probe.out_id), probe):
            return False
    return True


class _Probe:
    """A graph view for one part of a ``conv2d_stack``: ``tensors`` has the part's inputs and
    its output type (at ``out_id``), so ``supports_conv2d`` can inspect it."""

    def __init__(self, graph, ids, out_type):
        self.out_id = -1
        self.tensors = {i: graph.tensors[i] for i in ids}
        self.tensors[self.out_id] = out_type


def bind_conv2d_stack(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor, status=None) -> Thunk:
    """A thunk computing a ``conv2d_stack`` that ``supports_conv2d_stack`` accepts: each part as
    the ``conv2d`` it stands for (``bind_conv2d``, its own kernel choice), into its view of the
    flat ``out`` (backends/base.py's ``bind_conv2d_stack_parts``). Raises as ``bind_conv2d``."""
    return bind_conv2d_stack_parts(node, graph, args, out, status, bind_conv2d)


def supports_pool2d(node, graph) -> bool:
    """Can ``bind_pool2d`` run this ``max_pool2d`` / ``avg_pool2d`` node? float32 x and output,
    layout 'nchw' or 'nhwc'; floor mode (no ``ceil_mode``), no ``divisor_override``, and for
    avg_pool2d no dilation (torch's has none). False for any other op."""
    a = node.attrs
    if node.op not in ("max_pool2d", "avg_pool2d") or not _all_float32(node, graph) or len(node.inputs) != 1:
        return False
    if a.get("layout", "nchw") not in ("nchw", "nhwc") or a.get("ceil_mode") or a.get("divisor_override") is not None:
        return False
    if node.op == "avg_pool2d" and tuple(a.get("dilation", (1, 1))) != (1, 1):
        return False
    return len(graph.tensors[node.inputs[0]].shape) == 4


def bind_pool2d(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor, status=None) -> Thunk:
    """A thunk computing a ``max_pool2d`` / ``avg_pool2d`` node that ``supports_pool2d``
    accepts (``pool2d``): args [x], float32 DeviceTensors. Raises as ``pool2d``."""
    a = node.attrs
    return pool2d(args[0], out, kernel=a["kernel"], stride=a["stride"], padding=a["padding"],
                  dilation=a.get("dilation", (1, 1)), is_max=node.op == "max_pool2d",
                  count_include_pad=bool(a.get("count_include_pad", True)), nhwc=a.get("layout", "nchw") == "nhwc")


def supports_adaptive_avg_pool2d(node, graph) -> bool:
    """Can ``bind_adaptive_avg_pool2d`` run this node? float32 4-d x and output (NCHW). False
    for any other op."""
    return (node.op == "adaptive_avg_pool2d" and len(node.inputs) == 1 and _all_float32(node, graph)
            and len(graph.tensors[node.inputs[0]].shape) == 4 and node.attrs.get("layout", "nchw") == "nchw")


def bind_adaptive_avg_pool2d(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor, status=None) -> Thunk:
    """A thunk computing an ``adaptive_avg_pool2d`` node (``adaptive_avg_pool2d``): args [x],
    float32 DeviceTensors; out [N, C, oh, ow] (``output_size``). Raises as
    ``adaptive_avg_pool2d``, and YirageError when out's size is not ``output_size``."""
    if tuple(out.shape[2:]) != tuple(node.attrs["output_size"]):
        raise YirageError(f"webgpu adaptive_avg_pool2d: out {tuple(out.shape)} does not have the output size "
                          f"{tuple(node.attrs['output_size'])}")
    return adaptive_avg_pool2d(args[0], out)


def supports_batch_norm(node, graph) -> bool:
    """Can ``bind_batch_norm`` run this ``batch_norm`` node? float32 x [N, C, ...], statistics
    and output (inputs x, running_mean, running_var, then weight and bias with ``affine``).
    False for any other op."""
    return (node.op == "batch_norm" and _all_float32(node, graph)
            and len(node.inputs) == (5 if node.attrs.get("affine") else 3)
            and len(graph.tensors[node.inputs[0]].shape) >= 2)


def bind_batch_norm(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor, status=None) -> Thunk:
    """A thunk computing a ``batch_norm`` node that ``supports_batch_norm`` accepts
    (``batch_norm``): args [x, running_mean, running_var, (weight, bias)], float32
    DeviceTensors. Raises as ``batch_norm``."""
    a = node.attrs
    weight, bias = (args[3], args[4]) if a.get("affine") else (None, None)
    return batch_norm(args[0], args[1], args[2], weight, bias, out, float(a["eps"]))


#: op -> (supports(node, graph), bind(node, graph, args, out, status) -> thunk)
OPS: dict[str, tuple[Callable, Callable]] = {
    "conv2d": (supports_conv2d, bind_conv2d),
    "conv2d_stack": (supports_conv2d_stack, bind_conv2d_stack),
    "max_pool2d": (supports_pool2d, bind_pool2d),
    "avg_pool2d": (supports_pool2d, bind_pool2d),
    "adaptive_avg_pool2d": (supports_adaptive_avg_pool2d, bind_adaptive_avg_pool2d),
    "batch_norm": (supports_batch_norm, bind_batch_norm),
}


def supports(node, graph) -> bool:
    """Does this module have a kernel for ``node`` (``OPS``)? Never raises."""
    entry = OPS.get(node.op)
    return bool(entry and entry[0](node, graph))


def bind(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor, status=None) -> Thunk:
    """The thunk for ``node`` (one that ``supports`` accepts), by ``OPS``. KeyError for an op
    not in ``OPS``; otherwise raises as the op's binder."""
    return OPS[node.op][1](node, graph, args, out, status)


__all__ = ["ACTIVATION_CODES", "ConvConfig", "CONV_CONFIGS", "DIRECT", "DIRECT_MAX_OG", "conv_config", "f32_bits",
           "conv2d", "pool2d", "adaptive_avg_pool2d", "batch_norm", "supports_conv2d", "bind_conv2d",
           "supports_conv2d_stack", "bind_conv2d_stack", "supports_pool2d", "bind_pool2d",
           "supports_adaptive_avg_pool2d", "bind_adaptive_avg_pool2d", "supports_batch_norm", "bind_batch_norm",
           "OPS", "supports", "bind"]
