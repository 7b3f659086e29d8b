"""Renders fused row kernels (transforms.fusion.FusedKernel) as C++.

Each kernel becomes ``extern "C" void NAME(void** args, int64_t R)``: ``args`` holds the
input pointers then the output pointers, in the order of ``kernel.inputs`` and
``kernel.outputs``; ``R`` is the number of rows (a run-time value, so one build serves
every row count). The row width ``D`` is a constant of the code, or, for a kernel with
``runtime_d`` (graphs specialized from symbolic shapes), one more ``args`` slot after the
outputs holding D as an integer, so one build serves every width too. A second entry,
``NAME_task(const int64_t* args, int64_t lo, int64_t hi)``, runs rows lo..hi-1 on the calling
thread: a task of the persistent kernel runtime (kernels/cpu/persistent.cpp); ``NAME`` runs it
on every thread (``yr::parallel_chunks`` of kernels/cpu/yr_threads.h: OpenMP, or yirage's own
pool), a contiguous slice of the rows each. The loop over a row is split into
*phases* at each row reduction, each phase one ``omp simd`` loop. A vec value defined in
one phase and read in a later one is kept in a per-thread row buffer; plain input loads
are simply reloaded. All arithmetic is float32; float16/bfloat16 are converted on load
and store (bfloat16 rounds to nearest even); bool (uint8_t storage) is loaded as 0.0f/1.0f and
stored as ``v != 0``; int32/int64 inputs (a cast's source) are loaded as the nearest float32.

This module must never compile or load anything: runtime/cpp_kernels.py and
runtime/toolchain.py do that.
"""
from __future__ import annotations

import hashlib

from ..dtypes import DType
from ..transforms.fusion import RS, VEC, FusedKernel, phases

# Generated kernels include the prelude (kernels/cpu/yirage_prelude.h: bf16 conversions, and
# yr_threads.h's parallel loops); runtime/toolchain.py puts its directory on the include path
# and hashes its contents.
HEADER = '#include "yirage_prelude.h"\n'


_CTYPE = {DType.float32: "float", DType.float16: "yr_f16", DType.bfloat16: "uint16_t", DType.bool: "uint8_t",
          DType.int32: "int32_t", DType.int64: "int64_t"}   # integers: loaded only (a cast's input)

_UNARY = {
    # yr_exp / yr_tanh / yr_erf (yirage_prelude.h) are arithmetic that GCC vectorizes; libm's
    # std::exp / std::tanh are scalar calls inside the `omp simd` loops
    "exp": "yr_exp({0})", "sqrt": "std::sqrt({0})", "rsqrt": "(1.0f / std::sqrt({0}))",
    "square": "({0} * {0})", "neg": "(-{0})", "relu": "std::max({0}, 0.0f)",
    "silu": "({0} / (1.0f + yr_exp(-{0})))",
    "gelu": "(0.5f * {0} * (1.0f + yr_erf({0} * 0.70710678118654752f)))",  # yr_erf: yirage_prelude.h
    # tanh GELU as 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): silu's form
    "gelu_tanh": "({0} / (1.0f + yr_exp(-1.5957691216057308f * ({0} + 0.044715f * {0} * {0} * {0}))))",
    "tanh": "yr_tanh({0})", "sigmoid": "(1.0f / (1.0f + yr_exp(-{0})))",
    "erf": "yr_erf({0})", "log": "std::log({0})", "exp2": "std::exp2({0})", "abs": "std::fabs({0})",
    "reciprocal": "(1.0f / {0})", "cos": "std::cos({0})", "sin": "std::sin({0})",
    "floor": "std::floor({0})", "ceil": "std::ceil({0})", "trunc": "std::trunc({0})",
    # bool values are 0.0f / 1.0f (transforms/fusion.py)
    "logical_not": "({0} == 0.0f ? 1.0f : 0.0f)", "to_bool": "({0} != 0.0f ? 1.0f : 0.0f)",
}
_BINARY = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    # torch.maximum/minimum propagate NaN (std::max would drop it): a + b is NaN then
    "maximum": "(({0} != {0} || {1} != {1}) ? ({0} + {1}) : std::max({0}, {1}))",
    "minimum": "(({0} != {0} || {1} != {1}) ? ({0} + {1}) : std::min({0}, {1}))",
    "pow": "std::pow({0}, {1})",
    "eq": "({0} == {1} ? 1.0f : 0.0f)", "ne": "({0} != {1} ? 1.0f : 0.0f)", "lt": "({0} < {1} ? 1.0f : 0.0f)",
    "le": "({0} <= {1} ? 1.0f : 0.0f)", "gt": "({0} > {1} ? 1.0f : 0.0f)", "ge": "({0} >= {1} ? 1.0f : 0.0f)",
    "logical_and": "(({0} != 0.0f && {1} != 0.0f) ? 1.0f : 0.0f)",
    "logical_or": "(({0} != 0.0f || {1} != 0.0f) ? 1.0f : 0.0f)",
}


