"""Triton rendering of fused row kernels (codegen/triton.py, runtime/triton_kernels.py).

Every FusedKernel of a schedule is compiled to Triton and run step by step (library steps
through the op's torch reference, ``expand`` inputs materialized like the executor does);
the graph outputs are compared with the reference interpreter. Without a GPU the kernels
run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1). Each graph is
run with the code shape ``auto`` picks and with the looped shape forced (several chunks
even on narrow rows), so both shapes are checked on every op.
"""
import math

import pytest
import torch

pytest.importorskip("triton")

import yirage as yr  # noqa: E402
from yirage.codegen import triton as tcg  # noqa: E402
from yirage.ir.ops import BINARY, OPS, UNARY  # noqa: E402
from yirage.runtime.triton_kernels import compile_triton, interpreting  # noqa: E402
from yirage.transforms.fusion import FusedKernel, LibraryStep, schedule  # noqa: E402

# CPU tensors under the interpreter; on a machine with a GPU (no TRITON_INTERPRET) the same
# tests run compiled kernels on it.
DEVICE = "cpu" if interpreting() or not torch.cuda.is_available() else "cuda"
TOL = {yr.float32: 1e-5, yr.float16: 2e-3, yr.bfloat16: 2e-2}
SIZES = [(R, D) for R in (1, 7) for D in (1, 7, 4097)]
BIG_D = 20000  # > MAX_PERSISTENT_D: auto takes the looped shape (5 chunks of 4096)

# Masked lanes (rows past R, columns past D) compute on padding, e.g. rsqrt(0); numpy
# warns about it in the interpreter, GPUs do not care. The lanes are never stored.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("YIRAGE_CACHE_DIR", str(tmp_path_factory.mktemp("yirage_cache")))
        yield


def run_schedule(g, inputs, mode="auto", interpreter=None):
    """Outputs of ``g`` with every fused kernel compiled by Triton; also the kernels."""
    steps = schedule(g)
    fused = [s for s in steps if isinstance(s, FusedKernel)]
    compiled = dict(zip(map(id, fused), compile_triton(fused, mode, interpreter=interpreter)))
    env = dict(zip(g.inputs, inputs))
    for step in steps:
        if isinstance(step, LibraryStep):
            node = step.node
            env[node.output] = OPS[node.op].reference([env[i] for i in node.inputs], node.attrs)
            continue
        ins = []
        for i in step.inputs:
            x = env[i.tid]
            ins.append((x.expand(step.shape) if i.mode == "expand" else x).contiguous())
        outs = [torch.full(g.tensors[tid].shape, float("nan"), dtype=d.torch_dtype, device=DEVICE)
                for _, tid, d in step.outputs]
        compiled[id(step)].bind(ins + outs, step.R)()
        env.update({tid: t for (_, tid, _), t in zip(step.outputs, outs)})
    return [env[o] for o in g.outputs], fused


