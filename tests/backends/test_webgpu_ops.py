"""WebGPU kernels for a decoder step's library ops besides its GEMMs (backends/webgpu/ops.py,
the WGSL of kernels/webgpu): embedding, rope, rope_rows, rotary_emb, attention, attention_rows
and argmax, each in small kernel graphs run on the webgpu backend against the reference
interpreter (float32; attention over a KV cache updated in place, GQA, sliding windows, a
continuous-batching step with a prefill chunk and a repeated place), run-time indices out of
range raising IndexOutOfRangeError with nothing written, and the kernels bound directly at
nonzero offsets.

The backend's ``supports`` / ``bind_library_op`` are patched here to consult ``webgpu.ops.OPS``
first (the ``kernels`` fixture), and each test checks that its ops were bound to these kernels,
not run as torch references. Without wgpu or a WebGPU adapter the module is skipped. On Mesa's
lavapipe (a CPU driver) it runs in seconds: sizes stay small."""
import pytest
from webgpu_kernels import bound_ops
import torch
import torch.nn.functional as F

import yirage as yr
from yirage.backends import get_backend_info

if not yr.is_backend_available("webgpu"):
    pytest.skip(f"webgpu unavailable: {get_backend_info('webgpu').reason}", allow_module_level=True)

from yirage.backends.webgpu import ops as O  # noqa: E402
from yirage.errors import YirageError  # noqa: E402
from yirage.runtime import webgpu as wg  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
ATTN_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    """The ops the webgpu backend bound to this module's kernels (the backend consults them itself)."""
    monkeypatch.setenv("YIRAGE_TUNE", "off")
    return bound_ops(monkeypatch, O.OPS)


def run_both(g, inputs, tol=TOL):
    """``g`` on webgpu and on the reference interpreter (inputs cloned for each: ops update
    caches in place); asserts equal outputs; returns (webgpu outputs, its inputs after the run,
    the reference's inputs after it)."""
    mine, ref_in = [x.clone() for x in inputs], [x.clone() for x in inputs]
    out = g(inputs=mine, backend="webgpu")
    ref = g.interpret(ref_in)
    assert len(out) == len(ref)
    for a, b in zip(out, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    return out, mine, ref_in


# ---- embedding ---------------------------------------------------------------------------------
def _embedding_graph(ids_shape, V, H, ids_dtype=yr.int64):
    g = yr.new_kernel_graph()
    g.mark_output(g.embedding(g.new_input(ids_shape, ids_dtype), g.new_input((V, H))))
    return g


@pytest.mark.parametrize("ids_dtype", [yr.int64, yr.int32])
@pytest.mark.parametrize("ids_shape", [(1,), (7,), (2, 3)])
def test_embedding(ids_shape, ids_dtype, kernels):
    V, H = 11, 37
    g = _embedding_graph(ids_shape, V, H, ids_dtype)
    ids = torch.randint(0, V, ids_shape, dtype=ids_dtype.torch_dtype)
    ids.view(-1)[0] = V - 1
    out, _, _ = run_both(g, [ids, torch.randn(V, H)])
    assert kernels == ["embedding"]


@pytest.mark.parametrize("bad", [11, -1, 10**9, -10**9, 2**62])
def test_embedding_id_out_of_range_raises_and_the_plan_recovers(bad, kernels):
    g, table = _embedding_graph((3,), 11, 8), torch.randn(11, 8)
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"embedding: token id {bad} is out of range \[0, 11\)"):
        g(inputs=[torch.tensor([0, bad, 1]), table], backend="webgpu")
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"token id {bad} "):   # the reference says the same
        g.interpret([torch.tensor([0, bad, 1]), table])
    run_both(g, [torch.tensor([10, 0, 1]), table])
    assert set(kernels) == {"embedding"}


@pytest.mark.parametrize("bad", [11, -1, 2**31 - 1, -2**31])
def test_embedding_int32_id_out_of_range_raises(bad):
    g = _embedding_graph((3,), 11, 8, yr.int32)
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"embedding: token id {bad} is out of range \[0, 11\)"):
        g(inputs=[torch.tensor([2, 3, bad], dtype=torch.int32), torch.randn(11, 8)], backend="webgpu")


