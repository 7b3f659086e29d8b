"""Renders outputs of a threadblock graph (ir/threadblock.py ``TBGraph``) as a Triton kernel.

``render_threadblock_triton(tb, k, name)`` returns a Python module with one ``@triton.jit``
function ``NAME(in0, .., inN-1, out0, ..)`` (the block graph's input tensors in ``new_input``
order, then output ``k``, or every output of the tuple ``k``, computed by one kernel that runs
the ops they share once), launched on the grid ``tb.grid_dim``: ``tl.program_id(0..2)`` are the block
coordinates, the for-loop is a ``for it in range(forloop_range)`` inside the kernel, block
matmuls are ``tl.dot`` (when every dim is at least 16, else a broadcast multiply and sum).

Triton blocks have power-of-two shapes, so every tile of true size ``n`` along a dim is held
padded to ``pad(n)`` (1 for n == 1, else the next power of two, at least 16). Padded lanes
hold arbitrary values; they are masked to 0 (sum, matmul operands) or -inf (max) wherever
they could reach a real lane, and never stored. Arithmetic is float32; inputs of other float
dtypes are converted on load and the output on store. ``concat`` and
``forloop_accum(x, "sum_todimx")`` are not rendered (``triton_supported`` says False).
Meaning is ``ir.threadblock.run_threadblock``'s.

This module must never compile, import the generated code or launch anything.
"""
from __future__ import annotations

import math

from ..ir.threadblock import ACCUM, POST, TBGraph
from .threadblock_cpp import needed_ops

_UNARY = {
    "exp": "tl.exp({0})", "sqrt": "tl.sqrt({0})", "square": "({0} * {0})",
    "relu": "tl.maximum({0}, 0.0)", "silu": "({0} / (1.0 + tl.exp(-{0})))",
    "gelu": "(0.5 * {0} * (1.0 + tl.erf({0} * 0.7071067811865476)))",
}
_BINARY = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})"}
UNSUPPORTED = ("concat",)
NEG_INF = 'float("-inf")'


def pad(n: int) -> int:
    """Padded block size of a tile dim of true size ``n``."""
    return 1 if n == 1 else max(16, 1 << (n - 1).bit_length())


def triton_supported(tb: TBGraph, k) -> bool:
    """Whether output ``k`` (an index or a tuple of them) of ``tb`` can be rendered here."""
    return all(op.op not in UNSUPPORTED and op.attrs.get("acc") != "sum_todimx" for op in needed_ops(tb, k))


def _fl(x: float) -> str:
    return repr(float(x)) if math.isfinite(x) else ('float("inf")' if x > 0 else 'float("-inf")')


