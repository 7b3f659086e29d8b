"""WebGPU library kernels for ``linear`` over a GGUF block-quantized weight: q4_0, q4_1, q8_0,
q4_K, q5_K, q6_K, q5_0, q5_1, q2_K and q3_K.

The weight stays in its block storage on the device (the graph input's ``uint8`` bytes,
``DType.storage_shape``); the kernels read it as ``u32`` words and dequantize in registers,
computing what ``ir.ops._linear_ref`` does (the weight decoded as gguf-py decodes it, a float32
product, float32 bias). The WGSL (``kernels/webgpu``):

- ``qblocks.wgsl``: the block formats (byte, half and word reads at any byte address: q4_0's
  blocks are 18 bytes, q6_K's 210; each format read in units of 32 weights, 8 at a time),
  put in front of each kernel below.
- ``qgemv.wgsl``: one workgroup per block of output features and chunk of ``mr`` rows of x,
  its threads splitting the weight's row, each decoded weight multiplied into ``mr`` rows:
  decode (M = 1, ``mr`` 1) and small M.
- ``qmatmul.wgsl``: a tiled GEMM whose W tiles are dequantized into workgroup memory, 32
  weights deep per step: larger M (prefill).

x, bias and out are float32; x [..., K], the weight [N, K] ('nk', the only layout a quantized
weight has: ``weight_layout='kn'`` is for float weights), K a multiple of the format's block.
``compute_dtype`` ('int8', 'bfloat16') is refused, as are the other quantized types (IQ
types) and the CPU's row-group layouts (q4_1r16, q8_0r16): those run
elsewhere (the reference on the host).

As in library.py: the configuration is ``tuning.choose``'s per shape class, keyed with
the adapter's name and the weight format
(``linear|webgpu:llvmpipe-(LLVM-15.0.6,-256-bits)/float32/q4_k/bias|m1|n33|k512|t0``), timed at
first use on zero activations and the real weight; ``YIRAGE_TUNE=off`` takes a fixed default.
Buffers are bound whole, every shader adding offsets passed as ``u32`` parameters (the
weight's in bytes); when ``out`` lies in an input's buffer the inputs are bound writable too
(``{{IN_ACCESS}}``: WebGPU forbids one buffer bound read-only and writable in one dispatch); an
``out`` overlapping an input's bytes is refused (YirageError).

This module may import the runtime, tuning, ir, dtypes and errors layers and the WebGPU
backend's library module; it must never import the front end (kernel, dynamo, engines) or
another backend.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ...dtypes import DType
from ...errors import YirageError
from ...runtime import webgpu as wg
from ...tuning import profile as tuning
from .library import device_tag, render

Thunk = Callable[[], None]

#: the weight formats these kernels read, and their ``{{QTYPE}}`` code in qblocks.wgsl
QTYPES: dict[DType, int] = {DType.q4_0: 0, DType.q4_1: 1, DType.q8_0: 2, DType.q4_k: 3, DType.q5_k: 4,
                            DType.q6_k: 5, DType.q5_0: 6, DType.q5_1: 7, DType.q2_k: 8, DType.q3_k: 9}


# ---- configurations -------------------------------------------------------------------------
@dataclass(frozen=True)
class QGemvConfig:
    """A configuration of ``qgemv.wgsl``: ``rows`` output features per workgroup, ``tpr``
    threads (a power of two) splitting each one's row of W, ``mr`` rows of x per workgroup."""

    rows: int
    tpr: int
    mr: int

    @property
    def name(self) -> str:
        return f"qv{self.rows}x{self.tpr}m{self.mr}"

    def values(self) -> dict:
        return {"ROWS": self.rows, "TPR": self.tpr, "MR": self.mr}


@dataclass(frozen=True)
class QGemmConfig:
    """A tile configuration of ``qmatmul.wgsl``: each workgroup computes a ``tile_m`` x
    ``tile_n`` output tile, each thread a ``reg_m`` x ``reg_n`` block of it."""

    tile_m: int
    tile_n: int
    reg_m: int
    reg_n: int

    @property
    def name(self) -> str:
        return f"qg{self.tile_m}x{self.tile_n}r{self.reg_m}x{self.reg_n}"

    def values(self) -> dict:
        return {"TILE_M": self.tile_m, "TILE_N": self.tile_n, "REG_M": self.reg_m, "REG_N": self.reg_n}


#: GEMV configurations, 128 or 256 threads; ``mr`` 1 for decode, 4 and 8 for a few rows (at most
#: 8 KiB of workgroup memory for the reduction)
QGEMV_CONFIGS: dict[str, QGemvConfig] = {c.name: c for c in (
    QGemvConfig(8, 32, 1), QGemvConfig(4, 64, 1), QGemvConfig(2, 128, 1), QGemvConfig(16, 16, 1),
    QGemvConfig(8, 32, 4), QGemvConfig(4, 32, 8), QGemvConfig(8, 16, 8))}
