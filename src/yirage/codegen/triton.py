"""Renders fused row kernels (transforms.fusion.FusedKernel) as Triton.

Every kernel becomes one ``@triton.jit`` function

    NAME(in0, .., inN, out0, .., outM, R, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr)

whose pointer arguments are the kernel's inputs then its outputs (``kernel.inputs`` and
``kernel.outputs`` order; contiguous tensors of the listed dtypes). ``R`` (the number of
rows) is a run-time argument, so one compilation serves every sequence length; the row
width ``D = kernel.D`` is rendered as a literal (a compile-time constant, as in the C++
path). Program ``(i, c)`` owns rows ``i*BLOCK_R .. i*BLOCK_R+BLOCK_R-1``.

Values: a ``vec`` statement is a ``[BLOCK_R, BLOCK_D]`` tile (or a tile that broadcasts to
one: ``[1, BLOCK_D]`` for row inputs, ``[BLOCK_R, 1]`` for per-row values, a 0-d scalar); an
``rs`` statement is a ``[BLOCK_R, 1]`` column. Load modes index ``full``/``expand``
``[r * D + j]`` (the executor materializes ``expand`` inputs first), ``row`` ``[j]``,
``col`` ``[r]``, ``scalar`` ``[0]``. All arithmetic is float32: loads convert with
``.to(tl.float32)``, stores convert to the output dtype, rounding to nearest even
(float32 -> bfloat16 goes through the module's ``_to_bf16``: the GPU's ``cvt.rn``, or the
same rounding done on the bits under Triton's interpreter, which would truncate). A bool
(``tl.int1``) is loaded as 0.0/1.0 and stored as ``v != 0``; an int32/int64 input (a cast's
source) is loaded as the nearest float32; ``tanh`` and ``pow`` are the
module's ``_tanh``/``_pow`` (core ``tl`` ops only: libdevice does not run in the interpreter).
Masked lanes never reach a reduction (``where(cols < D, v, 0 / -inf)``).

Two code shapes (``code_shape``):

- ``persistent``: the whole row is one block (``BLOCK_D = next_pow2(D)``): every input is
  loaded once and the statements run in order, reductions over axis 1. Kernels without a
  row reduction use the same code with the columns split over a second grid axis
  (``cols = program_id(1) * BLOCK_D + arange``) so narrow-R launches still fill the GPU.
- ``looped``: for rows wider than ``MAX_PERSISTENT_D`` (or when forced), the row is walked
  in chunks of ``BLOCK_D``, one loop per *phase* (``transforms.fusion.phases``: split at
  each row reduction, as in codegen/cpp.py). A vec value needed in a later phase is recomputed there from the
  inputs and the rs values already available (no scratch buffers); reductions accumulate
  a ``[BLOCK_R, BLOCK_D]`` tile across chunks and reduce it after the loop; a vec output
  is stored in the phase of its statement, rs outputs after the last phase.

Both shapes compute the same values in the same order per element; they differ only in
the order in which a reduction adds its terms.

Launch heuristics live here too (``launch_config``); runtime/triton_kernels.py calls it
once per bind.

This module is pure text rendering: it must never import triton or torch, compile, write
files or load anything (runtime/triton_kernels.py does that).
"""
from __future__ import annotations

import hashlib
import math
from typing import NamedTuple

from ..dtypes import DType
from ..transforms.fusion import RS, VEC, FusedKernel, phases

#: Widest row (next power of two of D) a kernel with a row reduction keeps in one block.
#: 16384 float32 values over 16 warps is 32 registers per live tile per thread; wider
#: rows take the looped shape.
MAX_PERSISTENT_D = 16384
#: Largest chunk of the looped shape (BLOCK_D = min(this, next_pow2(ceil(D / 4)))).
LOOP_BLOCK_D = 4096
#: Column tile of reduction-free kernels on a GPU (the second grid axis covers the row).
SPLIT_BLOCK_D = 1024
#: Target elements per program tile (BLOCK_R * BLOCK_D) when rows are narrow (GPU).
TILE = 4096
#: Enough programs to occupy a GPU (H100: 132 SMs); BLOCK_R shrinks to reach it.
TARGET_PROGRAMS = 128
#: Under Triton's CPU interpreter each program costs Python overhead: tiles up to this.
INTERPRETER_TILE = 1 << 16
#: CUDA's limit on grid axis 1.
_MAX_GRID_Y = 65535