def test_embedding_reports_the_first_bad_id():
    g = _embedding_graph((600,), 11, 4)
    ids = torch.randint(0, 11, (600,))
    ids[[300, 450, 599]] = torch.tensor([-5, 77, 12])
    with pytest.raises(yr.IndexOutOfRangeError, match=r"token id -5 is out of range"):
        g(inputs=[ids, torch.randn(11, 4)], backend="webgpu")


# ---- rope, rope_rows, rotary_emb ----------------------------------------------------------------
def _tables(S, half):
    freqs = torch.arange(S).float()[:, None] * torch.rand(half)[None]
    return freqs.cos(), freqs.sin()


def _rope_graph(op, T, H, Dh, S):
    g = yr.new_kernel_graph()
    x, c, s = g.new_input((T, H, Dh)), g.new_input((S, Dh // 2)), g.new_input((S, Dh // 2))
    pos = g.new_input((T,) if op == "rope_rows" else (1,), yr.int64)
    g.mark_output(getattr(g, op)(x, c, s, pos))
    return g


@pytest.mark.parametrize("T,start", [(1, 0), (5, 3), (4, 8)])
def test_rope(T, start, kernels):
    H, Dh, S = 3, 16, 12
    g = _rope_graph("rope", T, H, Dh, S)
    run_both(g, [torch.randn(T, H, Dh), *_tables(S, Dh // 2), torch.tensor([start])])
    assert kernels == ["rope"]


@pytest.mark.parametrize("positions", [[3, 0, 12, 4, 4], [7]])
def test_rope_rows(positions, kernels):
    T, H, Dh, S = len(positions), 3, 18, 13
    g = _rope_graph("rope_rows", T, H, Dh, S)
    run_both(g, [torch.randn(T, H, Dh), *_tables(S, Dh // 2), torch.tensor(positions)])
    assert kernels == ["rope_rows"]


@pytest.mark.parametrize("bad", [13, -1, 2**62])
def test_rope_rows_position_out_of_range_raises(bad):
    g = _rope_graph("rope_rows", 3, 2, 8, 13)
    inputs = [torch.randn(3, 2, 8), *_tables(13, 4)]
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"rope_rows: position {bad} is out of range \[0, 13\)"):
        g(inputs=inputs + [torch.tensor([2, bad, 5])], backend="webgpu")
    run_both(g, inputs + [torch.tensor([2, 12, 5])])


@pytest.mark.parametrize("x_shape,table_shape", [((2, 3, 5, 8), (2, 1, 5, 8)), ((7, 16), (7, 16)),
                                                 ((4, 6, 64), (6, 64)), ((10,), (10,)), ((3, 2, 6), (1, 1, 6))])
def test_rotary_emb(x_shape, table_shape, kernels):
    g = yr.new_kernel_graph()
    x, c, s = g.new_input(x_shape), g.new_input(table_shape), g.new_input(table_shape)
    g.mark_output(g.rotary_emb(x, c, s))
    angles = torch.rand(table_shape) * 6.3
    data = torch.randn(x_shape)
    out, _, _ = run_both(g, [data, angles.cos(), angles.sin()])
    half = x_shape[-1] // 2
    want = data * angles.cos() + torch.cat([-data[..., half:], data[..., :half]], -1) * angles.sin()
    torch.testing.assert_close(out[0], want, **TOL)
    assert kernels == ["rotary_emb"]


# ---- attention ---------------------------------------------------------------------------------
def _attention_graph(T, Hq, Hkv, Dh, S, window=0, scale=None):
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((T, Hq, Dh)), g.new_input((T, Hkv, Dh)), g.new_input((T, Hkv, Dh))
    kc, vc, pos = g.new_input((S, Hkv, Dh)), g.new_input((S, Hkv, Dh)), g.new_input((1,), yr.int64)
    g.mark_output(g.attention(q, k, v, kc, vc, pos, scale=scale, window=window))
    return g


@pytest.mark.parametrize("T,start,window", [(1, 0, 0), (7, 0, 0), (1, 20, 0), (4, 6, 3), (5, 27, 0),
                                            (3, 10, 1), (70, 30, 0), (2, 80, 50)])
def test_attention_over_a_kv_cache(T, start, window, kernels):
    """GQA (4 query heads, 2 KV heads) over caches whose first ``start`` rows hold earlier keys;
    more than one tile of keys (the kernel takes 64 at a time) where start + T passes 64."""
    Hq, Hkv, Dh, S = 4, 2, 16, max(32, start + T)
    g = _attention_graph(T, Hq, Hkv, Dh, S, window)
    caches = [torch.zeros(S, Hkv, Dh) for _ in range(2)]
    for c in caches:
        c[:start] = torch.randn(start, Hkv, Dh)
    qkv = [torch.randn(T, h, Dh) for h in (Hq, Hkv, Hkv)]
    _, mine, ref = run_both(g, [*qkv, *caches, torch.tensor([start])], ATTN_TOL)
    torch.testing.assert_close(mine[3], ref[3], atol=0, rtol=0)   # the caches, appended in place
    torch.testing.assert_close(mine[4], ref[4], atol=0, rtol=0)
    assert kernels == ["attention"]


@pytest.mark.parametrize("Dh", [8, 80, 128])
def test_attention_head_dims_and_scale(Dh, kernels):
    """Head dims below, between and at multiples of the 64 threads; MHA (Hq == Hkv); a scale."""
    T, H, S = 3, 2, 16
    g = _attention_graph(T, H, H, Dh, S, scale=0.3)
    inputs = [torch.randn(T, H, Dh), torch.randn(T, H, Dh), torch.randn(T, H, Dh),
              torch.randn(S, H, Dh), torch.randn(S, H, Dh), torch.tensor([5])]
    run_both(g, inputs, ATTN_TOL)
    assert kernels == ["attention"]


def test_rope_attention_argmax_with_kv_cache(kernels):
    """Prefill 7 tokens, then decode 2, the caches carried across calls, against SDPA over the
    full sequence (the shared suite's test, every op on these kernels)."""
    Hq, Hkv, Dh, S = 4, 2, 16, 32
    inv = 1.0 / (10000 ** (torch.arange(0, Dh, 2).float() / Dh))
    freqs = torch.arange(S).float()[:, None] * inv[None]
    cos, sin = freqs.cos(), freqs.sin()
    kc, vc = torch.zeros(S, Hkv, Dh), torch.zeros(S, Hkv, Dh)
    kc_ref, vc_ref = torch.zeros(S, Hkv, Dh), torch.zeros(S, Hkv, Dh)
    q_all, k_all, v_all = torch.randn(9, Hq, Dh), torch.randn(9, Hkv, Dh), torch.randn(9, Hkv, Dh)
    outs = []
    for start, T in [(0, 7), (7, 1), (8, 1)]:
        g = yr.new_kernel_graph()
        q, k, v = g.new_input((T, Hq, Dh)), g.new_input((T, Hkv, Dh)), g.new_input((T, Hkv, Dh))
        c, s = g.new_input((S, Dh // 2)), g.new_input((S, Dh // 2))
        kcache, vcache, pos = g.new_input((S, Hkv, Dh)), g.new_input((S, Hkv, Dh)), g.new_input((1,), yr.int64)
        a = g.attention(g.rope(q, c, s, pos), g.rope(k, c, s, pos), v, kcache, vcache, pos)
        flat = g.reshape(a, (T, Hq * Dh))
        g.mark_output(flat)
        g.mark_output(g.argmax(g.slice_rows(flat, T - 1, T), -1))
        sl = slice(start, start + T)
        inputs = [q_all[sl], k_all[sl], v_all[sl], cos, sin, kc_ref, vc_ref, torch.tensor([start])]
        ref = g.interpret(inputs)
        out = g(inputs=inputs[:5] + [kc, vc, inputs[7]], backend="webgpu")
        torch.testing.assert_close(out[0], ref[0], **ATTN_TOL)
        assert torch.equal(out[1], ref[1])
        torch.testing.assert_close(kc, kc_ref, **TOL)
        torch.testing.assert_close(vc, vc_ref, **TOL)
        outs.append(out[0])
    assert {"rope", "attention", "argmax"} <= set(kernels)

    def rot(x):
        c, s = cos[:9, None], sin[:9, None]
        x1, x2 = x[..., :Dh // 2], x[..., Dh // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    qr, kr = rot(q_all).transpose(0, 1), rot(k_all).transpose(0, 1).repeat_interleave(2, 0)
    expect = F.scaled_dot_product_attention(qr, kr, v_all.transpose(0, 1).repeat_interleave(2, 0), is_causal=True)
    torch.testing.assert_close(torch.cat(outs), expect.transpose(0, 1).reshape(9, Hq * Dh), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("start", [-1, "limit", 10**9, 2**62])
def test_position_out_of_range_raises_and_leaves_the_cache(T, start, kernels):
    S = 8
    start = S - T + 1 if start == "limit" else start
    g = yr.new_kernel_graph()
    q, k = g.new_input((T, 2, 8)), g.new_input((T, 1, 8))
    c, s = g.new_input((S, 4)), g.new_input((S, 4))
    kc_in, vc_in, pos = g.new_input((S, 1, 8)), g.new_input((S, 1, 8)), g.new_input((1,), yr.int64)
    g.mark_output(g.attention(g.rope(q, c, s, pos), k, k, kc_in, vc_in, pos))
    kc, vc = torch.zeros(S, 1, 8), torch.zeros(S, 1, 8)
    inputs = [torch.randn(T, 2, 8), torch.randn(T, 1, 8), torch.randn(S, 4), torch.randn(S, 4)]
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"rope: start_pos {start} is out of range \[0, {S - T + 1}\)"):
        g(inputs=inputs + [kc, vc, torch.tensor([start])], backend="webgpu")
    assert not kc.any() and not vc.any()   # nothing written
    run_both(g, inputs + [kc, vc, torch.tensor([S - T])], ATTN_TOL)
    assert set(kernels) == {"rope", "attention"}


def test_attention_start_out_of_range_raises(kernels):
    g = _attention_graph(2, 2, 1, 8, 6)
    kc = torch.zeros(6, 1, 8)
    with pytest.raises(yr.IndexOutOfRangeError, match=r"attention: start_pos 5 is out of range \[0, 5\)"):
        g(inputs=[torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8), kc, kc.clone(),
                  torch.tensor([5])], backend="webgpu")
    assert not kc.any() and kernels == ["attention"]


# ---- attention_rows -----------------------------------------------------------------------------
#: (slot, position) rows of a continuous-batching step: a decode row of slot 0, a prefill chunk of
#: slot 2 (positions 4..6), a decode row of slot 1 at the cache's end, a padding row of slot 3
_BATCH_ROWS = [(0, 6), (2, 4), (2, 5), (2, 6), (1, 16), (3, 0)]


def _attention_rows_graph(T, Hq, Hkv, Dh, N, S, window=0):
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((T, Hq, Dh)), g.new_input((T, Hkv, Dh)), g.new_input((T, Hkv, Dh))
    kc, vc = g.new_input((N, S, Hkv, Dh)), g.new_input((N, S, Hkv, Dh))
    slots, pos = g.new_input((T,), yr.int64), g.new_input((T,), yr.int64)
    g.mark_output(g.attention_rows(q, k, v, kc, vc, slots, pos, window=window))
    return g


@pytest.mark.parametrize("rows,window", [(_BATCH_ROWS, 0), (_BATCH_ROWS, 3), ([(1, 9)], 0),
                                         ([(0, 2), (1, 3), (0, 2), (0, 3)], 0),   # a place named twice
                                         ([(1, p) for p in range(70, 80)], 0), ([(0, 79), (1, 75)], 40)])
def test_attention_rows(rows, window, kernels):
    Hq, Hkv, Dh, N = 6, 2, 12, 4
    S = 17 if max(p for _, p in rows) < 17 else 80
    T = len(rows)
    g = _attention_rows_graph(T, Hq, Hkv, Dh, N, S, window)
    inputs = [torch.randn(T, Hq, Dh), torch.randn(T, Hkv, Dh), torch.randn(T, Hkv, Dh),
              torch.randn(N, S, Hkv, Dh), torch.randn(N, S, Hkv, Dh),
              torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])]
    _, mine, ref = run_both(g, inputs, ATTN_TOL)
    torch.testing.assert_close(mine[3], ref[3], atol=0, rtol=0)
    torch.testing.assert_close(mine[4], ref[4], atol=0, rtol=0)
    assert kernels == ["attention_rows"]


@pytest.mark.parametrize("slot,pos,message", [(4, 3, r"slot or position 4 is out of range \[0, 4\)"),
                                              (-1, 3, r"slot or position -1 is out of range \[0, 4\)"),
                                              (1, 17, r"slot or position 17 is out of range \[0, 17\)"),
                                              (1, 2**62, rf"slot or position {2**62} is out of range \[0, 17\)"),
                                              (9, 99, r"slot or position 9 is out of range \[0, 4\)")])
def test_attention_rows_index_out_of_range_writes_nothing(slot, pos, message, kernels):
    """A bad slot or position of any row: IndexOutOfRangeError (slots checked before positions,
    as the reference does), and no row's keys or values are written."""
    T, N, S = 3, 4, 17
    g = _attention_rows_graph(T, 2, 1, 8, N, S)
    kc, vc = torch.randn(N, S, 1, 8), torch.randn(N, S, 1, 8)
    kc0, vc0 = kc.clone(), vc.clone()
    qkv = [torch.randn(T, 2, 8), torch.randn(T, 1, 8), torch.randn(T, 1, 8)]
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"attention_rows: {message}"):
        g(inputs=qkv + [kc, vc, torch.tensor([0, slot, 2]), torch.tensor([1, pos, 3])], backend="webgpu")
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"attention_rows: {message}"):   # as the reference
        g.interpret(qkv + [kc.clone(), vc.clone(), torch.tensor([0, slot, 2]), torch.tensor([1, pos, 3])])
    run_both(g, qkv + [kc, vc, torch.tensor([0, 1, 2]), torch.tensor([1, 16, 3])], ATTN_TOL)
    assert set(kernels) == {"attention_rows"}


# ---- argmax ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 3, 300), (5, 1000)])
def test_argmax(shape, kernels):
    g = yr.new_kernel_graph()
    g.mark_output(g.argmax(g.new_input(shape), -1))
    x = torch.randint(-3, 4, shape).float()   # many ties: the first maximum wins
    out, _, _ = run_both(g, [x])
    assert torch.equal(out[0], torch.argmax(x, -1))
    y = torch.randn(shape)
    y.view(-1, shape[-1])[0, -1] = float("inf")
    y.view(-1, shape[-1])[-1, :] = float("-inf")
    assert torch.equal(g(inputs=[y], backend="webgpu")[0], torch.argmax(y, -1))
    assert set(kernels) == {"argmax"}


def test_argmax_nan_wins_as_in_torch():
    g = yr.new_kernel_graph()
    g.mark_output(g.argmax(g.new_input((3, 9)), -1))
    x = torch.randn(3, 9)
    x[0, 4] = x[0, 6] = float("nan")
    x[1, 0] = float("nan")
    x[2, 8] = float("nan")
    assert torch.equal(g(inputs=[x], backend="webgpu")[0], torch.argmax(x, -1))


# ---- bound directly: offsets, a shared buffer, the status words, what supports refuses --------------
def _at(host: torch.Tensor, pad: int):
    """``host`` at element offset ``pad`` of a new buffer, as a DeviceTensor."""
    flat = torch.cat([torch.zeros(pad, dtype=host.dtype), host.reshape(-1)])
    t = wg.DeviceTensor.from_host(flat)[pad:]
    return t.view(host.shape)


def _node(g, op):
    return next(n for n in g.ops if n.op == op)


def test_kernels_at_nonzero_offsets_and_the_status_words():
    """Tensors at odd element offsets (int64 ones included), the status slot at a nonzero row of
    a status buffer: its words are [1, value, lo, hi] as int64, the other slots untouched."""
    g = _embedding_graph((4,), 6, 5)
    table = torch.randn(6, 5)
    ids = _at(torch.tensor([5, 0, 3, 3]), 3)
    tab = _at(table, 7)
    out = _at(torch.zeros(4, 5), 1)
    status = wg.DeviceTensor.from_host(torch.zeros(3, 4, dtype=torch.int64)).view(3, 4)
    O.bind_embedding(_node(g, "embedding"), g, [ids, tab], out, status[1])()
    torch.testing.assert_close(out.to_host(), table[[5, 0, 3, 3]], **TOL)
    assert not status.to_host().any()
    ids.upload(torch.tensor([5, 0, -7, 6]))
    O.bind_embedding(_node(g, "embedding"), g, [ids, tab], out, status[1])()
    assert status.to_host().tolist() == [[0] * 4, [1, -7, 0, 6], [0] * 4]

    g = _rope_graph("rope_rows", 2, 3, 8, 5)
    x, (c, s) = torch.randn(2, 3, 8), _tables(5, 4)
    args = [_at(x, 1), _at(c, 2), _at(s, 3), _at(torch.tensor([4, 1]), 5)]
    out = _at(torch.zeros(2, 3, 8), 9)
    O.bind_rope(_node(g, "rope_rows"), g, args, out, None)()
    want = g.interpret([x, c, s, torch.tensor([4, 1])])[0]
    torch.testing.assert_close(out.to_host(), want, **TOL)

    g = yr.new_kernel_graph()
    g.mark_output(g.argmax(g.new_input((3, 5)), -1))
    x = torch.randn(3, 5)
    out = _at(torch.zeros(3, dtype=torch.int64), 3)
    O.bind_argmax(_node(g, "argmax"), g, [_at(x, 5)], out, None)()
    assert torch.equal(out.to_host(), torch.argmax(x, -1))


def test_an_output_sharing_an_input_buffer():
    """The output in the table's buffer (other elements): the inputs are bound read_write; an
    output overlapping an input is refused."""
    g = _embedding_graph((2,), 4, 3)
    table = torch.randn(4, 3)
    buf = wg.DeviceTensor.from_host(torch.cat([table.reshape(-1), torch.zeros(6)]))
    tab, out = buf[:12].view(4, 3), buf[12:].view(2, 3)
    ids = wg.DeviceTensor.from_host(torch.tensor([3, 1]))
    O.bind_embedding(_node(g, "embedding"), g, [ids, tab], out, None)()
    torch.testing.assert_close(out.to_host(), table[[3, 1]], **TOL)
    with pytest.raises(YirageError, match="overlaps an input"):
        O.bind_embedding(_node(g, "embedding"), g, [ids, tab], buf[6:12].view(2, 3), None)


def test_supports_refuses_what_runs_on_the_host():
    g = yr.new_kernel_graph()
    x16 = g.new_input((2, 4, 8), yr.float16)
    c, s = g.new_input((6, 4)), g.new_input((6, 4))
    g.rope(x16, c, s, g.new_input((1,), yr.int64))
    q, k = g.new_input((2, 4, 8)), g.new_input((2, 2, 8))
    kc16 = g.new_input((6, 2, 8), yr.float16)
    g.attention(q, k, k, kc16, kc16, g.new_input((1,), yr.int64))
    g.argmax(g.new_input((3, 5), yr.float16), -1)
    for node in g.ops:
        assert not O.OPS[node.op][0](node, g), node.op