class _Renderer:
    def __init__(self, tb: TBGraph, k):
        self.tb, self.ks = tb, tuple(k) if isinstance(k, (tuple, list)) else (k,)
        self.ops = needed_ops(tb, self.ks)
        used = {i for op in self.ops for i in op.inputs} | {tb.outputs[j].sid for j in self.ks}
        self.inputs = [(n, inp) for n, inp in enumerate(tb.inputs) if inp.sid in used]
        self.lines: list[str] = []

    def shape(self, sid):
        return self.tb.tensors[sid].shape

    def emit(self, ind: str, *lines: str) -> None:
        self.lines.extend(ind + x for x in lines)

    @staticmethod
    def ar(d: int, r: int, n: int) -> str:
        """tl.arange over dim ``d`` of a rank-``r`` block, expanded to broadcast."""
        idx = ", ".join(":" if e == d else "None" for e in range(r))
        return f"tl.arange(0, {pad(n)})[{idx}]" if r > 1 else f"tl.arange(0, {pad(n)})"

    def mask(self, shape) -> str:
        """The valid-lane mask of a tile of true ``shape`` (None when nothing is padded)."""
        parts = [f"({self.ar(d, len(shape), n)} < {n})" for d, n in enumerate(shape) if pad(n) != n]
        return " & ".join(parts) if parts else ""

    def masked(self, sid, other: str) -> str:
        m = self.mask(self.shape(sid))
        return f"tl.where({m}, s{sid}, {other})" if m else f"s{sid}"

    def pointers(self, ptr, dshape, imap, fdim, shape, loop: bool) -> str:
        strides, s = [], 1
        for n in reversed(dshape):
            strides.append(s)
            s *= n
        strides.reverse()
        terms = []
        for d, n in enumerate(shape):
            off = [f"b{i} * {dshape[d] // self.tb.grid_dim[i]}" for i, e in enumerate(imap) if e == d]
            if loop and fdim == d:
                off.append(f"it * {n}")
            base = " + ".join(off)
            idx = f"({base} + {self.ar(d, len(shape), n)})" if base else self.ar(d, len(shape), n)
            terms.append(f"{idx} * {strides[d]}" if strides[d] != 1 else idx)
        return f"{ptr} + " + " + ".join(terms)

    def full(self, shape, value: str) -> str:
        return f"tl.full(({', '.join(str(pad(n)) for n in shape)},), {value}, tl.float32)"

    # ---- ops ------------------------------------------------------------------------------
    def op(self, ind, op) -> None:
        o, a, ins = op.outputs[0], op.attrs, op.inputs
        if op.op in _UNARY:
            self.emit(ind, f"s{o} = {_UNARY[op.op].format(f's{ins[0]}')}")
        elif op.op == "clamp":
            self.emit(ind, f"s{o} = tl.minimum(tl.maximum(s{ins[0]}, {_fl(a['min_val'])}), {_fl(a['max_val'])})")
        elif op.op == "mul_scalar":
            self.emit(ind, f"s{o} = s{ins[0]} * {_fl(a['scalar'])}")
        elif op.op == "add_scalar":
            self.emit(ind, f"s{o} = s{ins[0]} + {_fl(a['scalar'])}")
        elif op.op in _BINARY:
            self.emit(ind, f"s{o} = {_BINARY[op.op].format(f's{ins[0]}', f's{ins[1]}')}")
        elif op.op == "matmul":
            A, B = (self.masked(i, "0.0") for i in ins)
            sa, sb = self.shape(ins[0]), self.shape(ins[1])
            if min(pad(sa[-2]), pad(sa[-1]), pad(sb[-1])) >= 16:
                self.emit(ind, f"s{o} = tl.dot({A}, {B}, input_precision=\"ieee\")")
            else:
                r = len(sa)
                ea = ", ".join([":"] * r + ["None"])
                eb = ", ".join([":"] * (r - 2) + ["None", ":", ":"])
                self.emit(ind, f"s{o} = tl.sum(({A})[{ea}] * ({B})[{eb}], axis={r - 1})")
        elif op.op == "reduction":
            self.emit(ind, f"s{o} = tl.sum({self.masked(ins[0], '0.0')}, axis={a['dim']}, keep_dims=True)")
        elif op.op == "reduction_max":
            m = f"tl.max({self.masked(ins[0], NEG_INF)}, axis={a['dim']}, keep_dims=True)"
            self.emit(ind, f"prev{o} = s{o}", f"s{o} = tl.maximum(prev{o}, {m})",
                      f"s{op.outputs[1]} = prev{o} - s{o}")
        elif op.op == "rms_norm":
            L = self.shape(ins[0])[-1]
            x2 = self.masked(ins[0], "0.0")
            self.emit(ind, f"s{o} = s{ins[0]} / tl.sqrt(tl.sum({x2} * {x2}, axis={len(self.shape(o)) - 1}, "
                           f"keep_dims=True) / {L} + {_fl(a['eps'])})")
        elif op.stage == ACCUM:
            self.accum(ind, op)
        else:
            raise NotImplementedError(f"threadblock op {op.op} has no Triton rendering")

    def accum(self, ind, op) -> None:
        x, o, acc = op.inputs[0], op.outputs[0], op.attrs.get("acc")
        if op.op == "forloop_accum_max":
            self.emit(ind, f"s{o} = tl.maximum(s{o}, s{x})")
            return
        last = len(self.shape(x)) - 1
        if acc is None:
            term = f"s{x}"
        else:
            v = self.masked(x, "0.0")
            term = f"tl.sum({f'{v} * {v}' if acc == 'rms' else v}, axis={last}, keep_dims=True)"
        if op.op == "forloop_accum_rescale":
            self.emit(ind, f"s{o} = s{o} * s{op.inputs[1]} + {term}")
        else:
            self.emit(ind, f"s{o} = s{o} + {term}")

    def finalize(self, ind, op) -> None:
        acc, o = op.attrs.get("acc"), op.outputs[0]
        width = self.shape(op.inputs[0])[-1] * self.tb.forloop_range
        if acc == "mean":
            self.emit(ind, f"s{o} = s{o} / {width}")
        elif acc == "rms":
            self.emit(ind, f"s{o} = tl.sqrt(s{o} / {width})")

    # ---- the kernel -----------------------------------------------------------------------
    def render(self, name: str) -> str:
        tb, ind = self.tb, "    "
        args = [f"in{n}" for n in range(len(tb.inputs))] + [f"out{j}" for j in range(len(self.ks))]
        self.lines = ["import triton", "import triton.language as tl", "", "", "@triton.jit",
                      f"def {name}({', '.join(args)}):"]
        self.emit(ind, "b0 = tl.program_id(0)", "b1 = tl.program_id(1)", "b2 = tl.program_id(2)")
        for op in self.ops:
            o = op.outputs[0]
            if op.op in ("forloop_accum_max", "reduction_max"):
                self.emit(ind, f"s{o} = {self.full(self.shape(o), NEG_INF)}")
            elif op.stage == ACCUM:
                self.emit(ind, f"s{o} = {self.full(self.shape(o), '0.0')}")
        self.emit(ind, f"for it in range({tb.forloop_range}):")
        for n, inp in self.inputs:
            m = self.mask(self.shape(inp.sid))
            ptrs = self.pointers(f"in{n}", inp.dshape, inp.input_map, inp.forloop_dim, self.shape(inp.sid), True)
            load = f"tl.load({ptrs}, mask={m}, other=0.0)" if m else f"tl.load({ptrs})"
            self.emit(ind + "    ", f"s{inp.sid} = {load}.to(tl.float32)")
        for op in self.ops:
            if op.stage != POST:
                self.op(ind + "    ", op)
        for op in self.ops:
            if op.stage == ACCUM:
                self.finalize(ind, op)
        for op in self.ops:
            if op.stage == POST:
                self.op(ind, op)
        for j, k in enumerate(self.ks):
            out = tb.outputs[k]
            shape = self.shape(out.sid)
            m = self.mask(shape)
            ptrs = self.pointers(f"out{j}", out.dshape, out.output_map, -1, shape, False)
            val = f"s{out.sid}.to(out{j}.dtype.element_ty)"
            self.emit(ind, f"tl.store({ptrs}, {val}, mask={m})" if m else f"tl.store({ptrs}, {val})")
        return "\n".join(self.lines) + "\n"


def render_threadblock_triton(tb: TBGraph, k, name: str) -> str:
    """Python source of a module defining ``@triton.jit def name(in0, .., out0, ..)`` computing
    output ``k`` (or every output of the tuple ``k``) of ``tb`` on the grid ``tb.grid_dim``. NotImplementedError for ops of
    ``UNSUPPORTED`` and ``sum_todimx`` (check ``triton_supported`` first)."""
    return _Renderer(tb, k).render(name)
