"""Threadblock graphs (Mirage's µGraphs, ir/threadblock.py) as WGSL compute shaders
(codegen/threadblock_wgsl.py, runtime/threadblock_wgsl.py, backends/webgpu/threadblock.py): a
workgroup per block, the tiles in workgroup memory, the for-loop in the shader. Every block op
and accumulator kind, Mirage's hand-written block graphs (RMSNorm + matmul, gated MLP, LoRA by
concatenation, flash-decoding attention with its three-output block graph) and the
superoptimizer's candidates (search/mugraph.py, search/attention.py) equal
``run_threadblock`` / the graph's ``interpret``; tiles past 16 KiB are read from their buffers,
intermediates past it are refused; an output in an input's buffer binds the inputs writable.
Runs where wgpu finds an adapter (Mesa's lavapipe here).

The webgpu backend is wired to these kernels here by patching its instance (``supports``,
``bind_library_op``, ``bind_customized_group`` for ``customized``), and each test asserts the
kernels ran (no torch reference on the host)."""
import pytest
import torch

import yirage as yr
from yirage.backends import get_backend_impl, get_backend_info

if not yr.is_backend_available("webgpu"):
    pytest.skip(f"webgpu unavailable: {get_backend_info('webgpu').reason}", allow_module_level=True)

from yirage.backends.webgpu import threadblock as wt  # noqa: E402
from yirage.codegen.threadblock_wgsl import (render_threadblock_wgsl, shared_bytes,  # noqa: E402
                                             unsupported_reason, webgpu_supported)
from yirage.errors import YirageError  # noqa: E402
from yirage.ir.threadblock import run_threadblock  # noqa: E402
from yirage.runtime import webgpu as W  # noqa: E402
from yirage.runtime.threadblock_wgsl import bind_threadblock_wgsl  # noqa: E402
from yirage.search import attention, mugraph  # noqa: E402

F32 = yr.float32
TOL = dict(atol=1e-4, rtol=1e-4)


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float32)


@pytest.fixture
def wired(monkeypatch):
    """The webgpu backend with ``customized`` bound to the WGSL block kernels; counts launches bound."""
    impl = get_backend_impl("webgpu")
    calls = {"one": 0, "group": 0, "host": 0}
    supports, bind_op, bind_ref = impl.supports, impl.bind_library_op, impl.bind_reference

    def patched_supports(node, graph):
        return wt.customized_ok(node, graph) if node.op == "customized" else supports(node, graph)

    def patched_bind(node, graph, args, out, status=None):
        if node.op == "customized":
            calls["one"] += 1
            return wt.bind_customized(node, graph, args, out, status)
        return bind_op(node, graph, args, out, status)

    def patched_group(nodes, graph, args, outs):
        thunk = wt.bind_customized_group(nodes, graph, args, outs)
        calls["group"] += thunk is not None
        return thunk

    def patched_ref(node, args, out):
        calls["host"] += node.op == "customized"
        return bind_ref(node, args, out)

    monkeypatch.setattr(impl, "supports", patched_supports)
    monkeypatch.setattr(impl, "bind_library_op", patched_bind)
    monkeypatch.setattr(impl, "bind_customized_group", patched_group)
    monkeypatch.setattr(impl, "bind_reference", patched_ref)
    return calls


def _run_wired(g, inputs, calls, launches: int):
    """``g`` on the wired webgpu backend equals its interpreter, with ``launches`` customized
    kernels bound (alone or as groups) and none run on the host."""
    got = g(inputs=inputs, backend="webgpu")
    want = g.interpret(inputs)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    assert calls["one"] + calls["group"] == launches and calls["host"] == 0, calls


# ---- every op, straight through the runtime ---------------------------------------------------