MODES = ("auto", "persistent", "looped")

_TL_DTYPE = {DType.float32: "tl.float32", DType.float16: "tl.float16", DType.bfloat16: "tl.bfloat16",
             DType.bool: "tl.int1"}

_UNARY = {
    "exp": "tl.exp({0})", "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})",
    "square": "({0} * {0})", "neg": "(-{0})",
    "relu": "tl.where({0} < 0.0, 0.0, {0})",  # keeps NaN, like torch.relu
    "silu": "({0} / (1.0 + tl.exp(-{0})))",
    "gelu": "(0.5 * {0} * (1.0 + tl.erf({0} * 0.7071067811865476)))",  # erf form (F.gelu default)
    # F.gelu(approximate="tanh"): 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
    "gelu_tanh": "({0} / (1.0 + tl.exp(-1.5957691216057308 * ({0} + 0.044715 * {0} * {0} * {0}))))",
    "sigmoid": "(1.0 / (1.0 + tl.exp(-{0})))", "erf": "tl.erf({0})", "log": "tl.log({0})",
    "exp2": "tl.exp2({0})", "abs": "tl.abs({0})", "reciprocal": "(1.0 / {0})",
    "floor": "tl.floor({0})", "ceil": "tl.ceil({0})",
    "trunc": "tl.where({0} < 0.0, tl.ceil({0}), tl.floor({0}))",
    "cos": "tl.cos({0})", "sin": "tl.sin({0})",
    "tanh": "_tanh({0})",  # HEADER: libdevice's tanh does not run under the interpreter
    # bool values are 0.0 / 1.0 (transforms/fusion.py)
    "logical_not": "tl.where({0} == 0.0, 1.0, 0.0)", "to_bool": "tl.where({0} != 0.0, 1.0, 0.0)",
}
_BINARY = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    # torch.maximum/minimum propagate NaN: a + b is NaN when either is
    # (nested where, no `|`: the interpreter cannot `|` a 0-d scalar load's mask with a tile)
    "maximum": "tl.where({0} != {0}, {0}, tl.where({1} != {1}, {1}, tl.maximum({0}, {1})))",
    "minimum": "tl.where({0} != {0}, {0}, tl.where({1} != {1}, {1}, tl.minimum({0}, {1})))",
    "pow": "_pow({0}, {1})",
    "eq": "tl.where({0} == {1}, 1.0, 0.0)", "ne": "tl.where({0} != {1}, 1.0, 0.0)",
    "lt": "tl.where({0} < {1}, 1.0, 0.0)", "le": "tl.where({0} <= {1}, 1.0, 0.0)",
    "gt": "tl.where({0} > {1}, 1.0, 0.0)", "ge": "tl.where({0} >= {1}, 1.0, 0.0)",
    "logical_and": "tl.where({0} != 0.0, tl.where({1} != 0.0, 1.0, 0.0), 0.0)",
    "logical_or": "tl.where({0} != 0.0, 1.0, tl.where({1} != 0.0, 1.0, 0.0))",
}


def _lit(x: float) -> str:
    """A float32 literal as Triton source (inf, -inf and nan included)."""
    x = float(x)
    if math.isnan(x):
        return 'float("nan")'
    if math.isinf(x):
        return 'float("inf")' if x > 0 else 'float("-inf")'
    return repr(x)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _prev_pow2(n: int) -> int:
    return 1 << (int(n).bit_length() - 1) if n >= 1 else 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- analysis ------------------------------------------------------------------------------

def _is_reduction(kernel: FusedKernel, s) -> bool:
    """A row reduction (sum/max over the row of a vec value)."""
    return s.op in ("sum", "max")


def has_reduction(kernel: FusedKernel) -> bool:
    """True if the kernel reduces over the row (so a row cannot be split across programs)."""
    return any(_is_reduction(kernel, s) for s in kernel.stmts)


def _extents(kernel: FusedKernel) -> dict[int, tuple[bool, bool]]:
    """Per statement: (varies over rows, varies over columns), i.e. its tile's shape is
    [BLOCK_R or 1, BLOCK_D or 1] (neither: a 0-d scalar or a [1, 1] tile)."""
    ext = {}
    for s in kernel.stmts:
        if s.op == "load":
            mode = kernel.inputs[s.args[0]].mode
            ext[s.id] = {"full": (True, True), "expand": (True, True), "row": (False, True),
                         "col": (True, False), "scalar": (False, False)}[mode]
        elif _is_reduction(kernel, s):
            ext[s.id] = (ext[s.args[0]][0], False)
        else:
            ext[s.id] = (any(ext[a][0] for a in s.args), any(ext[a][1] for a in s.args))
    return ext


