"""Threadblock graphs (Mirage's µGraphs, ir/threadblock.py): Mirage's hand-written block graphs
rebuilt at small odd sizes equal the kernel-level reference, through the reference interpreter
(run_threadblock, literal grid and for-loop), through the generated C++ of the CPU backend and
through the generated Triton (under Triton's CPU interpreter, when Triton is installed); shape and partition mistakes fail at build time with GraphError."""
import pytest
import torch

import yirage as yr
from yirage.backends.cpu import CPUBackend
from yirage.codegen.threadblock_cpp import render_threadblock
from yirage.ir.threadblock import run_threadblock
from yirage.runtime.threadblock_kernels import bind_threadblock, compile_threadblock

F32 = yr.float32
# Padded Triton lanes compute on arbitrary values (exp, -inf - -inf); numpy warns about it in
# the interpreter. Those lanes are never stored.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float32)


def _check(g, inputs, want, atol=2e-4, rtol=2e-4):
    """The graph's outputs equal ``want`` through the interpreter and the compiled CPU graph,
    whose customized ops all have a C++ kernel (no reference fallback)."""
    for node in g.ops:
        if node.op == "customized":
            assert CPUBackend().supports(node, g)
    for got in (g.interpret(inputs), g(inputs=inputs, backend="cpu")):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def _triton_interpreting() -> bool:
    """Triton is installed and runs in its CPU interpreter (tests/conftest.py sets
    TRITON_INTERPRET=1 without a GPU): the Triton block kernels are checked then."""
    try:
        from yirage.runtime.triton_kernels import interpreting
        return interpreting()
    except ImportError:
        return False


def _check_triton(g, inputs, atol=2e-4, rtol=2e-4):
    """Every customized op of ``g`` rendered as Triton (codegen/threadblock_triton.py, under
    Triton's CPU interpreter) equals run_threadblock on the same inputs."""
    if not _triton_interpreting():
        return
    from yirage.codegen.threadblock_triton import triton_supported
    from yirage.runtime.threadblock_kernels import compile_threadblock_triton
    env = dict(zip(g.inputs, inputs))
    for node in g.ops:
        args = [env[i] for i in node.inputs]
        tb, k = node.attrs["tb"], node.attrs["output"]
        want = run_threadblock(tb, args, [k])[0]
        assert triton_supported(tb, k)
        got = torch.empty_like(want)
        compile_threadblock_triton(tb, k)(args, got)
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        env[node.output] = want
    if yr.is_backend_available("triton-interpret"):  # the whole graph on the Triton backend
        from yirage.backends import get_backend_impl
        impl = get_backend_impl("triton-interpret")
        assert all(impl.supports(node, g) for node in g.ops)
        for a, b in zip(g(inputs=inputs, backend="triton-interpret"), g.interpret(inputs)):
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def test_rms_norm_matmul():
    """Mirage's RMSNorm + matmul µGraph: rms accumulated beside the matmul, divided after the loop."""
    M, K, N, F = 5, 33, 21, 3
    g = yr.new_kernel_graph()
    X, W = g.new_input(dims=(M, K), dtype=F32), g.new_input(dims=(K, N), dtype=F32)
    tb = yr.new_threadblock_graph(grid_dim=(3, 1, 1), block_dim=(128, 1, 1), forloop_range=F, reduction_dimx=64)
    tX = tb.new_input(dtensor=X, input_map=(-1, -1, -1), forloop_dim=1)
    tW = tb.new_input(dtensor=W, input_map=(1, -1, -1), forloop_dim=0)
    assert tX.shape == (M, K // F) and tW.shape == (K // F, N // 3)
    tAccX = tb.forloop_accum(tX, "rms")
    tAccM = tb.forloop_accum(tb.matmul(tX, tW))
    tb.new_output(stensor=tb.div(tAccM, tAccX), output_map=(1, -1, -1))
    O, = g.customized([X, W], tb)
    g.mark_output(O)
    assert O.shape == (M, N)

    ref = yr.new_kernel_graph()
    rX, rW = ref.new_input(dims=(M, K), dtype=F32), ref.new_input(dims=(K, N), dtype=F32)
    ref.mark_output(ref.matmul(ref.rms_norm(rX, normalized_shape=(K,), eps=0.0), rW))
    x, w = _rand(M, K), _rand(K, N)
    _check(g, [x, w], ref.interpret([x, w]))
    _check_triton(g, [x, w])


def test_gated_mlp():
    """silu(x @ W1) * (x @ W3): two accumulated matmuls, the gate applied after the loop."""
    M, K, N = 7, 45, 27
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(M, K), dtype=F32)
    W1, W3 = g.new_input(dims=(K, N), dtype=F32), g.new_input(dims=(K, N), dtype=F32)
    tb = yr.new_threadblock_graph(grid_dim=(3, 1, 1), block_dim=(128, 1, 1), forloop_range=5, reduction_dimx=64)
    tX = tb.new_input(X, (-1, -1, -1), 1)
    tW1, tW3 = tb.new_input(W1, (1, -1, -1), 0), tb.new_input(W3, (1, -1, -1), 0)
    tA1, tA3 = tb.forloop_accum(tb.matmul(tX, tW1)), tb.forloop_accum(tb.matmul(tX, tW3))
    tb.new_output(tb.mul(tb.silu(tA1), tA3), (1, -1, -1))
    O, = g.customized([X, W1, W3], tb)
    g.mark_output(O)
    x, w1, w3 = _rand(M, K), _rand(K, N), _rand(K, N)
    _check(g, [x, w1, w3], [torch.nn.functional.silu(x @ w1) * (x @ w3)])
    _check_triton(g, [x, w1, w3])