def check(g, inputs, mode="auto", dtype=yr.float32, interpreter=None):
    """Assert ``run_schedule`` matches ``g.interpret`` within ``TOL[dtype]``; returns the
    fused kernels."""
    out, fused = run_schedule(g, inputs, mode, interpreter)
    ref = g.interpret(inputs)
    tol = TOL[dtype]
    for i, (a, b) in enumerate(zip(out, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=lambda m: f"output {i}: {m}")
    return fused


def rand(shape, dtype=yr.float32, positive=False):
    """Normal samples (|x| + 0.5 if ``positive``) of ``dtype``."""
    x = torch.randn(shape)
    if positive:
        x = x.abs() + 0.5
    return x.to(device=DEVICE, dtype=dtype.torch_dtype)


# ---- graphs ------------------------------------------------------------------------------

def unary_graph(R, D, dtype=yr.float32):
    """Every unary op, clamp (with an infinite bound) and scale: one kernel, 11 outputs."""
    g = yr.new_kernel_graph()
    x, p = g.new_input((R, D), dtype), g.new_input((R, D), dtype)
    for op in UNARY:
        g.mark_output(getattr(g, op)(p if op in ("sqrt", "rsqrt", "log", "reciprocal") else x))
    g.mark_output(g.clamp(x, -0.5, 0.75))
    g.mark_output(g.clamp(x, float("-inf"), 0.25))
    g.mark_output(g.scale(x, 1.75))
    return g, [rand((R, D), dtype), rand((R, D), dtype, positive=True)]


def broadcast_graph(R, D, dtype=yr.float32, row_sum=True):
    """Every binary op over the load modes full, row, col, scalar and expand (a [2, R, D]
    iteration space), plus an rs value computed from col/scalar loads and a row sum.

    (In half precision the reference rounds every product before summing them, so its
    row sum is off by ~sqrt(D) ulps; the half-precision test leaves the sum out.)"""
    g = yr.new_kernel_graph()
    x = g.new_input((2, R, D), dtype)
    w = g.new_input((D,), dtype)          # row
    c = g.new_input((2, R, 1), dtype)     # col
    s = g.new_input((1,), dtype)          # scalar
    e = g.new_input((2, 1, D), dtype)     # expand
    g.mark_output(g.add(x, w))
    g.mark_output(g.sub(c, x))
    g.mark_output(g.mul(x, s))
    g.mark_output(g.div(x, e))
    g.mark_output(g.sub(w, c))            # row op col: a full tile from two broadcasts
    g.mark_output(g.div(c, s))            # rs output from col and scalar loads
    g.mark_output(g.maximum(x, w))
    g.mark_output(g.minimum(c, e))
    g.mark_output(g.pow(e, c))            # a positive base
    if row_sum:
        g.mark_output(g.reduction(g.mul(g.add(x, e), w), -1))
    ins = [rand((2, R, D), dtype), rand((D,), dtype), rand((2, R, 1), dtype),
           rand((1,), dtype, positive=True), rand((2, 1, D), dtype, positive=True)]
    return g, ins


def reduction_graph(R, D, dtype=yr.float32):
    """Sums over the last dim (rs outputs), one used again in the row, and a column sum
    (dim 0: a library step) read back as a row input."""
    g = yr.new_kernel_graph()
    x = g.new_input((R, D), dtype)
    r = g.reduction(x, 1)
    g.mark_output(r)
    g.mark_output(g.sub(x, g.scale(r, 1.0 / D)))
    g.mark_output(g.reduction(g.exp(x), -1))
    colsum = g.reduction(x, 0)
    g.mark_output(g.mul(x, colsum))
    return g, [rand((R, D), dtype)]


def rms_norm_graph(R, D, dtype=yr.float32):
    """Residual add + RMSNorm * weight (llama's pre-norm): outputs h and the norm."""
    g = yr.new_kernel_graph()
    h, o, w = g.new_input((R, D), dtype), g.new_input((R, D), dtype), g.new_input((D,), dtype)
    h2 = g.add(h, o)
    g.mark_output(h2)
    g.mark_output(g.mul(g.rms_norm(h2, (D,), eps=1e-5), w))
    return g, [rand((R, D), dtype), rand((R, D), dtype), rand((D,), dtype)]


def softmax_graph(R, D, dtype=yr.float32):
    """softmax(3 x) over the last dim (max and sum reductions)."""
    g = yr.new_kernel_graph()
    x = g.new_input((R, D), dtype)
    g.mark_output(g.softmax(g.scale(x, 3.0), -1))
    return g, [rand((R, D), dtype)]


def chain_graph(R, D, dtype=yr.float32):
    """x / sqrt(sum(x^2)) then softmax(exp(-y)): four phases, an rs output."""
    g = yr.new_kernel_graph()
    x = g.new_input((R, D), dtype)
    s = g.sqrt(g.reduction(g.square(x), 1))
    y = g.div(x, s)
    g.mark_output(g.softmax(g.exp(g.neg(y)), -1))
    g.mark_output(s)
    return g, [rand((R, D), dtype)]


GRAPHS = {"unary": unary_graph, "broadcast": broadcast_graph, "reduction": reduction_graph,
          "rms_norm": rms_norm_graph, "softmax": softmax_graph, "chain": chain_graph}


# ---- tests -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["auto", "looped"])
@pytest.mark.parametrize("R,D", SIZES)
@pytest.mark.parametrize("name", list(GRAPHS))
def test_matches_reference(name, R, D, mode):
    """Every graph, size and code shape against the reference interpreter."""
    torch.manual_seed(R * 10007 + D)
    g, ins = GRAPHS[name](R, D)
    fused = check(g, ins, mode)
    want = "looped" if mode == "looped" else "persistent"
    assert fused and all(tcg.code_shape(k, mode) == want for k in fused)
    if mode == "looped" and D > 1:  # the loop really runs several chunks
        assert all(math.ceil(k.D / tcg.launch_config(k, R, mode, interpreter=True).BLOCK_D) >= 3 for k in fused)


@pytest.mark.parametrize("mode", ["auto", "looped"])
def test_rows_of_one_element(mode):
    """D == 1: an rs value has the row's shape, so a reduction may read one (a sum of a
    one-element row is the value) and an elementwise op of rs values may be a vec output."""
    torch.manual_seed(7)
    g = yr.new_kernel_graph()
    x, c = g.new_input((7, 1)), g.new_input((7, 1))
    s = g.reduction(x, 1)
    t = g.reduction(g.exp(s), -1)
    g.mark_output(t)
    g.mark_output(g.clamp(s, -0.1, 0.2))
    g.mark_output(g.softmax(g.add(t, c), -1))
    check(g, [rand((7, 1)), rand((7, 1))], mode)
    check(g, [rand((7, 1)), rand((7, 1))], mode, interpreter=False)


@pytest.mark.skipif(not hasattr(yr.new_kernel_graph(), "cast"), reason="no cast op")
@pytest.mark.parametrize("mode", ["auto", "looped"])
def test_casts_store_in_the_output_dtype(mode):
    """A cast is the value itself; its output's dtype decides the store (the same statement,
    even an input load, may be stored in two dtypes)."""
    torch.manual_seed(8)
    g = yr.new_kernel_graph()
    x, w = g.new_input((7, 300)), g.new_input((300,), yr.float16)
    b = g.new_input((7, 300), yr.bfloat16)
    g.mark_output(g.cast(x, yr.float16))
    g.mark_output(g.cast(x, yr.bfloat16))
    g.mark_output(g.mul(g.cast(g.silu(x), yr.float16), w))
    g.mark_output(g.cast(g.add(g.cast(b, yr.float32), x), yr.bfloat16))
    g.mark_output(g.cast(g.rms_norm(x, (300,)), yr.bfloat16))
    ins = [rand((7, 300)), rand((300,), yr.float16), rand((7, 300), yr.bfloat16)]
    out, _ = run_schedule(g, ins, mode)
    ref = g.interpret(ins)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])  # round to nearest even
    for a, r in zip(out, ref):
        tol = TOL[yr.bfloat16] if r.dtype == torch.bfloat16 else TOL[yr.float16]
        assert a.dtype == r.dtype
        torch.testing.assert_close(a.float(), r.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(not hasattr(yr.new_kernel_graph(), "cast"), reason="no cast op")
def test_bfloat16_rounds_to_nearest_even():
    """float32 -> bfloat16 stores round like torch: ties to even, inf/NaN/subnormals kept."""
    g = yr.new_kernel_graph()
    x = g.new_input((2, 8))
    g.mark_output(g.cast(x, yr.bfloat16))
    vals = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 3.4e38, float("inf"),
                         float("-inf"), float("nan"), 1e-40, -1e-40, 0.0, -0.0, 65504.0, 1.0 / 3, -2.7, 1e-3])
    x_in = vals.reshape(2, 8).to(DEVICE)
    (out,), _ = run_schedule(g, [x_in])
    torch.testing.assert_close(out, x_in.to(torch.bfloat16), atol=0, rtol=0, equal_nan=True)


