"""The options of the torch.compile front end: ``mode`` and ``options`` checked once, up front.

    opts = parse_options(mode="max-autotune", options={"time_budget_s": 5, "fallback": "raise"})

``parse_options`` turns what a user passes to ``yr.compile`` / ``torch.compile(m,
backend="yirage", mode=..., options=...)`` into a frozen ``CompileOptions`` and raises
``TorchCompileError`` naming the valid keys or values for anything else, so a typo never
silently does nothing.

This module must never import torch's compiler stack, a backend, or compile anything.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import TorchCompileError

#: mode -> what it means (also the text of the error for an unknown mode)
MODES = {
    None: "the fixed fusion of each partition",
    "default": "the same as None",
    "reduce-overhead": "plan reuse: each partition keeps its bound plan (buffers and launches) "
                       "between calls with the same input tensors; on GPUs the executor captures "
                       "it after a few calls. The CPU gets the same plan reuse as None",
    "max-autotune": "superoptimize each partition within options['time_budget_s'] seconds",
}

FALLBACKS = ("eager", "raise")
#: the ``dtype`` option's values besides None
DTYPES = ("bfloat16",)


@dataclass(frozen=True)
class CompileOptions:
    """The checked options of one ``yr.compile`` / ``torch.compile(backend="yirage")``.

    Attributes:
        mode: None, "reduce-overhead" or "max-autotune" ("default" is stored as None).
        backend: a yirage backend name ("cpu", "cuda", ...), or None for ``yr.get_backend()``
            at compile time.
        dtype: None (each partition computes in its graph's dtypes) or "bfloat16": the GEMMs
            of float32 linear layers compute in bfloat16 (activations and weights rounded to
            bfloat16, float32 sums rounded to bfloat16, float32 bias: ``ir.ops`` ``linear``
            with ``compute_dtype='bfloat16'``), everything else stays float32. An explicit
            choice, since it changes numerics (about 3 significant digits); on CPUs with
            AVX512-BF16 or AMX the GEMMs run about twice as fast.
        min_block_size: partitions with fewer compute ops (reshapes not counted) stay torch.
        torch_executed_ops: ATen op names ("aten.gelu" or "aten.gelu.default") that always
            run in torch.
        fallback: "eager" (a partition that fails runs its torch ops, with one warning) or
            "raise" (TorchCompileError).
        verify: compare the first call of each compiled graph with eager.
        cache_dir: the directory compiled kernels go to (``YIRAGE_CACHE_DIR`` while the
            partitions compile), or None for the usual one.
        time_budget_s: max-autotune's search budget per partition, in seconds.
        freeze: treat the model's parameters and buffers (the graph inputs dynamo marks
            static) as constant weights, so that the backend may keep them prepacked for the
            kernel chosen by measurement (the CPU's packed GEMMs: one packed copy of each
            weight whose chosen provider packs). Writes to a weight stay visible: its packed
            copy is remade when the weight's version or storage changes. False: every call
            reads the weights as they are (no packed copies).
    """

    mode: str | None = None
    backend: str | None = None
    dtype: str | None = None
    min_block_size: int = 2
    torch_executed_ops: frozenset[str] = field(default_factory=frozenset)
    fallback: str = "eager"
    verify: bool = False
    cache_dir: str | None = None
    time_budget_s: float = 10.0
    freeze: bool = True


VALID_KEYS = tuple(k for k in CompileOptions.__dataclass_fields__ if k != "mode")


def op_name(op) -> str:
    """The name ``torch_executed_ops`` matches: "aten.gelu.default" for the overload
    ``torch.ops.aten.gelu.default``, "aten.gelu" for the packet, strings as given with a
    leading "torch.ops." dropped and "::" written as "."."""
    text = op if isinstance(op, str) else str(op)
    text = text.replace("::", ".")
    return text[len("torch.ops."):] if text.startswith("torch.ops.") else text


def _fail(key: str, rule: str, value) -> None:
    raise TorchCompileError(f"yirage torch.compile option {key!r}: {rule}, got {value!r}")


def parse_options(mode: str | None = None, options: dict | None = None) -> CompileOptions:
    """Check ``mode`` and ``options`` and return them as a ``CompileOptions``.

    Raises:
        TorchCompileError: an unknown mode (the message lists the modes), an ``options`` that
            is not a dict, an unknown key (the message lists the valid keys) or a value of the
            wrong type or range (the message names the key and the rule).
    """
    if mode not in MODES:
        raise TorchCompileError(f"yirage torch.compile: unknown mode {mode!r}; valid modes: "
                                + "; ".join(f"{m!r} ({why})" for m, why in MODES.items()))
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise TorchCompileError(f"yirage torch.compile: options must be a dict, got {type(options).__name__}")
    unknown = sorted(set(options) - set(VALID_KEYS), key=str)
    if unknown:
        raise TorchCompileError(f"yirage torch.compile: unknown option(s) {', '.join(map(repr, unknown))}; "
                                f"valid options: {', '.join(VALID_KEYS)}")
    o = dict(options)
    if o.get("backend") is not None and not isinstance(o["backend"], str):
        _fail("backend", "must be a yirage backend name (a str) or None", o["backend"])
    dtype = o.get("dtype")
    if dtype is not None:
        dtype = str(dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            _fail("dtype", f"must be None or one of {DTYPES} (the GEMMs' compute dtype)", o["dtype"])
    mbs = o.get("min_block_size", 2)
    if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
        _fail("min_block_size", "must be an integer >= 1", mbs)
    ops = o.get("torch_executed_ops", ())
    if isinstance(ops, (str, bytes)) or not hasattr(ops, "__iter__"):
        _fail("torch_executed_ops", "must be a collection of ATen op names or overloads", ops)
    if o.get("fallback", "eager") not in FALLBACKS:
        _fail("fallback", f"must be one of {FALLBACKS}", o.get("fallback"))
    if not isinstance(o.get("verify", False), bool):
        _fail("verify", "must be a bool", o.get("verify"))
    cache_dir = o.get("cache_dir")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        _fail("cache_dir", "must be a path (str or os.PathLike) or None", cache_dir)
    if not isinstance(o.get("freeze", True), bool):
        _fail("freeze", "must be a bool", o.get("freeze"))
    budget = o.get("time_budget_s", 10.0)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        _fail("time_budget_s", "must be a positive number of seconds", budget)
    return CompileOptions(
        mode=None if mode == "default" else mode, backend=o.get("backend"), dtype=dtype,
        min_block_size=mbs, torch_executed_ops=frozenset(op_name(x) for x in ops),
        fallback=o.get("fallback", "eager"), verify=o.get("verify", False),
        cache_dir=os.fspath(cache_dir) if cache_dir is not None else None, time_budget_s=float(budget),
        freeze=o.get("freeze", True))