#: GEMM tiles, 256 threads each, under 13 KiB of workgroup memory (WebGPU's default limit: 16 KiB)
QGEMM_CONFIGS: dict[str, QGemmConfig] = {c.name: c for c in (
    QGemmConfig(32, 64, 2, 4), QGemmConfig(16, 64, 1, 4), QGemmConfig(64, 32, 4, 2))}


def _pipeline(kernel: str, qtype: DType, cfg, aliased: bool) -> wg.Pipeline:
    values = dict(cfg.values(), QTYPE=QTYPES[qtype], IN_ACCESS="read_write" if aliased else "read")
    return wg.Pipeline(render("qblocks.wgsl", **values) + "\n" + render(f"{kernel}.wgsl", **values))


# ---- launches -------------------------------------------------------------------------------
def _noop() -> Thunk:
    return lambda: None


def _byte_range(t: wg.DeviceTensor) -> tuple[int, int]:
    es = t.element_size()
    return t.offset * es, (t.offset + t.numel()) * es


def _check_buffers(x: wg.DeviceTensor, w: wg.DeviceTensor, bias: wg.DeviceTensor | None,
                   out: wg.DeviceTensor) -> bool:
    """Check dtypes (float32 x, bias, out; uint8 w) and that ``out`` overlaps no input's bytes;
    True when ``out`` shares a buffer with an input (then the inputs are bound writable)."""
    for t in (x, out) + ((bias,) if bias is not None else ()):
        if t.dtype != torch.float32:
            raise YirageError(f"webgpu quantized linear: float32 x, bias and out only, got {t.dtype}")
    if w.dtype != torch.uint8:
        raise YirageError(f"webgpu quantized linear: the weight must be its uint8 block storage, got {w.dtype}")
    aliased = False
    o_lo, o_hi = _byte_range(out)
    for t in (x, w) + ((bias,) if bias is not None else ()):
        if t.buffer is out.buffer:
            aliased = True
            lo, hi = _byte_range(t)
            if t.numel() and out.numel() and lo < o_hi and o_lo < hi:
                raise YirageError(f"webgpu quantized linear: the output (bytes {o_lo}..{o_hi}) overlaps an input "
                                  f"(bytes {lo}..{hi}) in one buffer; it cannot be computed in place")
    return aliased


def block_row_bytes(qtype: DType, rows: int, cols: int, t, what: str, name: str = "weight") -> int:
    """Bytes per row of a GGUF block-quantized [rows, cols] matrix held as its block bytes ``t``
    (uint8, ``t.numel()`` bytes). YirageError, prefixed by ``what``, when ``cols`` is not a whole
    number of ``qtype``'s blocks or ``t``'s size disagrees (never trusted: kernels index by it)."""
    per, nbytes = qtype.block
    if cols % per:
        raise YirageError(f"{what}: a {qtype.value} {name} needs its rows a multiple of {per} values, got {cols}")
    row_bytes = cols // per * nbytes
    if t.numel() != rows * row_bytes:
        raise YirageError(f"{what}: a {qtype.value} {name} [{rows}, {cols}] is {rows * row_bytes} bytes, "
                          f"got a tensor of {t.numel()}")
    return row_bytes


def _layout(qtype: DType, N: int, K: int, w: wg.DeviceTensor) -> tuple[int, int]:
    """(bytes per row of W, units of 32 weights per row); YirageError when w's size disagrees."""
    return block_row_bytes(qtype, N, K, w, "webgpu quantized linear"), K // 32