def test_every_op_and_load_mode_is_covered():
    """The graphs above exercise every statement op and every load mode."""
    ops = set()
    modes = set()
    for make in GRAPHS.values():
        g, _ = make(7, 7)
        for k in schedule(g):
            if isinstance(k, FusedKernel):
                ops |= {s.op for s in k.stmts}
                modes |= {i.mode for i in k.inputs}
    assert set(UNARY) | set(BINARY) | {"clamp", "affine", "sum", "max", "load"} <= ops
    assert modes == {"full", "row", "col", "scalar", "expand"}


@pytest.mark.parametrize("mode", ["auto", "persistent"])
@pytest.mark.parametrize("name", ["rms_norm", "chain", "broadcast"])
def test_wide_rows(name, mode):
    """D > MAX_PERSISTENT_D: auto loops over chunks (kernels with a reduction) and agrees
    with the forced persistent shape."""
    torch.manual_seed(3)
    g, ins = GRAPHS[name](3, BIG_D)
    fused = check(g, ins, mode)
    if mode == "auto":
        assert all(tcg.code_shape(k) == ("looped" if tcg.has_reduction(k) else "persistent") for k in fused)


@pytest.mark.parametrize("mode", ["auto", "looped"])
def test_rms_norm_over_two_trailing_dims(mode):
    """rms_norm over (A, B): a k=2 kernel, D = A * B (narrow and looped)."""
    torch.manual_seed(4)
    for shape in [(5, 3, 7), (2, 7, 2500)]:  # D = 21 and D = 17500 (looped under auto)
        g = yr.new_kernel_graph()
        x, w = g.new_input(shape), g.new_input(shape[1:])
        g.mark_output(g.mul(g.rms_norm(x, shape[1:]), w))
        fused = check(g, [rand(shape), rand(shape[1:])], mode)
        assert [k.k for k in fused] == [2]