def _f(x: float) -> str:
    return f"{float(x)!r}f" if x == x and abs(x) != float("inf") else (
        "std::numeric_limits<float>::infinity()" if x > 0 else "(-std::numeric_limits<float>::infinity())")


def _load(kernel: FusedKernel, idx: int) -> str:
    inp = kernel.inputs[idx]
    at = {"full": "r * D + j", "expand": "r * D + j", "row": "j", "col": "r", "scalar": "0"}[inp.mode]
    raw = f"in{idx}[{at}]"
    return f"yr_bf16_to_f32({raw})" if inp.dtype == DType.bfloat16 else f"(float){raw}"


def _store(dtype: DType, v: str) -> str:
    if dtype == DType.bool:
        return f"(uint8_t)({v} != 0.0f)"
    return f"yr_f32_to_bf16({v})" if dtype == DType.bfloat16 else f"({_CTYPE[dtype]}){v}"


def _pow_scalar(x: str, e: float) -> str:
    """x ** e: products for small integer exponents (exact as torch's, and vectorized), a square
    root for 0.5, libm's pow otherwise."""
    if e == int(e) and 1 <= abs(e) <= 4:
        prod = "(" + " * ".join([x] * int(abs(e))) + ")"
        return prod if e > 0 else f"(1.0f / {prod})"
    if e == 0.0:
        return "1.0f"
    if e == 0.5:
        return f"std::sqrt({x})"
    return f"std::pow({x}, {_f(e)})"


def _expr(kernel: FusedKernel, s) -> str:
    a = [f"v{x}" for x in s.args]
    if s.op == "load":
        return _load(kernel, s.args[0])
    if s.op in _UNARY:
        return _UNARY[s.op].format(*a)
    if s.op in _BINARY:
        return _BINARY[s.op].format(*a)
    if s.op == "where":
        return f"({a[0]} != 0.0f ? {a[1]} : {a[2]})"
    if s.op == "pow_scalar":
        return _pow_scalar(a[0], float(s.attrs["exponent"]))
    if s.op == "clamp":
        return f"std::min(std::max({a[0]}, {_f(s.attrs['lo'])}), {_f(s.attrs['hi'])})"
    if s.op == "affine":
        return f"({a[0]} * {_f(s.attrs['a'])} + {_f(s.attrs['b'])})"
    raise NotImplementedError(s.op)


