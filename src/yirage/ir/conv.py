"""The convolutional-network ops of the op table: ``conv2d``, ``max_pool2d``, ``avg_pool2d``,
``adaptive_avg_pool2d`` and ``batch_norm`` (inference), all over NCHW tensors.

``conv2d`` and the window pools take ``layout="nhwc"`` too (x and output [N, H, W, C]; the
channels-last pass, transforms/conv.py, makes them), and ``conv2d`` an epilogue: inference
batch norm folded in (``bn``), a residual added, then an activation (``conv2d_epilogue``).
``conv2d_stack`` is several ``conv2d`` of one x as one op (transforms/parallel.py makes it):
its output is the parts' outputs flattened one after another, each taken as a free view.

Each has a shape rule (``infer``, a GraphError naming the op, the shapes and the rule broken)
and a torch reference (``torch.nn.functional``, computed in float32 and cast back to the
input's dtype), registered in ``ir.ops.OPS`` like every other op. Output sizes follow torch:
``floor((H + 2 * padding - dilation * (kernel - 1) - 1) / stride) + 1`` (``ceil_mode`` is not
supported), and adaptive pooling's window of output cell i spans rows
``floor(i * H / out) .. ceil((i + 1) * H / out)``.

This module must never depend on a backend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..dtypes import DType
from .ops import TensorType, _fail, _register


def out_size(n: int, kernel: int, stride: int, padding: int, dilation: int = 1) -> int:
    """Output length of a window sliding over ``n`` (torch's formula, floor mode)."""
    return (n + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _float_nchw(op: str, ts: list[TensorType]) -> None:
    x = ts[0]
    if len(x.shape) != 4:
        _fail(op, ts, "x must be 4-d [N, C, H, W]")
    if not x.dtype.is_float:
        _fail(op, ts, f"x must be floating point, got {x.dtype.value}")


def _windows(op: str, ts: list[TensorType], kernel, stride, padding, dilation=(1, 1)) -> tuple[int, int]:
    """(Ho, Wo) of a window op, checking its attributes."""
    H, W = ts[0].shape[2:]
    for name, pair, low in (("kernel", kernel, 1), ("stride", stride, 1), ("dilation", dilation, 1),
                            ("padding", padding, 0)):
        if len(pair) != 2 or any(v < low for v in pair):
            _fail(op, ts, f"{name} must be two integers >= {low}, got {tuple(pair)}")
    ho, wo = (out_size(n, k, s, p, d) for n, k, s, p, d in zip((H, W), kernel, stride, padding, dilation))
    if ho < 1 or wo < 1:
        _fail(op, ts, f"the {tuple(kernel)} window (dilation {tuple(dilation)}, padding {tuple(padding)}) does "
                      f"not fit the {H}x{W} input")
    return ho, wo


# ---- conv2d ---------------------------------------------------------------------------------

#: activations a conv2d epilogue may apply (``activation`` attr): name -> torch function of
#: (y, args). ``hardtanh`` is ``clamp(y, args[0], args[1])`` (ReLU6: 0, 6).
ACTIVATIONS = {
    "relu": lambda y, a: torch.relu(y),
    "hardtanh": lambda y, a: torch.clamp(y, a[0], a[1]),
    "silu": lambda y, a: F.silu(y),
    "sigmoid": lambda y, a: torch.sigmoid(y),
    "tanh": lambda y, a: torch.tanh(y),
}
#: the same activations applied in place (the kernels' torch-op epilogues)
ACTIVATIONS_INPLACE = {
    "relu": lambda y, a: torch.relu_(y),
    "hardtanh": lambda y, a: y.clamp_(a[0], a[1]),
    "silu": lambda y, a: F.silu(y, inplace=True),
    "sigmoid": lambda y, a: y.sigmoid_(),
    "tanh": lambda y, a: y.tanh_(),
}


@dataclass
class ConvInputs:
    """The inputs of a ``conv2d`` op by role (each a tensor, a TensorType or None), in the
    order the op takes them: x, weight, [bias], [running_mean, running_var, [bn_weight,
    bn_bias]] (attr ``bn``), [residual] (attr ``residual``)."""

    x: object
    weight: object
    bias: object = None
    mean: object = None
    var: object = None
    bn_weight: object = None
    bn_bias: object = None
    residual: object = None


def conv_arity(attrs: dict, has_bias: bool) -> int:
    """How many inputs a ``conv2d`` with these attrs takes (x and weight included)."""
    bn = attrs.get("bn")
    return 2 + has_bias + (0 if not bn else 4 if bn["affine"] else 2) + bool(attrs.get("residual"))


def conv_inputs(items: list, attrs: dict) -> ConvInputs:
    """Split ``conv2d``'s inputs by role (see ``ConvInputs``); ValueError when their number does
    not match the attrs. Graphs without the epilogue attrs (``bias`` absent) have a bias iff
    they have three inputs."""
    has_bias = attrs.get("bias", len(items) == 3)
    bn = attrs.get("bn")
    want = conv_arity(attrs, has_bias)
    if len(items) != want:
        raise ValueError(f"conv2d: {len(items)} inputs, but its attributes (bias={has_bias}, bn={bn}, "
                         f"residual={bool(attrs.get('residual'))}) need {want}")
    it = iter(items)
    c = ConvInputs(next(it), next(it))
    if has_bias:
        c.bias = next(it)
    if bn:
        c.mean, c.var = next(it), next(it)
        if bn["affine"]:
            c.bn_weight, c.bn_bias = next(it), next(it)
    if attrs.get("residual"):
        c.residual = next(it)
    return c


def to_nchw(shape) -> tuple:
    """An NHWC shape [N, H, W, C] as NCHW [N, C, H, W]."""
    n, h, w, c = shape
    return (n, c, h, w)


def to_nhwc(shape) -> tuple:
    """An NCHW shape [N, C, H, W] as NHWC [N, H, W, C]."""
    n, c, h, w = shape
    return (n, h, w, c)


def _conv2d_infer(ts, attrs):
    layout = attrs.get("layout", "nchw")
    if layout not in ("nchw", "nhwc"):
        _fail("conv2d", ts, f"layout must be 'nchw' or 'nhwc', got {layout!r}")
    try:
        c = conv_inputs(ts, attrs)
    except ValueError as e:
        _fail("conv2d", ts, str(e))
    x = c.x if layout == "nchw" else TensorType(to_nchw(c.x.shape), c.x.dtype) if len(c.x.shape) == 4 else c.x
    _float_nchw("conv2d", [x])
    w = c.weight
    groups = attrs["groups"]
    if len(w.shape) != 4 or w.dtype != x.dtype:
        _fail("conv2d", ts, f"weight must be 4-d [out_channels, in_channels / groups, kh, kw] in x's dtype "
                            f"{x.dtype.value}")
    N, C, H, W = x.shape
    O, cg, kh, kw = w.shape
    if groups < 1 or C % groups or O % groups or cg != C // groups:
        _fail("conv2d", ts, f"groups={groups} must divide in_channels {C} and out_channels {O}, and the "
                            f"weight's dim 1 must be in_channels / groups = {C // max(groups, 1)}")
    if c.bias is not None and (tuple(c.bias.shape) != (O,) or c.bias.dtype != x.dtype):
        _fail("conv2d", ts, f"bias must have shape ({O},) and x's dtype")
    for t in (c.mean, c.var, c.bn_weight, c.bn_bias):
        if t is not None and (tuple(t.shape) != (O,) or t.dtype not in (DType.float32, x.dtype)):
            _fail("conv2d", ts, f"the batch-norm statistics and affine parameters must be [{O}] in float32 or "
                                f"x's dtype {x.dtype.value}")
    act = attrs.get("activation")
    if act is not None and act not in ACTIVATIONS:
        _fail("conv2d", ts, f"activation must be one of {sorted(ACTIVATIONS)} or None, got {act!r}")
    ho, wo = _windows("conv2d", [x], (kh, kw), attrs["stride"], attrs["padding"], attrs["dilation"])
    out = (N, O, ho, wo) if layout == "nchw" else (N, ho, wo, O)
    if c.residual is not None and (tuple(c.residual.shape) != out or c.residual.dtype != x.dtype):
        _fail("conv2d", ts, f"the residual must have the output's shape {out} and x's dtype")
    return TensorType(out, x.dtype)


def bn_scale_shift(mean, var, weight, bias, eps: float):
    """Inference BatchNorm as ``y * scale + shift`` per channel: ``scale = weight / sqrt(var +
    eps)``, ``shift = bias - mean * scale`` (float32 [C] each; weight and bias may be None)."""
    scale = torch.rsqrt(var.float() + eps)
    if weight is not None:
        scale = scale * weight.float()
    shift = -mean.float() * scale
    if bias is not None:
        shift = shift + bias.float()
    return scale, shift


def conv_class(c: "ConvInputs", attrs: dict) -> str:
    """The geometry part of a ``conv2d``'s shape class for kernel choice (``tuning``): layout,
    kernel size, stride, groups ('dw': depthwise) and a residual, e.g. ``/nhwc/3x3/s2/g1/res``."""
    O, cg, kh, kw = c.weight.shape
    return (f"/{attrs.get('layout', 'nchw')}/{kh}x{kw}/s{attrs['stride'][0]}"
            f"/g{'dw' if attrs['groups'] == O and cg == 1 else attrs['groups']}"
            + ("/res" if c.residual is not None else ""))


def conv2d_epilogue(y, c: ConvInputs, attrs: dict):
    """The epilogue of a ``conv2d`` on its float32 NCHW result ``y`` (``c``'s tensors NCHW):
    inference batch norm with the running statistics (``(y - mean) / sqrt(var + eps) *
    bn_weight + bn_bias``, attr ``bn`` {"eps", "affine"}), plus the residual, then the
    activation (attr ``activation``, see ``ACTIVATIONS``; args in ``act_args``)."""
    if attrs.get("bn"):
        y = F.batch_norm(y, *(None if t is None else t.float() for t in (c.mean, c.var, c.bn_weight, c.bn_bias)),
                         training=False, eps=attrs["bn"]["eps"])
    if c.residual is not None:
        y = y + c.residual.float()
    if attrs.get("activation"):
        y = ACTIVATIONS[attrs["activation"]](y, attrs.get("act_args") or [])
    return y


def conv2d_reference(args, attrs):
    """``F.conv2d`` in float32, then the epilogue (``conv2d_epilogue``), cast back to x's
    dtype; with ``layout="nhwc"`` x, the residual and the output are [N, H, W, C] (the weight
    stays [O, C / groups, kh, kw])."""
    c = conv_inputs(list(args), attrs)
    nhwc = attrs.get("layout", "nchw") == "nhwc"
    x = c.x.permute(0, 3, 1, 2) if nhwc else c.x
    if nhwc and c.residual is not None:
        c.residual = c.residual.permute(0, 3, 1, 2)
    b = c.bias.float() if c.bias is not None else None
    y = F.conv2d(x.float(), c.weight.float(), b, tuple(attrs["stride"]), tuple(attrs["padding"]),
                 tuple(attrs["dilation"]), attrs["groups"])
    y = conv2d_epilogue(y, c, attrs).to(c.x.dtype)
    return y.permute(0, 2, 3, 1).contiguous() if nhwc else y


# ---- conv2d_stack: parallel convolutions of one input ---------------------------------------

def conv2d_stack_parts(items: list, attrs: dict) -> list[tuple[dict, list]]:
    """The ``conv2d`` ops a ``conv2d_stack`` stands for, as ``(attrs, inputs)`` per part: the
    stack's inputs are x, then each part's ``conv2d`` inputs after x in part order (each
    part's attrs, in ``attrs["parts"]``, give its count: ``bias`` is explicit). ValueError when
    the inputs do not add up to what the parts take."""
    parts, pos = [], 1
    for a in attrs["parts"]:
        n = conv_arity(a, bool(a["bias"])) - 1
        parts.append((a, [items[0], *items[pos:pos + n]]))
        pos += n
    if pos != len(items):
        raise ValueError(f"conv2d_stack: {len(items)} inputs, but its {len(attrs['parts'])} parts take {pos}")
    return parts


def _conv2d_stack_infer(ts, attrs):
    if not attrs.get("parts"):
        _fail("conv2d_stack", ts, "needs one or more parts")
    try:
        parts = conv2d_stack_parts(ts, attrs)
    except (ValueError, KeyError) as e:
        _fail("conv2d_stack", ts, str(e))
    outs = [_conv2d_infer(ins, a) for a, ins in parts]
    if any(a.get("residual") for a, _ in parts):
        _fail("conv2d_stack", ts, "a part with a residual cannot be stacked (its residual comes later)")
    return TensorType((sum(math.prod(o.shape) for o in outs),), ts[0].dtype)


def conv2d_stack_reference(args, attrs):
    """The parts' ``conv2d`` outputs (``conv2d_reference`` each), flattened and concatenated:
    part i's output is the elements ``[sum(numel[:i]), sum(numel[:i + 1]))`` of the result."""
    return torch.cat([conv2d_reference(ins, a).reshape(-1) for a, ins in conv2d_stack_parts(list(args), attrs)])


# ---- pooling ------------------------------------------------------------------------------

def _pool_infer(op):
    def infer(ts, attrs):
        nhwc = attrs.get("layout", "nchw") == "nhwc"
        x = TensorType(to_nchw(ts[0].shape), ts[0].dtype) if nhwc and len(ts[0].shape) == 4 else ts[0]
        _float_nchw(op, [x])
        k, p = attrs["kernel"], attrs["padding"]
        if any(2 * pi > ki for pi, ki in zip(p, k)):
            _fail(op, ts, f"padding {tuple(p)} must be at most half the kernel {tuple(k)} (torch's rule)")
        ho, wo = _windows(op, [x], k, attrs["stride"], p, attrs.get("dilation", (1, 1)))
        N, C = x.shape[:2]
        return TensorType((N, ho, wo, C) if nhwc else (N, C, ho, wo), x.dtype)
    return infer


def _in_layout(fn):
    """A pooling reference over NCHW, made to take and give [N, H, W, C] when ``layout="nhwc"``."""
    def ref(args, attrs):
        if attrs.get("layout", "nchw") != "nhwc":
            return fn(args, attrs)
        return fn([args[0].permute(0, 3, 1, 2)], attrs).permute(0, 2, 3, 1).contiguous()
    ref.__doc__ = fn.__doc__
    return ref


@_in_layout
def max_pool2d_reference(args, attrs):
    """``F.max_pool2d`` (padding counts as -inf), in float32, cast back."""
    x = args[0]
    return F.max_pool2d(x.float(), tuple(attrs["kernel"]), tuple(attrs["stride"]), tuple(attrs["padding"]),
                        tuple(attrs["dilation"])).to(x.dtype)


@_in_layout
def avg_pool2d_reference(args, attrs):
    """``F.avg_pool2d`` (``count_include_pad``: padding zeros count in the divisor), in float32."""
    x = args[0]
    return F.avg_pool2d(x.float(), tuple(attrs["kernel"]), tuple(attrs["stride"]), tuple(attrs["padding"]),
                        count_include_pad=attrs["count_include_pad"]).to(x.dtype)


def _adaptive_infer(ts, attrs):
    _float_nchw("adaptive_avg_pool2d", ts)
    oh, ow = attrs["output_size"]
    if oh < 1 or ow < 1:
        _fail("adaptive_avg_pool2d", ts, f"output_size must be positive, got {(oh, ow)}")
    N, C = ts[0].shape[:2]
    return TensorType((N, C, oh, ow), ts[0].dtype)


def adaptive_avg_pool2d_reference(args, attrs):
    """``F.adaptive_avg_pool2d`` in float32, cast back."""
    x = args[0]
    return F.adaptive_avg_pool2d(x.float(), tuple(attrs["output_size"])).to(x.dtype)


# ---- batch_norm (inference) ---------------------------------------------------------------

def _batch_norm_infer(ts, attrs):
    x = ts[0]
    if len(x.shape) < 2 or not x.dtype.is_float:
        _fail("batch_norm", ts, "x must be floating point [N, C, ...]")
    C = x.shape[1]
    for t in ts[1:]:
        if tuple(t.shape) != (C,) or t.dtype not in (DType.float32, x.dtype):
            _fail("batch_norm", ts, f"running_mean, running_var, weight and bias must be [{C}] (C) in float32 "
                                    f"or x's dtype {x.dtype.value}")
    return x


def batch_norm_reference(args, attrs):
    """Inference batch normalization (Ioffe & Szegedy 2015) with the running statistics (float32
    or x's dtype): ``(x - mean[c]) / sqrt(var[c] + eps) * weight[c] + bias[c]`` over channel dim
    1, in float32 (``F.batch_norm(training=False)``), cast back to x's dtype. Inputs: x, running_mean,
    running_var, then weight and bias when ``affine``."""
    x, mean, var = (t.float() for t in args[:3])
    w, b = (args[3].float(), args[4].float()) if attrs["affine"] else (None, None)
    return F.batch_norm(x, mean, var, w, b, training=False, eps=attrs["eps"]).to(args[0].dtype)


_register("conv2d", "library", -1, _conv2d_infer, conv2d_reference)
_register("conv2d_stack", "library", -1, _conv2d_stack_infer, conv2d_stack_reference)
_register("max_pool2d", "library", 1, _pool_infer("max_pool2d"), max_pool2d_reference)
_register("avg_pool2d", "library", 1, _pool_infer("avg_pool2d"), avg_pool2d_reference)
_register("adaptive_avg_pool2d", "library", 1, _adaptive_infer, adaptive_avg_pool2d_reference)
_register("batch_norm", "library", -1, _batch_norm_infer, batch_norm_reference)

__all__ = ["out_size", "bn_scale_shift", "conv2d_reference", "conv2d_stack_parts", "conv2d_stack_reference", "max_pool2d_reference", "avg_pool2d_reference",
           "adaptive_avg_pool2d_reference", "batch_norm_reference"]
