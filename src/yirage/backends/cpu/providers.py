"""The CPU backend's linear layers as *providers* chosen by measurement: yirage's own GEMMs and
the vendor libraries inside torch (MKL, oneDNN with AMX or AVX512-BF16 where the CPU has them).

| case (op, x, weight)                          | providers                                          |
|-----------------------------------------------|----------------------------------------------------|
| ``linear`` float32 x, float32 w [N, K]        | ``yirage`` (packed AVX-512 GEMM), ``mkl``           |
|                                               | (``torch.addmm``), ``onednn`` (oneDNN on a weight   |
|                                               | reordered once, ``torch.ops.mkldnn._linear_pointwise``) |
| ``linear`` float32 x, bfloat16 w [N, K]       | ``yirage`` (packed ``vdpbf16ps`` GEMM),             |
|                                               | ``onednn`` (``torch.mm`` in bfloat16),              |
|                                               | ``onednn-packed`` (reordered weight)                |
| ``linear_w8a8`` (int8 weights, per-token int8 | ``yirage`` (VNNI / AVX-VNNI / AVX2 GEMM),           |
| activations)                                  | ``onednn`` (``torch._int_mm``; whole-row scales)    |
| ``linear`` float32 x, GGUF-block w (q4_1,     | ``yirage`` (GEMV on the blocks, or dequantize-and-  |
| q8_0, q4_k, ...: the quantized prefill GEMM)  | pack GEMM), ``mkl`` (M >= ``VENDOR_QUANT_MIN_M``:   |
|                                               | rows dequantized per call into a scratch, MKL GEMM) |
| the same with ``compute_dtype='bfloat16'``    | ``onednn`` (dequantized, rounded to bfloat16,       |
|                                               | oneDNN's bfloat16 GEMM: AMX / AVX512-BF16)          |
| ``linear`` float32 x, float32 w with          | ``yirage`` (packed ``vdpbf16ps`` GEMM of the        |
| ``compute_dtype='bfloat16'`` (torch.compile's | rounded weight), ``onednn-packed``, ``onednn``      |
| ``dtype`` option)                             | (weight rounded at every call)                      |
|                                               | ``yirage-f32`` (the float32 GEMM on operands        |
|                                               | rounded to bfloat16: ``YirageF32Fma``)              |

A float32 weight may be stored [K, N] (``layout`` "kn": ``x @ w``, GPT-2's Conv1D): the packing
providers pack it from its transpose, MKL reads it as it is.

A bfloat16 weight with float32 activations means: x rounded to bfloat16, products summed in
float32, the sum rounded to bfloat16, then the float32 bias (``ir.ops`` ``linear``; what oneDNN's
bfloat16 GEMM returns). Providers that keep a packed copy of the weight (``yirage`` float32 and
bfloat16, ``onednn`` float32, ``onednn-packed``) are candidates only for weights declared constant
(``embed.mark_constant``: the engines declare theirs); the rest read the weight as it is.
Block-quantized weights are never kept twice: the vendor providers dequantize them at every call
into one scratch buffer per thread (at most ``DEQUANT_SCRATCH_BYTES``; larger weights in row
blocks), which costs K·N dequantized values per M·K·N multiply-adds and so only pays for prefill
batches (M >= ``VENDOR_QUANT_MIN_M``). Their float32 results equal yirage's up to the order of
the sums (both multiply the exact dequantized weights); ``compute_dtype='bfloat16'`` (an explicit
choice: ``yr.LLM(prefill_dtype='bfloat16')``) rounds x and the weights to bfloat16.

For each shape class (op, dtype, M bucket, N, K, threads) ``yirage.tuning.choose`` returns the
provider: this machine's profile, a shipped template, or a measurement at first use (each
candidate bound to random inputs of the class and the real weight, timed in interleaved
rounds); ``YIRAGE_TUNE=off`` gives ``DEFAULTS``. Packed copies made for that measurement by a
provider that was not chosen are dropped again.

Epilogue fusion: yirage's GEMMs run a fused row kernel (residual + LayerNorm, GELU) on each
block of rows they finish; for a vendor GEMM the rows are computed in blocks of
``EPILOGUE_BLOCK_BYTES`` of output (at least 2K rows: see ``blocked``) and the row kernel runs
on each block right after it, while it is in cache (``yr_rows_parallel``). This module binds
kernels; it must never measure by itself (tuning does) or build graphs.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ...config import logger
from ...dtypes import DType
from ...ir.ops import PLAIN_TYPES, ROW_GROUP, quantize_rows_int8
from ...runtime import timing
from ...runtime.machine import Needs
from ...tuning import profile as tuning
from . import embed, native

#: output bytes per row block when a vendor GEMM runs a row epilogue (a block stays in L2)
EPILOGUE_BLOCK_BYTES = 256 * 1024

#: the provider of each case with YIRAGE_TUNE=off (and of weights that are not constant);
#: block-quantized weights (dtype 'q4_1', 'q4_k', ...) default to 'yirage' too
DEFAULTS = {"float32": "yirage", "bfloat16": "onednn", "int8": "yirage"}

#: rows below which the vendor GEMMs of block-quantized weights are not candidates (dequantizing
#: a weight per call costs about as much as its GEMM over this many rows; fewer rows take
#: yirage's GEMV, which reads the blocks in place)
VENDOR_QUANT_MIN_M = 16
#: the largest float32 scratch a vendor provider dequantizes a block-quantized weight into at once
DEQUANT_SCRATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class Case:
    """A linear layer to bind: ``op`` ('linear' / 'linear_w8a8'), ``dtype`` ('float32',
    'bfloat16' (weights), 'int8', a GGUF block format such as 'q4_1' (float32 compute), or
    '<format>/bfloat16' (its ``compute_dtype='bfloat16'``)), rows ``M``, out features ``N``, in
    features ``K``, the int8 activation ``group`` (0: whole rows), and whether the weight is
    ``constant``; ``layout``: the weight's, "nk" ([N, K]) or "kn" ([K, N], float32 only)."""

    op: str
    dtype: str
    M: int
    N: int
    K: int
    group: int = 0
    constant: bool = False
    layout: str = "nk"   # the weight stored [N, K] ("nk") or [K, N] ("kn": float32 weights only)

    def key(self) -> str:
        """The shape class this case is measured and recorded under."""
        dtype = f"int8/g{self.group}" if self.dtype == "int8" else self.dtype
        if self.layout == "kn":
            dtype += "/kn"
        return tuning.shape_class(self.op, dtype, self.M, self.N, self.K, torch.get_num_threads())


