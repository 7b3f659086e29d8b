"""Renders outputs of a threadblock graph (ir/threadblock.py ``TBGraph``) as a WGSL compute shader.

``render_threadblock_wgsl(tb, k)`` returns one shader module (entry point ``main``) computing
output ``k`` of ``tb``, or every output of the tuple ``k`` in one kernel that runs the ops they
share once (Mirage's attention block graph has three outputs from one Q K^T). It follows the
structure of the C++ renderer (codegen/threadblock_cpp.py) with Mirage's levels mapped onto
WebGPU:

- a *workgroup* is a threadblock: the shader is dispatched on ``tb.grid_dim`` workgroups,
  ``workgroup_id`` being the block coordinates (b0, b1, b2);
- the block's invocations (``workgroup_size``: ``prod(tb.block_dim)``, at most 256, WebGPU's
  guaranteed ``maxComputeInvocationsPerWorkgroup``) split every op's elementwise loop
  (``for (var e = lid; e < n; e += WG)``: each invocation owns some output elements of the op;
  a matmul element is a K loop, a reduction element a loop over the reduced dim, an rms_norm
  or a row accumulator element a whole row), with ``workgroupBarrier()`` between ops;
- the block tiles live in shared memory, one ``var<workgroup> sm: array<f32, N>`` arena: each
  tile gets a range of it for the part of the kernel where it is live (a first-fit of live
  intervals, so a matmul's product that is accumulated at once, or an accumulator read only by
  the epilogue, leaves its room to later tiles). The arena must fit ``max_shared_bytes``
  (16 KiB by default, WebGPU's guaranteed ``maxComputeWorkgroupStorageSize``): input tiles are
  copied in at each iteration of the for-loop (once before it when they do not move with the
  loop) while they fit; when they do not, the largest are read straight from their storage
  buffer instead (through the same index function); when even the intermediates do not fit,
  ``webgpu_supported`` says False;
- the for-loop is a ``for`` over ``forloop_range`` iterations; accumulators (and the running
  max of ``reduction_max``) keep their arena ranges across iterations, initialized before the
  loop; ``mean``/``rms`` are finished after it, then the ops after the loop run and the output
  tiles are stored.

Bindings: ``@binding(0)`` a uniform ``Params`` of ``u32`` element offsets (``o0..``: one per
bound input, then one per output: runtime/webgpu.py binds whole buffers), then one storage
buffer per input tile the kernel reads (``bound_inputs``: the ``new_input`` indices, in
order), then one per output. Inputs are ``read`` storage, or ``read_write`` with
``in_access="read_write"`` (WebGPU refuses a buffer bound read-only and writable in one
dispatch: when an output lies in an input's buffer). Float32 only (``webgpu_supported`` says
False for another dtype); arithmetic is f32. NaN: ``max`` (reduction_max, forloop_accum_max),
``relu`` and ``clamp`` keep a NaN as torch does (tested on the bits, codegen/wgsl.py's
``yr_isnan``); ``gelu`` uses codegen/wgsl.py's ``yr_erf`` (|error| <= 1.5e-7).
Meaning is ``ir.threadblock.run_threadblock``'s: tests compare the two.

This module is pure text rendering: it must never import wgpu or torch, compile or run
anything (runtime/threadblock_wgsl.py does that).
"""
from __future__ import annotations

import math

from ..dtypes import DType
from ..ir.threadblock import ACCUM, BINARY_OPS, POST, UNARY_OPS, TBGraph
from .threadblock_cpp import needed_ops
from .wgsl import PRELUDE, _lit

#: WebGPU's guaranteed minimum maxComputeWorkgroupStorageSize (bytes)
MAX_SHARED_BYTES = 16 * 1024
#: WebGPU's guaranteed minimum maxStorageBuffersPerShaderStage
MAX_STORAGE_BUFFERS = 8
#: WebGPU's guaranteed minimum maxComputeInvocationsPerWorkgroup
MAX_WORKGROUP_SIZE = 256
#: WebGPU's guaranteed minimum maxComputeWorkgroupsPerDimension
MAX_GRID_DIM = 65535

