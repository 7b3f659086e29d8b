"""Renders outputs of a threadblock graph (ir/threadblock.py ``TBGraph``) as C++.

``render_threadblock(tb, k, name)`` returns a translation unit with
``extern "C" void NAME(void** args)``: ``args`` holds the kernel tensors of the block graph's
inputs (in ``new_input`` order, contiguous float32) and then output ``k``; with ``k`` a tuple
of output indices, one kernel computes all of them (the ops they share run once: Mirage's
attention block graph has three outputs from one Q K^T) and ``args`` ends with them in that
order. The code follows
Mirage's µGraph levels on a CPU: the grid is one statically scheduled loop over the blocks of
all three dims (``yr::for_static`` in a ``yr::parallel`` region of ``tb.cpu_threads`` threads,
0: all; kernels/cpu/yr_threads.h: OpenMP, or yirage's own pool; one block per iteration,
blocks independent), each block runs the for-loop sequentially, every block tile
lives in a per-thread buffer (an arena allocated once per thread, sized by the tile shapes,
so tiles stay L1/L2-resident), input tiles are copied in at each iteration, accumulators stay
in their buffers across iterations, and the innermost loops are unit-stride ``omp simd``
loops (matmul as rank-1 updates of an output row). Only the ops the outputs depend on are
emitted. Meaning is ``ir.threadblock.run_threadblock``'s: tests compare the two.

This module must never compile or load anything (runtime/threadblock_kernels.py does).
"""
from __future__ import annotations

import math

from ..ir.threadblock import ACCUM, POST, TBGraph

_UNARY = {
    "exp": "std::exp({0})", "sqrt": "std::sqrt({0})", "square": "({0} * {0})",
    "relu": "std::max({0}, 0.0f)", "silu": "({0} / (1.0f + std::exp(-{0})))",
    "gelu": "(0.5f * {0} * (1.0f + std::erf({0} * 0.70710678118654752f)))",
}
_BINARY = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})"}


def _f(x: float) -> str:
    if math.isinf(x):
        return "INFINITY" if x > 0 else "-INFINITY"
    return f"{float(x)!r}f"


def _ks(k) -> tuple[int, ...]:
    return tuple(k) if isinstance(k, (tuple, list)) else (k,)


def needed_ops(tb: TBGraph, k) -> list:
    """The ops of ``tb`` that output ``k`` (an index or a tuple of them) depends on, in graph order."""
    producer = {s: op for op in tb.ops for s in op.outputs}
    need, stack = set(), [tb.outputs[j].sid for j in _ks(k)]
    while stack:
        op = producer.get(stack.pop())
        if op is not None and id(op) not in need:
            need.add(id(op))
            stack.extend(op.inputs)
    return [op for op in tb.ops if id(op) in need]


def _strides(shape) -> list[int]:
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return out[::-1]


def _nest(shape, body: list[str], ind: str, simd: bool = True) -> list[str]:
    """Nested loops i0..i{r-1} over ``shape`` around ``body`` (innermost loop ``omp simd``)."""
    lines, r = [], len(shape)
    for d, n in enumerate(shape):
        if simd and d == r - 1:
            lines.append(f"{ind}{'  ' * d}#pragma omp simd")
        lines.append(f"{ind}{'  ' * d}for (int64_t i{d} = 0; i{d} < {n}; ++i{d})")
    return lines + [f"{ind}{'  ' * r}{b}" for b in body]


def _index(shape, out_shape) -> str:
    """Flat index into a contiguous tile of ``shape`` broadcast to ``out_shape`` at i0..i{r-1}."""
    terms = [f"i{d} * {s}" if s != 1 else f"i{d}"
             for d, (n, s) in enumerate(zip(shape, _strides(shape))) if n != 1]
    return " + ".join(terms) or "0"