Rows = Callable[[int, int], None]   # computes output rows [lo, hi)
Epilogue = tuple[int, int]          # (address of a row task entry, address of its argument array)


# ---- providers -------------------------------------------------------------------------------
class Provider:
    """One implementation of a linear case. ``packs``: keeps its own packed copy of the weight
    under ``embed``'s cache kind ``kind(case)`` (constant weights only). ``needs``: what it
    needs of this machine (``runtime.machine.Needs``); where that does not hold it is never a
    candidate (``candidates``; ``unavailable`` says why)."""

    name = ""
    packs = False
    needs = Needs()

    def applies(self, case: Case) -> bool:
        """Can it run ``case`` (its dtype, a constant weight if it packs)?"""
        return case.constant or not self.packs

    def kind(self, case: Case) -> str:
        """The packed-cache kind of its weight copy."""
        return ""

    def bind(self, case: Case, args: list[torch.Tensor], out: torch.Tensor, epilogue: Epilogue | None):
        """A thunk computing ``out`` from ``args`` (the op's inputs) and, with ``epilogue``,
        running the row kernel on every block of finished rows. Default: ``rows`` in blocks."""
        return blocked(self.rows(case, args, out), case, epilogue)

    def rows(self, case: Case, args: list[torch.Tensor], out: torch.Tensor) -> Rows:
        raise NotImplementedError