def _every_op_graph():
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(3, 10, 24), dtype=F32)
    Y = g.new_input(dims=(3, 10, 1), dtype=F32)
    tb = yr.new_threadblock_graph(grid_dim=(3, 2, 1), forloop_range=3, reduction_dimx=4)
    tX = tb.new_input(X, (0, 1, -1), 2)            # [1, 5, 8]
    tY = tb.new_input(Y, (0, 1, -1), -1)           # [1, 5, 1], the same tile every iteration
    a = tb.sqrt(tb.add(tb.square(tX), tb.add_scalar(tb.mul_scalar(tb.relu(tX), 0.5), 0.25)))
    b = tb.sub(tb.gelu(tb.clamp(tX, -1.5, 1.0)), tY)
    c = tb.div(tb.exp(tb.rms_norm(b, eps=1e-5)), tb.add(tb.reduction(tb.square(a), 2), tY))
    m, _ = tb.reduction_max(c, 1)
    outs = [tb.forloop_accum(c), tb.forloop_accum(a, "sum"), tb.forloop_accum(b, "mean"),
            tb.forloop_accum(b, "rms"), tb.forloop_accum(c, "sum_todimx"), tb.forloop_accum_max(tb.silu(b)),
            tb.forloop_accum(m), tb.forloop_accum(tb.concat(tX, tb.mul(tX, tY), dim=1))]
    post = tb.silu(tb.mul(outs[0], outs[1]))
    for o in outs + [post]:
        tb.new_output(o, (0, 1, -1))
    return tb, [_rand(3, 10, 24), _rand(3, 10, 1).abs() + 0.5]


def test_every_block_op_equals_run_threadblock():
    """Unary/binary/scalar ops, reductions, rms_norm, concat and every accumulator kind, inside
    and after the loop, on a 3-d tile over a 3 x 2 grid: each output by its own kernel and all
    nine from one kernel (its ops run once) equal run_threadblock."""
    tb, xs = _every_op_graph()
    want = run_threadblock(tb, xs)
    dev = [W.DeviceTensor.from_host(x) for x in xs]
    together = tuple(range(len(want)))
    assert not webgpu_supported(tb, together)   # 11 storage buffers: more than WebGPU's guaranteed 8
    enough = W.limit("max-storage-buffers-per-shader-stage") >= 2 + len(want)
    for ks in [(k,) for k in range(len(want))] + ([together] if enough else []):
        assert webgpu_supported(tb, ks) == (len(ks) == 1)
        outs = [W.DeviceTensor.empty(tuple(want[k].shape), torch.float32) for k in ks]
        bind_threadblock_wgsl(tb, ks, dev, outs)()
        for k, o in zip(ks, outs):
            torch.testing.assert_close(o.to_host(), want[k], **TOL)


def test_generated_shader_shape():
    tb, _ = _every_op_graph()
    src = render_threadblock_wgsl(tb, 0)
    assert "@compute @workgroup_size(128)" in src          # the block's 128 threads
    assert "var<workgroup> sm: array<f32," in src and "workgroupBarrier();" in src
    assert "for (var it: u32 = 0u; it < 3u; it += 1u)" in src
    assert "var<storage, read> in0" in src and "read_write> in0" in render_threadblock_wgsl(tb, 0, "read_write")
    tb2 = yr.new_threadblock_graph((2, 1, 1), block_dim=(32, 2, 1), forloop_range=2)
    g = yr.new_kernel_graph()
    tb2.new_output(tb2.forloop_accum(tb2.exp(tb2.new_input(g.new_input((4, 8), F32), (0, -1, -1), 1))), (0, -1, -1))
    assert "@workgroup_size(64)" in render_threadblock_wgsl(tb2, 0)
    # a float16 block graph has no WGSL kernel here (its reference runs on the host)
    h = yr.new_kernel_graph()
    tb3 = yr.new_threadblock_graph((2, 1, 1), forloop_range=3)
    tb3.new_output(tb3.forloop_accum(tb3.new_input(h.new_input((4, 6), yr.float16), (0, -1, -1), 1), "sum"),
                   (0, -1, -1))
    assert "float32" in unsupported_reason(tb3, 0)


# ---- Mirage's block graphs through the backend ------------------------------------------------

def _rms_norm_matmul():
    M, K, N, F = 5, 33, 21, 3
    g = yr.new_kernel_graph()
    X, W_ = g.new_input(dims=(M, K), dtype=F32), g.new_input(dims=(K, N), dtype=F32)
    tb = yr.new_threadblock_graph(grid_dim=(3, 1, 1), forloop_range=F)
    tX = tb.new_input(X, (-1, -1, -1), 1)
    tW = tb.new_input(W_, (1, -1, -1), 0)
    tb.new_output(tb.div(tb.forloop_accum(tb.matmul(tX, tW)), tb.forloop_accum(tX, "rms")), (1, -1, -1))
    g.mark_output(g.customized([X, W_], tb)[0])
    return g, [_rand(M, K), _rand(K, N)], 1


