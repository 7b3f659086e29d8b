"""Convolutional-network kernels: conv2d as an implicit GEMM, a direct depthwise convolution,
and max / average pooling, over 4-d tensors in any memory layout (NCHW or NHWC: every tensor
comes with its element strides in logical [N, C, H, W] order).

conv2d (implicit GEMM, as in cuDNN's and CUTLASS's "implicit GEMM" convolutions): the output
is the GEMM ``[N*Ho*Wo, O/groups] = patches [N*Ho*Wo, C/groups*kh*kw] @ W^T`` per group, where
the patch matrix is never built: each K step decodes its columns into (channel, kernel row,
kernel column) and loads the input pixels they cover (zero outside the image). The epilogue
applies, in float32: the bias, a per-channel ``scale``/``shift`` (an inference BatchNorm), a
residual of the output's shape, then an activation (``ACT_*``).

Depthwise (groups == C == O): each program owns a tile of output pixels by channels and sums
the kh*kw window products directly (a GEMM would have K = kh*kw and one output column per
group). Same epilogue.

Pooling: max (padding is -inf; a NaN in the window wins, as torch's) and average
(``count_include_pad``), a tile of output pixels by channels per program.

Sizes come from tensor shapes checked on the host; masks keep every access inside the image.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import autotune, dot_upcast, mma, to_out

#: activation codes of the epilogue (ir/conv.py ``ACTIVATIONS``)
ACT_NONE, ACT_RELU, ACT_CLAMP, ACT_SILU, ACT_SIGMOID, ACT_TANH = range(6)
ACTIVATION_CODES = {None: ACT_NONE, "relu": ACT_RELU, "hardtanh": ACT_CLAMP, "silu": ACT_SILU,
                    "sigmoid": ACT_SIGMOID, "tanh": ACT_TANH}

_GEMM_CONFIGS = [   # the first one is what the interpreter runs
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=8, num_stages=3),
]
_DIRECT_CONFIGS = [
    triton.Config({"BLOCK_M": 32, "BLOCK_C": 32}, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_C": 64}, num_warps=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_C": 32}, num_warps=4),
    triton.Config({"BLOCK_M": 32, "BLOCK_C": 128}, num_warps=4),
]


@triton.jit
def _epilogue(acc, offs_m, offs_o, m_mask, o_mask, n, ho, wo, b_ptr, scale_ptr, shift_ptr, r_ptr, out_ptr,
              srn, src, srh, srw, son, soc, soh, sow, act_lo, act_hi,
              HAS_BIAS: tl.constexpr, HAS_BN: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr):
    """Bias, per-channel scale/shift, residual and activation on a float32 [pixels, channels]
    tile, stored into out."""
    mask = m_mask[:, None] & o_mask[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_o, mask=o_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BN:
        acc = acc * tl.load(scale_ptr + offs_o, mask=o_mask, other=0.0)[None, :] \
            + tl.load(shift_ptr + offs_o, mask=o_mask, other=0.0)[None, :]
    oc = offs_o.to(tl.int64)[None, :]
    if HAS_RES:
        r_off = n[:, None] * srn + oc * src + ho[:, None] * srh + wo[:, None] * srw
        acc += tl.load(r_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:
        acc = tl.maximum(acc, 0.0)
    elif ACT == 2:
        acc = tl.minimum(tl.maximum(acc, act_lo), act_hi)
    elif ACT == 3:
        acc = acc / (1.0 + tl.exp(-acc))
    elif ACT == 4:
        acc = 1.0 / (1.0 + tl.exp(-acc))
    elif ACT == 5:
        acc = 2.0 / (1.0 + tl.exp(-2.0 * acc)) - 1.0
    o_off = n[:, None] * son + oc * soc + ho[:, None] * soh + wo[:, None] * sow
    tl.store(out_ptr + o_off, to_out(acc, out_ptr), mask=mask)


@triton.jit
def _pixel_tile(M, C, Ho, Wo, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """The program's [BLOCK_M output pixels, BLOCK_C channels] tile of a direct kernel (grid:
    pixel tiles x channel tiles): offsets, masks and each pixel's (n, ho, wo)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    wo = offs_m % Wo
    ho = (offs_m // Wo) % Ho
    n = (offs_m // (Wo * Ho)).to(tl.int64)
    return offs_m, offs_c, offs_m < M, offs_c < C, n, ho, wo


@triton.jit
def _window_tap(x_ptr, n, hi, wi, cc, m_mask, c_mask, H, W, sxn, sxc, sxh, sxw, other):
    """x at input pixel (hi, wi) of each output pixel's window, for the tile's channels
    (``other`` outside the image), and the pixels inside it."""
    inside = m_mask & (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
    xv = tl.load(x_ptr + (n * sxn + hi * sxh + wi * sxw)[:, None] + cc[None, :] * sxc,
                 mask=inside[:, None] & c_mask[None, :], other=other)
    return xv, inside


@autotune(configs=_GEMM_CONFIGS, key=["M", "OG", "KG"])
@triton.jit
def _conv_gemm_kernel(x_ptr, w_ptr, b_ptr, scale_ptr, shift_ptr, r_ptr, out_ptr,
                      M, OG, KG, CG, H, W, Ho, Wo, KH, KW, SH, SW, PH, PW, DH, DW,
                      sxn, sxc, sxh, sxw, srn, src, srh, srw, son, soc, soh, sow, act_lo, act_hi,
                      HAS_BIAS: tl.constexpr, HAS_BN: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                      UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M pixels, BLOCK_N output channels] tile of one group per program; grid
    (tiles, groups). w is contiguous [O, C/groups, kh, kw], so group g's GEMM operand is rows
    g*OG.. of the [O, KG] matrix."""
    pid, g = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(OG, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < OG
    wo = offs_m % Wo
    ho = (offs_m // Wo) % Ho
    n = (offs_m // (Wo * Ho)).to(tl.int64)
    offs_o = g * OG + offs_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, KG, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < KG
        s = offs_k % KW
        r = (offs_k // KW) % KH
        c = (g * CG + offs_k // (KW * KH)).to(tl.int64)
        hi = ho[:, None] * SH - PH + r[None, :] * DH
        wi = wo[:, None] * SW - PW + s[None, :] * DW
        a_mask = m_mask[:, None] & k_mask[None, :] & (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
        a = tl.load(x_ptr + n[:, None] * sxn + c[None, :] * sxc + hi * sxh + wi * sxw, mask=a_mask, other=0.0)
        b = tl.load(w_ptr + offs_o.to(tl.int64)[None, :] * KG + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = mma(a, b, acc, UPCAST)
    _epilogue(acc, offs_m, offs_o, m_mask, n_mask, n, ho, wo, b_ptr, scale_ptr, shift_ptr, r_ptr, out_ptr,
              srn, src, srh, srw, son, soc, soh, sow, act_lo, act_hi, HAS_BIAS, HAS_BN, HAS_RES, ACT)


@autotune(configs=_DIRECT_CONFIGS, key=["M", "C", "KH", "KW"])
@triton.jit
def _conv_depthwise_kernel(x_ptr, w_ptr, b_ptr, scale_ptr, shift_ptr, r_ptr, out_ptr,
                           M, C, H, W, Ho, Wo, KH, KW, SH, SW, PH, PW, DH, DW,
                           sxn, sxc, sxh, sxw, srn, src, srh, srw, son, soc, soh, sow, act_lo, act_hi,
                           HAS_BIAS: tl.constexpr, HAS_BN: tl.constexpr, HAS_RES: tl.constexpr,
                           ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """One [BLOCK_M pixels, BLOCK_C channels] tile per program; w contiguous [C, 1, kh, kw]."""
    offs_m, offs_c, m_mask, c_mask, n, ho, wo = _pixel_tile(M, C, Ho, Wo, BLOCK_M, BLOCK_C)
    cc = offs_c.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for r in range(0, KH):
        hi = ho * SH - PH + r * DH
        for s in range(0, KW):
            wi = wo * SW - PW + s * DW
            xv, inside = _window_tap(x_ptr, n, hi, wi, cc, m_mask, c_mask, H, W, sxn, sxc, sxh, sxw, 0.0)
            wv = tl.load(w_ptr + cc * (KH * KW) + r * KW + s, mask=c_mask, other=0.0)
            acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
    _epilogue(acc, offs_m, offs_c, m_mask, c_mask, n, ho, wo, b_ptr, scale_ptr, shift_ptr, r_ptr, out_ptr,
              srn, src, srh, srw, son, soc, soh, sow, act_lo, act_hi, HAS_BIAS, HAS_BN, HAS_RES, ACT)


@autotune(configs=_DIRECT_CONFIGS, key=["M", "C", "KH", "KW", "IS_MAX"])
@triton.jit
def _pool_kernel(x_ptr, out_ptr, M, C, H, W, Ho, Wo, KH, KW, SH, SW, PH, PW, DH, DW,
                 sxn, sxc, sxh, sxw, son, soc, soh, sow,
                 IS_MAX: tl.constexpr, COUNT_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Max or average over each window; one [BLOCK_M pixels, BLOCK_C channels] tile per program."""
    offs_m, offs_c, m_mask, c_mask, n, ho, wo = _pixel_tile(M, C, Ho, Wo, BLOCK_M, BLOCK_C)
    cc = offs_c.to(tl.int64)
    if IS_MAX:
        acc = tl.full([BLOCK_M, BLOCK_C], float("-inf"), tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    count = tl.zeros([BLOCK_M], dtype=tl.float32)
    for r in range(0, KH):
        hi = ho * SH - PH + r * DH
        for s in range(0, KW):
            wi = wo * SW - PW + s * DW
            xv, inside = _window_tap(x_ptr, n, hi, wi, cc, m_mask, c_mask, H, W, sxn, sxc, sxh, sxw,
                                     float("-inf") if IS_MAX else 0.0)
            xv = xv.to(tl.float32)
            if IS_MAX:
                acc = tl.where((xv > acc) | (xv != xv), xv, acc)   # NaN wins
            else:
                acc += xv
            if COUNT_PAD:   # the window clipped to the padded image
                count += ((hi < H + PH) & (wi < W + PW)).to(tl.float32)
            else:
                count += inside.to(tl.float32)
    if not IS_MAX:
        acc = acc / tl.maximum(count, 1.0)[:, None]
    o_off = n[:, None] * son + cc[None, :] * soc + ho[:, None] * soh + wo[:, None] * sow
    tl.store(out_ptr + o_off, to_out(acc, out_ptr), mask=m_mask[:, None] & c_mask[None, :])


def _nchw_strides(t: torch.Tensor, nhwc: bool) -> tuple[int, int, int, int]:
    """Element strides of ``t`` in logical (n, c, h, w) order: t is NCHW, or NHWC when ``nhwc``."""
    if nhwc:
        sn, sh, sw, sc = t.stride()
        return sn, sc, sh, sw
    return tuple(t.stride())


def _dims(t: torch.Tensor, nhwc: bool) -> tuple[int, int, int, int]:
    n, a, b, c = t.shape
    return (n, c, a, b) if nhwc else (n, a, b, c)


def conv2d(x, w, bias, out, stride, padding, dilation, groups: int, scale=None, shift=None, residual=None,
           activation: str | None = None, act_args=(0.0, 0.0), nhwc: bool = False) -> None:
    """``out = act(conv2d(x, w, bias) * scale + shift + residual)`` (ir/conv.py's conv2d and its
    epilogue): x, out, residual [N, C, H, W] (``nhwc``: [N, H, W, C]) contiguous, w contiguous
    [O, C / groups, kh, kw], bias [O] (x's dtype), scale/shift float32 [O] (a BatchNorm as
    ``y * scale + shift``), all one float dtype; float32 accumulation. Depthwise convolutions
    (groups == C == O) run the direct kernel, others the implicit GEMM.

    Raises ValueError for shapes or dtypes that do not fit together."""
    N, C, H, W = _dims(x, nhwc)
    O, CG, KH, KW = w.shape
    _, _, Ho, Wo = _dims(out, nhwc)
    if (groups < 1 or C % groups or O % groups or CG != C // groups or _dims(out, nhwc)[:2] != (N, O)
            or w.dtype != x.dtype or out.dtype != x.dtype):
        raise ValueError(f"conv2d: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} and groups "
                         f"{groups} do not fit together (one float dtype)")
    if residual is not None and tuple(residual.shape) != tuple(out.shape):
        raise ValueError(f"conv2d: residual {tuple(residual.shape)} must have the output's shape {tuple(out.shape)}")
    for name, t in (("bias", bias), ("scale", scale), ("shift", shift)):
        if t is not None and tuple(t.shape) != (O,):
            raise ValueError(f"conv2d: {name} must be [{O}], got {tuple(t.shape)}")
    if out.numel() == 0:
        return
    M = N * Ho * Wo
    xs, os_ = _nchw_strides(x, nhwc), _nchw_strides(out, nhwc)
    rs = _nchw_strides(residual, nhwc) if residual is not None else (0, 0, 0, 0)
    dummy = out
    common = dict(HAS_BIAS=bias is not None, HAS_BN=scale is not None, HAS_RES=residual is not None,
                  ACT=ACTIVATION_CODES[activation])
    geom = (*stride, *padding, *dilation)
    lo, hi = (float(act_args[0]), float(act_args[1])) if activation == "hardtanh" else (0.0, 0.0)
    ptrs = (x, w, bias if bias is not None else dummy, scale if scale is not None else dummy,
            shift if shift is not None else dummy, residual if residual is not None else dummy, out)
    if groups == C == O:
        grid = lambda META: (triton.cdiv(M, META["BLOCK_M"]), triton.cdiv(C, META["BLOCK_C"]))  # noqa: E731
        _conv_depthwise_kernel[grid](*ptrs, M, C, H, W, Ho, Wo, KH, KW, *geom, *xs, *rs, *os_, lo, hi, **common)
        return
    OG, KG = O // groups, CG * KH * KW
    grid = lambda META: (triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(OG, META["BLOCK_N"]), groups)  # noqa: E731
    _conv_gemm_kernel[grid](*ptrs, M, OG, KG, CG, H, W, Ho, Wo, KH, KW, *geom, *xs, *rs, *os_, lo, hi,
                            UPCAST=dot_upcast(x), **common)


def pool2d(x, out, kernel, stride, padding, dilation=(1, 1), is_max: bool = True, count_include_pad: bool = True,
           nhwc: bool = False) -> None:
    """``F.max_pool2d`` (``is_max``) or ``F.avg_pool2d`` of x into out ([N, C, H, W], or
    [N, H, W, C] with ``nhwc``; one float dtype), float32 inside. ValueError for mismatched
    shapes or dtypes."""
    N, C, H, W = _dims(x, nhwc)
    n2, c2, Ho, Wo = _dims(out, nhwc)
    if (n2, c2) != (N, C) or out.dtype != x.dtype:
        raise ValueError(f"pool2d: out {tuple(out.shape)} does not fit x {tuple(x.shape)} (same N, C and dtype)")
    if out.numel() == 0:
        return
    M = N * Ho * Wo
    grid = lambda META: (triton.cdiv(M, META["BLOCK_M"]), triton.cdiv(C, META["BLOCK_C"]))  # noqa: E731
    _pool_kernel[grid](x, out, M, C, H, W, Ho, Wo, *kernel, *stride, *padding, *dilation,
                       *_nchw_strides(x, nhwc), *_nchw_strides(out, nhwc), IS_MAX=is_max,
                       COUNT_PAD=count_include_pad)