class YiragePacked(Provider):
    """yirage's packed GEMM of one weight dtype (kernels/cpu/embed_kernels.h): float32 with 12x32
    AVX-512 register tiles, or bfloat16 with ``vdpbf16ps`` tiles (AVX512-BF16; FMAs on the
    bfloat16 halves with AVX-512 alone, scalar otherwise). Its own row-epilogue hook."""

    name, packs = "yirage", True

    def __init__(self, dtype: str, kind: str, bind_packed):
        self.dtype, self._kind, self._bind = dtype, kind, bind_packed

    def applies(self, case):
        return case.dtype == self.dtype and case.constant and (case.layout == "nk" or self.dtype in F32_WEIGHTS)

    def kind(self, case):
        return self._kind if case.layout == "nk" else f"{self._kind}/{case.layout}"

    def bind(self, case, args, out, epilogue):
        kw = {"weight_layout": case.layout} if case.layout != "nk" else {}
        return self._bind(args[0], args[1], _bias(args, 2), out, epilogue, **kw)


class MklF32(Provider):
    """torch's float32 GEMM (``torch.addmm``: MKL in the x86 builds of torch)."""

    name = "mkl"

    def applies(self, case):
        return case.dtype == "float32"

    def rows(self, case, args, out):
        x2, o2, w, bias = args[0].view(case.M, case.K), out.view(case.M, case.N), args[1], _bias(args, 2)

        kn = case.layout == "kn"

        def rows(lo, hi):   # w.t() now: a weight whose storage was replaced is read where it is
            wt = w if kn else w.t()
            if bias is None:
                torch.mm(x2[lo:hi], wt, out=o2[lo:hi])
            else:
                torch.addmm(bias, x2[lo:hi], wt, out=o2[lo:hi])
        return rows


#: the case dtypes of float32 weights: float32 compute, or bfloat16 compute (``compute_dtype``)
F32_WEIGHTS = ("float32", "float32/bfloat16")


def gemm_weight(case: Case, w: torch.Tensor) -> torch.Tensor:
    """The weight of ``case`` as the GEMM multiplies it: [N, K], contiguous, rounded to bfloat16
    for bfloat16 compute (a temporary the packing providers pack from)."""
    if case.layout == "kn":
        w = w.t()
    if case.dtype == "float32/bfloat16":
        w = w.to(torch.bfloat16)
    return w.contiguous()