def render_kernel(kernel: FusedKernel, name: str) -> str:
    """C++ source of one fused kernel (without the module header)."""
    phase, avail = phases(kernel)
    stmts = kernel.stmts
    reloadable = {s.id for s in stmts if s.op == "load" and s.kind == VEC}
    # one statement may be stored to several outputs (a value and its casts)
    vec_outs: dict[int, list[tuple[int, DType]]] = {}
    rs_outs: dict[int, list[tuple[int, DType]]] = {}
    for n, (sid, _, d) in enumerate(kernel.outputs):
        (vec_outs if stmts[sid].kind == VEC else rs_outs).setdefault(sid, []).append((n, d))
    reductions = [s for s in stmts if s.op in ("sum", "max") and s.kind == RS]
    n_phases = max([phase[s.id] + 1 for s in stmts if s.kind == VEC and s.op not in ("sum", "max")]
                   + [avail[s.id] for s in reductions], default=0)
    # vec values read in a later phase than they are computed go through a row buffer
    # (a load's args name a kernel input, not a statement)
    buffered = sorted({x for s in stmts if (s.kind == VEC and s.op != "load") or s.op in ("sum", "max")
                       for x in s.args if x in phase and x not in reloadable
                       and stmts[x].kind == VEC and phase[x] < phase[s.id]})
    slot = {sid: i for i, sid in enumerate(buffered)}

    if kernel.runtime_d:  # D rides after the tensor pointers (runtime/cpp_kernels.py passes it)
        lines = [f"  const int64_t D = (int64_t)(intptr_t)args[{len(kernel.inputs) + len(kernel.outputs)}];"]
    else:
        lines = [f"  const int64_t D = {kernel.D};"]
    for i, inp in enumerate(kernel.inputs):
        lines.append(f"  const {_CTYPE[inp.dtype]}* __restrict in{i} = (const {_CTYPE[inp.dtype]}*)args[{i}];")
    for n, (_, _, d) in enumerate(kernel.outputs):
        lines.append(f"  {_CTYPE[d]}* __restrict out{n} = ({_CTYPE[d]}*)args[{len(kernel.inputs) + n}];")
    lines.append(_LOOP)
    if buffered:
        lines.append(f"    static thread_local std::vector<float> scratch; scratch.resize({len(buffered)} * D);")
    for p in range(n_phases + 1):
        for s in stmts:
            if s.kind == RS and s.op not in ("sum", "max") and avail[s.id] == p:
                lines.append(f"    const float v{s.id} = {_expr(kernel, s)};")
        if p == n_phases:
            break
        accs = [s for s in reductions if phase[s.id] == p]
        clauses = ""
        for s in accs:
            init = "0.0f" if s.op == "sum" else "(-std::numeric_limits<float>::infinity())"
            lines.append(f"    float v{s.id} = {init};")
            clauses += f" reduction({'+' if s.op == 'sum' else 'max'}:v{s.id})"
            if s.op == "max":  # std::max drops NaN: count NaNs beside it, as torch's max keeps them
                lines.append(f"    float v{s.id}_nan = 0.0f;")
                clauses += f" reduction(+:v{s.id}_nan)"
        lines.append(f"    #pragma omp simd{clauses}")
        lines.append("    for (int64_t j = 0; j < D; ++j) {")
        body_ids = [s.id for s in stmts if s.id in phase and phase[s.id] == p and s.op not in ("sum", "max")]
        used = {x for s in stmts if s.id in phase and phase[s.id] == p and s.op != "load" for x in s.args}
        for x in sorted(used):
            if x in phase and phase[x] != p and stmts[x].kind == VEC:
                src = _expr(kernel, stmts[x]) if x in reloadable else f"scratch[{slot[x]} * D + j]"
                lines.append(f"      const float v{x} = {src};")
        for sid in body_ids:
            lines.append(f"      const float v{sid} = {_expr(kernel, stmts[sid])};")
            if sid in slot:
                lines.append(f"      scratch[{slot[sid]} * D + j] = v{sid};")
            for n, d in vec_outs.get(sid, ()):
                lines.append(f"      out{n}[r * D + j] = {_store(d, f'v{sid}')};")
        for s in accs:
            a = f"v{s.args[0]}"
            lines.append(f"      v{s.id} = {'v%d + %s' % (s.id, a) if s.op == 'sum' else 'std::max(v%d, %s)' % (s.id, a)};")
            if s.op == "max":
                lines.append(f"      v{s.id}_nan += ({a} != {a}) ? 1.0f : 0.0f;")
        lines.append("    }")
        for s in accs:
            if s.op == "max":
                lines.append(f"    if (v{s.id}_nan != 0.0f) v{s.id} = std::numeric_limits<float>::quiet_NaN();")
    for sid, outs in rs_outs.items():
        for n, d in outs:
            lines.append(f"    out{n}[r] = {_store(d, f'v{sid}')};")
    lines.append("  }")
    task = "\n".join(lines).replace(_LOOP, "  for (int64_t r = lo; r < hi; ++r) {")
    # The task entry (rows lo..hi-1 on the calling thread: a worker of the persistent kernel
    # runtime, args as int64, see kernels/cpu/persistent.cpp), and the launch entry running it
    # on every thread (yr_threads.h), a contiguous slice of the R rows each.
    return (f'extern "C" void {name}_task(const int64_t* task_args, int64_t lo, int64_t hi) {{\n'
            f"  void* const* args = (void* const*)task_args;\n{task}\n}}\n\n"
            f'extern "C" void {name}(void** args, int64_t R) {{\n{lines[0]}\n'
            f"  yr::parallel_chunks(R, R * D >= 32768, [&](int64_t lo, int64_t hi) {{\n"
            f"    {name}_task((const int64_t*)args, lo, hi);\n  }});\n}}")


_LOOP = "  @ROW_LOOP@"


def kernel_name(kernel: FusedKernel) -> str:
    """The entry point's name: a hash of the kernel's structure (its D too, unless
    ``kernel.runtime_d``: then kernels that differ only in D share one entry)."""
    return "yr_fused_" + hashlib.sha256(kernel.key(with_d=not kernel.runtime_d).encode()).hexdigest()[:16]


def render_module(kernels: list[FusedKernel]) -> tuple[str, list[str]]:
    """One C++ translation unit for a set of kernels; returns (source, entry names).

    Kernels with the same structure share one entry point.
    """
    names, bodies = [], {}
    for k in kernels:
        name = kernel_name(k)
        names.append(name)
        if name not in bodies:
            body = _rendered.get(name)
            if body is None:
                if len(_rendered) >= 4096:
                    _rendered.clear()
                body = _rendered[name] = render_kernel(k, name)
            bodies[name] = body
    return HEADER + "\n\n".join(bodies[n] for n in sorted(bodies)) + "\n", names


#: entry name -> its rendered body: the name hashes everything the body depends on, and a model
#: renders the same kernels for every shape it plans (an encoder's 19 at each token bucket)
_rendered: dict[str, str] = {}
