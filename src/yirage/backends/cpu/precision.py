"""Which reduced precisions this CPU computes natively, and what an emulated one costs here.

bfloat16 has a hardware dot product with AMX-BF16, AVX512-BF16 or AVX-NE-CONVERT (Arm: bf16),
int8 with VNNI (AVX512-VNNI, AVX-VNNI, AMX-INT8; Arm: dotprod, i8mm): ``runtime.machine``'s
``NATIVE_PRECISION_FLAGS``, read under ``YIRAGE_ISA``'s cap. Without one the precision is
*emulated*: bfloat16 values are widened to float32 and multiplied with float32 FMAs, int8 ones
widened to int16 (AVX2 ``vpmaddubsw``). It still runs where a user asks for it (an embedding
model's ``dtype="bfloat16"`` or ``quantization="int8"``, an LLM's ``prefill_dtype`` or
``decode_dtype``, torch.compile's ``dtype`` option), with one ``EmulatedPrecisionWarning`` per
process and precision that says what it measured: the fastest provider of a linear layer in
that precision against the fastest in float32, on ``PROBE_SHAPE``, timed together once per
machine and kept in the machine profile (``extra["precision"]``). Nothing here ever picks a
precision; ``tools/optimize.py`` asks ``is_native`` before it recommends one.
"""
from __future__ import annotations

import threading
import warnings

import torch

from ...errors import EmulatedPrecisionWarning
from ...runtime.machine import NATIVE_PRECISION_FLAGS, cpu_model_name, isa_cap, native_precision_flag
from ...tuning import profile as tuning
from . import embed, providers

#: the linear layer (M rows, N out, K in features) the precisions are compared on: a BERT-base
#: attention projection over 128 tokens
PROBE_SHAPE = (128, 768, 768)
#: seconds each precision's providers are timed for
PROBE_BUDGET_S = 0.3
#: the flag names as vendors spell them, for messages
_FLAG_NAMES = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16", "avx_ne_convert": "AVX-NE-CONVERT",
               "bf16": "Arm BF16", "amx_int8": "AMX-INT8", "avx512_vnni": "AVX512-VNNI", "avx_vnni": "AVX-VNNI",
               "i8mm": "Arm I8MM", "asimddp": "Arm dotprod"}

_warned: set[str] = set()
_lock = threading.Lock()


def is_native(dtype: str) -> bool:
    """Whether ``dtype`` ('float32', 'bfloat16' or 'int8') has a hardware dot product on this CPU
    (under ``YIRAGE_ISA``'s cap). Raises ConfigError for a bad ``YIRAGE_ISA``."""
    return native_precision_flag(dtype) is not None


def _probe_args(dtype: str) -> tuple[providers.Case, list[torch.Tensor]]:
    M, N, K = PROBE_SHAPE
    if dtype == "int8":
        w = torch.randint(-127, 128, (K, N), dtype=torch.int8)
        args = [torch.empty(0), w, torch.rand(N) / 100, torch.randn(N)]
        case = providers.Case("linear_w8a8", "int8", M, N, K, constant=True)
    else:
        w = (torch.randn(N, K) / K ** 0.5).to(getattr(torch, dtype))
        args = [torch.empty(0), w, torch.randn(N)]
        case = providers.Case("linear", dtype, M, N, K, constant=True)
    embed.mark_constant(args[1])
    return case, args


def _fastest(dtype: str) -> tuple[str, float, str | None]:
    """(provider, median seconds, why the figure is noisy or None) of the fastest provider of
    ``dtype`` on ``PROBE_SHAPE``."""
    case, args = _probe_args(dtype)
    comparison = providers.measure(case, args, PROBE_BUDGET_S)
    best = comparison.fastest()
    for name, p in providers.candidates(case).items():   # drop the probe's packed copies
        if p.packs:
            embed.forget_packed(args[1], p.kind(case))
    return best, comparison.median(best), tuning.busy_reason(comparison)


def measured_speed(dtype: str) -> dict:
    """``dtype``'s linear layer against float32's on this machine: {"speed_vs_float32": float32's
    seconds over ``dtype``'s (above 1: ``dtype`` is faster), "shape": "MxNxK", "threads",
    "provider", "float32_provider"}. Measured once per machine and thread count (each precision's
    providers timed for ``PROBE_BUDGET_S``) and kept in the machine profile."""
    threads = torch.get_num_threads()
    key = f"{dtype}|t{threads}"
    prof = tuning.active_profile()
    with _lock:
        known = prof.extra.get("precision", {}).get(key)
        if known is not None:
            return known
        # outside any tracing mode (torch.compile asks while its fake tensors are active)
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            p_low, s_low, busy_low = _fastest(dtype)
            p_f32, s_f32, busy_f32 = _fastest("float32")
        M, N, K = PROBE_SHAPE
        entry = {"speed_vs_float32": round(s_f32 / s_low, 3), "shape": f"{M}x{N}x{K}", "threads": threads,
                 "provider": p_low, "float32_provider": p_f32}
        prof.extra.setdefault("precision", {})[key] = entry
        if busy_low is None and busy_f32 is None and prof.path is not None:
            prof.save()
        return entry


def emulation_message(dtype: str, asked: str) -> str | None:
    """The warning for ``dtype`` asked by ``asked`` (e.g. "EmbeddingModel(dtype='bfloat16')") where
    this CPU emulates it, with what it measured (``measured_speed``); None where it is native."""
    if is_native(dtype):
        return None
    wanted = ", ".join(_FLAG_NAMES.get(f, f) for f in NATIVE_PRECISION_FLAGS[dtype])
    level = isa_cap()
    cap = "" if level == "native" else f", capped at {level} by YIRAGE_ISA"
    m = measured_speed(dtype)
    verdict = "float32 is faster here" if m["speed_vs_float32"] < 1 else "it is still faster than float32 here"
    return (f"{asked}: {dtype} is emulated on this CPU ({cpu_model_name()}{cap}: none of {wanted}); its linear "
            f"layers measured {m['speed_vs_float32']:.2f}x float32's speed ({m['shape']}, {m['threads']} "
            f"thread{'s' if m['threads'] != 1 else ''}; "
            f"{m['provider']} against {m['float32_provider']}), and {verdict}. It runs as asked.")


def warn_if_emulated(dtype: str, asked: str) -> None:
    """One ``EmulatedPrecisionWarning`` per process and ``dtype`` where this CPU emulates it
    (``emulation_message``); nothing where it is native. ``asked``: what the user asked for, in
    their words (the option and its value)."""
    if dtype in _warned:
        return
    message = emulation_message(dtype, asked)
    if message is not None and dtype not in _warned:
        _warned.add(dtype)
        warnings.warn(message, EmulatedPrecisionWarning, stacklevel=3)


__all__ = ["PROBE_SHAPE", "is_native", "measured_speed", "emulation_message", "warn_if_emulated"]
