"""Property-based fuzzing of kernel graphs (GitHub issue 6), with hypothesis.

1. Random graphs (shapes with 1s and odd sizes; elementwise and row ops, broadcasting,
   matmul/linear, the W8A8 int8 linear, reshape/slice, casts, argmax) built with ``yr.new_kernel_graph()``: building
   raises nothing but ``GraphError`` (invalid combinations are drawn on purpose; linear weights
   are sometimes q8_0/q4_1 blocks), and a graph that builds gives the same outputs on the
   backend as the reference interpreter ``g.interpret`` (fp32: 1e-4 relative to the output's
   magnitude).
2. Run-time indices: ``g.embedding`` with random ids (in range, negative, >= vocab, huge),
   ``g.rope`` and ``g.attention`` with random ``start_pos`` (in range, start_pos + T > max_seq,
   negative, 10**7, 10**9, 2**62 ...) either equal the reference (``F.embedding``, the
   interpreter) or raise ``yr.IndexOutOfRangeError`` naming the op, the value and the valid range
   (and, for attention, leave the KV cache untouched).

Everything that runs kernels runs in a guarded child process (tests/fuzz/graphs.py
``GuardedServer``), so a kernel that crashes (SIGSEGV/abort) fails one example, not the test run.
Hypothesis is derandomized (the same examples every run, no example database) with no deadline;
shrinking is off so that a crashing example does not restart the child hundreds of times (the
failing case is printed in full instead). The backend 'triton-interpret' (Triton's CPU
interpreter, enabled by tests/conftest.py without a GPU) gets a smaller budget.
"""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

import yirage as yr
from fuzz.graphs import GuardedServer

TRITON = "triton-interpret"


def _settings(n: int) -> settings:
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    phases=(Phase.explicit, Phase.generate), print_blob=False,
                    suppress_health_check=list(HealthCheck))


def _available(backend: str) -> bool:
    return backend in [b.value for b in yr.get_available_backends()]


needs_triton = pytest.mark.skipif(not _available(TRITON), reason="triton-interpret is not available here")


@pytest.fixture(scope="module")
def server():
    s = GuardedServer(timeout=120.0)
    yield s
    s.close()


def _check(verdict: dict, kind: str, case: dict) -> None:
    if verdict.get("ok"):
        return
    shown = dict(case)
    if "graph" in shown:
        shown["graph"] = json.loads(shown["graph"])
    msg = f"{kind} case failed: {verdict.get('problem')}\ncase: {json.dumps(shown)[:4000]}"
    if verdict.get("traceback"):
        msg += f"\n--- traceback (tail)\n{verdict['traceback'][-1500:]}"
    if verdict.get("log"):
        msg += f"\n--- child stderr/faulthandler (tail)\n{verdict['log'][-2000:]}"
    pytest.fail(msg, pytrace=False)


# ================================================================================================
# 1. random graphs

DIMS = st.sampled_from([1, 1, 2, 3, 5, 7, 8, 16, 32, 33, 64])
UNARY = ["exp", "sqrt", "rsqrt", "square", "neg", "silu", "gelu", "relu"]
BINARY = ["add", "sub", "mul", "div"]
OPS = UNARY + BINARY * 2 + ["clamp", "scale", "reduction", "rms_norm", "softmax", "softmax", "matmul",
                            "matmul", "linear", "linear", "reshape", "slice_rows", "argmax", "cast"]
OPS = OPS[:4] + ["linear_w8a8"] + OPS[4:]  # early: hypothesis draws the list's head more often
# the elementwise ops of the grown IR whose domain is every real (drawn like the ones above); the
# comparisons, where, any-dim reductions and layout ops are covered by the conformance suite only
NEW_UNARY, NEW_BINARY = ["tanh", "sigmoid", "abs", "erf"], ["maximum", "minimum"]
UNARY, BINARY, OPS = UNARY + NEW_UNARY, BINARY + NEW_BINARY, OPS + NEW_UNARY + NEW_BINARY
LOWP_TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}