def _onednn_reorder(w: torch.Tensor, batch: int) -> torch.Tensor:
    """``w`` [N, K] reordered once into oneDNN's blocked layout for ~``batch`` rows (the
    weight prepacking TorchInductor's CPU freezing does)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, batch)


class OneDnnPacked(Provider):
    """oneDNN's inner product on a weight reordered once (float32 or bfloat16 weights; AMX or
    AVX512-BF16 for bfloat16 where the CPU has them). Its output is a new tensor each call,
    copied (float32) or converted and biased (bfloat16) into ``out``."""

    packs = True

    def __init__(self, dtype: str, name: str):
        self.dtype, self.name = dtype, name
        # a bfloat16 weight reorder raises where oneDNN has no bfloat16 path (x86 without
        # AVX512BW/VL/DQ or AVX-NE-CONVERT: "bf16 path needs the cpu support ...")
        self.needs = Needs(library=("mkldnn",) if dtype == "float32" else ("mkldnn", "mkldnn_bf16"))

    def applies(self, case):
        return case.dtype == self.dtype and case.constant

    def kind(self, case):
        return (f"onednn/{tuning.m_bucket(case.M)}" + ("/bf16" if case.dtype == "float32/bfloat16" else "")
                + ("" if case.layout == "nk" else f"/{case.layout}"))

    def rows(self, case, args, out):
        w, bias = args[1], _bias(args, 2)
        kind = self.kind(case)

        def reorder(t):   # from the [N, K] GEMM weight (a temporary for [K, N] or float32 weights)
            return _onednn_reorder(gemm_weight(case, t), case.M)
        x2, o2 = args[0].view(case.M, case.K), out.view(case.M, case.N)
        bf16 = self.dtype != "float32"
        xb = torch.empty((case.M, case.K), dtype=torch.bfloat16) if bf16 else None
        embed._cached(w, kind, reorder)   # reordered now, once

        def rows(lo, hi):
            pw = embed._cached(w, kind, reorder)
            if bf16:
                xb[lo:hi].copy_(x2[lo:hi])
                y = torch.ops.mkldnn._linear_pointwise(xb[lo:hi], pw, None, "none", [], "")
                _to_f32(y, bias, o2[lo:hi])
            else:
                o2[lo:hi].copy_(torch.ops.mkldnn._linear_pointwise(x2[lo:hi], pw, bias, "none", [], ""))
        return rows


class OneDnnBf16(Provider):
    """torch's bfloat16 GEMM (``torch.mm``: oneDNN, with AMX or AVX512-BF16 where present) on the
    weight as it is (a float32 weight with bfloat16 compute: rounded at every call), x converted
    into a bfloat16 buffer first."""

    name = "onednn"

    def applies(self, case):
        return case.dtype in ("bfloat16", "float32/bfloat16")

    def rows(self, case, args, out):
        x2, o2, w, bias = args[0].view(case.M, case.K), out.view(case.M, case.N), args[1], _bias(args, 2)
        xb = torch.empty((case.M, case.K), dtype=torch.bfloat16)
        yb = torch.empty((case.M, case.N), dtype=torch.bfloat16)
        convert = w.dtype != torch.bfloat16

        def rows(lo, hi):
            xb[lo:hi].copy_(x2[lo:hi])
            wt = gemm_weight(case, w).t() if convert else w.t()   # float32: rounded at every call
            torch.mm(xb[lo:hi], wt, out=yb[lo:hi])
            _to_f32(yb[lo:hi], bias, o2[lo:hi])
        return rows


class YirageF32Fma(Provider):
    """bfloat16 compute on yirage's float32 GEMM: the weight rounded to bfloat16 once and packed
    as float32 (``pack_f32``), x rounded to bfloat16 into a float32 scratch at every call, float32
    FMAs (a product of two bfloat16 values is exact in float32), the sum rounded to bfloat16,
    then the float32 bias: the numerics of the bfloat16 case, up to the order of the sums. For
    CPUs whose bfloat16 dot product runs slower than their float32 FMA: on the Intel Xeon 6/207
    (AVX512-BF16, no AMX) one thread issued 1.4 G ``vdpbf16ps`` (90 GFLOP/s) against 5.6 G
    float32 ``vfmadd`` (180 GFLOP/s) a second, and BERT-base with ``dtype="bfloat16"`` ran
    1.6x slower than in float32. Float32 weights only (torch.compile's ``dtype`` option, whose
    packing providers keep a copy anyway): its float32 copy is twice a bfloat16 one, and a
    weight kept in bfloat16 (the engines' ``dtype="bfloat16"``) is kept so for its memory."""

    name, packs = "yirage-f32", True

    def applies(self, case):
        return case.dtype == "float32/bfloat16" and case.constant

    def kind(self, case):
        return "f32/bf16" + ("" if case.layout == "nk" else f"/{case.layout}")

    def rows(self, case, args, out):
        w, bias = args[1], _bias(args, 2)
        kind, (M, N, K) = self.kind(case), (case.M, case.N, case.K)

        def pack(t):   # from the [N, K] GEMM weight, rounded to bfloat16
            return embed.pack_f32(gemm_weight(case, t).to(torch.bfloat16).float())
        x2, o2 = args[0].view(M, K), out.view(M, N)
        lib, st = native._lib(), native._status()
        embed._cached(w, kind, pack)   # packed now, once

        def rows(lo, hi):   # x and the sums rounded in this thread's scratch (none kept per layer)
            m = hi - lo
            xr = _thread_scratch(m * K, torch.float32).view(m, K)
            b16 = _thread_scratch(m * (K + N), torch.bfloat16)
            xb, yb = b16[:m * K].view(m, K), b16[m * K:].view(m, N)
            xb.copy_(x2[lo:hi])
            xr.copy_(xb)
            P, o = embed._cached(w, kind, pack), o2[lo:hi]
            lib.yr_emb_gemm_f32(xr.data_ptr(), P.data_ptr(), None, o.data_ptr(), m, N, K, xr.numel(), P.numel(),
                                o.numel(), None, None, st.data_ptr())
            if st[0]:
                native._raise_status(st, "linear (bfloat16 on the float32 GEMM)")
            yb.copy_(o)
            _to_f32(yb, bias, o)
        return rows


class YirageW8A8(Provider):
    """yirage's int8 GEMM (VNNI vpdpbusd / AVX-VNNI / AVX2 vpmaddubsw), weights packed once."""

    name = "yirage"

    def applies(self, case):
        return case.dtype == "int8"

    def kind(self, case):
        return f"s8/{case.group}"

    def bind(self, case, args, out, epilogue):
        return embed.bind_linear_w8a8_args(args, out, case.group, epilogue)


class OneDnnInt8(Provider):
    """torch's int8 GEMM (``torch._int_mm``: oneDNN, AMX-INT8 or VNNI where present) on
    activations quantized per row by ``ir.ops.quantize_rows_int8``, then the reference's
    ``acc * x_scale * w_scale + bias`` in float32. Whole-row activation scales only (group 0):
    a group's scale would need one integer GEMM per group."""

    name = "onednn"
    needs = Needs(library=("int_mm",))

    def applies(self, case):
        return case.dtype == "int8" and case.group == 0

    def rows(self, case, args, out):
        x2, o2 = args[0].view(case.M, case.K), out.view(case.M, case.N)
        w_t, w_scale, bias = args[1], args[2], _bias(args, 3)

        def rows(lo, hi):
            q, s = quantize_rows_int8(x2[lo:hi])
            o = o2[lo:hi]
            torch.mul(torch._int_mm(q, w_t), s, out=o)
            o.mul_(w_scale)
            if bias is not None:
                o.add_(bias)
        return rows


def quant_format(case: Case) -> str | None:
    """The GGUF block format of a case's weight ('q4_1', ...), or None for a float/int8 weight."""
    fmt = case.dtype.split("/")[0]
    try:
        return fmt if DType(fmt).is_quantized else None
    except ValueError:
        return None


class YirageQuant(Provider):
    """yirage's kernels for GGUF-block weights (kernels/cpu/library.cpp, ggml_quants.h): a GEMV
    reading the blocks in place below ``GEMM_MIN_M`` rows, else blocks dequantized while packing
    into the float32 GEMM's panels."""

    name = "yirage"

    def applies(self, case):
        return quant_format(case) is not None and "/" not in case.dtype

    def rows(self, case, args, out):
        fn = getattr(native.library(), f"yr_linear_{case.dtype}")
        x, w, bias, K, N = args[0], args[1], _bias(args, 2), case.K, case.N
        bias_ptr = None if bias is None else bias.data_ptr()

        def rows(lo, hi):
            fn(x.data_ptr() + 4 * lo * K, w.data_ptr(), bias_ptr, out.data_ptr() + 4 * lo * N, hi - lo, N, K)
        return rows


def _with_blocks_per_row(deq, nb: int):
    """``yr_dequant_<row-group layout>`` (src, dst, nblocks, blocks per row) called as the other formats'
    ``yr_dequant_<format>`` (src, dst, nblocks)."""
    return lambda src, dst, nblocks: deq(src, dst, nblocks, nb)


_scratch = threading.local()


def _thread_scratch(n: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's scratch of at least ``n`` elements of ``dtype`` (grown, never shrunk): one
    per dtype, shared by the providers that fill and read it within one call (``VendorDequant``,
    ``YirageF32Fma``)."""
    key = f"buf_{dtype}".replace(".", "_")
    buf = getattr(_scratch, key, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype)
        setattr(_scratch, key, buf)
    return buf[:n]


class VendorDequant(Provider):
    """A vendor GEMM on a block-quantized weight: per call, blocks of weight rows dequantized
    (``yr_dequant_<format>``, exact float32 values) into a per-thread scratch, then MKL's float32
    GEMM (``torch.addmm``) or, for ``compute_dtype='bfloat16'``, x and the rows rounded to
    bfloat16 and oneDNN's bfloat16 GEMM (AMX / AVX512-BF16 where the CPU has them), its
    bfloat16 sums converted to float32 with the bias added (``ir.ops`` ``linear``)."""

    def __init__(self, name: str, bf16: bool):
        self.name, self.bf16 = name, bf16

    def applies(self, case):
        return (quant_format(case) is not None and case.dtype.endswith("/bfloat16") == self.bf16
                and (self.bf16 or case.M >= VENDOR_QUANT_MIN_M))

    def rows(self, case, args, out):
        fmt = quant_format(case)
        deq, qb = getattr(native.library(), f"yr_dequant_{fmt}"), DType(fmt).block[0]
        M, N, K = case.M, case.N, case.K
        x2, o2, w, bias = args[0].view(M, K), out.view(M, N), args[1], _bias(args, 2)
        row_bytes = w.numel() * w.element_size() // N
        step = max(1, min(N, DEQUANT_SCRATCH_BYTES // (4 * K)))
        if DType(fmt) in PLAIN_TYPES:   # a row-group layout: whole 16-row groups, and the row length
            step = max(ROW_GROUP, step - step % ROW_GROUP)
            deq = _with_blocks_per_row(deq, K // qb)
        spans = [(n0, min(N, n0 + step)) for n0 in range(0, N, step)]
        xb = torch.empty((M, K), dtype=torch.bfloat16) if self.bf16 else None
        yb = torch.empty((M, step), dtype=torch.bfloat16) if self.bf16 else None

        def rows(lo, hi):
            wf = _thread_scratch(step * K, torch.float32)
            wb = _thread_scratch(step * K, torch.bfloat16) if self.bf16 else None
            if self.bf16:
                xb[lo:hi].copy_(x2[lo:hi])
            for n0, n1 in spans:
                r = n1 - n0
                deq(w.data_ptr() + n0 * row_bytes, wf.data_ptr(), r * K // qb)
                wr, o = wf[:r * K].view(r, K), o2[lo:hi, n0:n1]
                b = None if bias is None else bias[n0:n1]
                if self.bf16:
                    wb[:r * K].copy_(wf[:r * K])
                    y = yb[:hi - lo, :r]
                    torch.mm(xb[lo:hi], wb[:r * K].view(r, K).t(), out=y)
                    _to_f32(y, b, o)
                elif b is None:
                    torch.mm(x2[lo:hi], wr.t(), out=o)
                else:
                    torch.addmm(b, x2[lo:hi], wr.t(), out=o)
        return rows


PROVIDERS: list[Provider] = [
    YiragePacked("float32", "f32", embed.bind_linear_f32_packed), MklF32(), OneDnnPacked("float32", "onednn"),
    YiragePacked("bfloat16", "bf16", embed.bind_linear_bf16_packed), OneDnnBf16(),
    OneDnnPacked("bfloat16", "onednn-packed"),
    YiragePacked("float32/bfloat16", "bf16/f32", embed.bind_linear_bf16_packed),
    OneDnnPacked("float32/bfloat16", "onednn-packed"), YirageF32Fma(), YirageW8A8(), OneDnnInt8(),
    YirageQuant(), VendorDequant("mkl", bf16=False), VendorDequant("onednn", bf16=True)]


def _bias(args: list[torch.Tensor], i: int) -> torch.Tensor | None:
    return args[i] if len(args) > i else None


def _to_f32(yb: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out`` (float32) = ``yb`` (bfloat16) + ``bias`` (float32, or none). A copy then an add
    in float32: torch's mixed-dtype add took 1.3x as long (128 x 3072, 2 threads, Intel Xeon
    6/207: the bfloat16 rounding and the add, 102 -> 79 us); the sums are the same."""
    out.copy_(yb)
    if bias is not None:
        out.add_(bias)


# ---- row epilogues for providers without a hook of their own --------------------------------
def blocked(rows: Rows, case: Case, epilogue: Epilogue | None):
    """A thunk running ``rows`` over all M rows; with ``epilogue``, in blocks of
    ``EPILOGUE_BLOCK_BYTES`` of output (at least 2K rows), each followed by the row kernel on its
    rows (run by the OpenMP threads, ``yr_rows_parallel``) while they are still in cache."""
    M = case.M
    if epilogue is None:
        def run():
            rows(0, M)
    else:
        fn, fn_args = epilogue
        par, status = native.library().yr_rows_parallel, torch.zeros(4, dtype=torch.int64)
        # at least 2K rows per block: a vendor GEMM packs the weight (K x N values) at every
        # call, which must stay small next to the block's own work (GPT-2's 768 x 3072
        # projection + GELU at 1024 rows, MKL, Intel Xeon 6/207: 16-row blocks took 2.2x the
        # GEMM and the GELU run apart, 256-row blocks 1.18x, 768 1.06x, whole rows 1.0x)
        block = max(16, min(M, max(2 * case.K, 1 << max(0, (EPILOGUE_BLOCK_BYTES // (4 * case.N)).bit_length() - 1))))
        spans = [(lo, min(M, lo + block)) for lo in range(0, M, block)]

        def run():
            for lo, hi in spans:
                rows(lo, hi)
                par(fn, fn_args, lo, hi, M, 1, status.data_ptr())
            if status[0]:
                raise RuntimeError(f"yr_rows_parallel refused rows {status.tolist()}")  # a yirage bug
    return run


# ---- choosing --------------------------------------------------------------------------------
def case_of(op: str, args: list[torch.Tensor], out: torch.Tensor, group: int = 0,
            quant: tuple[str, int, int] | None = None, compute_dtype: str | None = None,
            layout: str = "nk") -> Case | None:
    """The provider case of a linear op's bound tensors, or None when no provider covers it
    (bfloat16 or float16 activations: they keep their own binders; a [K, N] weight (``layout``
    "kn") that is not float32). ``quant``: (GGUF block format, N, K) of a block-quantized
    weight, whose ``compute_dtype`` may be 'bfloat16'."""
    x, w = args[0], args[1]
    if x.dtype != torch.float32 or out.dtype != torch.float32:
        return None
    if quant is not None:
        fmt, N, K = quant
        dtype = f"{fmt}/bfloat16" if compute_dtype == "bfloat16" else fmt
        return Case(op, dtype, x.numel() // K, N, K, constant=embed.is_constant(w))
    if op == "linear_w8a8":
        K, N = w.shape
        return Case(op, "int8", x.numel() // K, N, K, group, embed.is_constant(w))
    if w.dtype not in (torch.float32, torch.bfloat16) or w.dim() != 2:
        return None
    if w.dtype == torch.float32 and (layout == "kn" or compute_dtype == "bfloat16"):
        K, N = w.shape if layout == "kn" else (w.shape[1], w.shape[0])
        return Case(op, "float32/bfloat16" if compute_dtype == "bfloat16" else "float32", x.numel() // K, N, K,
                    constant=embed.is_constant(w), layout=layout)
    if layout == "kn":
        return None
    N, K = w.shape
    return Case(op, "float32" if w.dtype == torch.float32 else "bfloat16", x.numel() // K, N, K,
                constant=embed.is_constant(w))


def candidates(case: Case) -> dict[str, Provider]:
    """The providers that can run ``case`` on this machine (``Provider.needs`` holds), by name."""
    return {p.name: p for p in PROVIDERS if p.applies(case) and p.needs.unmet() is None}


def unavailable(case: Case) -> dict[str, str]:
    """The providers that apply to ``case`` but cannot run on this machine: {name: why}."""
    return {p.name: why for p in PROVIDERS if p.applies(case) and (why := p.needs.unmet()) is not None}


def default_provider(case: Case, cands: dict[str, Provider]) -> str:
    """``DEFAULTS[case.dtype]`` ('yirage' for block-quantized weights) when it applies, else the
    first candidate."""
    name = DEFAULTS.get(case.dtype, "yirage")
    return name if name in cands else next(iter(cands))


def sample_args(case: Case, args: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Inputs of the class to time a provider on: random activations (the plan's buffers hold
    garbage at bind time, and denormals there would skew the timing), the real weights."""
    x = torch.randn(case.M, case.K)
    return [x, *args[1:]], torch.empty(case.M, case.N)


def _factories(case: Case, args: list[torch.Tensor], cands: dict[str, Provider]) -> dict:
    """{provider name: a factory binding it to sample inputs of the class (made once, shared)}."""
    sample: list = []

    def factory(p: Provider):
        def make():
            if not sample:
                sample.extend(sample_args(case, args))
            return p.bind(case, sample[0], sample[1], None)
        return make
    return {n: factory(p) for n, p in cands.items()}


def measure(case: Case, args: list[torch.Tensor], budget_s: float) -> timing.Comparison:
    """Every candidate provider of ``case`` bound to sample inputs of the class (``args``: the
    op's tensors, of which the weights are used) and timed together (``tuning.measure``)."""
    thunks = {}
    for name, make in _factories(case, args, candidates(case)).items():
        try:
            thunks[name] = make()
        except Exception as e:  # noqa: BLE001 - a provider this build of torch cannot run
            logger.debug("provider %s left out of %s: %s: %s", name, case.key(), type(e).__name__, e)
    return tuning.measure(thunks, budget_s)


def choose(case: Case, args: list[torch.Tensor]) -> tuple[Provider, tuning.Choice]:
    """The provider for ``case`` (see the module docstring) and how it was chosen."""
    cands = candidates(case)
    w = args[1]
    packed_before = {n for n, p in cands.items() if p.packs and embed.has_packed(w, p.kind(case))}
    choice = tuning.choose(case.key(), _factories(case, args, cands), default_provider(case, cands))
    for n, p in cands.items():   # packed copies made only to be measured
        if p.packs and n != choice.provider and n not in packed_before:
            embed.forget_packed(w, p.kind(case))
    return cands[choice.provider], choice


def bind_linear(op: str, args: list[torch.Tensor], out: torch.Tensor, group: int = 0,
                epilogue: Epilogue | None = None, quant: tuple[str, int, int] | None = None,
                compute_dtype: str | None = None, layout: str = "nk"):
    """A thunk computing a float32-activation linear layer (``linear`` with a float32, bfloat16
    or GGUF-block weight (``quant``: its format, N, K; ``compute_dtype``: None or 'bfloat16'),
    or ``linear_w8a8``) into ``out`` with the provider chosen for its shape class, and the row
    ``epilogue`` if given; None when no provider covers the case. ``layout`` "kn": the float32
    weight is stored [K, N] (``x @ w``)."""
    case = case_of(op, args, out, group, quant, compute_dtype, layout)
    if case is None:
        return None
    if case.M == 0:
        return lambda: None
    provider, choice = choose(case, args)
    thunk = provider.bind(case, args, out, epilogue)
    thunk.provider = f"{provider.name} ({choice.source})"
    return thunk


__all__ = ["Case", "Provider", "PROVIDERS", "DEFAULTS", "EPILOGUE_BLOCK_BYTES", "VENDOR_QUANT_MIN_M",
           "DEQUANT_SCRATCH_BYTES", "bind_linear", "case_of", "candidates", "unavailable", "choose", "measure",
           "quant_format"]