def code_shape(kernel: FusedKernel, mode: str = "auto") -> str:
    """``"persistent"`` or ``"looped"`` for ``kernel`` under ``mode`` (one of ``MODES``).

    ``auto`` is persistent unless the kernel has a row reduction and
    ``next_pow2(D) > MAX_PERSISTENT_D``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    return "looped" if has_reduction(kernel) and _next_pow2(kernel.D) > MAX_PERSISTENT_D else "persistent"


def splits_columns(kernel: FusedKernel, mode: str = "auto") -> bool:
    """True if the rendered kernel spreads a row over grid axis 1 (persistent shape, no
    row reduction)."""
    return code_shape(kernel, mode) == "persistent" and not has_reduction(kernel)


# ---- rendering -----------------------------------------------------------------------------

class _Renderer:
    """Renders one kernel: ``render()`` returns the text of its ``@triton.jit`` function."""

    def __init__(self, kernel: FusedKernel, name: str, mode: str):
        self.k = kernel
        self.name = name
        self.shape = code_shape(kernel, mode)
        self.split = self.shape == "persistent" and not has_reduction(kernel)
        self.ext = _extents(kernel)
        self.lines: list[str] = []
        self.vec_outs = {}
        self.rs_outs = {}
        for n, (sid, _, d) in enumerate(kernel.outputs):
            if d not in _TL_DTYPE:
                raise NotImplementedError(f"triton codegen: output dtype {d.value} is not supported")
            (self.vec_outs if kernel.stmts[sid].kind == VEC else self.rs_outs).setdefault(sid, []).append((n, d))
        for inp in kernel.inputs:   # integers are loaded only (a cast's source), as the nearest float32
            if inp.dtype not in _TL_DTYPE and inp.dtype not in (DType.int32, DType.int64):
                raise NotImplementedError(f"triton codegen: input dtype {inp.dtype.value} is not supported")

    def emit(self, line: str, depth: int = 1) -> None:
        self.lines.append("    " * depth + line)

    # -- expressions
    def load(self, idx: int) -> str:
        mode = self.k.inputs[idx].mode
        p = f"in{idx}"
        if mode in ("full", "expand"):
            raw = f"tl.load({p} + roff + cols, mask=mask, other=0.0)"
        elif mode == "row":
            raw = f'tl.load({p} + cols, mask=cmask, other=0.0, eviction_policy="evict_last")'
        elif mode == "col":
            raw = f"tl.load({p} + rows, mask=rmask, other=0.0)"
        else:
            raw = f"tl.load({p})"
        return f"{raw}.to(tl.float32)"

    def expr(self, s) -> str:
        a = [f"v{x}" for x in s.args]
        if s.op == "load":
            return self.load(s.args[0])
        if s.op in _UNARY:
            return _UNARY[s.op].format(*a)
        if s.op in _BINARY:
            return _BINARY[s.op].format(*a)
        if s.op == "where":
            return f"tl.where({a[0]} != 0.0, {a[1]}, {a[2]})"
        if s.op == "pow_scalar":
            e = float(s.attrs["exponent"])
            return f"({a[0]} * {a[0]})" if e == 2.0 else f"_pow({a[0]}, {_lit(e)})"
        if s.op == "clamp":  # NaN stays NaN, like torch.clamp
            lo, hi = _lit(s.attrs["lo"]), _lit(s.attrs["hi"])
            return f"tl.where({a[0]} < {lo}, {lo}, tl.where({a[0]} > {hi}, {hi}, {a[0]}))"
        if s.op == "affine":
            if float(s.attrs["b"]) == 0.0:
                return f"({a[0]} * {_lit(s.attrs['a'])})"
            return f"({a[0]} * {_lit(s.attrs['a'])} + {_lit(s.attrs['b'])})"
        raise NotImplementedError(f"triton codegen: op {s.op}")

    def masked(self, s) -> str:
        fill = "0.0" if s.op == "sum" else 'float("-inf")'
        return f"tl.where(cmask, v{s.args[0]}, {fill})"

    def _as(self, sid: int, shape: str, full: tuple[bool, bool]) -> str:
        return f"v{sid}" if self.ext[sid] == full else f"tl.broadcast_to(v{sid}, {shape})"

    @staticmethod
    def _cast(v: str, d: DType) -> str:
        if d == DType.float32:
            return v
        if d == DType.bool:
            return f"({v} != 0.0)"
        if d == DType.bfloat16:
            return f"_to_bf16({v})"
        return f"{v}.to({_TL_DTYPE[d]})"

    def store_vec(self, sid: int, depth: int) -> None:
        for n, d in self.vec_outs.get(sid, ()):
            v = self._cast(self._as(sid, "(BLOCK_R, BLOCK_D)", (True, True)), d)
            self.emit(f"tl.store(out{n} + roff + cols, {v}, mask=mask)", depth)

    def store_rs(self) -> None:
        if not self.rs_outs:
            return
        depth = 1
        if self.split:  # one column block writes the per-row values
            self.emit("if tl.program_id(1) == 0:")
            depth = 2
        for sid, outs in self.rs_outs.items():
            for n, d in outs:
                v = self._cast(self._as(sid, "(BLOCK_R, 1)", (True, False)), d)
                self.emit(f"tl.store(out{n} + rows, {v}, mask=rmask)", depth)

    # -- code shapes
    def header(self) -> None:
        k = self.k
        params = [f"in{i}" for i in range(len(k.inputs))] + [f"out{n}" for n in range(len(k.outputs))]
        ins = ", ".join(f"{i.mode}:{i.dtype.value}" for i in k.inputs)
        outs = ", ".join(f"{k.stmts[s].kind}:{d.value}" for s, _, d in k.outputs)
        self.lines += [
            "@triton.jit",
            f"def {self.name}({', '.join(params + ['R', 'BLOCK_R: tl.constexpr', 'BLOCK_D: tl.constexpr'])}):",
            f'    """{self.shape} row program, D = {k.D}; inputs [{ins}]; outputs [{outs}]."""',
        ]
        self.emit("rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]  # [BLOCK_R, 1]")
        self.emit("rmask = rows < R")
        self.emit(f"roff = rows.to(tl.int64) * {k.D}  # row start, int64: R * D may pass 2**31")

    def cols(self, start: str | None, depth: int) -> None:
        first = f"{start} + " if start else ""
        self.emit(f"cols = {first}tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]", depth)
        self.emit(f"cmask = cols < {self.k.D}", depth)
        self.emit("mask = rmask & cmask", depth)

    def persistent(self) -> None:
        self.cols("tl.program_id(1) * BLOCK_D" if self.split else None, 1)
        for s in self.k.stmts:
            if _is_reduction(self.k, s):
                fn = "tl.sum" if s.op == "sum" else "_max_rows"
                self.emit(f"v{s.id} = {fn}({self.masked(s)}, axis=1, keep_dims=True)")
            else:
                self.emit(f"v{s.id} = {self.expr(s)}")
            if s.kind == VEC:
                self.store_vec(s.id, 1)
        self.store_rs()

    def looped(self) -> None:
        k, stmts = self.k, self.k.stmts
        phase, avail = phases(k)
        reductions = [s for s in stmts if _is_reduction(k, s)]
        n_phases = max([phase[s.id] + 1 for s in stmts if s.kind == VEC]
                       + [avail[s.id] for s in reductions], default=0)
        for p in range(n_phases + 1):
            for s in stmts:
                if s.kind == RS and not _is_reduction(k, s) and avail[s.id] == p:
                    self.emit(f"v{s.id} = {self.expr(s)}")
            if p == n_phases:
                break
            accs = [s for s in reductions if phase[s.id] == p]
            stored = [sid for sid in self.vec_outs if phase[sid] == p]
            # vec statements this loop needs: its outputs, its reductions' arguments and
            # (recomputed) everything vec they depend on; rs arguments are already there.
            need: set[int] = set()
            todo = stored + [s.args[0] for s in accs]
            while todo:
                x = todo.pop()
                if x in need or stmts[x].kind != VEC:
                    continue
                need.add(x)
                todo += list(stmts[x].args)
            if not need and not accs:
                continue
            self.emit(f"# phase {p}")
            for s in accs:
                init = "tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)" if s.op == "sum" else \
                    'tl.full([BLOCK_R, BLOCK_D], float("-inf"), tl.float32)'
                self.emit(f"acc{s.id} = {init}")
            self.emit(f"for j in range(0, {k.D}, BLOCK_D):")
            self.cols("j", 2)
            for sid in sorted(need):
                self.emit(f"v{sid} = {self.expr(stmts[sid])}", 2)
                if phase[sid] == p:
                    self.store_vec(sid, 2)
            for s in accs:
                if s.op == "sum":
                    self.emit(f"acc{s.id} += {self.masked(s)}", 2)
                else:
                    self.emit(f"acc{s.id} = _max_acc(acc{s.id}, {self.masked(s)})", 2)
            for s in accs:
                fn = "tl.sum" if s.op == "sum" else "_max_rows"
                self.emit(f"v{s.id} = {fn}(acc{s.id}, axis=1, keep_dims=True)")
        self.store_rs()

    def render(self) -> str:
        self.header()
        self.persistent() if self.shape == "persistent" else self.looped()
        return "\n".join(self.lines) + "\n"


def render_kernel(kernel: FusedKernel, name: str, mode: str = "auto") -> str:
    """Triton source of one fused kernel: a ``@triton.jit`` function named ``name``.

    ``mode`` (``auto``, ``persistent`` or ``looped``) picks the code shape
    (``code_shape``); launch it with ``launch_config(kernel, R, mode)``. The text needs
    the module ``HEADER`` (imports and the ``_to_bf16`` helper); ``render_module`` adds it.
    Raises NotImplementedError for a dtype other than float32/float16/bfloat16/bool (int32/int64
    inputs too) or an unknown statement.
    """
    return _Renderer(kernel, name, mode).render()


def kernel_name(kernel: FusedKernel, mode: str = "auto") -> str:
    """Entry name: a hash of the kernel's structure and its code shape."""
    tag = f"{kernel.key()}|{code_shape(kernel, mode)}"
    return "yr_fused_" + hashlib.sha256(tag.encode()).hexdigest()[:16]