def qgemv(x: wg.DeviceTensor, w: wg.DeviceTensor, bias: wg.DeviceTensor | None, out: wg.DeviceTensor,
          M: int, N: int, K: int, qtype: DType, config: QGemvConfig | str = "qv8x32m1") -> Thunk:
    """A thunk recording one dispatch of ``qgemv.wgsl``: out (M x N) = x (M x K) @ W^T (+ bias),
    W the [N, K] ``qtype`` weight's block storage (uint8), x, bias [N] and out float32. ``out``
    may lie in an input's buffer, at bytes of its own. Raises YirageError for another dtype or
    format, a weight of the wrong size, an output overlapping an input, or sizes past the
    device's limits; KeyError for an unknown configuration name."""
    cfg = QGEMV_CONFIGS[config] if isinstance(config, str) else config
    if qtype not in QTYPES:
        raise YirageError(f"webgpu quantized linear: no kernel for {qtype.value} weights")
    aliased = _check_buffers(x, w, bias, out)
    row_bytes, units = _layout(qtype, N, K, w)
    if M * N == 0:
        return _noop()
    blocks, chunks = -(-N // cfg.rows), -(-M // cfg.mr)
    params = [M, N, K, blocks, chunks, x.offset, w.offset, bias.offset if bias is not None else 0,
              out.offset, row_bytes, units, int(bias is not None)]
    tensors = [x, w, bias if bias is not None else x, out]   # no bias: x bound again, never read
    return _pipeline("qgemv", qtype, cfg, aliased).bind(tensors, params, wg.grid(chunks * blocks))


def qgemm(x: wg.DeviceTensor, w: wg.DeviceTensor, bias: wg.DeviceTensor | None, out: wg.DeviceTensor,
          M: int, N: int, K: int, qtype: DType, config: QGemmConfig | str = "qg32x64r2x4") -> Thunk:
    """A thunk recording one dispatch of ``qmatmul.wgsl``: the product ``qgemv`` computes, by
    tiles of out with W's tiles dequantized into workgroup memory. Same arguments and errors
    (a ``QGEMM_CONFIGS`` name)."""
    cfg = QGEMM_CONFIGS[config] if isinstance(config, str) else config
    if qtype not in QTYPES:
        raise YirageError(f"webgpu quantized linear: no kernel for {qtype.value} weights")
    aliased = _check_buffers(x, w, bias, out)
    row_bytes, units = _layout(qtype, N, K, w)
    if M * N == 0:
        return _noop()
    tiles_m, tiles_n = -(-M // cfg.tile_m), -(-N // cfg.tile_n)
    params = [M, N, K, tiles_m, tiles_n, x.offset, w.offset, bias.offset if bias is not None else 0,
              out.offset, row_bytes, units, int(bias is not None)]
    tensors = [x, w, bias if bias is not None else x, out]
    return _pipeline("qmatmul", qtype, cfg, aliased).bind(tensors, params, wg.grid(tiles_m * tiles_n))


# ---- choosing a configuration ---------------------------------------------------------------
def candidates(M: int, N: int) -> list[str]:
    """Configurations worth timing for M rows and N features: the ``mr`` 1 GEMVs for one row;
    for more, the GEMVs of 4 and 8 rows up to 32 rows (8 only past 4 rows) and the GEMM tiles
    at most about twice what they cover (the smallest always)."""
    smallest = min(c.rows for c in QGEMV_CONFIGS.values())
    gemvs = [n for n, c in QGEMV_CONFIGS.items() if c.rows <= max(smallest, 2 * N)]
    if M == 1:
        return [n for n in gemvs if QGEMV_CONFIGS[n].mr == 1]
    names = [n for n in gemvs if M <= 32 and (QGEMV_CONFIGS[n].mr == 4 or (QGEMV_CONFIGS[n].mr == 8 and M > 4))]
    mb = tuning.m_bucket(M)
    names += [n for n, c in QGEMM_CONFIGS.items() if c.tile_m <= max(16, 2 * mb) and c.tile_n <= max(64, 2 * N)]
    return names


def default(M: int, names: list[str]) -> str:
    """The configuration used without measurement (``YIRAGE_TUNE=off``)."""
    if M == 1:
        wants = ("qv8x32m1",)
    elif M <= 4:
        wants = ("qv8x32m4",)
    elif M <= 8:
        wants = ("qv4x32m8", "qv8x16m8")
    else:
        wants = ("qg32x64r2x4",) if M > 16 else ("qg16x64r1x4",)
    return next((n for n in wants if n in names), names[0])


def _labelled(thunk: Thunk, label: str) -> Thunk:
    try:
        thunk.provider = label
        return thunk
    except AttributeError:
        def run():
            thunk()
        run.provider = label
        return run


# ---- linear -----------------------------------------------------------------------------------
def supports_quantized_linear(node, graph) -> bool:
    """Can ``bind_quantized_linear`` run this ``linear`` node? float32 x [..., K], a weight of a
    format in ``QTYPES`` (the ``w_dtype`` attr) stored [N, K] (``weight_layout`` 'nk'), optional
    float32 bias [N], float32 out, no ``compute_dtype``. Never raises; False for any other op."""
    try:
        attrs = node.attrs
        if node.op != "linear" or attrs.get("compute_dtype") or attrs.get("weight_layout", "nk") != "nk":
            return False
        qtype = DType(attrs.get("w_dtype") or "float32")
        if qtype not in QTYPES or len(node.inputs) not in (2, 3) or len(attrs.get("w_shape", ())) != 2:
            return False
        ts = [graph.tensors[i] for i in node.inputs]
        if ts[1].dtype != qtype or graph.tensors[node.output].dtype != DType.float32:
            return False
        N, K = attrs["w_shape"]
        return (K % qtype.block[0] == 0 and ts[0].dtype == DType.float32 and ts[0].shape[-1] == K
                and all(t.dtype == DType.float32 for t in ts[2:]))
    except Exception:  # noqa: BLE001 - a malformed node is simply not ours
        return False


def bind_quantized_linear(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor, status=None, *,
                          config: str | None = None) -> Thunk:
    """A thunk recording ``out = x @ W^T (+ bias)`` for a ``linear`` node that
    ``supports_quantized_linear`` accepts, W dequantized in registers.

    Args:
        args: [x, W] or [x, W, bias] as DeviceTensors: x float32 [..., K], W the weight's block
            storage (uint8 of ``w_dtype``'s ``storage_shape`` of ``w_shape`` [N, K]), bias
            float32 [N].
        out: float32 DeviceTensor [..., N] (x's leading dims), overlapping no input.
        status: the executor's status slot (unused: these kernels check nothing at run time).
        config: a configuration name (``QGEMV_CONFIGS``, ``QGEMM_CONFIGS``) to run instead of
            the chosen one (tests, benchmarks).

    The configuration is ``tuning.choose``'s for the shape class among ``candidates(M, N)``
    (timed at first use on zero activations and the real weight); ``thunk.provider`` says which
    and how it was chosen.

    Raises YirageError for a format without a kernel here, shapes that disagree with the
    weight, dtypes other than float32 (x, bias, out), an output overlapping an input, sizes
    past the device's limits, or an unknown ``config``; BackendUnavailableError without a
    WebGPU adapter.
    """
    x, w = args[0], args[1]
    bias = args[2] if len(args) == 3 else None
    qtype = DType(node.attrs.get("w_dtype") or "float32")
    if qtype not in QTYPES or node.attrs.get("weight_layout", "nk") != "nk" or node.attrs.get("compute_dtype"):
        raise YirageError(f"webgpu quantized linear: no kernel for a {qtype.value} weight with "
                          f"weight_layout={node.attrs.get('weight_layout', 'nk')!r}, "
                          f"compute_dtype={node.attrs.get('compute_dtype')!r}")
    N, K = (int(v) for v in node.attrs["w_shape"])
    if x.shape[-1] != K or out.shape[-1] != N or (bias is not None and tuple(bias.shape) != (N,)):
        raise YirageError(f"webgpu quantized linear: x {tuple(x.shape)}, W [{N}, {K}] ({qtype.value}), "
                          f"bias {None if bias is None else tuple(bias.shape)} and out {tuple(out.shape)} disagree")
    M = x.numel() // K
    if out.numel() != M * N:
        raise YirageError(f"webgpu quantized linear: out {tuple(out.shape)} must hold {M} x {N} elements")

    def launch(name: str, xt: wg.DeviceTensor, ot: wg.DeviceTensor) -> Thunk:
        if name in QGEMV_CONFIGS:
            return qgemv(xt, w, bias, ot, M, N, K, qtype, name)
        if name in QGEMM_CONFIGS:
            return qgemm(xt, w, bias, ot, M, N, K, qtype, name)
        raise YirageError(f"webgpu quantized linear: no configuration {name!r}; one of "
                          f"{sorted(QGEMV_CONFIGS) + sorted(QGEMM_CONFIGS)}")

    if config is not None:
        return _labelled(launch(config, x, out), f"webgpu-{config} (pinned)")
    if M * N == 0:
        _check_buffers(x, w, bias, out)
        return _labelled(_noop(), "webgpu (empty)")
    names = candidates(M, N)
    key = tuning.shape_class("linear", f"{device_tag()}/float32/{qtype.value}" + ("/bias" if bias is not None else ""),
                             M, N, K, 0)
    samples: dict = {}

    def make(name: str) -> Thunk:
        if "x" not in samples:
            samples["x"] = wg.DeviceTensor.empty(x.shape, x.dtype)
            samples["out"] = wg.DeviceTensor.empty(out.shape, out.dtype)
        return launch(name, samples["x"], samples["out"])

    def sync():   # a 4-byte read waits for the queue (wgpu 0.32's on_submitted_work_done_sync fails)
        wg.queue().read(samples["out"].buffer, 0, 4)
    choice = tuning.choose(key, {n: functools.partial(make, n) for n in names}, default(M, names), sync=sync)
    samples.clear()
    return _labelled(launch(choice.provider, x, out), f"webgpu-{choice.provider} ({choice.source})")


__all__ = ["QTYPES", "QGemvConfig", "QGemmConfig", "QGEMV_CONFIGS", "QGEMM_CONFIGS", "qgemv", "qgemm", "candidates",
           "default", "supports_quantized_linear", "bind_quantized_linear"]