_UNARY = {
    "exp": "exp({0})", "sqrt": "sqrt({0})", "square": "({0} * {0})",
    "relu": "select({0}, 0.0, {0} < 0.0)", "silu": "({0} / (1.0 + exp(-{0})))",
    "gelu": "(0.5 * {0} * (1.0 + yr_erf({0} * 0.70710678118654752)))",
}
_BINARY = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})"}
_OTHER = {"clamp", "mul_scalar", "add_scalar", "matmul", "reduction", "reduction_max", "rms_norm", "concat",
          "forloop_accum", "forloop_accum_rescale", "forloop_accum_max"}
SUPPORTED_OPS = frozenset(_UNARY) | frozenset(_BINARY) | _OTHER
assert set(UNARY_OPS) <= set(_UNARY) and set(BINARY_OPS) <= set(_BINARY)

_PRELUDE_TB = """
fn yr_max(a: f32, b: f32) -> f32 { return select(max(a, b), a + b, yr_isnan(a) || yr_isnan(b)); }
"""


def _ks(k) -> tuple[int, ...]:
    return tuple(k) if isinstance(k, (tuple, list)) else (k,)


def _strides(shape) -> list[int]:
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return out[::-1]


def _u(n: int) -> str:
    return f"{int(n)}u"


def _times(x: str, n: int) -> str:
    return x if n == 1 else f"{x} * {_u(n)}"


def _coord(e: str, shape, d: int) -> str | None:
    """Coordinate ``d`` of flat index ``e`` (u32) in a contiguous ``shape`` (None: always 0)."""
    if shape[d] == 1:
        return None
    inner = math.prod(shape[d + 1:])
    c = f"({e} / {_u(inner)})" if inner != 1 else e
    return f"({c} % {_u(shape[d])})" if d > 0 else c


def _bcast(e: str, shape, out_shape) -> str:
    """Flat index into a contiguous ``shape`` broadcast to ``out_shape``, at flat index ``e``
    of ``out_shape``."""
    if tuple(shape) == tuple(out_shape):
        return e
    terms = []
    for d, (n, s) in enumerate(zip(shape, _strides(shape))):
        if n == 1:
            continue
        c = _coord(e, out_shape, d)
        terms.append(f"{c} * {_u(s)}" if s != 1 else c)
    return " + ".join(terms) or "0u"


def bound_inputs(tb: TBGraph, k) -> list[int]:
    """Indices (``new_input`` order) of the inputs the kernel of output(s) ``k`` reads: the
    storage buffers it binds, after the parameters, before the outputs."""
    ops = needed_ops(tb, _ks(k))
    used = {i for op in ops for i in op.inputs} | {tb.outputs[j].sid for j in _ks(k)}
    return [n for n, inp in enumerate(tb.inputs) if inp.sid in used]


def workgroup_size(tb: TBGraph) -> int:
    """Invocations per workgroup: the block's threads (``prod(block_dim)``), at most 256."""
    return max(1, min(MAX_WORKGROUP_SIZE, math.prod(tb.block_dim)))