def test_lora_by_concatenation():
    """Mirage's LoRA µGraph: [x, x@A] @ [W; B] in one accumulated matmul = x@W + (x@A)@B."""
    M, K, N, R = 5, 39, 25, 3
    g = yr.new_kernel_graph()
    X, W = g.new_input(dims=(M, K), dtype=F32), g.new_input(dims=(K, N), dtype=F32)
    A, B = g.new_input(dims=(K, R), dtype=F32), g.new_input(dims=(R, N), dtype=F32)
    tb = yr.new_threadblock_graph(grid_dim=(5, 1, 1), block_dim=(128, 1, 1), forloop_range=3, reduction_dimx=64)
    tX = tb.new_input(X, (-1, -1, -1), 1)
    tW = tb.new_input(W, (1, -1, -1), 0)
    tA = tb.new_input(A, (-1, -1, -1), 0)
    tB = tb.new_input(B, (1, -1, -1), -1)
    tC = tb.concat(tX, tb.matmul(tX, tA), dim=1)
    tE = tb.concat(tW, tB, dim=0)
    assert tC.shape == (M, K // 3 + R) and tE.shape == (K // 3 + R, N // 5)
    tb.new_output(tb.forloop_accum(tb.matmul(tC, tE)), (1, -1, -1))
    O, = g.customized([X, W, A, B], tb)
    g.mark_output(O)

    ref = yr.new_kernel_graph()
    rX, rW, rA, rB = (ref.new_input(dims=d, dtype=F32) for d in [(M, K), (K, N), (K, R), (R, N)])
    ref.mark_output(ref.add(ref.matmul(rX, rW), ref.matmul(ref.matmul(rX, rA), rB)))
    xs = [_rand(M, K), _rand(K, N), _rand(K, R), _rand(R, N)]
    _check(g, xs, ref.interpret(xs))
    from yirage.codegen.threadblock_triton import triton_supported
    assert not triton_supported(tb, 0)  # concat has no Triton rendering yet


def _attention(B, Sq, Dh, Skv, splits, q_blocks, F1):
    """Mirage's group-query-attention µGraphs: block graph 1 computes, per key split, the
    numerator, denominator and max with a running max and rescaled accumulators; block graph 2
    combines the splits the same way over its for-loop."""
    g = yr.new_kernel_graph()
    Q = g.new_input(dims=(B, Sq, Dh), dtype=F32)
    K = g.new_input(dims=(B, Dh, Skv), dtype=F32)
    V = g.new_input(dims=(B, Skv, Dh), dtype=F32)
    t1 = yr.new_threadblock_graph(grid_dim=(B, splits, q_blocks), block_dim=(128, 1, 1), forloop_range=F1,
                                  reduction_dimx=64)
    bQ = t1.new_input(Q, (0, -1, 1), -1)
    bK = t1.new_input(K, (0, 2, -1), 2)
    bV = t1.new_input(V, (0, 1, -1), 1)
    bA = t1.matmul(bQ, bK)
    bMax, bDiff = t1.reduction_max(bA, dim=2)
    bE = t1.exp(t1.sub(bA, bMax))
    bEDiff = t1.exp(bDiff)
    for o in (t1.forloop_accum_rescale(t1.matmul(bE, bV), bEDiff),
              t1.forloop_accum_rescale(bE, bEDiff, "sum"), t1.forloop_accum_max(bMax)):
        t1.new_output(o, (0, 2, 1))
    O = g.customized([Q, K, V], t1)
    assert [o.shape for o in O] == [(B, Sq, Dh * splits), (B, Sq, splits), (B, Sq, splits)]

    t2 = yr.new_threadblock_graph(grid_dim=(B, 1, q_blocks), block_dim=(128, 1, 1), forloop_range=splits,
                                  reduction_dimx=64)
    bN, bD, bL = (t2.new_input(o, (0, -1, 1), 2) for o in O)
    bM, bDM = t2.reduction_max(bL, dim=2)
    s = t2.exp(t2.sub(bL, bM))
    e = t2.exp(bDM)
    num = t2.forloop_accum_rescale(t2.mul(bN, s), e)
    den = t2.forloop_accum_rescale(t2.mul(bD, s), e, "sum")
    t2.new_output(t2.div(num, den), (0, -1, 1))
    out, = g.customized(O, t2)
    g.mark_output(out)
    return g


@pytest.mark.parametrize("B,Sq,Dh,Skv,splits,q_blocks,F1", [(2, 12, 8, 30, 5, 3, 2), (1, 5, 7, 63, 3, 1, 7)])
def test_attention_with_rescale_and_max(B, Sq, Dh, Skv, splits, q_blocks, F1):
    g = _attention(B, Sq, Dh, Skv, splits, q_blocks, F1)
    q, k, v = _rand(B, Sq, Dh), _rand(B, Dh, Skv), _rand(B, Skv, Dh)
    _check(g, [q, k, v], [torch.softmax(q @ k, dim=-1) @ v])
    _check_triton(g, [q, k, v])


def test_outputs_of_one_block_graph_run_as_one_kernel():
    """The CPU binds the three outputs of the attention's first block graph as one kernel
    (Q K^T, its max and exp computed once, not once per output), plus one for the combine."""
    g = _attention(2, 12, 8, 30, 5, 3, 2)
    q, k, v = _rand(2, 12, 8), _rand(2, 8, 30), _rand(2, 30, 8)
    plan = g.compile("cpu").plan([q, k, v])
    assert len(plan.thunks) == 2
    for _ in range(2):   # the outputs stay right run after run (accumulators reset per run)
        torch.testing.assert_close(plan.run()[0], torch.softmax(q @ k, dim=-1) @ v)
    if "triton-interpret" in [b.value for b in yr.get_available_backends()]:   # the same on Triton
        plan = g.compile("triton-interpret").plan([q, k, v])
        assert len(plan.thunks) == 2
        torch.testing.assert_close(plan.run()[0], torch.softmax(q @ k, dim=-1) @ v)


def test_json_round_trip():
    g = _attention(1, 6, 4, 12, 3, 2, 2)
    back = yr.KNGraph.from_json(g.to_json())
    assert back.to_json() == g.to_json()
    xs = [_rand(1, 6, 4), _rand(1, 4, 12), _rand(1, 12, 4)]
    torch.testing.assert_close(back(inputs=xs, backend="cpu")[0], g.interpret(xs)[0], atol=1e-5, rtol=1e-5)


def test_every_block_op_cpp_equals_reference():
    """Unary/binary/scalar ops, reductions, rms_norm and every accumulator kind, inside and
    after the loop, on a 3-d tile: the generated C++ equals run_threadblock exactly enough."""
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(3, 10, 24), dtype=F32)
    Y = g.new_input(dims=(3, 10, 1), dtype=F32)
    tb = yr.new_threadblock_graph(grid_dim=(3, 2, 1), forloop_range=3, reduction_dimx=4)
    tX = tb.new_input(X, (0, 1, -1), 2)            # [1, 5, 8]
    tY = tb.new_input(Y, (0, 1, -1), -1)           # [1, 5, 1]
    a = tb.sqrt(tb.add(tb.square(tX), tb.add_scalar(tb.mul_scalar(tb.relu(tX), 0.5), 0.25)))
    b = tb.sub(tb.gelu(tb.clamp(tX, -1.5, 1.0)), tY)
    c = tb.div(tb.exp(tb.rms_norm(b, eps=1e-5)), tb.add(tb.reduction(tb.square(a), 2), tY))
    m, _ = tb.reduction_max(c, 1)
    outs = [tb.forloop_accum(c), tb.forloop_accum(a, "sum"), tb.forloop_accum(b, "mean"),
            tb.forloop_accum(b, "rms"), tb.forloop_accum(c, "sum_todimx"), tb.forloop_accum_max(tb.silu(b)),
            tb.forloop_accum(m)]
    post = tb.silu(tb.mul(outs[0], outs[1]))
    for o in outs + [post]:
        tb.new_output(o, (0, 1, -1))
    xs = [_rand(3, 10, 24), _rand(3, 10, 1).abs() + 0.5]
    want = run_threadblock(tb, xs)
    assert [w.shape for w in want] == [(3, 10, 8), (3, 10, 1), (3, 10, 1), (3, 10, 1), (3, 10, 4), (3, 10, 8),
                                      (3, 2, 8), (3, 10, 8)]
    for k, w in enumerate(want):
        out = torch.empty_like(w)
        bind_threadblock(compile_threadblock(tb, k), xs, out)()
        torch.testing.assert_close(out, w, atol=1e-4, rtol=1e-4)
    # the same block graph as Triton (sum_todimx, output 4, has no Triton rendering yet)
    if _triton_interpreting():
        from yirage.codegen.threadblock_triton import triton_supported
        from yirage.runtime.threadblock_kernels import compile_threadblock_triton
        assert not triton_supported(tb, 4)
        for k, w in enumerate(want):
            if k != 4:
                out = torch.empty_like(w)
                compile_threadblock_triton(tb, k)(xs, out)
                torch.testing.assert_close(out, w, atol=1e-4, rtol=1e-4)
    # spot-check the reference against whole-tensor torch: mean and rms of b over the last dim
    x, y = xs
    bb = torch.nn.functional.gelu(x.clamp(-1.5, 1.0)) - y
    torch.testing.assert_close(want[2], bb.mean(-1, keepdim=True), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(want[3], bb.square().mean(-1, keepdim=True).sqrt(), atol=1e-5, rtol=1e-5)


def test_generated_code_shape():
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(4, 8), dtype=F32)
    tb = yr.new_threadblock_graph((2, 1, 1), forloop_range=2)
    tb.new_output(tb.forloop_accum(tb.exp(tb.new_input(X, (0, -1, -1), 1))), (0, -1, -1))
    src = render_threadblock(tb, 0, "k")
    assert 'extern "C" void k(void** args)' in src
    assert "yr::for_static(2, [&](int64_t b) {" in src and "for (int64_t it = 0; it < 2; ++it)" in src