HEADER = '''"""Fused row kernels generated by yirage.codegen.triton (do not edit)."""
import os

import triton
import triton.language as tl

# float32 -> bfloat16 rounds to nearest even on GPUs (cvt.rn), but Triton's CPU interpreter
# truncates; under the interpreter the rounding is done on the bits so both agree.
_BF16_BY_HAND = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"))


@triton.jit
def _to_bf16(x):
    if _BF16_BY_HAND:
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, r)  # NaN stays NaN
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16, fp_downcast_rounding="rtne")


@triton.jit
def _max_rows(t, axis: tl.constexpr, keep_dims: tl.constexpr):
    # tl.max where a NaN wins, as in torch (a GPU's max instruction drops NaN)
    m = tl.max(t, axis=axis, keep_dims=keep_dims)
    nans = tl.sum(tl.where(t != t, 1.0, 0.0), axis=axis, keep_dims=keep_dims)
    return tl.where(nans > 0.0, float("nan"), m)


@triton.jit
def _max_acc(acc, x):
    # elementwise running max where a NaN wins
    return tl.where(x != x, x, tl.where(acc != acc, acc, tl.maximum(acc, x)))


@triton.jit
def _tanh(x):
    # odd Taylor series below |x| = 0.25 (error < 1e-9), else sign(x) (1 - e) / (1 + e), e = exp(-2|x|)
    a = tl.abs(x)
    x2 = x * x
    small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397
                                                                                  + x2 * 0.021869488536155203))))
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.25, small, tl.where(x < 0.0, -big, big))


@triton.jit
def _pow(a, b):
    # torch.pow in float32: |a| ** b = exp2(b log2 |a|), negative for a < 0 and an odd integer b,
    # NaN for a < 0 and a non-integer b; pow(a, 0) = pow(1, b) = 1
    # (nested where, no `&`/`|`: the interpreter cannot combine a 0-d scalar's mask with a tile)
    r = tl.exp2(b * tl.log2(tl.abs(a)))
    odd_r = tl.where(tl.floor(b * 0.5) * 2.0 != b, -r, r)
    r = tl.where(a < 0.0, tl.where(tl.floor(b) == b, odd_r, float("nan")), r)
    return tl.where(b == 0.0, 1.0, tl.where(a == 1.0, 1.0, r))


'''