def _gated_mlp():
    M, K, N = 7, 45, 27
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(M, K), dtype=F32)
    W1, W3 = g.new_input(dims=(K, N), dtype=F32), g.new_input(dims=(K, N), dtype=F32)
    tb = yr.new_threadblock_graph(grid_dim=(3, 1, 1), block_dim=(64, 1, 1), forloop_range=5)
    tX = tb.new_input(X, (-1, -1, -1), 1)
    tW1, tW3 = tb.new_input(W1, (1, -1, -1), 0), tb.new_input(W3, (1, -1, -1), 0)
    tA1, tA3 = tb.forloop_accum(tb.matmul(tX, tW1)), tb.forloop_accum(tb.matmul(tX, tW3))
    tb.new_output(tb.mul(tb.silu(tA1), tA3), (1, -1, -1))
    g.mark_output(g.customized([X, W1, W3], tb)[0])
    return g, [_rand(M, K), _rand(K, N), _rand(K, N)], 1


def _lora():
    M, K, N, R = 5, 39, 25, 3
    g = yr.new_kernel_graph()
    X, W_ = g.new_input(dims=(M, K), dtype=F32), g.new_input(dims=(K, N), dtype=F32)
    A, B = g.new_input(dims=(K, R), dtype=F32), g.new_input(dims=(R, N), dtype=F32)
    tb = yr.new_threadblock_graph(grid_dim=(5, 1, 1), forloop_range=3)
    tX = tb.new_input(X, (-1, -1, -1), 1)
    tW = tb.new_input(W_, (1, -1, -1), 0)
    tA = tb.new_input(A, (-1, -1, -1), 0)
    tB = tb.new_input(B, (1, -1, -1), -1)
    tC = tb.concat(tX, tb.matmul(tX, tA), dim=1)
    tE = tb.concat(tW, tB, dim=0)
    tb.new_output(tb.forloop_accum(tb.matmul(tC, tE)), (1, -1, -1))
    g.mark_output(g.customized([X, W_, A, B], tb)[0])
    return g, [_rand(M, K), _rand(K, N), _rand(K, R), _rand(R, N)], 1


def _attention(B=2, Sq=12, Dh=8, Skv=30, splits=5, q_blocks=3, F1=2):
    """Mirage's group-query-attention pair: graph 1 (three outputs: numerator, denominator and
    running max per key split, rescaled accumulators), graph 2 combines the splits."""
    g = yr.new_kernel_graph()
    Q = g.new_input(dims=(B, Sq, Dh), dtype=F32)
    K = g.new_input(dims=(B, Dh, Skv), dtype=F32)
    V = g.new_input(dims=(B, Skv, Dh), dtype=F32)
    t1 = yr.new_threadblock_graph(grid_dim=(B, splits, q_blocks), forloop_range=F1)
    bQ, bK, bV = t1.new_input(Q, (0, -1, 1), -1), t1.new_input(K, (0, 2, -1), 2), t1.new_input(V, (0, 1, -1), 1)
    bA = t1.matmul(bQ, bK)
    bMax, bDiff = t1.reduction_max(bA, dim=2)
    bE, bEDiff = t1.exp(t1.sub(bA, bMax)), t1.exp(bDiff)
    for o in (t1.forloop_accum_rescale(t1.matmul(bE, bV), bEDiff),
              t1.forloop_accum_rescale(bE, bEDiff, "sum"), t1.forloop_accum_max(bMax)):
        t1.new_output(o, (0, 2, 1))
    O = g.customized([Q, K, V], t1)
    t2 = yr.new_threadblock_graph(grid_dim=(B, 1, q_blocks), forloop_range=splits)
    bN, bD, bL = (t2.new_input(o, (0, -1, 1), 2) for o in O)
    bM, bDM = t2.reduction_max(bL, dim=2)
    s, e = t2.exp(t2.sub(bL, bM)), t2.exp(bDM)
    num = t2.forloop_accum_rescale(t2.mul(bN, s), e)
    den = t2.forloop_accum_rescale(t2.mul(bD, s), e, "sum")
    t2.new_output(t2.div(num, den), (0, -1, 1))
    g.mark_output(g.customized(O, t2)[0])
    return g, [_rand(B, Sq, Dh), _rand(B, Dh, Skv), _rand(B, Skv, Dh)], 2