@pytest.mark.parametrize("mode", ["auto", "looped"])
@pytest.mark.parametrize("dtype", [yr.float16, yr.bfloat16])
@pytest.mark.parametrize("name", ["unary", "broadcast", "rms_norm", "softmax", "chain"])
def test_half_precision(name, dtype, mode):
    """float16/bfloat16 inputs and outputs, float32 arithmetic inside."""
    torch.manual_seed(5)
    g, ins = broadcast_graph(7, 300, dtype, row_sum=False) if name == "broadcast" else GRAPHS[name](7, 300, dtype)
    check(g, ins, mode, dtype)


@pytest.mark.parametrize("name", ["unary", "broadcast", "rms_norm", "chain"])
def test_gpu_block_sizes(name):
    """The GPU launch heuristics (rows batched per program, rows of reduction-free kernels
    split over grid axis 1, rs outputs written once) give the same numbers."""
    torch.manual_seed(6)
    for R, D in [(7, 4097), (300, 24)]:
        g, ins = broadcast_graph(R, D, row_sum=False) if name == "broadcast" else GRAPHS[name](R, D)
        fused = check(g, ins, interpreter=False)
        for k in fused:
            cfg = tcg.launch_config(k, k.R)
            assert cfg.grid[0] * cfg.BLOCK_R >= k.R and cfg.grid[1] * cfg.BLOCK_D >= k.D
            assert cfg.grid[1] == (math.ceil(k.D / cfg.BLOCK_D) if tcg.splits_columns(k) else 1)
            if D == 4097:
                assert cfg.grid[1] == (5 if name in ("unary", "broadcast") else 1)
            elif name != "unary":  # 300 rows of 24 (2 x 300 for broadcast): several rows per program
                assert cfg.BLOCK_R > 1


