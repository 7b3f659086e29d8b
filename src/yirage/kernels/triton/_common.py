"""Shared pieces of the Triton library kernels: autotuning, GGUF block decoding, output casts.

Nothing here launches a kernel. The ``@triton.jit`` helpers are inlined into the kernels that
call them; the Python helpers run on the host at launch time and never read device memory.

GGUF block layouts (llama.cpp ``ggml-common.h``, little-endian):

- ``q8_0``: 34 bytes per 32 weights: ``fp16 d`` then ``int8 q[32]``; ``w[j] = d * q[j]``.
- ``q4_1``: 20 bytes per 32 weights: ``fp16 d``, ``fp16 m``, ``uint8 qs[16]``; weight ``j < 16``
  is the low nibble of ``qs[j]``, weight ``j + 16`` its high nibble; ``w = d * q + m``.

Run-time bounds checks (embedding ids, rope/attention ``start_pos``) happen on the device, so
no launch syncs with the host. A launch function given ``status`` (int64 ``(4,)``, zero on
entry) has the kernel that detects a violation record ``[1, value, lo, hi]`` there (value: the
offending id/position, ``[lo, hi)`` the valid range) via :func:`report_violation`; without
``status`` the checks still guard every access, just unreported (see :func:`status_arg`).
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

#: Codes of the weight/table storage types, passed to kernels as a ``tl.constexpr``.
W_FLOAT, W_Q8_0, W_Q4_1 = 0, 1, 2
#: Storage type name -> (code, bytes per block of 32 weights). "float" has no blocks.
W_TYPES = {"float": (W_FLOAT, 0), "q8_0": (W_Q8_0, 34), "q4_1": (W_Q4_1, 20)}
#: Weights per GGUF block (both q8_0 and q4_1).
QK = 32


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


def autotune(configs, key, prune=None, **kwargs):
    """``triton.autotune`` that never benchmarks under the CPU interpreter.

    On a GPU every config in ``configs`` (optionally filtered by ``prune(configs, args)``, args
    being the launch's arguments by name, constexprs included) is timed the first time a new
    ``key`` tuple (plus the argument dtypes) is seen, so the backend must run each shape once
    before capturing a CUDA graph. Before they are timed, the launch's configs are compiled
    together on a thread pool (``precompile``), and each is timed over about
    ``BENCH_MS`` (warm-up ``BENCH_WARMUP_MS``) rather than Triton's 100 ms (25). The winners are
    kept in Triton's on-disk cache (``cache_results``, where this Triton has it), so a later
    process does not time them again. Under ``TRITON_INTERPRET=1`` only the first surviving
    config is kept, so the first config of each list is chosen to be cheap for the interpreter
    (few, large programs) as well as sane on a GPU.
    """
    tuner, pending = [], []   # the Autotuner once made; the launch whose configs await timing

    def early_prune(cfgs, named_args, **kw):
        kept = list(prune(cfgs, {**named_args, **kw})) if prune is not None else list(cfgs)
        kept = kept or list(cfgs[:1])
        if interpreting():
            return kept[:1]
        pending[:] = [(kept, named_args, kw)] if len(kept) > 1 else []
        return kept

    def bench(fn, quantiles=None):
        """The autotuner's benchmark, once per config. Its first call for a launch compiles all
        of that launch's configs at once (``precompile``); it is not called at all when Triton's
        disk cache has the timings (``cache_results``), so a warm process compiles only the
        winner, as before."""
        if pending and tuner:
            precompile(tuner[0].fn, *pending.pop())
        return triton.testing.do_bench(fn, warmup=BENCH_WARMUP_MS, rep=BENCH_MS, quantiles=quantiles)

    if _AUTOTUNE_CACHES:
        kwargs.setdefault("cache_results", True)
    if _AUTOTUNE_DO_BENCH:
        kwargs.setdefault("do_bench", bench)
    decorate = triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": early_prune},
                               **kwargs)

    def decorator(fn):
        tuner.append(decorate(fn))
        return tuner[-1]
    return decorator


#: milliseconds each autotune config is timed for, after a warm-up of ``BENCH_WARMUP_MS``
#: (Triton's own: 100 and 25): every conv shape class of ResNet-50 times five configs
BENCH_MS, BENCH_WARMUP_MS = 20, 5


def precompile(jit_fn, configs, named_args: dict, kw: dict) -> int:
    """Compile ``jit_fn`` for each of ``configs`` on a thread pool before the autotuner times
    them one by one (it would compile each as it comes to it). Returns the number of configs
    tried (0 where this Triton has no ``AsyncCompileMode``).

    Triton's ``AsyncCompileMode`` (triton/runtime/_async_compile.py) hands the compiles that
    ``warmup`` starts to an executor; they run in parallel where the compiler releases the GIL
    (its MLIR passes, ``ptxas`` as a subprocess). Measured offline for sm_90 (the H100) on the
    2-core Xeon of the README, the five configs of the convolution's GEMM kernel took 8.0 s one
    after the other and 5.0 s on two threads. The ResNet-50 benchmark's first call on an H100 took
    93 s against Inductor's 13 s (2026-11-26); by those offline times, compiling these configs
    for its ~13 specializations is most of it (not yet measured on a GPU). A config that fails
    to compile here is left to the autotuner, which compiles it again and times it as
    infinitely slow (OutOfResources), as it did before."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return 0
    import os
    from concurrent.futures import ThreadPoolExecutor

    args = list(named_args.values())
    extra = {k: v for k, v in kw.items() if k not in ("grid", "warmup")}
    workers = min(len(configs), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    with ThreadPoolExecutor(max(1, workers)) as pool, AsyncCompileMode(pool, ignore_errors=True):
        for cfg in configs:
            try:
                jit_fn.warmup(*args, grid=(1,), **extra, **cfg.all_kwargs())
            except Exception as e:  # noqa: BLE001 - the autotuner compiles it again, and reports it
                from ...config import logger
                logger.debug("precompiling %s with %s failed (%s: %s); left to the autotuner",
                             getattr(jit_fn, "__name__", jit_fn), cfg, type(e).__name__, e)
    return len(configs)


#: whether this Triton's autotuner can keep its results on disk (``cache_results``, Triton >= 3.2)
_AUTOTUNE_CACHES = "cache_results" in inspect.signature(triton.autotune).parameters
#: whether this Triton's autotuner takes its benchmark function (``do_bench``, Triton >= 3.2)
_AUTOTUNE_DO_BENCH = "do_bench" in inspect.signature(triton.autotune).parameters


def acc_per_thread(cfg, block_m="BLOCK_M", block_n="BLOCK_N") -> float:
    """fp32 accumulator elements each thread of a config holds (BLOCK_M * BLOCK_N / threads)."""
    return cfg.kwargs[block_m] * cfg.kwargs[block_n] / (32 * cfg.num_warps)


def fp32_score_tiles(ptr_arg: str):
    """An autotune prune for attention kernels: with float32 inputs (``ptr_arg``'s dtype; dots on
    CUDA cores) only configs with <= 8 score elements per thread fit registers."""
    def prune(configs, args):
        if args[ptr_arg].dtype != torch.float32:
            return configs
        return [c for c in configs if acc_per_thread(c) <= 8]
    return prune


def pow2_bucket(n: int, cap: int = 4096) -> int:
    """Smallest power of two >= ``n``, capped: an autotune key that doesn't retune per size."""
    return min(triton.next_power_of_2(max(int(n), 1)), cap)


def check_tensors(op: str, **tensors) -> None:
    """ValueError unless every given tensor (None skipped) is contiguous and all share a device."""
    devices = set()
    for name, t in tensors.items():
        if t is None:
            continue
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (got strides {tuple(t.stride())})")
        devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(f"{op}: tensors are on different devices: {sorted(map(str, devices))}")


def status_arg(op: str, status, dummy: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(pointer argument, ``HAS_STATUS``) for a kernel taking an optional bounds-check status.

    ``status`` must be None or an int64 tensor of shape (4,) on ``dummy``'s device (ValueError
    otherwise). Without one, ``dummy`` (any tensor the launch already has) is passed in its place
    and never touched: the kernel's ``HAS_STATUS`` constexpr removes the reporting code, so no
    allocation is needed per call.
    """
    if status is None:
        return dummy, False
    if not isinstance(status, torch.Tensor) or status.dtype != torch.int64 or tuple(status.shape) != (4,):
        got = f"{status.dtype} {tuple(status.shape)}" if isinstance(status, torch.Tensor) else type(status).__name__
        raise ValueError(f"{op}: status must be an int64 tensor of shape (4,), got {got}")
    if status.device != dummy.device:
        raise ValueError(f"{op}: status is on {status.device}, the other tensors on {dummy.device}")
    if not status.is_contiguous():
        raise ValueError(f"{op}: status must be contiguous")
    return status, True


@triton.jit
def report_violation(status_ptr, value, lo, hi):
    """Record ``status = [1, value, lo, hi]`` unless an earlier violation already did.

    Call from a scalar branch taken only on a violation (zero cost on the in-range path). One
    writer is elected by ``atomic_cas(status[0], 0, 1)`` (on a GPU one thread of the program
    issues a scalar atomic): the winner, and only it, stores value, lo and hi, so the four words
    always describe one violation even when several programs or kernels sharing ``status``
    detect one. The host reads ``status`` after the launch (stream order makes it visible).
    """
    won = tl.atomic_cas(status_ptr, tl.full([], 0, tl.int64), tl.full([], 1, tl.int64)) == 0
    if won:
        tl.store(status_ptr + 1, value.to(tl.int64))
        tl.store(status_ptr + 2, tl.full([], 0, tl.int64) + lo)
        tl.store(status_ptr + 3, tl.full([], 0, tl.int64) + hi)


def weight_type(name: str) -> tuple[int, int]:
    """(kernel code, bytes per block) of a storage type name; ValueError if unknown."""
    try:
        return W_TYPES[name]
    except KeyError:
        raise ValueError(f"unsupported weight/table type {name!r}; expected one of {sorted(W_TYPES)}") from None


@triton.jit
def load_fp16_le(ptr, mask):
    """fp32 value of a little-endian fp16 stored as two bytes at ``ptr`` (uint8 pointers)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _block_values(base, j, mask, W_TYPE: tl.constexpr):
    """fp32 weight ``j`` (0..31) of the GGUF blocks starting at ``base`` (uint8 pointers)."""
    d = load_fp16_le(base, mask)
    if W_TYPE == 1:  # q8_0: d, int8 q[32]
        q = tl.load(base + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = d * q
    else:  # q4_1: d, m, qs[16]; j < 16 -> low nibble of qs[j], j >= 16 -> high nibble of qs[j - 16]
        m = load_fp16_le(base + 2, mask)
        byte = tl.load(base + 4 + (j % 16), mask=mask, other=0)
        q = ((byte >> ((j // 16) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
        w = d * q + m
    return tl.where(mask, w, 0.0)


@triton.jit
def dequant_block_tile(w_ptr, row_off, n_mask, kb, kb_mask, W_TYPE: tl.constexpr, BYTES: tl.constexpr):
    """Decode a [BLOCK_N, NB, 32] fp32 tile of whole GGUF blocks.

    ``row_off`` [BLOCK_N, 1, 1] is each row's int64 byte offset, ``kb`` [1, NB, 1] the block
    index along K, ``n_mask``/``kb_mask`` broadcastable validity masks; masked weights are 0.
    Scales are loaded once per block; the quant bytes once (q8_0) or twice (q4_1: both nibble
    halves read the same 16 bytes, from the same cache line).
    """
    base = w_ptr + row_off + kb.to(tl.int64) * BYTES
    return _block_values(base, tl.arange(0, 32)[None, None, :], n_mask & kb_mask, W_TYPE)


@triton.jit
def dequant_gather(w_ptr, row_off, k, mask, W_TYPE: tl.constexpr, BYTES: tl.constexpr):
    """fp32 weights at column ``k`` of the rows starting at byte ``row_off``, any broadcast shape.

    Elementwise: each weight loads its own block's scale bytes (the repeats hit L1), so the
    result comes out directly in the layout a ``tl.dot`` operand wants (e.g. [BLOCK_K,
    BLOCK_N] from ``row_off`` [1, BLOCK_N] and ``k`` [BLOCK_K, 1]), with no reshape. Masked: 0.
    """
    base = w_ptr + row_off + (k // 32).to(tl.int64) * BYTES
    return _block_values(base, k % 32, mask, W_TYPE)


@triton.jit
def cast_rtne(val, ty: tl.constexpr):
    """fp32 ``val`` as ``ty`` (float32/float16/bfloat16), rounding to nearest, ties to even.

    bf16 is rounded with integer ops on the fp32 bits (NaN stays NaN, overflow gives inf): the
    interpreter's fp32 -> bf16 cast truncates even when "rtne" is asked for; on a GPU this is
    the same rounding as ``cvt.rn.bf16.f32`` for two more integer instructions.
    """
    if ty == tl.bfloat16:
        bits = val.to(tl.float32).to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        nan = (bits >> 16) | 0x40  # quiet NaN, sign kept
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        return tl.where(is_nan, nan, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif ty == tl.float32:
        return val.to(tl.float32)
    else:
        return val.to(ty)


@triton.jit
def to_out(val, out_ptr):
    """fp32 ``val`` cast to ``out_ptr``'s element type with round-to-nearest-even."""
    return cast_rtne(val, out_ptr.dtype.element_ty)


def dot_upcast(*tensors) -> bool:
    """Whether kernels must feed ``tl.dot`` fp32 instead of bf16 operands.

    Only under the interpreter, whose ``tl.dot`` multiplies bf16's raw uint16 storage (a
    Triton interpreter limitation). bf16 values are exact in fp32, so results match a GPU's
    bf16 MMA (exact products, fp32 accumulation) up to summation order.
    """
    return interpreting() and any(t.dtype == torch.bfloat16 for t in tensors)


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """``tl.dot(a, b, acc)`` with fp32 accumulation and IEEE fp32 products (no TF32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision="ieee")
