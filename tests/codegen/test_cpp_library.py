"""Tests of the hand-written C++ kernels (src/yirage/kernels/cpu/library.cpp) against torch.

Every kernel runs in three builds of the same source: the native one (``library()``,
AVX-512 on a machine that has it), one with AVX-512 switched off (AVX2/FMA/F16C path)
and a baseline x86-64 one (portable scalar path), so that every ``#if`` branch is tested
on an x86 machine with AVX-512. Quantized weights come from ``gguf.quants.quantize`` and
reference weights from ``gguf.quants.dequantize``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf import quants

import cross  # tests/cross: the aarch64 builds of the lib fixtures
from yirage.backends.cpu.native import SIGNATURES, library

QUANT = {"q4_1": QT.Q4_1, "q8_0": QT.Q8_0}
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}


# ---------------------------------------------------------------------------------------
# Builds of the library
# ---------------------------------------------------------------------------------------

# The ``lib`` fixture (native, AVX2 and scalar builds of the library) is in tests/conftest.py.


def test_signatures_are_bound():
    lib_ = library()
    assert library() is lib_
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib_, name)
        assert list(fn.argtypes) == list(argtypes)
        assert fn.restype is None


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------

def _quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw block bytes as uint8 [N, K/32*bytes], reference dequantized fp32 [N, K])."""
    raw = quants.quantize(w.numpy(), QUANT[fmt])
    ref = quants.dequantize(raw, QUANT[fmt])
    assert raw.shape == (w.shape[0], w.shape[1] // 32 * BLOCK_BYTES[fmt])
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(np.ascontiguousarray(ref))


def _status() -> torch.Tensor:
    """A fresh int64 status[4] slot (the kernels record an out-of-range index there)."""
    return torch.zeros(4, dtype=torch.int64)


def _ptr(t: torch.Tensor | None):
    """``t.data_ptr()`` as an int that keeps ``t`` alive and names it (``cross.ptr``): a temporary
    passed straight to a kernel lives through the call, and the aarch64 builds can ship it."""
    if t is None:
        return None
    assert t.is_contiguous()
    return cross.ptr(t)


def _assert_linear_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    # error bound scales with sum_k |x_k w_k| (fp32 accumulation in any order)
    mag = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    tol = 1e-5 * mag.max().item() + 1e-6
    err = (y.double() - ref).abs().max().item() if y.numel() else 0.0
    assert err <= tol, f"max abs error {err} > {tol}"
    # and against torch's own fp32 result
    torch.testing.assert_close(y, F.linear(x, w, bias), atol=2 * tol, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Linear layers
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("K", [32, 96, 4096])
@pytest.mark.parametrize("N", [1, 7, 33, 64])
@pytest.mark.parametrize("M", [1, 3, 6, 9, 16, 33])   # GEMV below 6 rows, row tiles to 16 (AVX-512), packed GEMM
def test_linear_quant(lib, fmt, M, N, K):
    g = torch.Generator().manual_seed(M * 10007 + N * 101 + K)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.1 + 0.02
    bias = torch.randn(N, generator=g) if (M + N) % 2 == 0 else None
    raw, ref_w = _quantize(w, fmt)
    y = torch.full((M, N), float("nan"))
    getattr(lib, f"yr_linear_{fmt}")(_ptr(x), _ptr(raw), _ptr(bias), _ptr(y), M, N, K)
    _assert_linear_close(y, x, ref_w, bias)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("M,N,K", [(1, 1536, 576), (1, 576, 1536), (1, 4099, 64), (16, 1536, 576), (13, 577, 1536),
                                   (64, 1536, 576), (130, 37, 320), (257, 65, 576), (4100, 6, 1024)])
def test_linear_quant_model_shapes(lib, fmt, M, N, K):
    """Shapes of a small LLM, large enough for the parallel paths."""
    g = torch.Generator().manual_seed(N + K + M)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    bias = torch.randn(N, generator=g)
    raw, ref_w = _quantize(w, fmt)
    for b in (None, bias):
        y = torch.full((M, N), float("nan"))
        getattr(lib, f"yr_linear_{fmt}")(_ptr(x), _ptr(raw), _ptr(b), _ptr(y), M, N, K)
        _assert_linear_close(y, x, ref_w, b)


@pytest.mark.parametrize("K", [1, 17, 96, 100, 4096])
@pytest.mark.parametrize("N", [1, 7, 33, 64])
@pytest.mark.parametrize("M", [1, 3, 6, 33])
def test_linear_f32(lib, M, N, K):
    g = torch.Generator().manual_seed(M * 7 + N * 13 + K)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g)
    bias = torch.randn(N, generator=g) if (M + K) % 2 == 1 else None
    y = torch.full((M, N), float("nan"))
    lib.yr_linear_f32(_ptr(x), _ptr(w), _ptr(bias), _ptr(y), M, N, K)
    _assert_linear_close(y, x, w, bias)


def test_linear_f32_large(lib):
    g = torch.Generator().manual_seed(3)
    for M, N, K in [(1, 1536, 576), (1, 3000, 1001), (70, 515, 333)]:
        x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
        y = torch.empty(M, N)
        lib.yr_linear_f32(_ptr(x), _ptr(w), _ptr(b), _ptr(y), M, N, K)
        _assert_linear_close(y, x, w, b)


def test_linear_quant_special_blocks(lib):
    """Constant blocks (d == 0), zero rows and large magnitudes."""
    K, N = 64, 6
    w = torch.randn(N, K) * 0.1
    w[0] = 0.0
    w[1, :32] = 0.75          # constant block: q4_1 gives d = 0, m = 0.75
    w[2] = -3.0
    w[3] *= 1000.0
    x = torch.randn(2, K)
    for fmt in ("q4_1", "q8_0"):
        raw, ref_w = _quantize(w, fmt)
        for M in (1, 2):
            y = torch.empty(M, N)
            getattr(lib, f"yr_linear_{fmt}")(_ptr(x[:M].contiguous()), _ptr(raw), None, _ptr(y), M, N, K)
            _assert_linear_close(y, x[:M], ref_w, None)


# ---------------------------------------------------------------------------------------
# Embedding
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("D", [32, 96, 576])
def test_embedding_quant_bitwise(lib, fmt, D):
    V = 50
    g = torch.Generator().manual_seed(D)
    table = torch.randn(V, D, generator=g) * torch.logspace(-6, 3, V).unsqueeze(1)
    raw, ref = _quantize(table, fmt)
    for ids_list in ([0], [V - 1, 0, 3, 3, 17], list(range(V)) * 3):
        ids = torch.tensor(ids_list, dtype=torch.int64)
        out = torch.full((len(ids_list), D), float("nan"))
        getattr(lib, f"yr_embedding_{fmt}")(_ptr(ids), _ptr(raw), _ptr(out), len(ids_list), D, V, _ptr(_status()))
        assert torch.equal(out.view(torch.int32), ref[ids].view(torch.int32))


def test_embedding_q8_0_every_fp16_scale(lib):
    """d = every fp16 bit pattern (subnormals, inf, nan): the conversion must be exact."""
    d = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    q = np.tile(np.array([1, -1, 127, -128, 0, 3, -7, 64] * 4, dtype=np.int8), (65536, 1))
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], axis=1)  # [65536, 34]
    with np.errstate(invalid="ignore"):          # inf * 0 in the reference
        ref = torch.from_numpy(quants.dequantize(raw, QT.Q8_0).reshape(65536, 32))
    ids = torch.arange(65536, dtype=torch.int64)
    out = torch.empty(65536, 32)
    lib.yr_embedding_q8_0(_ptr(ids), _ptr(torch.from_numpy(raw)), _ptr(out), 65536, 32, 65536, _ptr(_status()))
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int32), ref[~nan].view(torch.int32))


