"""Renders fused row kernels (transforms.fusion.FusedKernel) as WGSL compute shaders (WebGPU).

Each kernel becomes one shader module with entry point ``main``. Bindings: ``@binding(0)`` a
uniform ``Params`` struct of ``u32``: ``R`` (rows), ``D`` (row width), then one element offset
per tensor (``o0..``: inputs then outputs), since the runtime binds whole buffers
(runtime/webgpu.py); then one storage buffer per input (read-only) and per output, in
``kernel.inputs`` / ``kernel.outputs`` order. R and D are run-time values, so one pipeline
serves every shape of one structure.

Two code shapes:

- ``elementwise`` (no row reduction): one invocation per element of the R x D space, 256 per
  workgroup, workgroups over a 2-D grid (``x + y * num_workgroups.x``).
- ``row`` (a row reduction): one workgroup of ``WG`` invocations per row. The row is walked in
  *phases* (``transforms.fusion.phases``), each a strided loop ``j = lid; j < D; j += WG``; a
  vec value needed in a later phase is recomputed there from the inputs (no scratch memory).
  Each reduction accumulates per invocation, then a tree over ``var<workgroup>`` memory (all
  of a phase's reductions together); ``max`` counts NaNs beside it, as torch's max keeps them.
  Row values (rs) are computed once per invocation at function scope; rs outputs are stored by
  invocation 0.

All arithmetic is f32. Storage: float32 ``array<f32>``; int32 ``array<i32>``; int64 as pairs of
``u32`` (loaded only, as the nearest float32 of hi * 2^32 + lo); float16, bfloat16 and bool in
``u32`` words (2 or 4 per word) unpacked on load (``unpack2x16float``, bfloat16's high half,
a byte != 0) and, as outputs, written with ``atomicAnd``/``atomicOr`` on the element's own bits,
so neighbours written by other invocations are kept (bfloat16 rounds to nearest even; NaN stays
NaN).

Native float16 (``render_kernel(kernel, f16=True)``, where the device has WebGPU's
``shader-f16``; runtime/wgsl_kernels.py asks): a kernel with a float16 input or output starts
with ``enable f16;`` and binds its float16 tensors as ``array<f16>`` (element offsets in
2-byte units, the buffers still bound whole): a plain load ``f32(in[i])`` and a plain store
``out[i] = yr_f16(v)``, no atomics. The arithmetic stays f32, rounded once at the store, as
torch's float16 ops on the CPU do; ``yr_f16`` turns a finite value past the f16 range into
torch's inf first (WGSL leaves converting it undefined). The first line of such a module says
so (``// yirage: float16 storage native``), and ``kernel_name`` ends in ``_f16``. A kernel
without float16 tensors renders the same either way. NaN tests look at the bits (a shader compiler may assume ``x != x`` is false). ``erf`` is
Abramowitz and Stegun's 7.1.26 (|error| <= 1.5e-7), ``tanh`` is computed from ``exp(-2|x|)`` (a
driver's tanh may give NaN for large |x|), and ``pow`` of a negative base with an integral
exponent keeps torch's sign.

This module is pure text rendering: it must never import wgpu or torch, compile or run anything
(runtime/wgsl_kernels.py does that).
"""
from __future__ import annotations

import hashlib
import math
import struct

from ..dtypes import DType
from ..transforms.fusion import RS, VEC, FusedKernel, phases

#: invocations per workgroup: a row's in the row shape, elements' in the elementwise shape
ROW_WG = 64
ELEMENTWISE_WG = 256

#: packed storage: elements per u32 word
_PER_WORD = {DType.float16: 2, DType.bfloat16: 2, DType.bool: 4}

#: the first lines of a module whose float16 tensors are native ``array<f16>``
F16_HEADER = "enable f16;\n// yirage: float16 storage native (shader-f16)"

#: f32 -> f16 as torch rounds: a finite value past the range (|x| >= 65520, what rounds past
#: 65504) becomes inf before the conversion, which WGSL leaves undefined for it
F16_PRELUDE = """
fn yr_f16(x: f32) -> f16 {
  return f16(select(x, select(yr_inf(), -yr_inf(), x < 0.0), abs(x) >= 65520.0));
}
"""