def test_float16_runs_the_reference():
    """A block graph the C++ path does not cover (float16) runs its torch reference."""
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(4, 6), dtype=yr.float16)
    tb = yr.new_threadblock_graph((2, 1, 1), forloop_range=3)
    tb.new_output(tb.forloop_accum(tb.new_input(X, (0, -1, -1), 1), "sum"), (0, -1, -1))
    O, = g.customized([X], tb)
    g.mark_output(O)
    assert not CPUBackend().supports(g.ops[0], g)
    x = torch.randn(4, 6).half()
    torch.testing.assert_close(g(inputs=[x], backend="cpu")[0], x.float().sum(1, keepdim=True).half(),
                               atol=1e-2, rtol=1e-2)


# ---- build-time errors ---------------------------------------------------------------------

def _graph():
    g = yr.new_kernel_graph()
    return g, g.new_input(dims=(6, 12), dtype=F32), g.new_input(dims=(12, 9), dtype=F32)


@pytest.mark.parametrize("imap,fdim,match", [
    ((2, -1, -1), -1, "not -1 or a dim"),
    ((0, 0, -1), -1, "partitioned by two grid dims"),
    ((-1, 0, -1), -1, "not divisible by grid_dim"),
    ((-1, -1, -1), 5, "forloop_dim 5"),
    ((-1, -1, -1), 0, "not divisible by forloop_range"),
    ((1.0, -1, -1), -1, "must be an integer"),
    ((0, -1, -1, -1), -1, "1 to 3 entries"),
])
def test_bad_input_maps(imap, fdim, match):
    g, X, _ = _graph()
    tb = yr.new_threadblock_graph((3, 5, 1), forloop_range=4)
    with pytest.raises(yr.GraphError, match=match):
        tb.new_input(X, imap, fdim)