def test_embedding_q4_1_random_bits(lib):
    """Random finite fp16 d and m (subnormal included) and random nibbles: bitwise exact."""
    rng = np.random.default_rng(0)
    n = 20000
    dm = rng.integers(0, 65536, size=(n, 2), dtype=np.uint16)
    dm[(dm & 0x7C00) == 0x7C00] &= 0x3FFF        # no inf/nan
    dm[:100] &= 0x83FF                           # subnormal d and m
    qs = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    raw = np.concatenate([dm.view(np.uint8).reshape(n, 4), qs], axis=1)
    ref = torch.from_numpy(quants.dequantize(raw, QT.Q4_1).reshape(n, 32))
    out = torch.empty(n, 32)
    ids = torch.arange(n, dtype=torch.int64)
    lib.yr_embedding_q4_1(_ptr(ids), _ptr(torch.from_numpy(raw)), _ptr(out), n, 32, n, _ptr(_status()))
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


def test_out_of_range_indices_are_reported_not_accessed(lib):
    """ids outside [0, V) give zero rows; start_pos outside [0, S - T] writes nothing; each
    call records {1, value, lo, hi} in its status slot."""
    table, ids = torch.randn(4, 33), torch.tensor([1, 4, -3, 2], dtype=torch.int64)
    out, st = torch.full((4, 33), 7.0), _status()
    lib.yr_embedding_f32(_ptr(ids), _ptr(table), _ptr(out), 4, 33, 4, _ptr(st))
    assert st.tolist() == [1, 4, 0, 4]
    assert torch.equal(out[[0, 3]], table[[1, 2]]) and not out[[1, 2]].any()
    cos_t, sin_t = _rope_tables(8, 4)
    x, st, six, minus_one = torch.randn(3, 1, 4), _status(), torch.tensor([6]), torch.tensor([-1])
    y = x.clone()
    lib.yr_rope(_ptr(x), _ptr(cos_t), _ptr(sin_t), _ptr(six), _ptr(y), 3, 1, 4, 8, _ptr(st))
    assert st.tolist() == [1, 6, 0, 6] and torch.equal(y, x)
    kc, vc, st = torch.zeros(8, 1, 4), torch.zeros(8, 1, 4), _status()
    lib.yr_attention(_ptr(x), _ptr(x), _ptr(x), _ptr(kc), _ptr(vc), _ptr(minus_one),
                     _ptr(y), 3, 1, 1, 4, 8, 0.5, _ptr(st))
    assert st.tolist() == [1, -1, 0, 6] and not kc.any() and not vc.any()


