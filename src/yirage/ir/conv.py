"""The convolutional-network ops of the op table: ``conv2d``, ``max_pool2d``, ``avg_pool2d``,
``adaptive_avg_pool2d`` and ``batch_norm`` (inference), all over NCHW tensors.

Each has a shape rule (``infer``, a GraphError naming the op, the shapes and the rule broken)
and a torch reference (``torch.nn.functional``, computed in float32 and cast back to the
input's dtype), registered in ``ir.ops.OPS`` like every other op. Output sizes follow torch:
``floor((H + 2 * padding - dilation * (kernel - 1) - 1) / stride) + 1`` (``ceil_mode`` is not
supported), and adaptive pooling's window of output cell i spans rows
``floor(i * H / out) .. ceil((i + 1) * H / out)``.

This module must never depend on a backend.
"""
from __future__ import annotations

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


# ---- conv2d -------------------------------------------------------------------------------

def _conv2d_infer(ts, attrs):
    _float_nchw("conv2d", ts)
    x, w = ts[0], ts[1]
    groups = attrs["groups"]
    if len(w.shape) != 4 or w.dtype != x.dtype:
        _fail("conv2d", ts, f"weight must be 4-d [out_channels, in_channels / groups, kh, kw] in x's dtype "
                            f"{x.dtype.value}")
    N, C, H, W = x.shape
    O, cg, kh, kw = w.shape
    if groups < 1 or C % groups or O % groups or cg != C // groups:
        _fail("conv2d", ts, f"groups={groups} must divide in_channels {C} and out_channels {O}, and the "
                            f"weight's dim 1 must be in_channels / groups = {C // max(groups, 1)}")
    if len(ts) == 3 and (tuple(ts[2].shape) != (O,) or ts[2].dtype != x.dtype):
        _fail("conv2d", ts, f"bias must have shape ({O},) and x's dtype")
    ho, wo = _windows("conv2d", ts, (kh, kw), attrs["stride"], attrs["padding"], attrs["dilation"])
    return TensorType((N, O, ho, wo), x.dtype)


def conv2d_reference(args, attrs):
    """``F.conv2d`` in float32, cast back to x's dtype."""
    x, w = args[0], args[1]
    b = args[2].float() if len(args) == 3 else None
    y = F.conv2d(x.float(), w.float(), b, tuple(attrs["stride"]), tuple(attrs["padding"]),
                 tuple(attrs["dilation"]), attrs["groups"])
    return y.to(x.dtype)


# ---- pooling ------------------------------------------------------------------------------

def _pool_infer(op):
    def infer(ts, attrs):
        _float_nchw(op, ts)
        k, p = attrs["kernel"], attrs["padding"]
        if any(2 * pi > ki for pi, ki in zip(p, k)):
            _fail(op, ts, f"padding {tuple(p)} must be at most half the kernel {tuple(k)} (torch's rule)")
        ho, wo = _windows(op, ts, k, attrs["stride"], p, attrs.get("dilation", (1, 1)))
        N, C = ts[0].shape[:2]
        return TensorType((N, C, ho, wo), ts[0].dtype)
    return infer


def max_pool2d_reference(args, attrs):
    """``F.max_pool2d`` (padding counts as -inf), in float32, cast back."""
    x = args[0]
    return F.max_pool2d(x.float(), tuple(attrs["kernel"]), tuple(attrs["stride"]), tuple(attrs["padding"]),
                        tuple(attrs["dilation"])).to(x.dtype)


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
        if tuple(t.shape) != (C,) or t.dtype != DType.float32:
            _fail("batch_norm", ts, f"running_mean, running_var, weight and bias must be float32 [{C}] (C)")
    return x


def batch_norm_reference(args, attrs):
    """Inference batch normalization (Ioffe & Szegedy 2015) with the running statistics:
    ``(x - mean[c]) / sqrt(var[c] + eps) * weight[c] + bias[c]`` over channel dim 1, in
    float32 (``F.batch_norm(training=False)``), cast back to x's dtype. Inputs: x, running_mean,
    running_var, then weight and bias when ``affine``."""
    x, mean, var = args[:3]
    w, b = (args[3], args[4]) if attrs["affine"] else (None, None)
    return F.batch_norm(x.float(), mean, var, w, b, training=False, eps=attrs["eps"]).to(x.dtype)


_register("conv2d", "library", -1, _conv2d_infer, conv2d_reference)
_register("max_pool2d", "library", 1, _pool_infer("max_pool2d"), max_pool2d_reference)
_register("avg_pool2d", "library", 1, _pool_infer("avg_pool2d"), avg_pool2d_reference)
_register("adaptive_avg_pool2d", "library", 1, _adaptive_infer, adaptive_avg_pool2d_reference)
_register("batch_norm", "library", -1, _batch_norm_infer, batch_norm_reference)

__all__ = ["out_size", "conv2d_reference", "max_pool2d_reference", "avg_pool2d_reference",
           "adaptive_avg_pool2d_reference", "batch_norm_reference"]
