"""The shared backend suite: every IR op and fused kernel, compiled for every backend this
machine can run (cpu; 'triton-interpret' under TRITON_INTERPRET=1; cuda/rocm/xpu/mps where
present), against the reference interpreter (torch eager) and plain torch.

Adding a backend means passing this file on it (see the ``backend`` fixture in conftest.py).
"""
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import yirage as yr
from yirage.backends import get_backend_impl
from yirage.ir.ops import dequantize

SIZES = [(1, 1), (7, 7), (3, 4097)]


def run_both(g, inputs, backend, atol=1e-5, rtol=1e-5):
    """Run ``g`` on ``backend`` (inputs moved to its device) and on the reference
    interpreter (CPU); assert equal outputs; return the backend's outputs on the CPU."""
    dev = get_backend_impl(backend).torch_device
    out = [o.cpu() for o in g(inputs=[x.to(dev) for x in inputs], backend=backend)]
    ref = g.interpret([x.clone() for x in inputs])
    assert len(out) == len(ref)
    for a, b in zip(out, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    return out


@pytest.mark.parametrize("R,D", SIZES)
@pytest.mark.parametrize("op", ["exp", "sqrt", "square", "silu", "gelu", "relu", "rsqrt", "neg"])
def test_unary(op, R, D, backend):
    g = yr.new_kernel_graph()
    x = g.new_input((R, D))
    g.mark_output(getattr(g, op)(x))
    data = torch.rand(R, D) + 0.1 if op in ("sqrt", "rsqrt") else torch.randn(R, D)
    out = run_both(g, [data], backend)
    # the interpreter itself agrees with plain torch
    expect = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu}.get(op) or getattr(torch, op)
    expect = expect(data)
    torch.testing.assert_close(out[0], expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("R,D", SIZES)
def test_clamp_and_scale(R, D, backend):
    g = yr.new_kernel_graph()
    x = g.new_input((R, D))
    g.mark_output(g.clamp(x, -0.5, 0.25))
    g.mark_output(g.scale(x, 3.0))
    data = torch.randn(R, D)
    out = run_both(g, [data], backend)
    torch.testing.assert_close(out[0], data.clamp(-0.5, 0.25))


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("a_shape,b_shape", [
    ((7, 33), (7, 33)), ((7, 33), (33,)), ((7, 33), (7, 1)), ((7, 33), (1,)),
    ((7, 1), (7, 33)), ((2, 3, 5), (3, 1)), ((1, 4097), (1, 4097)), ((4, 1, 6), (1, 5, 6)),
])
def test_binary_broadcast(op, a_shape, b_shape, backend):
    g = yr.new_kernel_graph()
    a, b = g.new_input(a_shape), g.new_input(b_shape)
    g.mark_output(getattr(g, op)(a, b))
    xa, xb = torch.randn(a_shape), torch.rand(b_shape) + 0.5
    out = run_both(g, [xa, xb], backend)
    torch.testing.assert_close(out[0], getattr(torch, op)(xa, xb))


@pytest.mark.parametrize("R,D", SIZES)
def test_rows_ops(R, D, backend):
    g = yr.new_kernel_graph()
    x = g.new_input((R, D))
    g.mark_output(g.reduction(x, 1))
    g.mark_output(g.reduction(x, 0))
    g.mark_output(g.rms_norm(x, (D,)))
    g.mark_output(g.softmax(x, -1))
    g.mark_output(g.softmax(x, 0))
    data = torch.randn(R, D)
    out = run_both(g, [data], backend, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[0], data.sum(1, keepdim=True), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(out[2], F.rms_norm(data, (D,), eps=1e-6), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[3], torch.softmax(data, -1))


def test_rms_norm_over_two_dims_and_3d(backend):
    g = yr.new_kernel_graph()
    x = g.new_input((2, 3, 5, 8))
    g.mark_output(g.rms_norm(x, (5, 8), eps=1e-5))
    data = torch.randn(2, 3, 5, 8)
    out = run_both(g, [data], backend)
    torch.testing.assert_close(out[0], F.rms_norm(data, (5, 8), eps=1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(yr.float16, 2e-3), (yr.bfloat16, 2e-2)])
def test_half_precision(dtype, tol, backend):
    g = yr.new_kernel_graph()
    x, w = g.new_input((7, 129), dtype), g.new_input((129,), dtype)
    y = g.silu(g.mul(g.rms_norm(x, (129,)), w))
    g.mark_output(y)
    g.mark_output(g.softmax(y, -1))
    tdt = dtype.torch_dtype
    run_both(g, [torch.randn(7, 129).to(tdt), torch.randn(129).to(tdt)], backend, atol=tol, rtol=tol)


def test_non_contiguous_inputs(backend):
    g = yr.new_kernel_graph()
    x, y = g.new_input((7, 33)), g.new_input((7, 33))
    g.mark_output(g.softmax(g.add(x, y), -1))
    a = torch.randn(33, 7).t()
    b = torch.randn(7, 66)[:, ::2]
    assert not a.is_contiguous() and not b.is_contiguous()
    out = run_both(g, [a, b], backend)
    torch.testing.assert_close(out[0], torch.softmax(a + b, -1))


@pytest.mark.parametrize("a_shape,b_shape", [((7, 33), (33, 5)), ((2, 1, 4, 8), (3, 8, 1)), ((1, 1), (1, 4097))])
def test_matmul(a_shape, b_shape, backend):
    g = yr.new_kernel_graph()
    a, b = g.new_input(a_shape), g.new_input(b_shape)
    g.mark_output(g.matmul(a, b))
    xa, xb = torch.randn(a_shape), torch.randn(b_shape)
    out = run_both(g, [xa, xb], backend, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[0], xa @ xb, atol=1e-4, rtol=1e-4)


def quantized(shape, qtype):
    """Random weights in GGML blocks made by the gguf package; returns (storage, float values)."""
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    q = gguf.quants.quantize(w, qtype)
    return torch.from_numpy(q.copy()), torch.from_numpy(gguf.quants.dequantize(q, qtype).copy())


@pytest.mark.parametrize("M", [1, 7])
@pytest.mark.parametrize("dtype", [yr.q4_1, yr.q8_0, yr.float32])
def test_linear(M, dtype, backend):
    N, K = 33, 96
    if dtype.is_quantized:
        qt = {yr.q4_1: gguf.GGMLQuantizationType.Q4_1, yr.q8_0: gguf.GGMLQuantizationType.Q8_0}[dtype]
        storage, wf = quantized((N, K), qt)
        torch.testing.assert_close(dequantize(storage, dtype, (N, K)), wf, atol=0, rtol=0)
    else:
        storage = wf = torch.randn(N, K)
    g = yr.new_kernel_graph()
    x, w, b = g.new_input((M, K)), g.new_input((N, K), dtype), g.new_input((N,))
    g.mark_output(g.linear(x, w, b))
    g.mark_output(g.linear(x, w))
    xs, bias = torch.randn(M, K), torch.randn(N)
    out = run_both(g, [xs, storage, bias], backend, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[0], F.linear(xs, wf, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [yr.q4_1, yr.q8_0, yr.float32])
def test_embedding(dtype, backend):
    V, D = 50, 64
    if dtype.is_quantized:
        qt = {yr.q4_1: gguf.GGMLQuantizationType.Q4_1, yr.q8_0: gguf.GGMLQuantizationType.Q8_0}[dtype]
        storage, table = quantized((V, D), qt)
    else:
        storage = table = torch.randn(V, D)
    g = yr.new_kernel_graph()
    ids, t = g.new_input((7,), yr.int64), g.new_input((V, D), dtype)
    g.mark_output(g.embedding(ids, t))
    idx = torch.tensor([0, 49, 3, 3, 17, 1, 2])
    out = run_both(g, [idx, storage], backend, atol=0, rtol=0)
    torch.testing.assert_close(out[0], table[idx], atol=0, rtol=0)


def test_rope_attention_argmax_with_kv_cache(backend):
    """Prefill 7 tokens, then decode 2, against SDPA over the full sequence."""
    Hq, Hkv, Dh, S = 4, 2, 16, 32
    inv = 1.0 / (10000 ** (torch.arange(0, Dh, 2).float() / Dh))
    freqs = torch.arange(S).float()[:, None] * inv[None]
    cos, sin = freqs.cos(), freqs.sin()
    dev = get_backend_impl(backend).torch_device
    kc, vc = torch.zeros(S, Hkv, Dh, device=dev), torch.zeros(S, Hkv, Dh, device=dev)  # updated in place
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
        out = g(inputs=[x.to(dev) for x in inputs[:5]] + [kc, vc, inputs[7].to(dev)], backend=backend)
        out = [o.cpu() for o in out]
        torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(out[1], ref[1])
        torch.testing.assert_close(kc.cpu(), kc_ref)
        torch.testing.assert_close(vc.cpu(), vc_ref)
        outs.append(out[0])

    # independent reference: rotate-half RoPE + causal SDPA with repeated KV heads
    def rot(x):
        c, s = cos[:9, None], sin[:9, None]
        x1, x2 = x[..., :Dh // 2], x[..., Dh // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    qr, kr = rot(q_all).transpose(0, 1), rot(k_all).transpose(0, 1).repeat_interleave(2, 0)
    expect = F.scaled_dot_product_attention(qr, kr, v_all.transpose(0, 1).repeat_interleave(2, 0), is_causal=True)
    torch.testing.assert_close(torch.cat(outs), expect.transpose(0, 1).reshape(9, Hq * Dh), atol=1e-5, rtol=1e-4)


def test_argmax_ties_and_odd_sizes(backend):
    g = yr.new_kernel_graph()
    x = g.new_input((3, 4097))
    g.mark_output(g.argmax(x, -1))
    data = torch.zeros(3, 4097)
    data[1, 5] = data[1, 4000] = 1.0
    data[2] = torch.randn(4097)
    out = run_both(g, [data], backend, atol=0, rtol=0)
    assert out[0].tolist() == torch.argmax(data, -1).tolist()


@pytest.mark.parametrize("src,dst", [(yr.float32, yr.float16), (yr.float32, yr.bfloat16),
                                     (yr.bfloat16, yr.float32), (yr.float16, yr.bfloat16)])
def test_cast_fuses_with_its_neighbours(src, dst, backend):
    g = yr.new_kernel_graph()
    x = g.new_input((7, 33), src)
    y = g.cast(g.exp(x), dst)
    g.mark_output(g.add(y, y))
    g.mark_output(g.cast(g.reduction(x, 1), dst))
    data = torch.randn(7, 33).to(src.torch_dtype)
    # from float32 the result is the same rounding as torch's .to(); from a half type the
    # reference rounds exp's result to that type first, the fused kernel keeps float32
    tol = 0 if src == yr.float32 else 1e-2
    out = run_both(g, [data], backend, atol=tol, rtol=tol)
    assert out[0].dtype == dst.torch_dtype


@pytest.mark.parametrize("dtype,tol", [(yr.float16, 2e-3), (yr.bfloat16, 2e-2)])
def test_half_activations_with_quantized_weights_and_rope(dtype, tol, backend):
    """What an LLM in float16/bfloat16 runs: q8_0 linear, RoPE and attention in half precision.
    A backend without a kernel for a case runs the torch reference (e.g. the CPU here)."""
    T, H, Dh, S = 3, 2, 16, 8
    storage, _ = quantized((H * Dh, 64), gguf.GGMLQuantizationType.Q8_0)
    g = yr.new_kernel_graph()
    x, w = g.new_input((T, 64), dtype), g.new_input((H * Dh, 64), yr.q8_0)
    c, s = g.new_input((S, Dh // 2)), g.new_input((S, Dh // 2))
    kc, vc, pos = g.new_input((S, H, Dh), dtype), g.new_input((S, H, Dh), dtype), g.new_input((1,), yr.int64)
    q = g.rope(g.reshape(g.linear(x, w), (T, H, Dh)), c, s, pos)
    g.mark_output(g.attention(q, q, q, kc, vc, pos))
    freqs = torch.arange(S).float()[:, None] * torch.rand(Dh // 2)[None]
    td = dtype.torch_dtype
    # x / 8 keeps q around 1 (w is standard normal): tolerances are relative to that scale
    run_both(g, [(torch.randn(T, 64) / 8).to(td), storage, freqs.cos(), freqs.sin(), torch.zeros(S, H, Dh, dtype=td),
                 torch.zeros(S, H, Dh, dtype=td), torch.tensor([2])], backend, atol=tol, rtol=tol)


def test_row_ops_over_rows_of_one_element(backend):
    """D == 1: a per-row value has the row's shape, so row ops may read one."""
    g = yr.new_kernel_graph()
    x, c = g.new_input((7, 1)), g.new_input((7, 1))
    s = g.reduction(x, 1)
    t = g.reduction(g.exp(s), -1)
    g.mark_output(t)
    g.mark_output(g.softmax(g.add(t, c), -1))
    g.mark_output(g.rms_norm(s, (1,)))
    run_both(g, [torch.randn(7, 1), torch.randn(7, 1)], backend)


# ---- run-time indices are checked before any access ----------------------------------------

def _embedding_graph(dtype):
    g = yr.new_kernel_graph()
    ids, t = g.new_input((3,), yr.int64), g.new_input((5, 32), dtype)
    g.mark_output(g.embedding(ids, t))
    return g


def _table(dtype):
    if dtype.is_quantized:
        return quantized((5, 32), {yr.q4_1: gguf.GGMLQuantizationType.Q4_1,
                                   yr.q8_0: gguf.GGMLQuantizationType.Q8_0}[dtype])[0]
    return torch.randn(5, 32)


@pytest.mark.parametrize("dtype", [yr.float32, yr.q8_0, yr.q4_1])
@pytest.mark.parametrize("bad", [5, -1, 10**9, -10**9, 2**62])
def test_embedding_id_out_of_range_raises(bad, dtype, backend):
    g, dev = _embedding_graph(dtype), get_backend_impl(backend).torch_device
    table = _table(dtype).to(dev)
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"embedding: token id {bad} is out of range \[0, 5\)"):
        g(inputs=[torch.tensor([0, bad, 1], device=dev), table], backend=backend)
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"token id {bad} "):  # the reference says the same
        g.interpret([torch.tensor([0, bad, 1]), table.cpu()])
    ok = g(inputs=[torch.tensor([4, 0, 1], device=dev), table], backend=backend)  # the plan recovers
    torch.testing.assert_close(ok[0].cpu(), g.interpret([torch.tensor([4, 0, 1]), table.cpu()])[0])


def _rope_attention_graph(T, S):
    g = yr.new_kernel_graph()
    q, k = g.new_input((T, 2, 8)), g.new_input((T, 1, 8))
    c, s = g.new_input((S, 4)), g.new_input((S, 4))
    kc, vc, pos = g.new_input((S, 1, 8)), g.new_input((S, 1, 8)), g.new_input((1,), yr.int64)
    g.mark_output(g.attention(g.rope(q, c, s, pos), k, k, kc, vc, pos))
    return g


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("start", [-1, "limit", 10**7, 10**9, 2**62])
def test_position_out_of_range_raises_and_leaves_the_cache(T, start, backend):
    S = 8
    start = S - T + 1 if start == "limit" else start
    g, dev = _rope_attention_graph(T, S), get_backend_impl(backend).torch_device
    kc = torch.zeros(S, 1, 8, device=dev)
    inputs = [torch.randn(T, 2, 8), torch.randn(T, 1, 8), torch.randn(S, 4), torch.randn(S, 4)]
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"(rope|attention): start_pos {start} is out of "
                                                      rf"range \[0, {S - T + 1}\)"):
        g(inputs=[x.to(dev) for x in inputs] + [kc, kc.clone(), torch.tensor([start], device=dev)],
          backend=backend)
    assert not kc.any()  # nothing written
    ok = g(inputs=[x.to(dev) for x in inputs] + [kc, kc.clone(), torch.tensor([S - T], device=dev)],
           backend=backend)
    ref = g.interpret(inputs + [torch.zeros(S, 1, 8), torch.zeros(S, 1, 8), torch.tensor([S - T])])
    torch.testing.assert_close(ok[0].cpu(), ref[0], atol=1e-5, rtol=1e-5)