PRELUDE = """
fn yr_isnan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }
fn yr_nan() -> f32 { return bitcast<f32>(0x7fc00000u); }
fn yr_inf() -> f32 { return bitcast<f32>(0x7f800000u); }
fn yr_erf(x: f32) -> f32 {
  let a = abs(x);
  let t = 1.0 / (1.0 + 0.3275911 * a);
  let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * exp(-a * a);
  return select(select(y, -y, x < 0.0), x, yr_isnan(x));
}
fn yr_tanh(x: f32) -> f32 {
  let e = exp(-2.0 * abs(x));
  let y = (1.0 - e) / (1.0 + e);
  return select(select(y, -y, x < 0.0), x, yr_isnan(x));
}
fn yr_pow(a: f32, b: f32) -> f32 {
  if (yr_isnan(a) || yr_isnan(b)) { return select(yr_nan(), 1.0, b == 0.0 || a == 1.0); }
  if (b == 0.0 || a == 1.0) { return 1.0; }
  if (a == 0.0) { return select(select(0.0, yr_inf(), b < 0.0), 1.0, b == 0.0); }
  let m = exp2(b * log2(abs(a)));
  if (a > 0.0) { return m; }
  if (b != floor(b)) { return yr_nan(); }
  let odd = abs(b) < 16777216.0 && (abs(b) - 2.0 * floor(abs(b) * 0.5)) == 1.0;
  return select(m, -m, odd);
}
fn yr_i64(lo: u32, hi: u32) -> f32 {
  // the nearest float32 of hi * 2^32 + lo; one rounding wherever the value fits 32 bits
  if (hi == 0u) { return f32(lo); }
  if (hi == 0xffffffffu && lo >= 0x80000000u) { return f32(bitcast<i32>(lo)); }
  return f32(bitcast<i32>(hi)) * 4294967296.0 + f32(lo);
}
fn yr_trunc(x: f32) -> f32 { return select(floor(x), ceil(x), x < 0.0); }
fn yr_bf16(x: f32) -> u32 {
  let u = bitcast<u32>(x);
  if (yr_isnan(x)) { return (u >> 16u) | 0x40u; }
  return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}
"""

_UNARY = {
    "exp": "exp({0})", "sqrt": "sqrt({0})", "rsqrt": "inverseSqrt({0})", "square": "({0} * {0})",
    "neg": "(-{0})", "relu": "select({0}, 0.0, {0} < 0.0)",
    "silu": "({0} / (1.0 + exp(-{0})))",
    "gelu": "(0.5 * {0} * (1.0 + yr_erf({0} * 0.70710678118654752)))",
    # tanh GELU as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
    "gelu_tanh": "({0} / (1.0 + exp(-1.5957691216057308 * ({0} + 0.044715 * {0} * {0} * {0}))))",
    "tanh": "yr_tanh({0})", "sigmoid": "(1.0 / (1.0 + exp(-{0})))", "erf": "yr_erf({0})",
    "log": "log({0})", "exp2": "exp2({0})", "abs": "abs({0})", "reciprocal": "(1.0 / {0})",
    "cos": "cos({0})", "sin": "sin({0})", "floor": "floor({0})", "ceil": "ceil({0})", "trunc": "yr_trunc({0})",
    # bool values are 0.0 / 1.0 (transforms/fusion.py)
    "logical_not": "select(0.0, 1.0, {0} == 0.0)", "to_bool": "select(0.0, 1.0, {0} != 0.0)",
}
_BINARY = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    # torch.maximum/minimum propagate NaN: a + b is NaN when either is
    "maximum": "select(max({0}, {1}), {0} + {1}, yr_isnan({0}) || yr_isnan({1}))",
    "minimum": "select(min({0}, {1}), {0} + {1}, yr_isnan({0}) || yr_isnan({1}))",
    "pow": "yr_pow({0}, {1})",
    # a NaN compares unequal to everything: tested on the bits, since the compiler may assume
    # no NaN reaches a comparison
    "eq": "select(0.0, 1.0, {0} == {1} && !yr_isnan({0}) && !yr_isnan({1}))",
    "ne": "select(0.0, 1.0, {0} != {1} || yr_isnan({0}) || yr_isnan({1}))",
    "lt": "select(0.0, 1.0, {0} < {1} && !yr_isnan({0}) && !yr_isnan({1}))",
    "le": "select(0.0, 1.0, {0} <= {1} && !yr_isnan({0}) && !yr_isnan({1}))",
    "gt": "select(0.0, 1.0, {0} > {1} && !yr_isnan({0}) && !yr_isnan({1}))",
    "ge": "select(0.0, 1.0, {0} >= {1} && !yr_isnan({0}) && !yr_isnan({1}))",
    "logical_and": "select(0.0, 1.0, {0} != 0.0 && {1} != 0.0)",
    "logical_or": "select(0.0, 1.0, {0} != 0.0 || {1} != 0.0)",
}
_INPUT_TYPES = (DType.float32, DType.float16, DType.bfloat16, DType.bool, DType.int32, DType.int64)
_OUTPUT_TYPES = (DType.float32, DType.float16, DType.bfloat16, DType.bool)


