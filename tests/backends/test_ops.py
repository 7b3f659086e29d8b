"""The shared backend suite: every IR op and fused kernel, compiled for every backend this
machine can run (cpu; 'triton-interpret' under TRITON_INTERPRET=1; cuda/rocm/xpu/mps where
present), against the reference interpreter (torch eager) and plain torch.

The op and fused-kernel cases are the package's conformance suite (yirage/tools/conformance.py
``CASES``, what ``yirage test BACKEND`` runs); this file runs each of them on every backend, plus
what a single graph call cannot show: a KV cache carried across prefill and decode against SDPA,
non-contiguous inputs, and run-time indices out of range.

Adding a backend means passing this file on it (see the ``backend`` fixture in conftest.py).
"""
import pytest
import torch
import torch.nn.functional as F

import yirage as yr
from yirage.backends import get_backend_impl
from yirage.tools.conformance import CASES, quantized, run_case

WEBGPU = True   # every case runs on webgpu too (lavapipe here): see the backend fixture


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_conformance_case(case, backend):
    """The case's outputs (and KV caches) equal the reference interpreter's, and plain torch's
    where the case has an expectation, within its dtype's tolerance."""
    result = run_case(case, backend)
    assert result.status == "PASS", f"{result.op}/{result.case} on {backend}: {result.message}"


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


def test_non_contiguous_inputs(backend):
    g = yr.new_kernel_graph()
    x, y = g.new_input((7, 33)), g.new_input((7, 33))
    g.mark_output(g.softmax(g.add(x, y), -1))
    a = torch.randn(33, 7).t()
    b = torch.randn(7, 66)[:, ::2]
    assert not a.is_contiguous() and not b.is_contiguous()
    out = run_both(g, [a, b], backend)
    torch.testing.assert_close(out[0], torch.softmax(a + b, -1))


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


# ---- run-time indices are checked before any access ----------------------------------------

def _embedding_graph(dtype):
    g = yr.new_kernel_graph()
    ids, t = g.new_input((3,), yr.int64), g.new_input((5, 32), dtype)
    g.mark_output(g.embedding(ids, t))
    return g


def _table(dtype):
    return quantized((5, 32), dtype)[0] if dtype.is_quantized else torch.randn(5, 32)


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