def test_embedding_f32(lib):
    table = torch.randn(40, 33)
    ids = torch.tensor([5, 0, 39, 5], dtype=torch.int64)
    out = torch.empty(4, 33)
    lib.yr_embedding_f32(_ptr(ids), _ptr(table), _ptr(out), 4, 33, 40, _ptr(_status()))
    assert torch.equal(out, table[ids])


# ---------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------

def _rope_tables(max_seq: int, dh: int, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh)
    ang = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
    return ang.cos().contiguous(), ang.sin().contiguous()


def _rope_ref(x, cos_t, sin_t, p0):
    """Hugging Face apply_rotary_pos_emb with rotate_half; x: [T, H, Dh]."""
    T = x.shape[0]
    cos = torch.cat([cos_t[p0:p0 + T]] * 2, dim=-1).unsqueeze(1)   # [T, 1, Dh]
    sin = torch.cat([sin_t[p0:p0 + T]] * 2, dim=-1).unsqueeze(1)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    rotate_half = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotate_half * sin


@pytest.mark.parametrize("T,H,Dh,p0", [(1, 1, 2, 0), (5, 3, 64, 0), (1, 9, 64, 17), (7, 2, 6, 3),
                                       (300, 9, 64, 0), (4, 2, 40, 9)])
def test_rope(lib, T, H, Dh, p0):
    max_seq = 512
    cos_t, sin_t = _rope_tables(max_seq, Dh)
    x = torch.randn(T, H, Dh)
    ref = _rope_ref(x, cos_t, sin_t, p0)
    sp = torch.tensor([p0], dtype=torch.int64)
    out = torch.full_like(x, float("nan"))
    lib.yr_rope(_ptr(x), _ptr(cos_t), _ptr(sin_t), _ptr(sp), _ptr(out), T, H, Dh, max_seq, _ptr(_status()))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # in place (out aliases x)
    y = x.clone()
    lib.yr_rope(_ptr(y), _ptr(cos_t), _ptr(sin_t), _ptr(sp), _ptr(y), T, H, Dh, max_seq, _ptr(_status()))
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------

def _attention_ref(q, k_all, v_all, p0, scale):
    """q: [T, Hq, Dh] at positions p0..p0+T-1; k_all, v_all: [p0+T, Hkv, Dh]."""
    T, L = q.shape[0], k_all.shape[0]
    mask = torch.arange(L).unsqueeze(0) <= (p0 + torch.arange(T)).unsqueeze(1)   # [T, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k_all.transpose(0, 1).double(), v_all.transpose(0, 1).double(),
        attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1).float()


@pytest.mark.parametrize("Hq,Hkv,Dh", [(6, 2, 16), (9, 3, 64), (4, 4, 8), (2, 1, 7)])
def test_attention_prefill_then_decode(lib, Hq, Hkv, Dh):
    max_seq = 40
    scale = 1.0 / math.sqrt(Dh) if Dh != 7 else 0.3
    g = torch.Generator().manual_seed(Hq * 100 + Dh)
    k_cache = torch.full((max_seq, Hkv, Dh), float("nan"))
    v_cache = torch.full((max_seq, Hkv, Dh), float("nan"))
    ks, vs = [], []
    p0 = 0
    for T in (7, 1, 1, 3, 22):   # prefill, two decode steps, chunks of 3 and 22
        q = torch.randn(T, Hq, Dh, generator=g) * 2
        k = torch.randn(T, Hkv, Dh, generator=g) * 2
        v = torch.randn(T, Hkv, Dh, generator=g)
        ks.append(k)
        vs.append(v)
        out = torch.full((T, Hq, Dh), float("nan"))
        sp = torch.tensor([p0], dtype=torch.int64)
        lib.yr_attention(_ptr(q), _ptr(k), _ptr(v), _ptr(k_cache), _ptr(v_cache), _ptr(sp), _ptr(out),
                         T, Hq, Hkv, Dh, max_seq, scale, _ptr(_status()))
        k_all, v_all = torch.cat(ks), torch.cat(vs)
        L = p0 + T
        assert torch.equal(k_cache[:L], k_all) and torch.equal(v_cache[:L], v_all)
        assert torch.isnan(k_cache[L:]).all() and torch.isnan(v_cache[L:]).all()
        ref = _attention_ref(q, k_all, v_all, p0, scale)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        if p0 == 0:   # prefill equals plain causal SDPA with repeat_interleave of kv heads
            rep = Hq // Hkv
            sdpa = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.repeat_interleave(rep, dim=1).transpose(0, 1),
                v.repeat_interleave(rep, dim=1).transpose(0, 1), is_causal=True, scale=scale)
            torch.testing.assert_close(out, sdpa.transpose(0, 1), atol=2e-5, rtol=1e-4)
        p0 += T