class _Renderer:
    def __init__(self, tb: TBGraph, k, max_shared_bytes: int = MAX_SHARED_BYTES, wg: int | None = None):
        self.tb, self.ks = tb, _ks(k)
        self.wg = wg or workgroup_size(tb)
        self.ops = needed_ops(tb, self.ks)
        self.inputs = [(n, tb.inputs[n]) for n in bound_inputs(tb, self.ks)]
        self.in_of = {inp.sid: j for j, (_, inp) in enumerate(self.inputs)}   # sid -> bound input slot
        self.max_words = max_shared_bytes // 4
        self.lines: list[str] = []
        self.why: str | None = None
        self._layout()

    def shape(self, sid):
        return self.tb.tensors[sid].shape

    def numel(self, sid) -> int:
        return math.prod(self.shape(sid))

    def emit(self, ind: str, *lines: str) -> None:
        self.lines.extend(ind + x for x in lines)

    # ---- shared memory: live intervals, first fit -------------------------------------------
    def _intervals(self) -> dict[int, list[int]]:
        """[first, last] position where each tile is live: 0 is the top of the loop (input
        tiles copied in, state initialized), 1..L the ops in the loop, L + 1 the finishing of
        the accumulators, then the ops after the loop, END the output stores."""
        loop_ops = [op for op in self.ops if op.stage != POST]
        post_ops = [op for op in self.ops if op.stage == POST]
        L = len(loop_ops)
        end = L + 2 + len(post_ops)
        live: dict[int, list[int]] = {}
        for _, inp in self.inputs:
            live[inp.sid] = [0, L if inp.forloop_dim == -1 else 0]
        pos = {}
        for i, op in enumerate(loop_ops):
            pos[id(op)] = i + 1
        for j, op in enumerate(post_ops):
            pos[id(op)] = L + 2 + j
        for op in self.ops:
            p = pos[id(op)]
            for s in op.inputs:
                live[s][1] = max(live[s][1], p)
            for n, s in enumerate(op.outputs):
                if op.stage == ACCUM or (op.op == "reduction_max" and n == 0):
                    live[s] = [0, L + 1]           # carried across iterations, set before the loop
                else:
                    live[s] = [p, p]
        for j in self.ks:
            live[self.tb.outputs[j].sid][1] = end
        return live

    def _place(self, direct: set[int]) -> tuple[dict[int, int], int]:
        live = self.live
        order = sorted((s for s in live if s not in direct), key=lambda s: (live[s][0], -self.numel(s), s))
        placed: list[tuple[int, int, int]] = []   # (offset, size, sid)
        offs: dict[int, int] = {}
        for s in order:
            size, (a, b) = self.numel(s), live[s]
            clash = sorted((o, n) for o, n, t in placed if not (live[t][1] < a or b < live[t][0]))
            at = 0
            for o, n in clash:
                if at + size <= o:
                    break
                at = max(at, o + n)
            offs[s] = at
            placed.append((at, size, s))
        return offs, max([o + n for o, n, _ in placed], default=0)

    def _layout(self) -> None:
        self.live = self._intervals()
        self.direct: set[int] = set()   # input tiles read from their storage buffers
        self.offs, self.words = self._place(self.direct)
        for _, inp in sorted(self.inputs, key=lambda x: -self.numel(x[1].sid)):
            if self.words <= self.max_words:
                break
            self.direct.add(inp.sid)
            self.offs, self.words = self._place(self.direct)
        if self.words > self.max_words:
            self.why = (f"its tiles need {4 * self.words} bytes of workgroup memory, more than "
                        f"{4 * self.max_words}")

    # ---- reading and writing tiles ------------------------------------------------------------
    def rd(self, sid: int, idx: str) -> str:
        if sid in self.direct:
            return f"ld{self.in_of[sid]}({idx})"
        return f"sm[{_u(self.offs[sid])} + {idx}]" if self.offs[sid] else f"sm[{idx}]"

    def wr(self, sid: int, idx: str) -> str:
        return f"sm[{_u(self.offs[sid])} + {idx}]" if self.offs[sid] else f"sm[{idx}]"

    def global_index(self, e: str, dshape, imap, fdim, tile, loop: bool) -> str:
        """Element index in a contiguous tensor of ``dshape`` of element ``e`` of the block's
        tile (block ``yr_b``, iteration ``yr_it`` when ``loop``)."""
        terms = []
        for d, (n, s) in enumerate(zip(dshape, _strides(dshape))):
            parts = []
            c = _coord(e, tile, d)
            if c is not None:
                parts.append(c)
            for i, m in enumerate(imap):
                if m == d and self.tb.grid_dim[i] > 1:
                    parts.append(_times(f"yr_b.{'xyz'[i]}", n // self.tb.grid_dim[i]))
            if loop and fdim == d and self.tb.forloop_range > 1:
                parts.append(_times("yr_it", tile[d]))
            if not parts:
                continue
            x = " + ".join(parts)
            terms.append(f"({x}) * {_u(s)}" if s != 1 else f"({x})")
        return " + ".join(terms) or "0u"

    def loop(self, ind: str, n: int, body: list[str], var: str = "e") -> None:
        """Each invocation's share of ``n`` elements (``var`` = lid, lid + WG, ...)."""
        if n <= 0:
            return
        self.emit(ind, f"for (var {var}: u32 = lid; {var} < {_u(n)}; {var} += {_u(self.wg)}) {{")
        self.emit(ind + "  ", *body)
        self.emit(ind, "}")

    def barrier(self, ind: str) -> None:
        self.emit(ind, "workgroupBarrier();")

    # ---- ops ------------------------------------------------------------------------------
    def op(self, ind: str, op) -> None:
        o, a, ins = op.outputs[0], op.attrs, op.inputs
        out = self.shape(o)
        n = self.numel(o)
        if op.op in _UNARY or op.op in ("clamp", "mul_scalar", "add_scalar"):
            x = "x"
            if op.op in _UNARY:
                v = _UNARY[op.op].format(x)
            elif op.op == "clamp":
                v = f"select(min(max(x, {_lit(a['min_val'])}), {_lit(a['max_val'])}), x, yr_isnan(x))"
            elif op.op == "mul_scalar":
                v = f"(x * {_lit(a['scalar'])})"
            else:
                v = f"(x + {_lit(a['scalar'])})"
            self.loop(ind, n, [f"let x = {self.rd(ins[0], 'e')};", f"{self.wr(o, 'e')} = {v};"])
        elif op.op in _BINARY:
            x, y = (self.rd(i, _bcast("e", self.shape(i), out)) for i in ins)
            self.loop(ind, n, [f"{self.wr(o, 'e')} = {_BINARY[op.op].format(x, y)};"])
        elif op.op == "matmul":
            self.matmul(ind, o, *ins)
        elif op.op in ("reduction", "reduction_max"):
            self.reduce(ind, op)
        elif op.op == "rms_norm":
            L = out[-1]
            self.loop(ind, n // L, [
                "var ss: f32 = 0.0;",
                f"for (var j: u32 = 0u; j < {_u(L)}; j += 1u) {{ let x = {self.rd(ins[0], f'r * {_u(L)} + j')}; "
                "ss = ss + x * x; }",
                f"let inv = 1.0 / sqrt(ss / {_lit(L)} + {_lit(a['eps'])});",
                f"for (var j: u32 = 0u; j < {_u(L)}; j += 1u) {{ {self.wr(o, f'r * {_u(L)} + j')} = "
                f"{self.rd(ins[0], f'r * {_u(L)} + j')} * inv; }}"], var="r")
        elif op.op == "concat":
            d = a["dim"]
            inner = math.prod(out[d + 1:])
            ca, cb = self.shape(ins[0])[d], self.shape(ins[1])[d]
            c = out[d]
            first = self.rd(ins[0], f"(p * {_u(ca)} + q) * {_u(inner)} + j")
            second = self.rd(ins[1], f"(p * {_u(cb)} + q - {_u(ca)}) * {_u(inner)} + j")
            self.loop(ind, n, [
                f"let p = e / {_u(c * inner)}; let q = (e / {_u(inner)}) % {_u(c)}; let j = e % {_u(inner)};",
                f"if (q < {_u(ca)}) {{ {self.wr(o, 'e')} = {first}; }}",
                f"else {{ {self.wr(o, 'e')} = {second}; }}"])
        elif op.stage == ACCUM:
            self.accum(ind, op)
        else:
            raise NotImplementedError(f"threadblock op {op.op} has no WGSL rendering")

    def matmul(self, ind: str, o: int, A: int, B: int) -> None:
        sa, sb = self.shape(A), self.shape(B)
        M, K, N = sa[-2], sa[-1], sb[-1]
        batch = math.prod(sa[:-2])
        body = []
        if batch > 1:
            body.append(f"let b = e / {_u(M * N)};")
        body.append(f"let m = (e / {_u(N)}) % {_u(M)}; let n = e % {_u(N)};")
        arow = f"(b * {_u(M)} + m) * {_u(K)}" if batch > 1 else f"m * {_u(K)}"
        bcol = f"b * {_u(K * N)} + n" if batch > 1 else "n"
        body += ["var acc: f32 = 0.0;",
                 f"let ar = {arow}; let bc = {bcol};",
                 f"for (var k: u32 = 0u; k < {_u(K)}; k += 1u) {{",
                 f"  acc = acc + {self.rd(A, 'ar + k')} * {self.rd(B, f'bc + k * {_u(N)}')};",
                 "}",
                 f"{self.wr(o, 'e')} = acc;"]
        self.loop(ind, batch * M * N, body)

    def reduce(self, ind: str, op) -> None:
        x, o, d = op.inputs[0], op.outputs[0], op.attrs["dim"]
        shp = self.shape(x)
        outer, red, inner = math.prod(shp[:d]), shp[d], math.prod(shp[d + 1:])
        is_max = op.op == "reduction_max"
        src = self.rd(x, f"(p * {_u(red)} + r) * {_u(inner)} + j")
        body = [f"let p = e / {_u(inner)}; let j = e % {_u(inner)};",
                f"var v: f32 = {'-yr_inf()' if is_max else '0.0'};",
                f"for (var r: u32 = 0u; r < {_u(red)}; r += 1u) {{ "
                + (f"v = yr_max(v, {src}); }}" if is_max else f"v = v + {src}; }}")]
        if is_max:   # running max over the loop: the tile of m holds the previous max
            diff = op.outputs[1]
            body += [f"let prev = {self.rd(o, 'e')}; let m = yr_max(prev, v);",
                     f"{self.wr(o, 'e')} = m; {self.wr(diff, 'e')} = prev - m;"]
        else:
            body.append(f"{self.wr(o, 'e')} = v;")
        self.loop(ind, outer * inner, body)

    def accum(self, ind: str, op) -> None:
        x, o, acc = op.inputs[0], op.outputs[0], op.attrs.get("acc")
        sx, so = self.shape(x), self.shape(o)
        if op.op == "forloop_accum_max":
            self.loop(ind, self.numel(o), [f"{self.wr(o, 'e')} = yr_max({self.rd(o, 'e')}, {self.rd(x, 'e')});"])
            return
        scale = (self.rd(op.inputs[1], _bcast("e", self.shape(op.inputs[1]), so))
                 if op.op == "forloop_accum_rescale" else None)
        prev = self.rd(o, "e")
        if scale:
            prev = f"{prev} * {scale}"
        if acc is None:
            self.loop(ind, self.numel(o), [f"{self.wr(o, 'e')} = {prev} + {self.rd(x, 'e')};"])
            return
        L = sx[-1]
        if acc == "sum_todimx":
            rdx = self.tb.reduction_dimx
            self.loop(ind, self.numel(o), [
                f"let r = e / {_u(rdx)}; let j = e % {_u(rdx)};", "var v: f32 = 0.0;",
                f"for (var q: u32 = 0u; q < {_u(L // rdx)}; q += 1u) {{ "
                f"v = v + {self.rd(x, f'r * {_u(L)} + q * {_u(rdx)} + j')}; }}",
                f"{self.wr(o, 'e')} = {prev} + v;"])
            return
        t = self.rd(x, f"e * {_u(L)} + j")
        term = f"let t = {t}; v = v + t * t;" if acc == "rms" else f"v = v + {t};"
        self.loop(ind, self.numel(o), [
            "var v: f32 = 0.0;",
            f"for (var j: u32 = 0u; j < {_u(L)}; j += 1u) {{ {term} }}",
            f"{self.wr(o, 'e')} = {prev} + v;"])

    def finalize(self, ind: str, op) -> bool:
        acc, o = op.attrs.get("acc"), op.outputs[0]
        if acc not in ("mean", "rms"):
            return False
        width = self.shape(op.inputs[0])[-1] * self.tb.forloop_range
        v = f"{self.rd(o, 'e')} / {_lit(width)}"
        v = f"sqrt({v})" if acc == "rms" else v
        self.loop(ind, self.numel(o), [f"{self.wr(o, 'e')} = {v};"])
        return True

    # ---- the kernel -----------------------------------------------------------------------
    def render(self, in_access: str = "read") -> str:
        if self.why:
            raise NotImplementedError(f"threadblock graph: {self.why}")
        tb = self.tb
        n_in = len(self.inputs)
        fields = [f"o{i}: u32" for i in range(n_in + len(self.ks))]
        self.lines = [PRELUDE.strip(), _PRELUDE_TB.strip(),
                      "struct Params { " + ", ".join(fields) + " };",
                      "@group(0) @binding(0) var<uniform> P: Params;"]
        for j in range(n_in):
            self.lines.append(f"@group(0) @binding({j + 1}) var<storage, {in_access}> in{j}: array<f32>;")
        for j in range(len(self.ks)):
            self.lines.append(f"@group(0) @binding({n_in + j + 1}) var<storage, read_write> out{j}: array<f32>;")
        self.lines += [f"var<workgroup> sm: array<f32, {max(self.words, 1)}>;",
                       "var<private> yr_b: vec3<u32>;", "var<private> yr_it: u32;"]
        for j, (_, inp) in enumerate(self.inputs):   # element e of input j's tile this iteration
            gi = self.global_index("e", inp.dshape, inp.input_map, inp.forloop_dim, self.shape(inp.sid), True)
            self.lines.append(f"fn ld{j}(e: u32) -> f32 {{ return in{j}[P.o{j} + {gi}]; }}")
        self.lines += [f"@compute @workgroup_size({self.wg})",
                       "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {",
                       "  yr_b = wid;"]
        ind = "  "
        # state carried over the loop: accumulators at 0 (max at -inf), running maxima at -inf
        for op in self.ops:
            o = op.outputs[0]
            if op.op in ("forloop_accum_max", "reduction_max"):
                self.loop(ind, self.numel(o), [f"{self.wr(o, 'e')} = -yr_inf();"])
            elif op.stage == ACCUM:
                self.loop(ind, self.numel(o), [f"{self.wr(o, 'e')} = 0.0;"])
        staged = [(j, inp) for j, (_, inp) in enumerate(self.inputs) if inp.sid not in self.direct]
        self.emit(ind, "yr_it = 0u;")
        for j, inp in staged:    # tiles that stay the same every iteration: copied in once
            if inp.forloop_dim == -1:
                self.loop(ind, self.numel(inp.sid), [f"{self.wr(inp.sid, 'e')} = ld{j}(e);"])
        self.barrier(ind)
        self.emit(ind, f"for (var it: u32 = 0u; it < {_u(tb.forloop_range)}; it += 1u) {{")
        inner = ind + "  "
        self.emit(inner, "yr_it = it;")
        moving = [(j, inp) for j, inp in staged if inp.forloop_dim != -1]
        for j, inp in moving:
            self.loop(inner, self.numel(inp.sid), [f"{self.wr(inp.sid, 'e')} = ld{j}(e);"])
        if moving:
            self.barrier(inner)
        for op in self.ops:
            if op.stage != POST:
                self.op(inner, op)
                self.barrier(inner)
        self.emit(ind, "}")
        done = False
        for op in self.ops:
            if op.stage == ACCUM:
                done = self.finalize(ind, op) or done
        if done:
            self.barrier(ind)
        for op in self.ops:
            if op.stage == POST:
                self.op(ind, op)
                self.barrier(ind)
        for j, k in enumerate(self.ks):
            out = tb.outputs[k]
            tile = self.shape(out.sid)
            gi = self.global_index("e", out.dshape, out.output_map, -1, tile, False)
            self.loop(ind, self.numel(out.sid), [f"out{j}[P.o{n_in + j} + {gi}] = {self.rd(out.sid, 'e')};"])
        self.lines.append("}")
        return "\n".join(self.lines) + "\n"


def unsupported_reason(tb: TBGraph, k, max_shared_bytes: int = MAX_SHARED_BYTES,
                       max_storage_buffers: int = MAX_STORAGE_BUFFERS) -> str | None:
    """Why output(s) ``k`` of ``tb`` cannot be rendered (None when they can): a dtype other
    than float32, an op without a rendering, tiles past ``max_shared_bytes`` of workgroup
    memory, more storage buffers than ``max_storage_buffers``, or a grid dim past 65535."""
    ks = _ks(k)
    if not ks or any(not 0 <= j < len(tb.outputs) for j in ks):
        return f"no output {k!r}"
    if any(inp.dtype != DType.float32 for inp in tb.inputs):
        return "float32 block graphs only"
    if max(tb.grid_dim) > MAX_GRID_DIM:
        return f"grid {tb.grid_dim} has a dim past {MAX_GRID_DIM} workgroups"
    ops = needed_ops(tb, ks)
    bad = sorted({op.op for op in ops if op.op not in SUPPORTED_OPS})
    if bad:
        return f"no WGSL rendering of {', '.join(bad)}"
    n_buf = len(bound_inputs(tb, ks)) + len(ks)
    if n_buf > max_storage_buffers:
        return f"{n_buf} storage buffers, more than {max_storage_buffers}"
    return _Renderer(tb, ks, max_shared_bytes).why


def webgpu_supported(tb: TBGraph, k, max_shared_bytes: int = MAX_SHARED_BYTES,
                     max_storage_buffers: int = MAX_STORAGE_BUFFERS) -> bool:
    """Whether output ``k`` (an index or a tuple of them) of ``tb`` renders to WGSL within
    WebGPU's guaranteed limits (see ``unsupported_reason``)."""
    return unsupported_reason(tb, k, max_shared_bytes, max_storage_buffers) is None


def shared_bytes(tb: TBGraph, k, max_shared_bytes: int = MAX_SHARED_BYTES) -> int:
    """Bytes of workgroup memory the kernel of output(s) ``k`` declares (its tile arena)."""
    return 4 * max(_Renderer(tb, k, max_shared_bytes).words, 1)


def render_threadblock_wgsl(tb: TBGraph, k, in_access: str = "read", max_shared_bytes: int = MAX_SHARED_BYTES,
                            workgroup_size: int | None = None) -> str:
    """WGSL source of a compute shader (entry ``main``) computing output ``k`` of ``tb``, or
    every output of the tuple ``k`` in one kernel, dispatched on ``tb.grid_dim`` workgroups.
    Bindings: 0 the uniform element offsets (bound inputs, then outputs), then the
    ``bound_inputs`` storage buffers (``in_access``: 'read' or 'read_write'), then the
    outputs. ``workgroup_size`` (default ``prod(tb.block_dim)``, at most 256) invocations per
    workgroup. NotImplementedError for what ``webgpu_supported`` rejects (check it first)."""
    if in_access not in ("read", "read_write"):
        raise ValueError(f"in_access must be 'read' or 'read_write', got {in_access!r}")
    why = unsupported_reason(tb, k, max_shared_bytes, max_storage_buffers=1 << 30)
    if why:
        raise NotImplementedError(f"threadblock graph: {why}")
    return _Renderer(tb, k, max_shared_bytes, workgroup_size).render(in_access)


__all__ = ["render_threadblock_wgsl", "webgpu_supported", "unsupported_reason", "bound_inputs", "shared_bytes",
           "workgroup_size", "MAX_SHARED_BYTES", "MAX_STORAGE_BUFFERS"]