def render_module(kernels: list[FusedKernel], mode: str = "auto") -> tuple[str, list[str]]:
    """One Python module of ``@triton.jit`` functions; returns (source, entry name per kernel).

    Kernels with equal ``FusedKernel.key()`` (and code shape) share one function; the
    functions are sorted by name, so the text depends only on the set of structures.
    """
    names, bodies = [], {}
    for k in kernels:
        name = kernel_name(k, mode)
        names.append(name)
        if name not in bodies:
            bodies[name] = render_kernel(k, name, mode)
    return HEADER + "\n\n".join(bodies[n] for n in sorted(bodies)), names


# ---- launch --------------------------------------------------------------------------------

class LaunchConfig(NamedTuple):
    """How to launch a rendered kernel over R rows: ``fn[grid](*ptrs, R, BLOCK_R=..,
    BLOCK_D=.., num_warps=..)``; unpacks as ``(grid, BLOCK_R, BLOCK_D, num_warps)``."""

    grid: tuple[int, int]
    BLOCK_R: int
    BLOCK_D: int
    num_warps: int


def _num_warps(tile: int) -> int:
    """Warps for a BLOCK_R * BLOCK_D tile: 4 to 16 elements per thread for big tiles."""
    if tile >= 8192:
        return 16
    if tile >= 2048:
        return 8
    if tile >= 512:
        return 4
    return 2 if tile >= 128 else 1