def test_attention_long_context(lib):
    """Parallel path and large scores (stable softmax)."""
    Hq, Hkv, Dh, max_seq = 9, 3, 64, 600
    k_cache = torch.zeros(max_seq, Hkv, Dh)
    v_cache = torch.zeros(max_seq, Hkv, Dh)
    q = torch.randn(520, Hq, Dh) * 4
    k = torch.randn(520, Hkv, Dh) * 4
    v = torch.randn(520, Hkv, Dh)
    out = torch.empty(520, Hq, Dh)
    sp = torch.tensor([0], dtype=torch.int64)
    lib.yr_attention(_ptr(q), _ptr(k), _ptr(v), _ptr(k_cache), _ptr(v_cache), _ptr(sp), _ptr(out),
                     520, Hq, Hkv, Dh, max_seq, 0.125, _ptr(_status()))
    torch.testing.assert_close(out, _attention_ref(q, k, v, 0, 0.125), atol=2e-5, rtol=1e-4)
    q1, k1, v1 = torch.randn(1, Hq, Dh), torch.randn(1, Hkv, Dh), torch.randn(1, Hkv, Dh)
    out1 = torch.empty(1, Hq, Dh)
    sp = torch.tensor([520], dtype=torch.int64)
    lib.yr_attention(_ptr(q1), _ptr(k1), _ptr(v1), _ptr(k_cache), _ptr(v_cache), _ptr(sp), _ptr(out1),
                     1, Hq, Hkv, Dh, max_seq, 0.125, _ptr(_status()))
    ref = _attention_ref(q1, torch.cat([k, k1]), torch.cat([v, v1]), 520, 0.125)
    torch.testing.assert_close(out1, ref, atol=2e-5, rtol=1e-4)


def test_attention_extreme_scores(lib):
    """Score differences beyond the float exp range: softmax must stay finite and exact."""
    Hq, Hkv, Dh, max_seq, T = 2, 1, 32, 48, 40
    g = torch.Generator().manual_seed(5)
    q = torch.randn(T, Hq, Dh, generator=g) * 30
    k = torch.randn(T, Hkv, Dh, generator=g) * 30
    v = torch.randn(T, Hkv, Dh, generator=g)
    kc, vc = torch.zeros(max_seq, Hkv, Dh), torch.zeros(max_seq, Hkv, Dh)
    out = torch.empty(T, Hq, Dh)
    sp = torch.tensor([0], dtype=torch.int64)
    lib.yr_attention(_ptr(q), _ptr(k), _ptr(v), _ptr(kc), _ptr(vc), _ptr(sp), _ptr(out),
                     T, Hq, Hkv, Dh, max_seq, 1.0, _ptr(_status()))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _attention_ref(q, k, v, 0, 1.0), atol=2e-5, rtol=1e-4)
    # a NaN in one query poisons that query's output only, as in torch
    q[20, 1, 3] = math.nan
    lib.yr_attention(_ptr(q), _ptr(k), _ptr(v), _ptr(kc), _ptr(vc), _ptr(sp), _ptr(out),
                     T, Hq, Hkv, Dh, max_seq, 1.0, _ptr(_status()))
    ref = _attention_ref(q, k, v, 0, 1.0)
    assert torch.isnan(out[20, 1]).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4, equal_nan=True)


def _f16_edge_values() -> torch.Tensor:
    """float32 values around every float16 rounding edge: random bit patterns over the whole
    range, the halfway points between neighbouring halves (ties to even both ways) and one ulp
    either side of them, the overflow edge (65504, 65519.99, 65520), subnormal halves, values
    that round to zero or to the smallest subnormal, signed zeros, infinities and NaN."""
    g = torch.Generator().manual_seed(16)
    bits = torch.randint(-2**31, 2**31 - 1, (60000,), generator=g, dtype=torch.int64).to(torch.int32)
    rand = bits.view(torch.float32)
    halves = torch.arange(0, 0x7c00, 7, dtype=torch.int16).view(torch.float16).float()
    mids = (halves[:-1].double() + halves[1:].double()) / 2    # exact in float32: the ties
    mids = mids.float()
    up, down = torch.nextafter(mids, torch.tensor(math.inf)), torch.nextafter(mids, torch.tensor(-math.inf))
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e5, 6.1e-5, 6.0e-5, 5.96e-8, 2.98e-8,
                            2.9802322e-08, 2.9802326e-08, 1e-9, math.inf, -math.inf, math.nan])
    vals = torch.cat([rand, halves, mids, up, down, special])
    return torch.cat([vals, -vals])