@pytest.mark.parametrize("make", [_rms_norm_matmul, _gated_mlp, _lora, _attention,
                                  lambda: _attention(1, 5, 7, 63, 3, 1, 7)],
                         ids=["rms_norm_matmul", "gated_mlp", "lora_concat", "attention", "attention_odd"])
def test_mirage_block_graphs_through_the_backend(make, wired):
    g, xs, launches = make()
    _run_wired(g, xs, wired, launches)
    if launches == 2:   # attention: graph 1's three outputs are one kernel (Q K^T once), graph 2 another
        assert wired["group"] == 1 and wired["one"] == 1
        plan = g.compile("webgpu").plan(xs)
        assert wired["group"] == 2 and wired["one"] == 2
        want = torch.softmax(xs[0] @ xs[1], dim=-1) @ xs[2]
        for _ in range(2):   # the accumulators start again at every run
            torch.testing.assert_close(plan.run()[0], want, **TOL)


# ---- the superoptimizer's candidates ------------------------------------------------------------

def _matmul_family():
    gated = yr.new_kernel_graph()
    X, W1, W3 = (gated.new_input(dims=d, dtype=F32) for d in [(4, 96), (96, 48), (96, 48)])
    gated.mark_output(gated.mul(gated.silu(gated.matmul(X, W1)), gated.matmul(X, W3)))
    rms = yr.new_kernel_graph()
    X, W_ = rms.new_input(dims=(3, 64), dtype=F32), rms.new_input(dims=(64, 40), dtype=F32)
    rms.mark_output(rms.silu(rms.matmul(rms.rms_norm(X, normalized_shape=(64,), eps=1e-5), W_)))
    lora = yr.new_kernel_graph()
    X, W_, A, B = (lora.new_input(dims=d, dtype=F32) for d in [(5, 64), (64, 32), (64, 4), (4, 32)])
    lora.mark_output(lora.add(lora.matmul(X, W_), lora.matmul(lora.matmul(X, A), B)))
    return [gated, rms, lora]


def test_superoptimizer_candidates_run_as_wgsl(wired):
    """mugraph.lower's block graphs (two schedules and thread widths each) and attention.lower's
    flash-decoding pair equal the input graphs on the backend."""
    n = 0
    for g in _matmul_family():
        p = mugraph.match(g)
        for (grid, loop), block in zip(mugraph.schedules(p, 2, 16 * 1024)[:2], (128, 64)):
            cand = mugraph.lower(g, p, grid, loop, type(g), block=block)
            xs = [_rand(*g.tensors[t].shape) for t in g.inputs]
            n += 1
            _run_wired(cand, xs, wired, n)
            for a, b in zip(cand.interpret(xs), g.interpret(xs)):
                torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    g = yr.new_kernel_graph()
    B, G, D, T = 2, 2, 8, 48
    Q, Kt, V = g.new_input((B * G, D), F32), g.new_input((B, D, T), F32), g.new_input((B, T, D), F32)
    s = g.scale(g.matmul(g.reshape(Q, (B, G, D)), Kt), 0.35)
    g.mark_output(g.reshape(g.matmul(g.softmax(s, dim=-1), V), (B * G, D)))
    p = attention.match(g)
    assert p is not None
    splits, loop = attention.schedules(p, 2, 16 * 1024)[0]
    cand = attention.lower(g, p, splits, loop, type(g))
    xs = [_rand(*g.tensors[t].shape) for t in g.inputs]
    _run_wired(cand, xs, wired, n + 2)
    for a, b in zip(cand.interpret(xs), g.interpret(xs)):
        torch.testing.assert_close(a, b, **TOL)


# ---- workgroup memory and buffers -----------------------------------------------------------------

