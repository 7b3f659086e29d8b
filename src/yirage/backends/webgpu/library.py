"""WebGPU library kernels for float32 GEMM and GEMV: the ``linear`` and ``matmul`` ops.

The kernels are WGSL source files shipped with the package (``kernels/webgpu``):

- ``matmul.wgsl``: a tiled GEMM (X and W tiles in workgroup memory, a register block per
  thread) with a batch axis, W stored [N, K] ("nk") or [K, N] ("kn"): ``linear`` with more
  than one row, ``matmul``.
- ``gemv.wgsl``: one workgroup per block of output features, its threads splitting K, a
  workgroup reduction: ``linear`` with one row (decode), ``matmul`` with M = 1.

Both accumulate in f32 and check every index, so M, N and K may be any size. Their tile sizes
are template parameters (``{{TILE_M}}`` ... in the source, substituted here before compiling:
``runtime.webgpu.Pipeline`` compiles one source per configuration and caches it). Which
configuration runs is chosen per shape class by measurement (``tuning.choose``: the profile, a
template, or a timing at first use), among the configurations that fit the shape (a tile at
most about twice the rows it covers); the key names the adapter
(``linear|webgpu:llvmpipe-(LLVM-15.0.6,-256-bits)/float32/kn/bias|m16|n33|k129|t0``), so a
choice is never read on another GPU. Each sample of a timing ends with a 4-byte read of the
sample's output (it waits for the queue; wgpu 0.32's ``on_submitted_work_done_sync`` fails on
wgpu-native). ``YIRAGE_TUNE=off`` takes a fixed default per shape.

Buffers are bound whole (``runtime.webgpu``): every shader adds the tensors' element offsets,
passed in its ``u32`` parameters. WebGPU forbids binding one buffer as both read-only and
writable storage in a dispatch (a validation error at the next flush, losing every launch
recorded with it), so when ``out`` lies in an input's buffer (a plan's arena) the inputs are
bound writable too (the ``{{IN_ACCESS}}`` placeholder); an ``out`` overlapping an input's
elements is refused (YirageError): a GEMM cannot run in place.

This module may import the runtime, tuning, ir, dtypes and errors layers; it must never import
the front end (kernel, dynamo, engines) or another backend.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from importlib import resources
from typing import Callable, Sequence

import torch

from ...dtypes import DType
from ...errors import YirageError
from ...ir.ops import linear_nk
from ...runtime import webgpu as wg
from ...tuning import profile as tuning

Thunk = Callable[[], None]


# ---- configurations -------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmConfig:
    """A tile configuration of ``matmul.wgsl``: each workgroup computes a ``tile_m`` x
    ``tile_n`` output tile, ``tile_k`` deep per step, each thread a ``reg_m`` x ``reg_n``
    block of it ((tile_m / reg_m) * (tile_n / reg_n) threads)."""

    tile_m: int
    tile_n: int
    tile_k: int
    reg_m: int
    reg_n: int

    @property
    def name(self) -> str:
        return f"g{self.tile_m}x{self.tile_n}k{self.tile_k}r{self.reg_m}x{self.reg_n}"

    @property
    def threads(self) -> int:
        return (self.tile_m // self.reg_m) * (self.tile_n // self.reg_n)

    def values(self, kn: bool) -> dict:
        return {"TILE_M": self.tile_m, "TILE_N": self.tile_n, "TILE_K": self.tile_k, "REG_M": self.reg_m,
                "REG_N": self.reg_n, "W_KN": "true" if kn else "false"}


@dataclass(frozen=True)
class GemvConfig:
    """A configuration of ``gemv.wgsl``: ``rows`` output features per workgroup, ``tpr``
    threads (a power of two) splitting K for each."""

    rows: int
    tpr: int

    @property
    def name(self) -> str:
        return f"v{self.rows}x{self.tpr}"

    @property
    def threads(self) -> int:
        return self.rows * self.tpr

    def values(self, kn: bool) -> dict:
        return {"ROWS": self.rows, "TPR": self.tpr, "W_KN": "true" if kn else "false"}


#: GEMM tiles, 256 threads each (WebGPU's default max-compute-invocations-per-workgroup),
#: about 8 KiB of workgroup memory at most (the default limit is 16 KiB)
GEMM_CONFIGS: dict[str, GemmConfig] = {c.name: c for c in (
    GemmConfig(64, 64, 16, 4, 4), GemmConfig(32, 64, 16, 2, 4), GemmConfig(32, 32, 16, 2, 2),
    GemmConfig(16, 32, 16, 1, 2))}
#: GEMV configurations per weight layout: "nk" puts a feature's threads along its row of W,
#: "kn" puts many features side by side (W's rows run along N)
GEMV_CONFIGS: dict[str, dict[str, GemvConfig]] = {
    "nk": {c.name: c for c in (GemvConfig(4, 64), GemvConfig(8, 32), GemvConfig(2, 128))},
    "kn": {c.name: c for c in (GemvConfig(64, 4), GemvConfig(32, 8), GemvConfig(16, 16))},
}


# ---- kernel sources -------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def kernel_source(name: str) -> str:
    """The text of ``kernels/webgpu/<name>`` (e.g. 'matmul.wgsl'), with its placeholders.
    Raises YirageError when the file is not in the installed package."""
    try:
        return resources.files("yirage.kernels").joinpath("webgpu", name).read_text()
    except (FileNotFoundError, OSError) as e:
        raise YirageError(f"webgpu: the kernel source kernels/webgpu/{name} is missing from the installed "
                          f"yirage package ({e}); reinstall it") from None


_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")


@functools.lru_cache(maxsize=None)
def _render(name: str, items: tuple) -> str:
    values = dict(items)
    missing = sorted(set(_PLACEHOLDER.findall(kernel_source(name))) - set(values))
    if missing:
        raise YirageError(f"webgpu: kernels/webgpu/{name} needs values for {missing}")
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), kernel_source(name))


def render(name: str, **values) -> str:
    """``kernels/webgpu/<name>`` with each ``{{KEY}}`` replaced by ``values[KEY]``. Raises
    YirageError when a placeholder has no value."""
    return _render(name, tuple(sorted(values.items())))


def _pipeline(kind: str, cfg, kn: bool, aliased: bool) -> wg.Pipeline:
    return wg.Pipeline(render(f"{kind}.wgsl", IN_ACCESS="read_write" if aliased else "read", **cfg.values(kn)))


# ---- launches -------------------------------------------------------------------------------
def _noop() -> Thunk:
    """A new thunk that does nothing (an empty output), free to carry its own attributes."""
    return lambda: None


def _check_buffers(what: str, inputs: Sequence[wg.DeviceTensor], out: wg.DeviceTensor) -> bool:
    """Check dtypes and that ``out`` overlaps no input; True when ``out`` shares a buffer with
    an input (then the inputs are bound writable: WebGPU forbids a buffer bound read-only and
    writable in one dispatch, a validation error at the next flush that would lose every launch
    recorded with it, but allows it writable twice)."""
    for t in (*inputs, out):
        if t.dtype != torch.float32:
            raise YirageError(f"webgpu {what}: float32 tensors only, got {t.dtype}")
    aliased = False
    for t in inputs:
        if t.buffer is out.buffer:
            aliased = True
            if t.numel() and out.numel() and t.offset < out.offset + out.numel() and out.offset < t.offset + t.numel():
                raise YirageError(f"webgpu {what}: the output (elements {out.offset}..{out.offset + out.numel()}) "
                                  f"overlaps an input (elements {t.offset}..{t.offset + t.numel()}) in one buffer; "
                                  "it cannot be computed in place")
    return aliased


def gemm(x: wg.DeviceTensor, w: wg.DeviceTensor, bias: wg.DeviceTensor | None, out: wg.DeviceTensor,
         M: int, N: int, K: int, *, kn: bool, batch: int = 1, x_bs: int = 0, w_bs: int = 0, o_bs: int = 0,
         config: GemmConfig | str = "g32x32k16r2x2") -> Thunk:
    """A thunk recording one dispatch of ``matmul.wgsl``: for each of ``batch`` batches b,
    out[b] (M x N) = x[b] (M x K) @ W[b]^T (+ bias), W[b] stored [N, K] row-major, or [K, N]
    with ``kn`` (then out[b] = x[b] @ W[b]); batch b's operands start ``b * x_bs``, ``b * w_bs``
    and ``b * o_bs`` elements after each tensor's offset (0 broadcasts). All float32, bias [N].
    ``out`` may lie in an input's buffer, at elements of its own. Raises YirageError for
    another dtype, an output overlapping an input, or sizes past the device's limits;
    KeyError for an unknown configuration name."""
    cfg = GEMM_CONFIGS[config] if isinstance(config, str) else config
    aliased = _check_buffers("gemm", [x, w] + ([bias] if bias is not None else []), out)
    if batch * M * N == 0:
        return _noop()
    tiles_m, tiles_n = -(-M // cfg.tile_m), -(-N // cfg.tile_n)
    params = [M, N, K, batch, x.offset, w.offset, bias.offset if bias is not None else 0, out.offset,
              x_bs, w_bs, o_bs, int(bias is not None), tiles_m, tiles_n]
    groups = wg.grid(batch * tiles_m * tiles_n)
    tensors = [x, w, bias if bias is not None else w, out]   # no bias: W bound again, never read
    return _pipeline("matmul", cfg, kn, aliased).bind(tensors, params, groups)


def gemv(x: wg.DeviceTensor, w: wg.DeviceTensor, bias: wg.DeviceTensor | None, out: wg.DeviceTensor,
         N: int, K: int, *, kn: bool, batch: int = 1, x_bs: int = 0, w_bs: int = 0, o_bs: int = 0,
         config: GemvConfig | str | None = None) -> Thunk:
    """A thunk recording one dispatch of ``gemv.wgsl``: for each of ``batch`` batches b,
    out[b] (N) = W[b] (N x K, row-major) @ x[b] (K) (+ bias), or with ``kn`` x[b] @ W[b]
    (W[b] [K, N] row-major); batch b's operands start ``b * x_bs``, ``b * w_bs`` and
    ``b * o_bs`` elements after each tensor's offset (0 broadcasts: ``w_bs = 0, x_bs = K,
    o_bs = N`` runs the rows of x [batch, K] as a linear layer). All float32, bias [N].
    ``out`` may lie in an input's buffer, at elements of its own. Raises YirageError for
    another dtype, an output overlapping an input, or sizes past the device's limits;
    KeyError for an unknown configuration name."""
    configs = GEMV_CONFIGS["kn" if kn else "nk"]
    if config is None:
        config = next(iter(configs))
    cfg = configs[config] if isinstance(config, str) else config
    aliased = _check_buffers("gemv", [x, w] + ([bias] if bias is not None else []), out)
    if batch * N == 0:
        return _noop()
    blocks = -(-N // cfg.rows)
    params = [N, K, batch, blocks, x.offset, w.offset, bias.offset if bias is not None else 0, out.offset,
              x_bs, w_bs, o_bs, int(bias is not None)]
    tensors = [x, w, bias if bias is not None else w, out]
    return _pipeline("gemv", cfg, kn, aliased).bind(tensors, params, wg.grid(batch * blocks))


# ---- choosing a configuration ---------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def device_tag() -> str:
    """The adapter's name for shape classes: 'webgpu:' and its device name, spaces as '-'
    (``webgpu:llvmpipe-(LLVM-15.0.6,-256-bits)``). Raises BackendUnavailableError without an
    adapter."""
    name = str(dict(wg.adapter().info).get("device") or "unknown")
    return "webgpu:" + name.replace(" ", "-").replace("|", "/")


def _gemm_candidates(M: int, N: int) -> list[str]:
    """GEMM configurations worth timing for M rows (by M's bucket) and N columns: tiles at
    most about twice what they cover (the smallest always)."""
    mb = tuning.m_bucket(M)
    names = [n for n, c in GEMM_CONFIGS.items() if c.tile_m <= max(16, 2 * mb) and c.tile_n <= max(32, 2 * N)]
    return names or [min(GEMM_CONFIGS, key=lambda n: GEMM_CONFIGS[n].tile_m * GEMM_CONFIGS[n].tile_n)]


def _gemm_default(M: int, N: int, names: list[str]) -> str:
    for want in (("g64x64k16r4x4",) if M >= 64 and N >= 64 else ()) + ("g32x32k16r2x2", "g16x32k16r1x2"):
        if want in names:
            return want
    return names[0]


def _gemv_candidates(N: int, kn: bool) -> list[str]:
    configs = GEMV_CONFIGS["kn" if kn else "nk"]
    smallest = min(c.rows for c in configs.values())
    return [n for n, c in configs.items() if c.rows <= max(smallest, 2 * N)]


def _choose(key: str, names: list[str], default: str, make: Callable[[str], Thunk], sync_buffer) -> tuple[str, str]:
    """(configuration, how it was chosen) for ``key``: ``tuning.choose`` over ``names``, each
    factory calling ``make(name)`` (a thunk on sample inputs); samples end with a 4-byte read of
    ``sync_buffer()`` (waits for the queue: wgpu 0.32's on_submitted_work_done_sync fails on
    wgpu-native)."""
    def sync():
        wg.queue().read(sync_buffer(), 0, 4)
    choice = tuning.choose(key, {n: functools.partial(make, n) for n in names}, default, sync=sync)
    return choice.provider, choice.source


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
def supports_linear(node, graph) -> bool:
    """Can ``bind_linear`` run this ``linear`` node? float32 x [..., K], a float32 weight
    [N, K] (``weight_layout`` 'nk', the default) or [K, N] ('kn'), optional float32 bias [N];
    no block-quantized weight (``w_dtype``) and no ``compute_dtype``. Never raises for a
    ``linear`` node; False for any other op."""
    if node.op != "linear" or node.attrs.get("w_dtype") or node.attrs.get("compute_dtype"):
        return False
    if node.attrs.get("weight_layout", "nk") not in ("nk", "kn"):
        return False
    return all(graph.tensors[i].dtype == DType.float32 for i in node.inputs) and len(node.inputs) in (2, 3)


def bind_linear(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor, status=None, *,
                config: str | None = None) -> Thunk:
    """A thunk recording ``out = x @ W^T (+ bias)`` for a ``linear`` node that
    ``supports_linear`` accepts.

    Args:
        args: [x, W] or [x, W, bias] as DeviceTensors, float32: x [..., K], W [N, K] (or
            [K, N] with ``weight_layout='kn'``), bias [N].
        out: float32 DeviceTensor [..., N] (x's leading dims), overlapping no input.
        status: the executor's status slot (unused: these kernels check nothing at run time).
        config: a configuration name (``GEMM_CONFIGS``, or ``GEMV_CONFIGS[layout]``: then each
            row of x is one GEMV batch) to run instead of the chosen one (tests, benchmarks).

    One row (M == 1) runs ``gemv.wgsl``, more the tiled ``matmul.wgsl``; the configuration is
    ``tuning.choose``'s for the shape class (timed at first use on zero activations of the
    shape and the real weights). ``thunk.provider`` says which and how it was chosen.

    Raises YirageError for shapes that disagree with the weight, a dtype other than float32,
    an output overlapping an input, sizes past the device's limits, or an unknown
    ``config``; BackendUnavailableError without a WebGPU adapter.
    """
    x, w = args[0], args[1]
    bias = args[2] if len(args) == 3 else None
    layout = node.attrs.get("weight_layout", "nk")
    kn = layout == "kn"
    N, K = linear_nk(tuple(w.shape), node.attrs)
    if x.shape[-1] != K or out.shape[-1] != N or (bias is not None and tuple(bias.shape) != (N,)):
        raise YirageError(f"webgpu linear: x {tuple(x.shape)}, W {tuple(w.shape)} ({layout}), "
                          f"bias {None if bias is None else tuple(bias.shape)} and out {tuple(out.shape)} disagree")
    M = x.numel() // K if K else out.numel() // max(N, 1)
    if out.numel() != M * N:
        raise YirageError(f"webgpu linear: out {tuple(out.shape)} must hold {M} x {N} elements")

    def launch(name: str, xt: wg.DeviceTensor, ot: wg.DeviceTensor) -> Thunk:
        if name in GEMM_CONFIGS:
            return gemm(xt, w, bias, ot, M, N, K, kn=kn, config=name)
        if name in GEMV_CONFIGS[layout]:
            return gemv(xt, w, bias, ot, N, K, kn=kn, batch=M, x_bs=K, w_bs=0, o_bs=N, config=name)
        raise YirageError(f"webgpu linear: no configuration {name!r}; one of "
                          f"{sorted(GEMM_CONFIGS) + sorted(GEMV_CONFIGS[layout])}")

    if config is not None:
        return _labelled(launch(config, x, out), f"webgpu-{config} (pinned)")
    if M * N == 0:
        return _labelled(_noop(), "webgpu (empty)")
    if M == 1:
        names = _gemv_candidates(N, kn)
        default = names[0]
    else:
        names = _gemm_candidates(M, N)
        default = _gemm_default(M, N, names)
    key = tuning.shape_class("linear", f"{device_tag()}/float32" + ("/kn" if kn else "")
                             + ("/bias" if bias is not None else ""), M, N, K, 0)
    samples = {}

    def make(name: str) -> Thunk:
        if "x" not in samples:
            samples["x"] = wg.DeviceTensor.empty(x.shape, x.dtype)
            samples["out"] = wg.DeviceTensor.empty(out.shape, out.dtype)
        return launch(name, samples["x"], samples["out"])
    chosen, source = _choose(key, names, default, make, lambda: samples["out"].buffer)
    samples.clear()
    return _labelled(launch(chosen, x, out), f"webgpu-{chosen} ({source})")


# ---- matmul -----------------------------------------------------------------------------------
def _matmul_batches(a_shape, b_shape, o_shape) -> tuple[int, bool, bool] | None:
    """(batch, a batched?, b batched?) when each operand's batch dims are the output's (left
    padded with 1s) or all 1s (broadcast); None otherwise."""
    ob = tuple(o_shape[:-2])
    batch = math.prod(ob)
    flags = []
    for shape in (a_shape, b_shape):
        bd = tuple(shape[:-2])
        padded = (1,) * (len(ob) - len(bd)) + bd
        if len(bd) > len(ob):
            return None
        if math.prod(bd) == 1 and batch != 1:
            flags.append(False)
        elif padded == ob:
            flags.append(batch > 1)
        else:
            return None
    return batch, flags[0], flags[1]


def supports_matmul(node, graph) -> bool:
    """Can ``bind_matmul`` run this ``matmul`` node? float32 a [..., M, K] and b [..., K, N]
    whose batch dims are either the output's (torch.matmul's broadcast shape) or all 1
    (broadcast over every batch); other broadcasts (e.g. [2, 1] against [1, 3]) are refused.
    Never raises for a ``matmul`` node; False for any other op."""
    if node.op != "matmul" or len(node.inputs) != 2:
        return False
    a, b = (graph.tensors[i] for i in node.inputs)
    o = graph.tensors[node.output]
    if a.dtype != DType.float32 or b.dtype != DType.float32 or len(a.shape) < 2 or len(b.shape) < 2:
        return False
    return _matmul_batches(a.shape, b.shape, o.shape) is not None


def bind_matmul(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor, status=None, *,
                config: str | None = None) -> Thunk:
    """A thunk recording ``out = torch.matmul(a, b)`` for a ``matmul`` node that
    ``supports_matmul`` accepts.

    Args:
        args: [a, b], float32 DeviceTensors a [..., M, K], b [..., K, N]; each one's batch dims
            are the output's or all 1.
        out: float32 DeviceTensor [..., M, N] (the broadcast batch dims), overlapping no input.
        status: the executor's status slot (unused).
        config: a configuration name (``GEMM_CONFIGS``, or ``GEMV_CONFIGS['kn']`` when
            M == 1) to run instead of the chosen one.

    A b without batch (or all-1 batch dims) folds a's batches into the rows of one GEMM. One
    row per batch (M == 1) runs ``gemv.wgsl``, more the tiled ``matmul.wgsl`` with a batch
    axis; the configuration is ``tuning.choose``'s for the shape class (timed at first use on
    zero operands of the shape). ``thunk.provider`` says which and how it was chosen.

    Raises YirageError for shapes that disagree or a broadcast ``supports_matmul`` refuses, a
    dtype other than float32, an output overlapping an input, sizes past the
    device's limits, or an unknown or unfit ``config``; BackendUnavailableError without a
    WebGPU adapter.
    """
    a, b = args
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise YirageError(f"webgpu matmul: both operands need 2 dims or more, got {tuple(a.shape)} and "
                          f"{tuple(b.shape)}")
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    batches = _matmul_batches(a.shape, b.shape, out.shape)
    if b.shape[-2] != K or tuple(out.shape[-2:]) != (M, N) or batches is None:
        raise YirageError(f"webgpu matmul: a {tuple(a.shape)}, b {tuple(b.shape)} and out {tuple(out.shape)} do not "
                          "fit (batch dims must be the output's or all 1)")
    batch, a_batched, b_batched = batches
    if not b_batched:   # one b for all batches (a's, or none): they are the rows of one GEMM
        M, batch = M * batch, 1
    x_bs = M * K if a_batched and b_batched else 0
    w_bs = K * N if b_batched else 0
    o_bs = M * N

    def launch(name: str, at, bt, ot) -> Thunk:
        if name in GEMM_CONFIGS:
            return gemm(at, bt, None, ot, M, N, K, kn=True, batch=batch, x_bs=x_bs, w_bs=w_bs, o_bs=o_bs, config=name)
        if name in GEMV_CONFIGS["kn"] and M == 1:
            return gemv(at, bt, None, ot, N, K, kn=True, batch=batch, x_bs=x_bs, w_bs=w_bs, o_bs=o_bs, config=name)
        raise YirageError(f"webgpu matmul: no configuration {name!r} for M = {M}; one of "
                          f"{sorted(GEMM_CONFIGS) + (sorted(GEMV_CONFIGS['kn']) if M == 1 else [])}")

    if config is not None:
        return _labelled(launch(config, a, b, out), f"webgpu-{config} (pinned)")
    if batch * M * N == 0:
        return _labelled(_noop(), "webgpu (empty)")
    if M == 1:
        names = _gemv_candidates(N, True)
        default = names[0]
    else:
        names = _gemm_candidates(M, N)
        default = _gemm_default(M, N, names)
    key = tuning.shape_class("matmul", f"{device_tag()}/float32/b{batch}" + ("" if b_batched else "/shared-b"),
                             M, N, K, 0)
    samples = {}

    def make(name: str) -> Thunk:
        if "a" not in samples:
            samples.update(a=wg.DeviceTensor.empty(a.shape, a.dtype), b=wg.DeviceTensor.empty(b.shape, b.dtype),
                           out=wg.DeviceTensor.empty(out.shape, out.dtype))
        return launch(name, samples["a"], samples["b"], samples["out"])
    chosen, source = _choose(key, names, default, make, lambda: samples["out"].buffer)
    samples.clear()
    return _labelled(launch(chosen, a, b, out), f"webgpu-{chosen} ({source})")


__all__ = ["GemmConfig", "GemvConfig", "GEMM_CONFIGS", "GEMV_CONFIGS", "kernel_source", "render", "gemm", "gemv",
           "device_tag", "supports_linear", "bind_linear", "supports_matmul", "bind_matmul"]