def test_float16_kv_cache_appends_round_as_torch(lib):
    """yr_attention_window_f16kv and yr_attention_rows_f16kv write k, v into float16 caches
    exactly as torch's ``.half()`` rounds them (F16C in the SIMD builds, bit manipulation in the
    scalar one), for every float16 rounding edge and special value."""
    vals = _f16_edge_values()
    n = vals.numel() // 2 * 2
    k, v = vals[:n // 2].reshape(1, 1, -1).contiguous(), vals[n // 2:n].reshape(1, 1, -1).contiguous()
    Dh = k.shape[-1]
    want_k, want_v = k.half().view(torch.int16), v.half().view(torch.int16)
    q, out = torch.zeros(1, 1, Dh), torch.empty(1, 1, Dh)
    kc, vc = torch.zeros(2, 1, Dh, dtype=torch.float16), torch.zeros(2, 1, Dh, dtype=torch.float16)
    sp = torch.tensor([1], dtype=torch.int64)
    lib.yr_attention_window_f16kv(_ptr(q), _ptr(k), _ptr(v), _ptr(kc), _ptr(vc), _ptr(sp), _ptr(out),
                                  1, 1, 1, Dh, 2, 1.0, 0, _ptr(_status()))
    assert torch.equal(kc[1].view(torch.int16), want_k[0]) and torch.equal(vc[1].view(torch.int16), want_v[0])
    assert torch.equal(kc[0], torch.zeros_like(kc[0]))   # only row start_pos written
    kc2, vc2 = torch.zeros(3, 2, 1, Dh, dtype=torch.float16), torch.zeros(3, 2, 1, Dh, dtype=torch.float16)
    slots, pos = torch.tensor([2], dtype=torch.int64), torch.tensor([1], dtype=torch.int64)
    lib.yr_attention_rows_f16kv(_ptr(q), _ptr(k), _ptr(v), _ptr(kc2), _ptr(vc2), _ptr(slots), _ptr(pos), _ptr(out),
                                1, 1, 1, Dh, 3, 2, 1.0, 0, _ptr(_status()))
    assert torch.equal(kc2[2, 1].view(torch.int16), want_k[0]) and torch.equal(vc2[2, 1].view(torch.int16), want_v[0])
    assert int((kc2 != 0).sum()) == int((kc2[2, 1] != 0).sum())   # nothing else written


@pytest.mark.parametrize("Hq,Hkv,Dh", [(6, 2, 16), (9, 3, 64), (2, 1, 7)])
def test_float16_kv_cache_attention_prefill_then_decode(lib, Hq, Hkv, Dh):
    """Attention over float16 caches (prefill in tiles, decode, chunks) equals float64 SDPA over
    the rounded keys and values, and the caches hold k, v rounded as torch rounds them."""
    max_seq, scale = 120, 1.0 / math.sqrt(Dh)
    g = torch.Generator().manual_seed(Hq * 10 + Dh)
    kc = torch.zeros(max_seq, Hkv, Dh, dtype=torch.float16)
    vc = torch.zeros(max_seq, Hkv, Dh, dtype=torch.float16)
    ks, vs, p0 = [], [], 0
    for T in (70, 1, 3, 1):
        q = torch.randn(T, Hq, Dh, generator=g) * 2
        k = torch.randn(T, Hkv, Dh, generator=g) * 2
        v = torch.randn(T, Hkv, Dh, generator=g)
        ks.append(k.half().float())
        vs.append(v.half().float())
        out = torch.full((T, Hq, Dh), float("nan"))
        sp = torch.tensor([p0], dtype=torch.int64)
        lib.yr_attention_window_f16kv(_ptr(q), _ptr(k), _ptr(v), _ptr(kc), _ptr(vc), _ptr(sp), _ptr(out),
                                      T, Hq, Hkv, Dh, max_seq, scale, 0, _ptr(_status()))
        k_all, v_all = torch.cat(ks), torch.cat(vs)
        assert torch.equal(kc[:p0 + T].float(), k_all) and torch.equal(vc[:p0 + T].float(), v_all)
        torch.testing.assert_close(out, _attention_ref(q, k_all, v_all, p0, scale), atol=2e-5, rtol=1e-4)
        p0 += T


def _task_fn(lib, name):
    """A ``yr_task_*`` entry point of ``lib``: fn(int64 args [n], lo, hi)."""
    import ctypes
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64], None
    return fn