def _lit(x: float) -> str:
    """An f32 literal (inf and NaN as bit patterns: WGSL has no literal for them)."""
    bits = struct.unpack("<I", struct.pack("<f", float(x)))[0]
    v = struct.unpack("<f", struct.pack("<I", bits))[0]
    if math.isnan(v) or math.isinf(v):
        return f"bitcast<f32>({bits:#010x}u)"
    return f"f32({v!r})"


def _pow_scalar(x: str, e: float) -> str:
    """x ** e: products for small integer exponents (as codegen/cpp.py), sqrt for 0.5."""
    if e == int(e) and 1 <= abs(e) <= 4:
        prod = "(" + " * ".join([x] * int(abs(e))) + ")"
        return prod if e > 0 else f"(1.0 / {prod})"
    if e == 0.0:
        return "1.0"
    if e == 0.5:
        return f"sqrt({x})"
    return f"yr_pow({x}, {_lit(e)})"


class _Renderer:
    """One kernel's shader text (``render()``)."""

    def __init__(self, kernel: FusedKernel, f16: bool = False):
        self.k = kernel
        self.f16 = f16 and uses_float16(kernel)
        for inp in kernel.inputs:
            if inp.dtype not in _INPUT_TYPES:
                raise NotImplementedError(f"wgsl codegen: input dtype {inp.dtype.value} is not supported")
        for _, _, d in kernel.outputs:
            if d not in _OUTPUT_TYPES:
                raise NotImplementedError(f"wgsl codegen: output dtype {d.value} is not supported")
        self.n_in = len(kernel.inputs)

    # -- storage ---------------------------------------------------------------------------------
    def _decls(self) -> list[str]:
        k = self.k
        fields = ["R: u32", "D: u32"] + [f"o{i}: u32" for i in range(self.n_in + len(k.outputs))]
        lines = ["struct Params { " + ", ".join(fields) + " };", "@group(0) @binding(0) var<uniform> P: Params;"]
        for i, inp in enumerate(k.inputs):
            elem = {DType.float32: "f32", DType.int32: "i32"}.get(inp.dtype, "u32")
            if self.f16 and inp.dtype == DType.float16:
                elem = "f16"
            lines.append(f"@group(0) @binding({i + 1}) var<storage, read> in{i}: array<{elem}>;")
        for n, (_, _, d) in enumerate(k.outputs):
            elem = "f32" if d == DType.float32 else "f16" if self.f16 and d == DType.float16 else "atomic<u32>"
            lines.append(f"@group(0) @binding({self.n_in + n + 1}) var<storage, read_write> out{n}: array<{elem}>;")
        return lines

    def _load(self, idx: int) -> str:
        inp = self.k.inputs[idx]
        at = {"full": "r * P.D + j", "expand": "r * P.D + j", "row": "j", "col": "r", "scalar": "0u"}[inp.mode]
        e = f"(P.o{idx} + {at})"
        a = f"in{idx}"
        if inp.dtype == DType.float32:
            return f"{a}[{e}]"
        if inp.dtype == DType.int32:
            return f"f32({a}[{e}])"
        if inp.dtype == DType.int64:
            return f"yr_i64({a}[2u * {e}], {a}[2u * {e} + 1u])"
        if inp.dtype == DType.float16 and self.f16:
            return f"f32({a}[{e}])"
        if inp.dtype == DType.float16:
            return f"unpack2x16float({a}[{e} >> 1u])[{e} & 1u]"
        if inp.dtype == DType.bfloat16:
            return f"bitcast<f32>((({a}[{e} >> 1u] >> (({e} & 1u) * 16u)) & 0xffffu) << 16u)"
        return f"select(0.0, 1.0, (({a}[{e} >> 2u] >> (({e} & 3u) * 8u)) & 0xffu) != 0u)"   # bool

    def _store(self, n: int, at: str, v: str) -> list[str]:
        d = self.k.outputs[n][2]
        e = f"(P.o{self.n_in + n} + {at})"
        if d == DType.float32:
            return [f"out{n}[{e}] = {v};"]
        if d == DType.float16 and self.f16:
            return [f"out{n}[{e}] = yr_f16({v});"]
        bits = {DType.float16: f"(pack2x16float(vec2<f32>({v}, 0.0)) & 0xffffu)",
                DType.bfloat16: f"yr_bf16({v})", DType.bool: f"select(0u, 1u, {v} != 0.0)"}[d]
        per = _PER_WORD[d]
        width = 32 // per
        mask = (1 << width) - 1
        return [f"{{ let e = {e}; let sh = (e & {per - 1}u) * {width}u;",
                f"  atomicAnd(&out{n}[e / {per}u], ~({mask:#x}u << sh));",
                f"  atomicOr(&out{n}[e / {per}u], {bits} << sh); }}"]

    def _expr(self, s) -> str:
        a = [f"v{x}" for x in s.args]
        if s.op == "load":
            return self._load(s.args[0])
        if s.op in _UNARY:
            return _UNARY[s.op].format(*a)
        if s.op in _BINARY:
            return _BINARY[s.op].format(*a)
        if s.op == "where":
            return f"select({a[2]}, {a[1]}, {a[0]} != 0.0)"
        if s.op == "pow_scalar":
            return _pow_scalar(a[0], float(s.attrs["exponent"]))
        if s.op == "clamp":
            return f"min(max({a[0]}, {_lit(s.attrs['lo'])}), {_lit(s.attrs['hi'])})"
        if s.op == "affine":
            return f"({a[0]} * {_lit(s.attrs['a'])} + {_lit(s.attrs['b'])})"
        raise NotImplementedError(f"wgsl codegen: statement {s.op}")

    # -- shapes ----------------------------------------------------------------------------------
    def _needed(self, roots: list[int], computed: set[int]) -> list[int]:
        """Statements (in order) that ``roots`` need and that are not in ``computed``: the vec
        values of a phase, recomputed from the inputs and the rs values at hand."""
        need: set[int] = set()
        stack = list(roots)
        while stack:
            sid = stack.pop()
            if sid in need or sid in computed:
                continue
            need.add(sid)
            s = self.k.stmts[sid]
            if s.op != "load":
                stack.extend(s.args)
        return sorted(need)

    def _elementwise(self) -> list[str]:
        k = self.k
        body = [f"@compute @workgroup_size({ELEMENTWISE_WG})",
                "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,",
                "        @builtin(local_invocation_index) lid: u32) {",
                f"  let i = (wid.x + wid.y * nwg.x) * {ELEMENTWISE_WG}u + lid;",
                "  if (P.D == 0u || i >= P.R * P.D) { return; }",
                "  let r = i / P.D;", "  let j = i % P.D;"]
        outs = [sid for sid, _, _ in k.outputs]
        for sid in self._needed(outs, set()):
            body.append(f"  let v{sid} = {self._expr(k.stmts[sid])};")
        for n, (sid, _, _) in enumerate(k.outputs):
            body += ["  " + line for line in self._store(n, "r * P.D + j" if k.stmts[sid].kind == VEC else "r",
                                                         f"v{sid}")]
        return body + ["}"]

    def _row(self) -> list[str]:
        k = self.k
        stmts = k.stmts
        phase, avail = phases(k)
        reductions = [s for s in stmts if s.op in ("sum", "max")]
        n_phases = max([phase[s.id] + 1 for s in stmts if s.kind == VEC and s.op not in ("sum", "max")]
                       + [avail[s.id] for s in reductions], default=0)
        per_phase = max([sum(1 for s in reductions if phase[s.id] == p) for p in range(n_phases)], default=1)
        lines = [f"var<workgroup> red: array<f32, {ROW_WG * max(per_phase, 1) * 2}>;",
                 f"@compute @workgroup_size({ROW_WG})",
                 "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,",
                 "        @builtin(local_invocation_index) t: u32) {",
                 "  let r = wid.x + wid.y * nwg.x;",
                 "  if (r >= P.R) { return; }"]
        rs_done: set[int] = set()
        for p in range(n_phases + 1):
            for s in stmts:   # row values available from this phase on
                if s.kind == RS and s.op not in ("sum", "max") and avail[s.id] == p:
                    lines.append(f"  let v{s.id} = {self._expr(s)};")
                    rs_done.add(s.id)
            if p == n_phases:
                break
            accs = [s for s in reductions if phase[s.id] == p]
            stores = [(n, sid) for n, (sid, _, _) in enumerate(k.outputs)
                      if stmts[sid].kind == VEC and phase.get(sid) == p]
            for s in accs:
                init = "0.0" if s.op == "sum" else "-yr_inf()"
                lines.append(f"  var a{s.id}: f32 = {init};")
                if s.op == "max":
                    lines.append(f"  var n{s.id}: f32 = 0.0;")
            lines.append(f"  for (var j: u32 = t; j < P.D; j += {ROW_WG}u) {{")
            roots = [s.args[0] for s in accs] + [sid for _, sid in stores]
            for sid in self._needed(roots, rs_done):
                lines.append(f"    let v{sid} = {self._expr(stmts[sid])};")
            for n, sid in stores:
                lines += ["    " + x for x in self._store(n, "r * P.D + j", f"v{sid}")]
            for s in accs:
                x = f"v{s.args[0]}"
                if s.op == "sum":
                    lines.append(f"    a{s.id} = a{s.id} + {x};")
                else:
                    lines.append(f"    a{s.id} = max(a{s.id}, select({x}, -yr_inf(), yr_isnan({x})));")
                    lines.append(f"    n{s.id} = n{s.id} + select(0.0, 1.0, yr_isnan({x}));")
            lines.append("  }")
            lines += self._reduce(accs)
            rs_done.update(s.id for s in accs)
        for n, (sid, _, _) in enumerate(k.outputs):
            if stmts[sid].kind == RS:
                lines.append("  if (t == 0u) {")
                lines += ["    " + x for x in self._store(n, "r", f"v{sid}")]
                lines.append("  }")
        return lines + ["}"]

    def _reduce(self, accs) -> list[str]:
        """The workgroup tree over every reduction of a phase; each ends as ``let v{id}``."""
        if not accs:
            return []
        slots = []   # (slot, accumulator, op): max reductions also reduce their NaN count
        for s in accs:
            slots.append((len(slots), f"a{s.id}", "sum" if s.op == "sum" else "max"))
            if s.op == "max":
                slots.append((len(slots), f"n{s.id}", "sum"))
        lines = [f"  red[{i * ROW_WG}u + t] = {acc};" for i, acc, _ in slots]
        lines.append("  workgroupBarrier();")
        lines.append(f"  for (var s: u32 = {ROW_WG // 2}u; s > 0u; s = s >> 1u) {{")
        lines.append("    if (t < s) {")
        for i, _, op in slots:
            a, b = f"red[{i * ROW_WG}u + t]", f"red[{i * ROW_WG}u + t + s]"
            lines.append(f"      {a} = {a + ' + ' + b if op == 'sum' else f'max({a}, {b})'};")
        lines += ["    }", "    workgroupBarrier();", "  }"]
        for s in accs:
            i = next(i for i, acc, _ in slots if acc == f"a{s.id}")
            if s.op == "sum":
                lines.append(f"  let v{s.id} = red[{i * ROW_WG}u];")
            else:
                lines.append(f"  let v{s.id} = select(red[{i * ROW_WG}u], yr_nan(), red[{(i + 1) * ROW_WG}u] != 0.0);")
        lines.append("  workgroupBarrier();")   # red is rewritten by the next phase
        return lines

    def render(self) -> str:
        has_reduction = any(s.op in ("sum", "max") for s in self.k.stmts)
        body = self._row() if has_reduction else self._elementwise()
        head = [F16_HEADER, PRELUDE.strip(), F16_PRELUDE.strip()] if self.f16 else [PRELUDE.strip()]
        return "\n".join([*head, *self._decls(), *body]) + "\n"