class _Builder:
    """Draws a random graph op by op; tracks which tensors went through a half-precision type."""

    def __init__(self, data):
        self.draw = data.draw
        self.g = yr.new_kernel_graph()
        self.lowp: dict[int, bool] = {}
        self.pool = []  # float tensors ops can use
        self.outputs: list = []
        self.argmax_of: dict[int, int] = {}
        self.rejected: list[str] = []

    def input(self, shape, like=None):
        t = self.g.new_input(tuple(shape), like.dtype if like is not None else yr.float32)
        self.lowp[t.id] = like is not None and like.dtype != yr.float32
        return t

    def _mark(self, t, *parents):
        self.lowp[t.id] = any(self.lowp.get(p.id, False) for p in parents) or t.dtype != yr.float32
        return t

    def operand_shape(self, shape):
        """Mostly a shape that broadcasts with ``shape``; sometimes any shape."""
        mode = self.draw(st.sampled_from(["same", "ones", "suffix", "suffix", "random"]))
        if mode == "same":
            return tuple(shape)
        if mode == "ones":
            return tuple(self.draw(st.sampled_from([d, 1])) for d in shape)
        if mode == "suffix":
            k = self.draw(st.integers(1, len(shape)))
            return tuple(shape[-k:])
        return tuple(self.draw(DIMS) for _ in range(self.draw(st.integers(1, 3))))

    def step(self):
        draw, g = self.draw, self.g
        op = draw(st.sampled_from(OPS))
        x = draw(st.sampled_from(self.pool))
        shape = x.shape
        if op in UNARY:
            if op in ("sqrt", "rsqrt"):
                x = self._mark(g.clamp(x, 0.1, 10.0), x)  # keep the domain valid: values, not NaNs, are compared
            elif op == "exp":
                x = self._mark(g.clamp(x, -8.0, 8.0), x)
            return self._mark(getattr(g, op)(x), x)
        if op in BINARY:
            if draw(st.booleans()):
                b = draw(st.sampled_from(self.pool))
            else:
                b = self.input(self.operand_shape(shape), like=x if draw(st.integers(0, 4)) else None)
            if op == "div":
                b = self._mark(g.clamp(b, 0.5, 4.0), b)
            a, b = (x, b) if draw(st.booleans()) or op == "div" else (b, x)
            return self._mark(getattr(g, op)(a, b), a, b)
        if op == "clamp":
            lo = draw(st.sampled_from([-2.0, -0.5, 0.0, 0.3, -math.inf]))
            hi = draw(st.sampled_from([-1.0, 0.0, 0.5, 2.0, math.inf]))
            return self._mark(g.clamp(x, lo, hi), x)
        if op == "scale":
            f = draw(st.sampled_from([0.0, -1.5, 0.5, 3.0, 1e-3, math.nan, math.inf]))
            return self._mark(g.scale(x, f), x)
        if op in ("reduction", "softmax"):
            dim = draw(st.integers(-len(shape) - 1, len(shape)))
            return self._mark(getattr(g, op)(x, dim), x)
        if op == "rms_norm":
            if draw(st.integers(0, 5)):
                ns = shape[-draw(st.integers(1, len(shape))):]
            else:
                ns = tuple(draw(DIMS) for _ in range(draw(st.integers(1, 2))))
            eps = draw(st.sampled_from([1e-6, 1e-5, 0.1, -1.0]))
            return self._mark(g.rms_norm(x, ns, eps), x)
        if op == "matmul":
            K = shape[-1] if draw(st.integers(0, 6)) else draw(DIMS)
            N = draw(DIMS)
            batch = draw(st.sampled_from([(), tuple(shape[:-2]), tuple(1 for _ in shape[:-2]), (2,)]))
            b = self.input((*batch, K, N), like=x if draw(st.integers(0, 4)) else None)
            if draw(st.integers(0, 4)) == 0:
                x, b = b, x
            return self._mark(g.matmul(x, b), x, b)
        if op == "linear":
            quant = x.dtype == yr.float32 and draw(st.integers(0, 2)) == 0  # a q8_0/q4_1 weight
            if quant and shape[-1] % 32:  # blocks need K % 32 == 0: a fresh input that has it
                x = self.input((*shape[:-1], draw(st.sampled_from([32, 64]))))
                shape = x.shape
            K = shape[-1] if draw(st.integers(0, 6)) else draw(DIMS)
            N = draw(DIMS)
            if quant:
                w = self.g.new_input((N, K), draw(st.sampled_from([yr.q8_0, yr.q4_1])))  # GraphError if K % 32
                event("a linear with a block-quantized weight")
            else:
                w = self.input((N, K), like=x)
            bias = self.input((draw(st.sampled_from([N, N, N + 1])),), like=x) if draw(st.booleans()) else None
            return self._mark(g.linear(x, w, bias), x)
        if op == "linear_w8a8":  # int8 weights [K, N]; on the CPU fused kernels after it run as its epilogue
            K = shape[-1] if draw(st.integers(0, 6)) else draw(DIMS)
            N = draw(DIMS)
            # activation groups: whole rows, 4 (valid when 4 divides K) or 3 (GraphError: not a multiple of 4)
            group = draw(st.sampled_from([0, 4, 3])) if draw(st.integers(0, 3)) == 0 else 0
            w_t, w_scale = self.g.new_input((K, N), yr.int8), self.input((N,))
            bias = self.input((N,)) if draw(st.booleans()) else None
            out = g.linear_w8a8(x, w_t, w_scale, bias, group_size=group)
            event("a W8A8 int8 linear")
            return self._mark(out, x)
        if op == "reshape":
            n = math.prod(shape)
            options = [(n,), (1, n), tuple(reversed(shape)), (shape[0], n // shape[0]), (n + 1,)]
            return self._mark(g.reshape(x, draw(st.sampled_from(options))), x)
        if op == "slice_rows":
            start = draw(st.integers(-1, shape[0]))
            end = draw(st.integers(start, shape[0] + 1))
            return self._mark(g.slice_rows(x, start, end), x)
        if op == "cast":
            return self._mark(g.cast(x, draw(st.sampled_from([yr.float16, yr.bfloat16, yr.float32]))), x)
        assert op == "argmax"
        dim = draw(st.sampled_from([-1, len(shape) - 1, 0]))
        out = g.argmax(x, dim)  # an int64 output: not an operand of later ops
        self.outputs.append(x)
        self.argmax_of[len(self.outputs)] = len(self.outputs) - 1
        self.outputs.append(out)
        return None

    def build(self):
        rank = self.draw(st.integers(1, 3))
        self.pool.append(self.input(tuple(self.draw(DIMS) for _ in range(rank))))
        for _ in range(self.draw(st.integers(1, 7))):
            try:
                t = self.step()
            except yr.GraphError as e:  # invalid combination: rejected at build time, the graph unchanged
                self.rejected.append(str(e))
                continue
            # any other exception propagates and fails the test: building raises GraphError only
            if t is not None:
                self.pool.append(t)
        last = self.pool[-1]
        if not self.outputs or last is not self.pool[0]:
            self.outputs.append(last)
        for t in self.outputs:
            self.g.mark_output(t)
        def tol(i: int, t) -> float:
            if i in self.argmax_of:  # an argmax: the tolerance of the values it picks from
                return tol(self.argmax_of[i], self.outputs[self.argmax_of[i]])
            base = LOWP_TOL["float16"] if self.lowp.get(t.id) else LOWP_TOL["float32"]
            return max(base, LOWP_TOL[t.dtype.value])
        return self.g, [tol(i, t) for i, t in enumerate(self.outputs)]


def _graph_property(server, data, backend):
    b = _Builder(data)
    g, tol = b.build()
    event(f"ops in the graph: {len(g.ops)}")
    event(f"ops rejected at build time (GraphError): {min(len(b.rejected), 2)}{'+' if len(b.rejected) > 2 else ''}")
    case = {"graph": g.to_json(), "backend": backend, "seed": data.draw(st.integers(0, 2**16)),
            "tolerance": tol, "argmax_of": b.argmax_of}
    _check(server.call("graph", case), "graph", case)


@_settings(100)
@given(data=st.data())
def test_random_graphs_match_the_interpreter_cpu(server, data):
    _graph_property(server, data, "cpu")


@needs_triton
@_settings(25)
@given(data=st.data())
def test_random_graphs_match_the_interpreter_triton_interpret(server, data):
    _graph_property(server, data, TRITON)


def test_builder_rejects_bad_arguments_with_graph_error():
    """Fixed examples of the build-time rule (every one must be GraphError, nothing else)."""
    g = yr.new_kernel_graph()
    x, ids = g.new_input((3, 5)), g.new_input((2,), yr.int64)
    bad = [
        lambda: g.new_input((0, 3)), lambda: g.new_input((-1,)), lambda: g.new_input((2.5,)),
        lambda: g.new_input((3, 31), yr.q8_0), lambda: g.add(x, g.new_input((4,))),
        lambda: g.matmul(x, g.new_input((4, 2))), lambda: g.matmul(g.new_input((5,)), x),
        lambda: g.linear(x, g.new_input((4, 6))), lambda: g.reduction(x, 2), lambda: g.softmax(x, -3),
        lambda: g.rms_norm(x, (3,)), lambda: g.reshape(x, (4, 4)), lambda: g.reshape(x, (-1, 15)),
        lambda: g.slice_rows(x, 2, 2), lambda: g.slice_rows(x, 0, 4), lambda: g.clamp(x, 1.0, 0.0),
        lambda: g.scale(x, math.nan), lambda: g.embedding(x, x), lambda: g.embedding(ids, g.new_input((4,))),
        lambda: g.rope(x, x, x, ids), lambda: g.cast(x, yr.int64), lambda: g.argmax(x, 0),
        lambda: g.add(x, torch_tensor()), lambda: g.exp("x"),
    ]
    for make in bad:
        with pytest.raises(yr.GraphError):
            make()
        assert g.ops == []  # a rejected op leaves nothing behind


def torch_tensor():
    import torch

    return torch.zeros(3, 5)


# ================================================================================================
# 2. run-time indices

HUGE = [10**7, 10**9, 2**31, 2**62, 2**63 - 1]
NEG_HUGE = [-1, -2, -10**9, -2**63]


@st.composite
def embedding_cases(draw, backend):
    dtype = draw(st.sampled_from(["float32", "float32", "q8_0", "q4_1"]))
    vocab = draw(st.integers(1, 40))
    dim = draw(st.sampled_from([1, 3, 8, 33])) if dtype == "float32" else draw(st.sampled_from([32, 64]))
    ids_dtype = draw(st.sampled_from(["int64", "int64", "int32"]))
    big = [v for v in HUGE if ids_dtype == "int64" or v < 2**31]
    neg = [v for v in NEG_HUGE if ids_dtype == "int64" or v >= -2**31]
    one_id = st.one_of(st.integers(0, vocab - 1), st.integers(0, vocab - 1), st.sampled_from([vocab, vocab + 1]),
                       st.sampled_from(big), st.sampled_from(neg))
    n = draw(st.integers(1, 6))
    ids = draw(st.lists(one_id, min_size=n, max_size=n))
    shape = [n] if n % 2 or draw(st.booleans()) else [2, n // 2]
    return {"backend": backend, "vocab": vocab, "dim": dim, "dtype": dtype, "ids": ids, "ids_shape": shape,
            "ids_dtype": ids_dtype, "seed": draw(st.integers(0, 2**16))}


def _start(draw, T, S):
    return draw(st.one_of(st.integers(0, max(0, S - T)), st.integers(0, max(0, S - T)),
                          st.sampled_from([S - T + 1, S, S + 1, S - T + 2]), st.sampled_from(HUGE),
                          st.sampled_from(NEG_HUGE)))


@st.composite
def rope_cases(draw, backend):
    S = draw(st.integers(1, 12))
    T = draw(st.integers(1, S + 1))
    return {"backend": backend, "T": T, "H": draw(st.sampled_from([1, 2, 3])), "Dh": draw(st.sampled_from([2, 8, 16])),
            "S": S, "start": _start(draw, T, S), "seed": draw(st.integers(0, 2**16))}


@st.composite
def attention_cases(draw, backend):
    S = draw(st.integers(1, 12))
    T = draw(st.integers(1, S + 1))
    hkv = draw(st.sampled_from([1, 2]))
    return {"backend": backend, "T": T, "Hq": hkv * draw(st.sampled_from([1, 2, 3])), "Hkv": hkv,
            "Dh": draw(st.sampled_from([4, 8, 16])), "S": S, "start": _start(draw, T, S),
            "seed": draw(st.integers(0, 2**16))}


@_settings(80)
@given(case=embedding_cases("cpu"))
def test_embedding_ids_in_range_or_index_error_cpu(server, case):
    _check(server.call("embedding", case), "embedding", case)


@_settings(60)
@given(case=rope_cases("cpu"))
def test_rope_start_pos_in_range_or_index_error_cpu(server, case):
    _check(server.call("rope", case), "rope", case)


@_settings(60)
@given(case=attention_cases("cpu"))
def test_attention_start_pos_in_range_or_index_error_cpu(server, case):
    _check(server.call("attention", case), "attention", case)


@needs_triton
@_settings(20)
@given(case=embedding_cases(TRITON))
def test_embedding_ids_in_range_or_index_error_triton_interpret(server, case):
    _check(server.call("embedding", case), "embedding", case)


@needs_triton
@_settings(15)
@given(case=rope_cases(TRITON))
def test_rope_start_pos_in_range_or_index_error_triton_interpret(server, case):
    _check(server.call("rope", case), "rope", case)


@needs_triton
@_settings(15)
@given(case=attention_cases(TRITON))
def test_attention_start_pos_in_range_or_index_error_triton_interpret(server, case):
    _check(server.call("attention", case), "attention", case)


@pytest.mark.parametrize("kind,case", [
    ("embedding", {"vocab": 5, "dim": 32, "dtype": "float32", "ids": [0, 10**9], "ids_shape": [2],
                   "ids_dtype": "int64", "seed": 0}),
    ("rope", {"T": 1, "H": 2, "Dh": 8, "S": 8, "start": 10**9, "seed": 0}),
    ("attention", {"T": 1, "Hq": 2, "Hkv": 1, "Dh": 8, "S": 8, "start": 10**7, "seed": 0}),
    ("attention", {"T": 1, "Hq": 2, "Hkv": 1, "Dh": 8, "S": 8, "start": 8, "seed": 0}),  # == cache length
])
def test_known_crashers_raise_index_error(server, kind, case):
    """The inputs that crashed the process before the bounds checks (SIGSEGV / abort)."""
    case = dict(case, backend="cpu")
    _check(server.call(kind, case), kind, case)