@pytest.mark.parametrize("cache", [torch.float32, torch.float16])
@pytest.mark.parametrize("Hq,Hkv,Dh", [(4, 2, 64), (9, 3, 64), (8, 2, 64), (4, 2, 128), (6, 2, 16)])
def test_decode_attention_tasks_every_build(lib, cache, Hq, Hkv, Dh):
    """The flash-decoding task pair (partial over KV splits, then combine) in every build: the
    grouped GQA pass (group_dots / group_weighted, four rows' sums reduced together in the SIMD
    builds) and the per-head loops, splits with key counts that are not multiples of 4, against
    float64 SDPA over the cache."""
    import struct
    suffix = "_f16kv" if cache == torch.float16 else ""
    partial, combine = _task_fn(lib, "yr_task_attention_partial" + suffix), _task_fn(lib, "yr_task_attention_combine")
    g = torch.Generator().manual_seed(Hq + Dh)
    max_seq, p0, splits, scale = 160, 150, 3, 1.0 / math.sqrt(Dh)
    kc, vc = torch.randn(max_seq, Hkv, Dh, generator=g).to(cache), torch.randn(max_seq, Hkv, Dh, generator=g).to(cache)
    q = torch.randn(1, Hq, Dh, generator=g) * 2
    part = torch.full((1, Hq, splits, Dh + 2), float("nan"))
    out = torch.full((1, Hq, Dh), float("nan"))
    sp = torch.tensor([p0], dtype=torch.int64)
    bits = struct.unpack("<I", struct.pack("<f", scale))[0]
    a = torch.tensor([q.data_ptr(), kc.data_ptr(), vc.data_ptr(), sp.data_ptr(), part.data_ptr(), 1, Hq, Hkv, Dh,
                      max_seq, bits, splits, 0], dtype=torch.int64)
    for pair in range(Hkv * splits):
        partial(a.data_ptr(), pair, pair + 1)
    b = torch.tensor([part.data_ptr(), out.data_ptr(), 1, Hq, Dh, splits], dtype=torch.int64)
    combine(b.data_ptr(), 0, Hq)
    ref = _attention_ref(q, kc[:p0 + 1].float(), vc[:p0 + 1].float(), p0, scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# argmax
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("R,D", [(1, 1), (1, 4097), (3, 4097), (64, 2000), (2, 49152)])
def test_argmax(lib, R, D):
    x = torch.randn(R, D)
    # ties: the maximum repeated, the first occurrence wins
    x[0, D // 3] = 100.0
    x[0, D // 2] = 100.0
    x[0, D - 1] = 100.0
    if R > 1:
        x[1] = -5.0                        # all equal -> index 0
        x[R - 1, D - 1] = 1e30             # max at the end
    out = torch.full((R,), -1, dtype=torch.int64)
    lib.yr_argmax(_ptr(x), _ptr(out), R, D)
    assert torch.equal(out, torch.argmax(x, dim=-1))


def test_argmax_special_values(lib):
    x = torch.tensor([[-math.inf, -math.inf, -1e38],
                      [-math.inf, -math.inf, -math.inf],
                      [0.0, -0.0, 0.0],
                      [1.0, math.nan, 2.0],
                      [math.inf, 3.0, math.inf]])
    out = torch.empty(5, dtype=torch.int64)
    lib.yr_argmax(_ptr(x), _ptr(out), 5, 3)
    assert out.tolist() == torch.argmax(x, dim=-1).tolist()
    # rows wide enough for the SIMD loop (whole vectors, then a tail of 5): a NaN in a vector
    # or in the tail, two NaNs, signed zeros, -inf throughout, the maximum only in the tail
    D = 101
    w = torch.randn(8, D)
    w[0, 37] = math.nan
    w[1, 99] = math.nan
    w[2, 70], w[2, 20] = math.nan, math.nan
    w[3] = -0.0
    w[3, 50] = 0.0
    w[4] = -math.inf
    w[5, 100] = 1e30
    w[6, 3], w[6, 90] = math.inf, math.inf
    out = torch.empty(8, dtype=torch.int64)
    lib.yr_argmax(_ptr(w), _ptr(out), 8, D)
    assert out.tolist() == torch.argmax(w, dim=-1).tolist()


# ---------------------------------------------------------------------------------------
# int8-activation GEMV (linear's compute_dtype='int8')
# ---------------------------------------------------------------------------------------

def _int8_case(M: int, N: int, K: int, fmt: str, seed: int):
    """x (with a zero block and a block of large values), the raw weight, its decoded values and a bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[0, :32] = 0.0                     # amax == 0: a zero scale, quants 0
    if K >= 64:
        x[-1, 32:64] *= 1e4
    w = torch.randn(N, K, generator=g) * 0.1 + 0.02
    raw, ref_w = _quantize(w, fmt)
    return x, raw, ref_w, torch.randn(N, generator=g)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("M,N,K", [(1, 37, 64), (1, 1536, 576), (3, 576, 1536), (2, 9, 32)])
def test_linear_int8_activations_match_the_quantized_reference(lib_vnni, fmt, M, N, K):
    """yr_linear_T_q8 computes x quantized per block of 32 (ir.ops.quantize_blocks_int8) times
    the decoded weight, on every build (VNNI, AVX-VNNI, AVX2 vpmaddubsw / int16, scalar); it
    differs from the float32 product by the quantization error, which the reference has too."""
    from yirage.ir.ops import quantize_blocks_int8
    x, raw, ref_w, bias = _int8_case(M, N, K, fmt, M * 31 + N + K)
    xq = quantize_blocks_int8(x)
    for b in (None, bias):
        y = torch.full((M, N), float("nan"))
        getattr(lib_vnni, f"yr_linear_{fmt}_q8")(_ptr(x), _ptr(raw), _ptr(b), _ptr(y), M, N, K)
        _assert_linear_close(y, xq, ref_w, b)
    exact = F.linear(x.double(), ref_w.double(), bias.double())
    assert (y.double() - exact).abs().max() > 10 * (F.linear(xq.double(), ref_w.double(), bias.double())
                                                    - y.double()).abs().max()   # x was quantized


def _task(lib, name: str):
    """The task entry point ``name`` (``void fn(const int64_t* args, int64_t lo, int64_t hi)``)."""
    import ctypes
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64], None
    return fn


def _quantized_rows(lib, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] quantized by yr_task_quantize_rows_q8 (the int8 linear tasks' input), its blocks
    in three uneven slices and one past the end (clipped): the buffer, checked against
    ir.ops.quantize_blocks_int8 (the values) and against the whole range in one task (the bytes)."""
    import ctypes
    from yirage.ir.ops import quantize_blocks_int8
    M, K = x.shape
    n = torch.ones(1, dtype=torch.int64)
    for bad in ((M, K + 1), (0, K), (M, -32)):   # sizes it cannot hold: 0 bytes
        lib.yr_quantized_rows_bytes(*bad, _ptr(n))
        assert n[0] == 0
    lib.yr_quantized_rows_bytes(M, K, _ptr(n))
    buf, whole = torch.zeros(int(n[0]), dtype=torch.uint8), torch.zeros(int(n[0]), dtype=torch.uint8)
    fn = _task(lib, "yr_task_quantize_rows_q8")
    blocks = M * K // 32
    for t, cuts in ((buf, (0, 1, blocks // 2, blocks, blocks + 7)), (whole, (0, blocks))):
        args = (ctypes.c_int64 * 4)(_ptr(x), _ptr(t), M, K)
        for lo, hi in zip(cuts, cuts[1:]):
            fn(args, lo, hi)
    assert torch.equal(buf, whole)
    xq = buf[:M * K].view(torch.int8).float().view(M, -1, 32)
    at = -(-M * K // 64) * 64
    dx = buf[at:at + 4 * blocks].view(torch.float32).view(M, -1, 1)
    torch.testing.assert_close(xq * dx, quantize_blocks_int8(x).view(M, -1, 32), rtol=0, atol=0)
    return buf


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_linear_int8_task_writes_its_rows_only(lib_vnni, fmt):
    """yr_task_linear_T_q8 over row slices, on x quantized by yr_task_quantize_rows_q8, equals the
    launch, and writes nothing outside [lo, hi), whatever slice its argument block says comes
    next."""
    import ctypes
    M, N, K = 2, 41, 96
    x, raw, ref_w, bias = _int8_case(M, N, K, fmt, 5)
    full = torch.empty(M, N)
    getattr(lib_vnni, f"yr_linear_{fmt}_q8")(_ptr(x), _ptr(raw), _ptr(bias), _ptr(full), M, N, K)
    fn = _task(lib_vnni, f"yr_task_linear_{fmt}_q8")
    xq = _quantized_rows(lib_vnni, x)
    for stride in (0, 16, 40, 2**62):   # the next slice's rows only steer prefetches (clipped to N)
        y = torch.full((M, N), float("nan"))
        args = (ctypes.c_int64 * 8)(_ptr(xq), _ptr(raw), _ptr(bias), _ptr(y), M, N, K, stride)
        fn(args, 8, 24)
        assert torch.equal(y[:, 8:24], full[:, 8:24])
        assert y[:, :8].isnan().all() and y[:, 24:].isnan().all()
        fn(args, 0, 8)
        fn(args, 24, N)
        assert torch.equal(y, full)


# ---------------------------------------------------------------------------------------
# q4_1 / q8_0 rows in groups of 16 (kernels/cpu/row_groups.h, DTypes q4_1r16 / q8_0r16)
# ---------------------------------------------------------------------------------------

RG_LAYOUT = {"q4_1": "q4_1r16", "q8_0": "q8_0r16"}


def _row_groups_case(M: int, N: int, K: int, fmt: str, seed: int):
    """_int8_case with the weight also repacked (ir.ops.to_row_groups)."""
    from yirage.dtypes import DType
    from yirage.ir.ops import to_row_groups
    x, raw, ref_w, bias = _int8_case(M, N, K, fmt, seed)
    return x, to_row_groups(raw, DType(fmt)), ref_w, bias


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("M,N,K", [(1, 48, 96), (1, 1536, 576), (3, 32, 64), (8, 48, 32), (9, 16, 96),
                                   (16, 64, 96), (17, 48, 64), (40, 80, 96)])
def test_row_groups_linear_matches_the_reference(lib, fmt, M, N, K):
    """yr_linear_<layout> (float32 x: the group GEMV up to 16 rows, the packed GEMM beyond) equals
    x @ W^T of the decoded weight (gguf-py) within float32 rounding, on every build; its int8 form
    (yr_linear_<layout>_q8) equals the product of x quantized per block of 32, as the plain
    format's does."""
    from yirage.ir.ops import quantize_blocks_int8
    t = RG_LAYOUT[fmt]
    x, rg, ref_w, bias = _row_groups_case(M, N, K, fmt, M * 7 + N + K)
    for b in (None, bias):
        y = torch.full((M, N), float("nan"))
        getattr(lib, f"yr_linear_{t}")(_ptr(x), _ptr(rg), _ptr(b), _ptr(y), M, N, K)
        _assert_linear_close(y, x, ref_w, b)
        y = torch.full((M, N), float("nan"))
        getattr(lib, f"yr_linear_{t}_q8")(_ptr(x), _ptr(rg), _ptr(b), _ptr(y), M, N, K)
        _assert_linear_close(y, quantize_blocks_int8(x), ref_w, b)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("suffix", ["", "_q8"])
def test_row_groups_task_writes_its_groups_only(lib, fmt, suffix):
    """yr_task_linear_<layout>[_q8] over slices of whole groups (the int8 form on x quantized by
    yr_task_quantize_rows_q8) equals the launch and writes nothing outside [lo, hi); a slice
    that ends inside a group, or runs past N, computes only the whole groups it holds inside N."""
    import ctypes
    M, N, K = 2, 64, 96
    t = RG_LAYOUT[fmt]
    x, rg, _, bias = _row_groups_case(M, N, K, fmt, 11)
    full = torch.empty(M, N)
    getattr(lib, f"yr_linear_{t}{suffix}")(_ptr(x), _ptr(rg), _ptr(bias), _ptr(full), M, N, K)
    fn = _task(lib, f"yr_task_linear_{t}{suffix}")
    xin = _quantized_rows(lib, x) if suffix else x
    y = torch.full((M, N), float("nan"))
    args = (ctypes.c_int64 * 8)(_ptr(xin), _ptr(rg), _ptr(bias), _ptr(y), M, N, K, 0)
    fn(args, 16, 40)   # the group 16..31 only
    assert torch.equal(y[:, 16:32], full[:, 16:32])
    assert y[:, :16].isnan().all() and y[:, 32:].isnan().all()
    fn(args, 48, 1 << 40)   # clipped to N
    fn(args, 0, 16)
    fn(args, 32, 48)
    assert torch.equal(y, full)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_row_groups_dequant_repack_and_layout(lib, fmt):
    """yr_dequant_<layout> decodes whole groups to gguf-py's values; to_row_groups /
    from_row_groups are inverse; ir.ops.dequantize reads the layout as the blocks it came from;
    the C++ repack equals to_row_groups on whole groups and leaves a partial one."""
    from yirage.dtypes import DType
    from yirage.ir.ops import dequantize, from_row_groups
    N, K = 48, 96
    t = RG_LAYOUT[fmt]
    _, rg, ref_w, _ = _row_groups_case(1, N, K, fmt, 3)
    out = torch.full((N, K), float("nan"))
    getattr(lib, f"yr_dequant_{t}")(_ptr(rg), _ptr(out), N * K // 32 - 5, K // 32)   # 2 whole groups and a part
    assert torch.equal(out[:32], ref_w[:32]) and out[32:].isnan().all()
    raw = from_row_groups(rg, DType(fmt))
    assert torch.equal(torch.from_numpy(quants.dequantize(raw.numpy(), QUANT[fmt])), ref_w)
    assert torch.equal(dequantize(rg, DType(t), (N, K)), ref_w)
    assert not torch.equal(rg, raw)
    out = torch.zeros(N + 5, raw.shape[1], dtype=torch.uint8)
    src = torch.cat([raw, raw[:5]])
    getattr(lib, f"yr_repack_{t}")(_ptr(src), _ptr(out), N + 5, K // 32)
    assert torch.equal(out[:N], rg) and not out[N:].any()


def test_q8_0_row_groups_embedding(lib):
    """yr_embedding_q8_0r16 and its task form give the table's rows (gguf-py's values); an id
    outside the table gives zeros and is reported, by the launch and by the task that holds it."""
    import ctypes
    V, D = 48, 64
    _, rg, ref_w, _ = _row_groups_case(1, V, D, "q8_0", 9)
    ids = torch.tensor([0, 47, 17, 17, 31, 5])
    out, status = torch.full((6, D), float("nan")), _status()
    lib.yr_embedding_q8_0r16(_ptr(ids), _ptr(rg), _ptr(out), 6, D, V, _ptr(status))
    assert torch.equal(out, ref_w[ids]) and status[0] == 0
    fn = lib.yr_task_embedding_q8_0r16
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64], None
    bad = torch.tensor([3, 48, 9])
    out, status = torch.full((3, D), float("nan")), _status()
    args = (ctypes.c_int64 * 8)(_ptr(bad), _ptr(rg), _ptr(out), 3, D, V, _ptr(status), 0)
    fn(args, 0, 1)
    fn(args, 1, 3)
    assert torch.equal(out[0], ref_w[3]) and torch.equal(out[2], ref_w[9]) and not out[1].any()
    assert status.tolist() == [1, 48, 0, 48]