def test_launch_heuristics():
    """The documented GPU/interpreter block sizes, grids and warps."""
    def kern(D, reduce=True):
        g = yr.new_kernel_graph()
        x = g.new_input((8, D))
        g.mark_output(g.rms_norm(x, (D,)) if reduce else g.silu(x))
        return next(s for s in schedule(g) if isinstance(s, FusedKernel))

    cfg = tcg.launch_config(kern(4096), 8)
    assert (cfg.grid, cfg.BLOCK_R, cfg.BLOCK_D, cfg.num_warps) == ((8, 1), 1, 4096, 8)
    cfg = tcg.launch_config(kern(64), 8192)
    assert cfg.BLOCK_D == 64 and cfg.BLOCK_R == 64 and cfg.grid == (128, 1)
    assert tcg.code_shape(kern(16384)) == "persistent" and tcg.code_shape(kern(16385)) == "looped"
    cfg = tcg.launch_config(kern(50000), 1)
    assert (cfg.grid, cfg.BLOCK_R, cfg.BLOCK_D) == ((1, 1), 1, 4096)
    cfg = tcg.launch_config(kern(14336, reduce=False), 1)  # decode-time SwiGLU: split the row
    assert (cfg.grid, cfg.BLOCK_R, cfg.BLOCK_D) == ((1, 14), 1, 1024)
    cfg = tcg.launch_config(kern(14336, reduce=False), 5, interpreter=True)
    assert (cfg.grid, cfg.BLOCK_R, cfg.BLOCK_D) == ((2, 1), 4, 16384)
    with pytest.raises(ValueError):
        tcg.code_shape(kern(8), "tiled")


def test_rendering_is_deterministic_and_shares_equal_kernels():
    """Same graph, same text; equal-structure kernels share one function and one module file."""
    def graph():
        g = yr.new_kernel_graph()
        x, w = g.new_input((4, 32)), g.new_input((32, 32))
        a = g.rms_norm(x, (32,))
        b = g.rms_norm(g.matmul(a, w), (32,))  # same structure as the first kernel
        g.mark_output(g.softmax(b, -1))
        return g

    k1 = [s for s in schedule(graph()) if isinstance(s, FusedKernel)]
    k2 = [s for s in schedule(graph()) if isinstance(s, FusedKernel)]
    assert len(k1) == 2 and k1[0].key() != k1[1].key()
    src1, names1 = tcg.render_module(k1)
    src2, names2 = tcg.render_module(k2)
    assert (src1, names1) == (src2, names2)
    # a kernel of the same structure as k1[0] joins its function
    src3, names3 = tcg.render_module([k1[0], k1[1], k2[0]])
    assert names3 == [names1[0], names1[1], names1[0]] and src3 == src1
    assert src3.count("def yr_fused_") == 2
    # forcing another code shape renames the entry points
    _, looped = tcg.render_module(k1, "looped")
    assert set(looped).isdisjoint(names1)
    compiled = compile_triton([k1[0], k2[0]])
    assert compiled[0].fn is compiled[1].fn
    import hashlib
    from yirage.config import cache_dir
    path = cache_dir() / "triton" / f"k_{hashlib.sha256(tcg.render_module([k1[0], k2[0]])[0].encode()).hexdigest()[:24]}.py"
    assert path.is_file() and not list(path.parent.glob("*.tmp"))


def test_float_literals():
    """inf, -inf and nan render as valid Triton expressions; finite values round-trip."""
    assert tcg._lit(float("inf")) == 'float("inf")' and tcg._lit(float("-inf")) == 'float("-inf")'
    assert tcg._lit(float("nan")) == 'float("nan")' and float(tcg._lit(0.1)) == 0.1


def test_bind_checks_tensors():
    """bind rejects wrong counts, sizes and dtypes; R == 0 binds a no-op."""
    g, ins = softmax_graph(3, 8)
    k = next(s for s in schedule(g) if isinstance(s, FusedKernel))
    (tk,) = compile_triton([k])
    with pytest.raises(ValueError, match="1 outputs"):
        tk.bind(ins, 3)
    with pytest.raises(ValueError, match="expected 24"):
        tk.bind([ins[0], torch.empty(3, 9, device=DEVICE)], 3)
    with pytest.raises(ValueError, match="float32"):
        tk.bind([ins[0], torch.empty(3, 8, dtype=torch.float16, device=DEVICE)], 3)
    tk.bind([ins[0][:0], torch.empty(0, 8, device=DEVICE)], 0)()  # no rows: no launch