def test_tiles_past_workgroup_memory_are_read_from_their_buffers(wired):
    """Input tiles of 48 KiB: read from their storage buffers (the kernel's arena stays within
    16 KiB); an intermediate tile past 16 KiB has no kernel and runs as the reference."""
    g = yr.new_kernel_graph()
    X, W_ = g.new_input((8, 1024), F32), g.new_input((1024, 8), F32)
    tb = yr.new_threadblock_graph((2, 1, 1), forloop_range=1)
    tX, tW = tb.new_input(X, (-1, -1, -1), -1), tb.new_input(W_, (1, -1, -1), -1)   # 32 KiB, 16 KiB
    tb.new_output(tb.forloop_accum(tb.exp(tb.mul_scalar(tb.matmul(tX, tW), 0.05))), (1, -1, -1))
    g.mark_output(g.customized([X, W_], tb)[0])
    assert webgpu_supported(tb, 0) and shared_bytes(tb, 0) <= 16 * 1024
    src = render_threadblock_wgsl(tb, 0)
    assert "ld0(ar + k)" in src and "ld1(bc + k * 4u)" in src
    _run_wired(g, [_rand(8, 1024), _rand(1024, 8)], wired, 1)

    big = yr.new_kernel_graph()
    Y = big.new_input((64, 128), F32)
    tb2 = yr.new_threadblock_graph((1, 1, 1), forloop_range=1)
    tb2.new_output(tb2.forloop_accum(tb2.exp(tb2.new_input(Y, (-1, -1, -1), -1))), (-1, -1, -1))
    big.mark_output(big.customized([Y], tb2)[0])
    assert not webgpu_supported(tb2, 0) and "workgroup memory" in unsupported_reason(tb2, 0)
    assert not wt.customized_ok(big.ops[0], big)
    y = _rand(64, 128)
    torch.testing.assert_close(big(inputs=[y], backend="webgpu")[0], y.exp(), **TOL)
    assert wired["host"] == 1


def test_an_output_in_an_input_buffer_binds_the_inputs_writable():
    """One buffer holding the inputs and the output (a plan's arena): the inputs are bound
    read_write (WebGPU refuses read-only and writable in one dispatch); an output overlapping
    an input's elements is refused."""
    g, xs, _ = _gated_mlp()
    node = g.ops[0]
    tb = node.attrs["tb"]
    sizes = [x.numel() for x in xs] + [7 * 27]
    arena = W.DeviceTensor.empty((sum(sizes) + 5,), torch.float32)
    views, at = [], 5
    for x, n in zip(xs + [None], sizes):
        shape = tuple(x.shape) if x is not None else (7, 27)
        views.append(arena[at:at + n].view(shape))
        at += n
    for x, v in zip(xs, views):
        v.upload(x)
    bind_threadblock_wgsl(tb, 0, views[:3], views[3])()
    torch.testing.assert_close(views[3].to_host(), run_threadblock(tb, xs)[0], **TOL)
    with pytest.raises(YirageError, match="overlaps an input"):
        bind_threadblock_wgsl(tb, 0, views[:3], arena[5:5 + 7 * 27].view(7, 27))


def test_superoptimize_on_webgpu_searches_verifies_and_keys_by_the_adapter(tmp_path, monkeypatch):
    """g.superoptimize(backend="webgpu") times µGraphs whose block graphs compile to WGSL (none
    left on the host), its winner computes the graph, the cache key names the adapter, and the
    saved codes are WGSL."""
    from yirage.config import cache_dir
    from yirage.search import superoptimize as so

    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path))
    g = yr.new_kernel_graph()
    x, w1, w2 = g.new_input((8, 256)), g.new_input((256, 256)), g.new_input((256, 256))
    g.mark_output(g.mul(g.silu(g.matmul(x, w1)), g.matmul(x, w2)))
    torch.manual_seed(0)
    xs, a, b = torch.randn(8, 256), torch.randn(256, 256) / 16, torch.randn(256, 256) / 16
    opt = g.superoptimize(backend="webgpu", time_budget_s=20, use_cached_graphs=False, save_codes=True,
                          warmup_iters=2, profile_iters=6)
    report = opt.report
    assert report["backend"] == "webgpu" and report["verified"] >= 2 and not report.get("build_errors")
    torch.testing.assert_close(opt(inputs=[xs, a, b])[0], torch.nn.functional.silu(xs @ a) * (xs @ b),
                               rtol=1e-4, atol=1e-4)
    from yirage.runtime import webgpu as W
    assert W.adapter_record()["device"] in so._machine("webgpu")
    folder = cache_dir() / "superopt" / so.cache_key(g, "webgpu")
    if report["best"] != so.FIXED:
        assert list(folder.glob("*.wgsl")) and not list(folder.glob("*.cpp"))