class _Renderer:
    def __init__(self, tb: TBGraph, k):
        self.tb, self.ks = tb, _ks(k)
        self.ops = needed_ops(tb, self.ks)
        used = {i for op in self.ops for i in op.inputs} | {tb.outputs[j].sid for j in self.ks}
        self.inputs = [(n, inp) for n, inp in enumerate(tb.inputs) if inp.sid in used]
        self.bufs = sorted(used | {s for op in self.ops for s in op.outputs})
        self.lines: list[str] = []

    def shape(self, sid):
        return self.tb.tensors[sid].shape

    def numel(self, sid) -> int:
        return math.prod(self.shape(sid))

    def emit(self, ind: str, *lines: str) -> None:
        self.lines.extend(ind + x for x in lines)

    # ---- tiles in and out -----------------------------------------------------------------
    def offsets(self, dshape, imap, fdim, tile, loop: bool) -> list[str]:
        off = [[] for _ in dshape]
        for i, d in enumerate(imap):
            if d >= 0:
                block = dshape[d] // self.tb.grid_dim[i]
                off[d].append(f"b{i} * {block}")
        if loop and fdim >= 0:
            off[fdim].append(f"it * {tile[fdim]}")
        return [" + ".join(o) or "0" for o in off]

    def copy(self, ind, ptr, dshape, imap, fdim, sid, store: bool, loop: bool) -> None:
        tile = self.shape(sid)
        offs = self.offsets(dshape, imap, fdim, tile, loop)
        g = " + ".join(f"({o} + i{d}) * {s}" for d, (o, s) in enumerate(zip(offs, _strides(dshape))))
        t = _index(tile, tile)
        body = f"{ptr}[{g}] = s{sid}[{t}];" if store else f"s{sid}[{t}] = {ptr}[{g}];"
        self.lines.extend(_nest(tile, [body], ind))

    # ---- ops ------------------------------------------------------------------------------
    def op(self, ind, op) -> None:
        o, a, ins = op.outputs[0], op.attrs, op.inputs
        out = self.shape(o)
        if op.op in _UNARY or op.op in ("clamp", "mul_scalar", "add_scalar"):
            x = f"s{ins[0]}[i]"
            e = (_UNARY[op.op].format(x) if op.op in _UNARY else
                 f"std::min(std::max({x}, {_f(a['min_val'])}), {_f(a['max_val'])})" if op.op == "clamp"
                 else f"({x} * {_f(a['scalar'])})" if op.op == "mul_scalar" else f"({x} + {_f(a['scalar'])})")
            self.emit(ind, "#pragma omp simd", f"for (int64_t i = 0; i < {self.numel(o)}; ++i) s{o}[i] = {e};")
        elif op.op in _BINARY:
            x, y = (f"s{i}[{_index(self.shape(i), out)}]" for i in ins)
            self.lines.extend(_nest(out, [f"s{o}[{_index(out, out)}] = {_BINARY[op.op].format(x, y)};"], ind))
        elif op.op == "matmul":
            self.matmul(ind, o, *ins)
        elif op.op in ("reduction", "reduction_max"):
            self.reduce(ind, op)
        elif op.op == "rms_norm":
            L = out[-1]
            self.emit(ind, f"for (int64_t r = 0; r < {self.numel(o) // L}; ++r) {{",
                      f"  const float* x = s{ins[0]} + r * {L}; float* y = s{o} + r * {L}; float ss = 0.0f;",
                      "  #pragma omp simd reduction(+:ss)", f"  for (int64_t j = 0; j < {L}; ++j) ss += x[j] * x[j];",
                      f"  const float inv = 1.0f / std::sqrt(ss / {L} + {_f(a['eps'])});",
                      "  #pragma omp simd", f"  for (int64_t j = 0; j < {L}; ++j) y[j] = x[j] * inv;", "}")
        elif op.op == "concat":
            d = a["dim"]
            outer = math.prod(out[:d])
            na, nb = (math.prod(self.shape(i)[d:]) for i in ins)
            self.emit(ind, f"for (int64_t r = 0; r < {outer}; ++r) {{",
                      f"  std::copy(s{ins[0]} + r * {na}, s{ins[0]} + (r + 1) * {na}, s{o} + r * {na + nb});",
                      f"  std::copy(s{ins[1]} + r * {nb}, s{ins[1]} + (r + 1) * {nb}, s{o} + r * {na + nb} + {na});",
                      "}")
        elif op.stage == ACCUM:
            self.accum(ind, op)
        else:
            raise NotImplementedError(op.op)

    def matmul(self, ind, o, A, B) -> None:
        sa, sb = self.shape(A), self.shape(B)
        M, K, N = sa[-2], sa[-1], sb[-1]
        batch = math.prod(sa[:-2])
        self.emit(ind, f"for (int64_t b = 0; b < {batch}; ++b) for (int64_t m = 0; m < {M}; ++m) {{",
                  f"  float* c = s{o} + (b * {M} + m) * {N};",
                  f"  const float* a = s{A} + (b * {M} + m) * {K};",
                  f"  std::fill(c, c + {N}, 0.0f);",
                  f"  for (int64_t k = 0; k < {K}; ++k) {{",
                  f"    const float av = a[k]; const float* br = s{B} + (b * {K} + k) * {N};",
                  "    #pragma omp simd", f"    for (int64_t n = 0; n < {N}; ++n) c[n] += av * br[n];",
                  "  }", "}")

    def reduce(self, ind, op) -> None:
        x, o, d = op.inputs[0], op.outputs[0], op.attrs["dim"]
        shp = self.shape(x)
        outer, red, inner = math.prod(shp[:d]), shp[d], math.prod(shp[d + 1:])
        is_max = op.op == "reduction_max"
        init, comb = ("-INFINITY", "v = std::max(v, {})") if is_max else ("0.0f", "v += {}")
        lines = [f"for (int64_t p = 0; p < {outer}; ++p) for (int64_t j = 0; j < {inner}; ++j) {{",
                 f"  float v = {init};",
                 f"  for (int64_t r = 0; r < {red}; ++r) " + comb.format(f"s{x}[(p * {red} + r) * {inner} + j]") + ";"]
        if is_max:  # running max over the loop: s{o} holds the previous max
            diff = op.outputs[1]
            lines += [f"  const float prev = s{o}[p * {inner} + j], m = std::max(prev, v);",
                      f"  s{o}[p * {inner} + j] = m; s{diff}[p * {inner} + j] = prev - m;"]
        else:
            lines.append(f"  s{o}[p * {inner} + j] = v;")
        self.emit(ind, *lines, "}")

    def accum(self, ind, op) -> None:
        x, o, acc = op.inputs[0], op.outputs[0], op.attrs.get("acc")
        sx, so = self.shape(x), self.shape(o)
        if op.op == "forloop_accum_max":
            self.emit(ind, "#pragma omp simd",
                      f"for (int64_t i = 0; i < {self.numel(o)}; ++i) s{o}[i] = std::max(s{o}[i], s{x}[i]);")
            return
        scale = (f"s{op.inputs[1]}[{_index(self.shape(op.inputs[1]), so)}]"
                 if op.op == "forloop_accum_rescale" else None)
        if acc is None:
            prev = f"s{o}[{_index(so, so)}]"
            new = f"{prev} * {scale} + s{x}[{_index(so, so)}]" if scale else f"{prev} + s{x}[{_index(so, so)}]"
            self.lines.extend(_nest(so, [f"{prev} = {new};"], ind))
            return
        L, rows = sx[-1], self.numel(x) // sx[-1]
        if acc == "sum_todimx":
            rdx = self.tb.reduction_dimx
            self.emit(ind, f"for (int64_t r = 0; r < {rows}; ++r) for (int64_t q = 0; q < {L // rdx}; ++q) {{",
                      "  #pragma omp simd",
                      f"  for (int64_t j = 0; j < {rdx}; ++j) s{o}[r * {rdx} + j] += s{x}[r * {L} + q * {rdx} + j];",
                      "}")
            return
        term = f"s{x}[r * {L} + j] * s{x}[r * {L} + j]" if acc == "rms" else f"s{x}[r * {L} + j]"
        if scale:  # acc "sum" with rescale: index the scale by row (its shape broadcasts to [..., 1])
            rshape = so[:-1]
            scale = f"s{op.inputs[1]}[r]" if self.numel(op.inputs[1]) == rows else \
                f"s{op.inputs[1]}[{_row_index(self.shape(op.inputs[1])[:-1], rshape)}]"
        upd = f"s{o}[r] = s{o}[r] * {scale} + v;" if scale else f"s{o}[r] += v;"
        self.emit(ind, f"for (int64_t r = 0; r < {rows}; ++r) {{", "  float v = 0.0f;",
                  "  #pragma omp simd reduction(+:v)", f"  for (int64_t j = 0; j < {L}; ++j) v += {term};",
                  f"  {upd}", "}")

    def finalize(self, ind, op) -> None:
        acc, o = op.attrs.get("acc"), op.outputs[0]
        if acc in ("mean", "rms"):
            width = self.shape(op.inputs[0])[-1] * self.tb.forloop_range
            e = f"s{o}[i] / {width}.0f"
            e = f"std::sqrt({e})" if acc == "rms" else e
            self.emit(ind, f"for (int64_t i = 0; i < {self.numel(o)}; ++i) s{o}[i] = {e};")

    # ---- the kernel -----------------------------------------------------------------------
    def render(self, name: str) -> str:
        tb, ind = self.tb, "      "
        offs, total = {}, 0
        for s in self.bufs:
            offs[s] = total
            total += -(-self.numel(s) // 16) * 16
        self.lines = ["#include <algorithm>", "#include <cmath>", "#include <cstdint>", "#include <vector>",
                      '#include "yr_threads.h"', "",
                      f'extern "C" void {name}(void** args) {{']
        for n, _ in self.inputs:
            self.emit("  ", f"const float* in{n} = static_cast<const float*>(args[{n}]);")
        for j in range(len(self.ks)):
            self.emit("  ", f"float* out{j} = static_cast<float*>(args[{len(tb.inputs) + j}]);")
        # a team of tb.cpu_threads threads (0: all), each with its arena; blocks split statically
        self.emit("  ", f"yr::parallel(true, {tb.cpu_threads or 0}, [&] {{",
                  f"  std::vector<float> arena({max(total, 1)});")
        for s in self.bufs:
            self.emit("    ", f"float* s{s} = arena.data() + {offs[s]};")
        gx, gy, gz = tb.grid_dim
        self.emit("    ", f"yr::for_static({gx * gy * gz}, [&](int64_t b) {{",
                  f"  const int64_t b0 = b / {gy * gz}, b1 = b / {gz} % {gy}, b2 = b % {gz};")
        for op in self.ops:
            init = ("-INFINITY" if op.op in ("forloop_accum_max", "reduction_max") else
                    "0.0f" if op.stage == ACCUM else None)
            if init:
                o = op.outputs[0]
                self.emit(ind, f"std::fill(s{o}, s{o} + {self.numel(o)}, {init});")
        self.emit(ind, f"for (int64_t it = 0; it < {tb.forloop_range}; ++it) {{")
        for n, inp in self.inputs:
            self.copy(ind + "  ", f"in{n}", inp.dshape, inp.input_map, inp.forloop_dim, inp.sid,
                      store=False, loop=True)
        for op in self.ops:
            if op.stage != POST:
                self.op(ind + "  ", op)
        self.emit(ind, "}")
        for op in self.ops:
            if op.stage == ACCUM:
                self.finalize(ind, op)
        for op in self.ops:
            if op.stage == POST:
                self.op(ind, op)
        for j, k in enumerate(self.ks):
            out = tb.outputs[k]
            self.copy(ind, f"out{j}", out.dshape, out.output_map, -1, out.sid, store=True, loop=False)
        self.lines += ["    });", "  });", "}", ""]
        return "\n".join(self.lines)


def _row_index(shape, out_shape) -> str:
    """Flat index into ``shape`` broadcast to ``out_shape`` at flat row ``r`` of ``out_shape``."""
    terms, rest = [], "r"
    for d in range(len(out_shape)):
        inner = math.prod(out_shape[d + 1:])
        coord = f"(({rest}) / {inner} % {out_shape[d]})"
        if shape[d] != 1:
            terms.append(f"{coord} * {math.prod(shape[d + 1:])}")
    return " + ".join(terms) or "0"


def arena_floats(tb: TBGraph, k) -> int:
    """Floats of tile buffers one thread needs to run output ``k`` (an index or a tuple of them)."""
    r = _Renderer(tb, k)
    return sum(-(-r.numel(s) // 16) * 16 for s in r.bufs)


def render_threadblock(tb: TBGraph, k, name: str) -> str:
    """C++ source of ``extern "C" void name(void** args)`` computing output ``k`` of ``tb``, or
    every output of the tuple ``k`` in one kernel (float32; args: every ``new_input`` tensor in
    order, then the output(s) in ``k``'s order)."""
    return _Renderer(tb, k).render(name)