def test_bad_graph_arguments():
    with pytest.raises(yr.GraphError, match="positive"):
        yr.new_threadblock_graph((0, 1, 1))
    with pytest.raises(yr.GraphError, match="forloop_range"):
        yr.new_threadblock_graph((1, 1, 1), forloop_range=0)


def test_bad_ops_and_outputs():
    g, X, W = _graph()
    tb = yr.new_threadblock_graph((3, 1, 1), forloop_range=2)
    tX = tb.new_input(X, (-1, -1, -1), 1)   # [6, 6]
    tW = tb.new_input(W, (1, -1, -1), 0)    # [6, 3]
    with pytest.raises(yr.GraphError, match="matmul"):
        tb.matmul(tW, tX)
    with pytest.raises(yr.GraphError, match="do not broadcast"):
        tb.add(tX, tW)
    with pytest.raises(yr.GraphError, match="differ outside dim"):
        tb.concat(tX, tW, dim=0)
    acc = tb.forloop_accum(tb.matmul(tX, tW))
    with pytest.raises(yr.GraphError, match="mixes tiles"):
        tb.add(acc, tb.matmul(tX, tW))
    with pytest.raises(yr.GraphError, match="inside the for-loop"):
        tb.forloop_accum(acc)
    with pytest.raises(yr.GraphError, match="running max"):
        tb.reduction_max(acc, 1)
    with pytest.raises(yr.GraphError, match="acc must be"):
        tb.forloop_accum(tX, "median")
    with pytest.raises(yr.GraphError, match="reduction_dimx"):
        tb.forloop_accum(tX, "sum_todimx")
    with pytest.raises(yr.GraphError, match="out of range"):
        tb.reduction(tX, 2)
    with pytest.raises(yr.GraphError, match="min_val"):
        tb.clamp(tX, 2.0, 1.0)
    with pytest.raises(yr.GraphError, match="scalar must be"):
        tb.mul_scalar(tX, float("inf"))
    with pytest.raises(yr.GraphError, match="add_scalar: scalar must not be NaN"):
        tb.add_scalar(tX, float("nan"))
    with pytest.raises(yr.GraphError, match="eps must be"):
        tb.rms_norm(tX, eps=-1.0)
    with pytest.raises(yr.GraphError, match="DTensor"):
        tb.new_input(torch.zeros(6, 12), (-1, -1, -1), -1)
    with pytest.raises(yr.GraphError, match="accumulate it"):
        tb.new_output(tX, (1, -1, -1))
    with pytest.raises(yr.GraphError, match="would write the same tile"):
        tb.new_output(acc, (-1, -1, -1))
    with pytest.raises(yr.GraphError, match="forloop_dim must be -1"):
        tb.new_output(acc, (1, -1, -1), forloop_dim=0)
    other = yr.new_threadblock_graph((1, 1, 1))
    with pytest.raises(yr.GraphError, match="STensor of this threadblock graph"):
        other.exp(tX)
    with pytest.raises(yr.GraphError, match="no output"):
        g.customized([X, W], tb)
    tb.new_output(acc, (1, -1, -1))
    with pytest.raises(yr.GraphError, match="inputs must be the kernel tensors"):
        g.customized([W, X], tb)
    with pytest.raises(yr.GraphError, match="threadblock graph"):
        g.customized([X, W], "tb")
    O, = g.customized([X, W], tb)
    assert O.shape == (6, 9)


def test_inputs_of_another_kernel_graph():
    g, X, _ = _graph()
    g2, Y, _ = _graph()
    tb = yr.new_threadblock_graph((1, 1, 1))
    tb.new_input(X, (-1, -1, -1), -1)
    with pytest.raises(yr.GraphError, match="one kernel graph"):
        tb.new_input(Y, (-1, -1, -1), -1)