def launch_config(kernel: FusedKernel, R: int, mode: str = "auto",
                  interpreter: bool = False) -> LaunchConfig:
    """Grid, block sizes and warps for ``kernel`` over ``R`` rows (rendered with ``mode``).

    GPU heuristics (``interpreter=False``):

    - persistent with a row reduction: ``BLOCK_D = next_pow2(D)`` (<= MAX_PERSISTENT_D
      under ``auto``); ``BLOCK_R`` = rows per program, a power of two at most
      ``TILE // BLOCK_D`` (so narrow rows are batched into ~4096-element tiles) and at most
      ``R // TARGET_PROGRAMS`` (so at least ~128 programs when R allows); 1 for rows of
      4096 or more. Grid ``(cdiv(R, BLOCK_R), 1)``.
    - persistent without a reduction: the same with ``BLOCK_D = min(next_pow2(D),
      SPLIT_BLOCK_D)`` and the row spread over grid axis 1 (``cdiv(D, BLOCK_D)`` programs).
    - looped: ``BLOCK_D = min(LOOP_BLOCK_D, next_pow2(cdiv(D, 4)))`` (chunks of at most 4096,
      at least ~4 chunks per row), ``BLOCK_R = 1``.
    - ``num_warps`` from the tile size: >= 8192 elements 16, >= 2048 8, >= 512 4, >= 128 2,
      else 1.

    Under Triton's CPU interpreter (``interpreter=True``) programs are expensive and warps
    meaningless: rows are batched up to ``INTERPRETER_TILE`` elements per program and
    reduction-free rows are not split (the looped chunk size is kept, so loops still run).
    """
    if R < 0:
        raise ValueError(f"R must be >= 0, got {R}")
    D = kernel.D
    shape = code_shape(kernel, mode)
    split = splits_columns(kernel, mode)
    r_cap = _next_pow2(max(R, 1))
    if shape == "looped":
        block_d = min(LOOP_BLOCK_D, _next_pow2(_cdiv(D, 4)))
        block_r = min(r_cap, max(1, INTERPRETER_TILE // block_d)) if interpreter else 1
    else:
        block_d = _next_pow2(D)
        if split and not interpreter and mode == "auto":
            block_d = min(block_d, SPLIT_BLOCK_D)
        while _cdiv(D, block_d) > _MAX_GRID_Y:
            block_d *= 2
        if interpreter:
            block_r = min(r_cap, max(1, INTERPRETER_TILE // block_d))
        else:
            ncol = _cdiv(D, block_d)
            block_r = min(r_cap, max(1, TILE // block_d), _prev_pow2(max(1, R * ncol // TARGET_PROGRAMS)))
    ncol = _cdiv(D, block_d) if split else 1
    return LaunchConfig((_cdiv(R, block_r), ncol), block_r, block_d, _num_warps(block_r * block_d))