def uses_float16(kernel: FusedKernel) -> bool:
    """Does the kernel read or write a float16 tensor (what native f16 storage changes)?"""
    return (any(inp.dtype == DType.float16 for inp in kernel.inputs)
            or any(d == DType.float16 for _, _, d in kernel.outputs))


def render_kernel(kernel: FusedKernel, f16: bool = False) -> str:
    """The WGSL module of one fused kernel (see the module docstring for its bindings).
    ``f16``: the device has ``shader-f16``, so float16 tensors are bound as ``array<f16>``
    (the module then starts with ``enable f16;``; a kernel without float16 tensors is the same
    text either way). Raises NotImplementedError for a dtype or statement it cannot render."""
    return _Renderer(kernel, f16).render()


def shape_of(kernel: FusedKernel) -> str:
    """'row' (a workgroup per row: the kernel reduces over rows) or 'elementwise'."""
    return "row" if any(s.op in ("sum", "max") for s in kernel.stmts) else "elementwise"


def kernel_name(kernel: FusedKernel, f16: bool = False) -> str:
    """A stable name of the kernel's structure (D excluded: it is a run-time value), ending in
    ``_f16`` when ``render_kernel(kernel, f16)`` binds float16 natively."""
    name = "yr_wgsl_" + hashlib.sha256(kernel.key(with_d=False).encode()).hexdigest()[:16]
    return name + "_f16" if f16 and uses_float16(kernel) else name


__all__ = ["render_kernel", "shape_of", "kernel_name", "uses_float16", "F16_HEADER", "ROW_WG", "ELEMENTWISE_WG"]
