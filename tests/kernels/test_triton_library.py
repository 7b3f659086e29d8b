"""The Triton library kernels against independent torch references.

"cpu" runs the kernels in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when there is no GPU); "cuda" runs them compiled on a GPU. References are always computed on
the CPU in float32 (GGUF weights decoded by the gguf package).
"""

import gguf
import numpy as np
import pytest
import torch

from yirage.ir.ops import attention_reference, rope_reference, rope_rows_reference

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
QTYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def quantize(w: torch.Tensor, qtype: str):
    """(uint8 blocks [N, K//32*bytes], float32 dequantized [N, K]) via the gguf package."""
    blocks = gguf.quants.quantize(w.numpy(), QTYPES[qtype])
    deq = gguf.quants.dequantize(blocks, QTYPES[qtype])
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(np.ascontiguousarray(deq)).float()


def close(got, ref, dtype):
    torch.testing.assert_close(got.cpu().float(), ref.float(), **TOL[dtype])


def new_status(device):
    """The bounds-check status the executor passes: int64 (4,), zero on entry."""
    return torch.zeros(4, dtype=torch.int64, device=device)


#: start_pos values outside [0, hi) for a valid range [0, hi): negative, exactly the limit,
#: limit + 1, huge (int32 overflow in offsets), 2**62 and int64's minimum.
def bad_starts(hi):
    return [-1, hi, hi + 1, 10**9, 2**62, -2**63]


# ---------------------------------------------------------------- linear

@pytest.mark.parametrize("M", [1, 7, 33])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_float(K, device, M, dtype, bias):
    g = gen(M)
    N, Kd = 33, 96
    x = torch.randn(M, Kd, generator=g).to(dtype)
    w = torch.randn(N, Kd, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    out = torch.empty(M, N, dtype=dtype, device=device)
    K.linear(x.to(device), w.to(device), b.to(device) if bias else None, out, "float")
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    close(out, ref, dtype)


@pytest.mark.parametrize("M", [1, 7, 33])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_linear_quantized(K, device, M, qtype):
    g = gen(10 + M)
    N, Kd = 33, 1024 if M == 33 else 4096
    x = torch.randn(2, M, Kd, generator=g)[1]         # a [M, K] slice, contiguous
    blocks, w = quantize(torch.randn(N, Kd, generator=g), qtype)
    b = torch.randn(N, generator=g) if M != 7 else None
    out = torch.empty(M, N, device=device)
    K.linear(x.to(device), blocks.to(device), b.to(device) if b is not None else None, out, qtype)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_quantized_half_activations(K, device, dtype):
    """A quantized weight with fp16/bf16 x: decoded weights rounded to x's dtype (as the IR ref)."""
    g = gen(3)
    blocks, w = quantize(torch.randn(17, 64, generator=g), "q4_1")
    for M in (2, 20):
        x = torch.randn(3, M, 64, generator=g).to(dtype)  # [..., K] input
        out = torch.empty(3, M, 17, dtype=dtype, device=device)
        K.linear(x.to(device), blocks.to(device), None, out, "q4_1")
        close(out, x.float() @ w.to(dtype).float().T, dtype)


@pytest.mark.parametrize("wtype", ["float", "q8_0", "q4_1"])
@pytest.mark.parametrize("M", [3, 130])
def test_linear_many_tiles(K, device, wtype, M):
    """Several programs along N (GEMV) and along M and N (GEMM, grouped tile order)."""
    g = gen(20 + M)
    N, Kd = 200, 96
    x = torch.randn(M, Kd, generator=g)
    w = torch.randn(N, Kd, generator=g)
    blocks = w
    if wtype != "float":
        blocks, w = quantize(w, wtype)
    out = torch.empty(M, N, device=device)
    K.linear(x.to(device), blocks.to(device), None, out, wtype)
    torch.testing.assert_close(out.cpu().double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-4)


def test_linear_large_k(K, device):
    g = gen(4)
    x = torch.randn(9, 4096, generator=g)
    w = torch.randn(33, 4096, generator=g)
    out = torch.empty(9, 33, device=device)
    K.linear(x.to(device), w.to(device), None, out, "float")
    torch.testing.assert_close(out.cpu().double(), x.double() @ w.double().T, atol=2e-4, rtol=1e-4)


def test_linear_errors(K):
    x, w, out = torch.zeros(2, 64), torch.zeros(3, 64), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unsupported"):
        K.linear(x, w, None, out, "q5_k")
    with pytest.raises(ValueError, match="dtype"):
        K.linear(x, w.half(), None, out, "float")
    with pytest.raises(ValueError, match="uint8"):
        K.linear(x, w, None, out, "q8_0")
    with pytest.raises(ValueError, match=r"\[N, 68\]"):
        K.linear(x, torch.zeros(3, 40, dtype=torch.uint8), None, out, "q8_0")
    with pytest.raises(ValueError, match="divisible"):
        K.linear(torch.zeros(2, 40), torch.zeros(3, 40, dtype=torch.uint8), None, out, "q4_1")
    with pytest.raises(ValueError, match="bias"):
        K.linear(x, w, torch.zeros(4), out, "float")
    with pytest.raises(ValueError, match="out"):
        K.linear(x, w, None, torch.zeros(2, 4), "float")


# ---------------------------------------------------------------- matmul

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shapes", [((7, 33), (33, 5)), ((2, 1, 4, 8), (3, 8, 1)), ((1, 1), (1, 4097)),
                                    ((3, 2, 5, 4, 6), (2, 1, 6, 3)), ((70, 40), (2, 40, 19)),
                                    ((2, 130, 50), (50, 150))])
def test_matmul(K, device, dtype, shapes):
    g = gen(sum(shapes[0]))
    a = torch.randn(*shapes[0], generator=g).to(dtype)
    b = torch.randn(*shapes[1], generator=g).to(dtype)
    ref = torch.matmul(a.float(), b.float())
    out = torch.empty(ref.shape, dtype=dtype, device=device)
    K.matmul(a.to(device), b.to(device), out)
    close(out, ref, dtype)


def test_matmul_errors(K):
    with pytest.raises(ValueError, match="inner"):
        K.matmul(torch.zeros(2, 3), torch.zeros(4, 5), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="broadcast"):
        K.matmul(torch.zeros(2, 2, 3), torch.zeros(3, 3, 5), torch.zeros(2, 2, 5))
    with pytest.raises(ValueError, match="dtype"):
        K.matmul(torch.zeros(2, 3), torch.zeros(3, 5).half(), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="out"):
        K.matmul(torch.zeros(2, 3), torch.zeros(3, 5), torch.zeros(5, 2))


# ---------------------------------------------------------------- embedding

@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("table_type", ["float", "bf16", "q8_0", "q4_1"])
def test_embedding(K, device, ids_dtype, table_type):
    g = gen(5)
    V, D = 37, 96
    rows = torch.randn(V, D, generator=g)
    if table_type in QTYPES:
        table, ref_table = quantize(rows, table_type)
        kind = table_type
    else:
        table = rows.to(torch.bfloat16) if table_type == "bf16" else rows
        ref_table, kind = table, "float"
    ids = torch.tensor([[0, 36, 5], [5, 17, 2]], dtype=ids_dtype)
    out = torch.empty(2, 3, D, dtype=ref_table.dtype, device=device)
    status = new_status(device)
    K.embedding(ids.to(device), table.to(device), out, kind, status=status)
    assert torch.equal(out.cpu(), ref_table[ids.long()])
    assert status.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("table_type", ["float", "q4_1"])
def test_embedding_wide_rows(K, device, table_type):
    """Rows wider than one program's 1024 columns (a second, partly masked program per token)."""
    g = gen(9)
    rows = torch.randn(6, 1056, generator=g)
    table, ref_table = quantize(rows, table_type) if table_type in QTYPES else (rows, rows)
    ids = torch.tensor([5, 0, 5], dtype=torch.int64)
    out = torch.empty(3, 1056, device=device)
    K.embedding(ids.to(device), table.to(device), out, table_type)
    assert torch.equal(out.cpu(), ref_table[ids])


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("table_type", ["float", "q8_0"])
def test_embedding_out_of_range(K, device, ids_dtype, table_type):
    """A bad id gives a zero row (no table read), reports [1, id, 0, V]; good rows are exact."""
    g = gen(11)
    V, D = 9, 64
    rows = torch.randn(V, D, generator=g)
    table, ref_table = quantize(rows, table_type) if table_type in QTYPES else (rows, rows)
    table = table.to(device)
    huge = 2**62 if ids_dtype == torch.int64 else -2**31
    for bad in [-1, V, V + 1, 10**9, huge]:
        ids = torch.tensor([4, bad, 0, V - 1], dtype=ids_dtype)
        expect = torch.zeros(4, D)
        expect[[0, 2, 3]] = ref_table[[4, 0, V - 1]]
        for status in (new_status(device), None):
            out = torch.full((4, D), 7.0, device=device)
            K.embedding(ids.to(device), table, out, table_type, status=status)
            assert torch.equal(out.cpu(), expect)
            if status is not None:
                assert status.tolist() == [1, bad, 0, V]
    # several bad ids among good ones: one of them is reported
    bads = [-5, V, 10**9, -2**31]
    ids = torch.tensor([1, bads[0], 2, bads[1], bads[2], 3, bads[3]], dtype=ids_dtype)
    status = new_status(device)
    out = torch.full((7, D), 7.0, device=device)
    K.embedding(ids.to(device), table, out, table_type, status=status)
    expect = torch.zeros(7, D)
    expect[[0, 2, 5]] = ref_table[[1, 2, 3]]
    assert torch.equal(out.cpu(), expect)
    st = status.tolist()
    assert st[0] == 1 and st[1] in bads and st[2:] == [0, V]
    # a status already flagged (an earlier op's violation) is kept as it is
    K.embedding(torch.tensor([V + 3], dtype=ids_dtype, device=device), table, out[:1], table_type, status=status)
    assert status.tolist() == st


def test_embedding_errors(K):
    with pytest.raises(ValueError, match="int32 or int64"):
        K.embedding(torch.zeros(3), torch.zeros(4, 8), torch.zeros(3, 8), "float")
    with pytest.raises(ValueError, match="out"):
        K.embedding(torch.zeros(3, dtype=torch.long), torch.zeros(4, 68, dtype=torch.uint8), torch.zeros(3, 68),
                    "q8_0")
    ids, tab, out = torch.zeros(3, dtype=torch.long), torch.zeros(4, 8), torch.zeros(3, 8)
    for bad in (torch.zeros(4, dtype=torch.int32), torch.zeros(3, dtype=torch.long), torch.zeros(4, 2).long()[:, 0]):
        with pytest.raises(ValueError, match="status"):
            K.embedding(ids, tab, out, "float", status=bad)


# ---------------------------------------------------------------- rope

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("start", [0, 11])
def test_rope(K, device, dtype, start):
    g = gen(6 + start)
    T, H, Dh, S = 5, 3, 24, 20
    ang = torch.rand(S, Dh // 2, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    x = torch.randn(T, H, Dh, generator=g).to(dtype)
    ref = rope_reference(x.float(), cos, sin, start)
    pos = torch.tensor([start], device=device)
    xd, cd, sd = x.to(device), cos.to(device), sin.to(device)
    out = torch.empty_like(xd)
    status = new_status(device)
    K.rope(xd, cd, sd, pos, out, status=status)
    close(out, ref, dtype)
    assert status.tolist() == [0, 0, 0, 0]
    K.rope(xd, cd, sd, pos, xd)                        # out aliasing x
    assert torch.equal(xd, out)


@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_rows(K, device, dtype):
    """A position per row (rows of several sequences, repeats, the table's last row), against
    ``rope_rows_reference``; in place too."""
    g = gen(7)
    T, H, Dh, S = 6, 3, 24, 20
    ang = torch.rand(S, Dh // 2, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    x = torch.randn(T, H, Dh, generator=g).to(dtype)
    pos = torch.tensor([3, 0, 19, 3, 7, 8])
    ref = rope_rows_reference(x.float(), cos, sin, pos)
    xd, cd, sd, pd = x.to(device), cos.to(device), sin.to(device), pos.to(device)
    out, status = torch.empty_like(xd), new_status(device)
    K.rope_rows(xd, cd, sd, pd, out, status=status)
    close(out, ref, dtype)
    assert status.tolist() == [0, 0, 0, 0]
    K.rope_rows(xd, cd, sd, pd, xd)
    assert torch.equal(xd, out)


def test_rope_rows_out_of_range(K, device):
    """A row whose position is outside [0, S): that row neither read nor written, the others
    rotated, the status [1, position, 0, S]."""
    g = gen(8)
    T, H, Dh, S = 4, 2, 8, 10
    ang = torch.rand(S, Dh // 2, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    x = torch.randn(T, H, Dh, generator=g)
    for bad in (S, -1):
        pos = torch.tensor([1, bad, 9, 0])
        out, status = torch.full((T, H, Dh), 7.0, device=device), new_status(device)
        K.rope_rows(x.to(device), cos.to(device), sin.to(device), pos.to(device), out, status=status)
        assert status.tolist() == [1, bad, 0, S]
        assert torch.equal(out[1].cpu(), torch.full((H, Dh), 7.0))
        good = [0, 2, 3]
        ref = rope_rows_reference(x[good], cos, sin, pos[good])
        torch.testing.assert_close(out.cpu()[good], ref, atol=1e-5, rtol=1e-5)


def test_rope_out_of_range(K, device):
    """start_pos outside [0, S - T]: nothing read or written (out keeps its contents, an
    in-place x is unchanged), status [1, start_pos, 0, S - T + 1]; S - T itself is fine."""
    g = gen(12)
    T, H, Dh, S = 5, 3, 8, 12
    ang = torch.rand(S, Dh // 2, generator=g) * 6
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    x = torch.randn(T, H, Dh, generator=g)
    xd = x.to(device)
    for start in bad_starts(S - T + 1):
        for status in (new_status(device), None):
            out = torch.full_like(xd, 7.0)
            K.rope(xd, cos, sin, torch.tensor([start], device=device), out, status=status)
            assert torch.equal(out.cpu(), torch.full_like(x, 7.0))
            if status is not None:
                assert status.tolist() == [1, start, 0, S - T + 1]
    xi = xd.clone()
    status = new_status(device)
    K.rope(xi, cos, sin, torch.tensor([S - T + 1], device=device), xi, status=status)  # in place
    assert torch.equal(xi.cpu(), x) and status.tolist() == [1, S - T + 1, 0, S - T + 1]
    # more tokens than table rows: no start is valid (the range [0, S - T + 1) is empty)
    status = new_status(device)
    K.rope(xd, cos[:3], sin[:3], torch.tensor([0], device=device), xi, status=status)
    assert torch.equal(xi.cpu(), x) and status.tolist() == [1, 0, 0, 3 - T + 1]
    # the last valid start
    status = new_status(device)
    out = torch.empty_like(xd)
    K.rope(xd, cos, sin, torch.tensor([S - T], device=device), out, status=status)
    close(out, rope_reference(x, cos.cpu(), sin.cpu(), S - T), torch.float32)
    assert status.tolist() == [0, 0, 0, 0]


def test_rope_errors(K):
    x, tab, pos = torch.zeros(2, 3, 8), torch.zeros(4, 4), torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="even"):
        K.rope(torch.zeros(2, 3, 7), tab, tab, pos, torch.zeros(2, 3, 7))
    with pytest.raises(ValueError, match="start_pos"):
        K.rope(x, tab, tab, torch.zeros(1, dtype=torch.int32), x)
    with pytest.raises(ValueError, match="cos"):
        K.rope(x, torch.zeros(4, 3), tab, pos, x)
    with pytest.raises(ValueError, match="status"):
        K.rope(x, tab, tab, pos, x, status=torch.zeros(4, 1, dtype=torch.long))


# ---------------------------------------------------------------- attention

def _attention_steps(K, device, dtype, hq, hkv, dh, max_seq, steps, workspace_chunk=None, prefill_cache=0,
                     status=False):
    """Run ``steps`` (token counts) through the kernel and the reference on cloned caches
    (with ``status``: passing a bounds-check status, which must stay zero)."""
    g = gen(7 + dh + max_seq)
    kc = torch.zeros(max_seq, hkv, dh).to(dtype)
    vc = torch.zeros(max_seq, hkv, dh).to(dtype)
    if prefill_cache:  # cache rows written by earlier steps, filled directly
        kc[:prefill_cache] = torch.randn(prefill_cache, hkv, dh, generator=g).to(dtype)
        vc[:prefill_cache] = torch.randn(prefill_cache, hkv, dh, generator=g).to(dtype)
    ref_kc, ref_vc = kc.float(), vc.float()
    kc_d, vc_d = kc.to(device), vc.to(device)
    ws = None
    pos = prefill_cache
    for T in steps:
        q = torch.randn(T, hq, dh, generator=g).to(dtype)
        k = torch.randn(T, hkv, dh, generator=g).to(dtype)
        v = torch.randn(T, hkv, dh, generator=g).to(dtype)
        scale = dh ** -0.5
        ref = attention_reference(q.float(), k.float(), v.float(), ref_kc, ref_vc, pos, scale)
        if T == 1 and ws is None and workspace_chunk is not None:
            ws = K.attention_workspace(q.to(device), kc_d, chunk=workspace_chunk)
        out = torch.empty(T, hq, dh, dtype=dtype, device=device)
        st = new_status(device) if status else None
        K.attention(q.to(device), k.to(device), v.to(device), kc_d, vc_d,
                    torch.tensor([pos], device=device), out, scale, ws, status=st)
        close(out, ref, dtype)
        assert st is None or st.tolist() == [0, 0, 0, 0]
        assert torch.equal(kc_d.cpu().float(), ref_kc) and torch.equal(vc_d.cpu().float(), ref_vc)
        pos += T


@pytest.mark.parametrize("dtype", FLOATS)
def test_attention_prefill_then_decode(K, device, dtype):
    _attention_steps(K, device, dtype, hq=4, hkv=2, dh=16, max_seq=32, steps=[7, 1, 1], workspace_chunk=16,
                     status=True)


def test_attention_long_cache_decode(K, device):
    """Dh=24 (not a power of two), 300 cached keys: several flash-decoding chunks."""
    ws_default = K.attention_workspace(torch.zeros(1, 6, 24), torch.zeros(320, 2, 24))
    assert ws_default.num_chunks >= 5
    _attention_steps(K, device, torch.float32, hq=6, hkv=2, dh=24, max_seq=320, steps=[1, 1], prefill_cache=299)
    _attention_steps(K, device, torch.float16, hq=6, hkv=2, dh=24, max_seq=320, steps=[1], prefill_cache=299,
                     workspace_chunk=32)


def test_attention_chunked_prefill(K, device):
    """T > 1 at start_pos > 0, more queries than one tile, MHA and GQA group 3."""
    _attention_steps(K, device, torch.float32, hq=3, hkv=1, dh=24, max_seq=160, steps=[70, 67, 2])
    _attention_steps(K, device, torch.bfloat16, hq=2, hkv=2, dh=32, max_seq=40, steps=[3, 5])


def test_attention_from_empty_cache(K, device):
    """Decode of the very first token (one key), then T=2 and T=1 steps up to a full cache (the
    last ones at the largest valid start_pos, max_seq - T); Dh=8 < the 16-wide tiles."""
    _attention_steps(K, device, torch.float32, hq=2, hkv=1, dh=8, max_seq=8, steps=[1, 1, 2, 1, 2, 1],
                     status=True)


@pytest.mark.parametrize("T", [1, 3])
def test_attention_out_of_range(K, device, T):
    """start_pos outside [0, max_seq - T]: caches, workspace and out untouched, status
    [1, start_pos, 0, max_seq - T + 1]; the same checks, unreported, without a status."""
    g = gen(13 + T)
    hq, hkv, dh, max_seq = 4, 2, 16, 24
    kc = torch.randn(max_seq, hkv, dh, generator=g).to(device)
    vc = torch.randn(max_seq, hkv, dh, generator=g).to(device)
    kc0, vc0 = kc.clone(), vc.clone()
    q, k, v = (torch.randn(T, h, dh, generator=g).to(device) for h in (hq, hkv, hkv))
    ws = K.attention_workspace(q, kc, chunk=16) if T == 1 else None
    if ws is not None:
        for buf in (ws.m, ws.l, ws.acc):
            buf.fill_(3.0)
    hi = max_seq - T + 1
    for start in bad_starts(hi):
        for status in (new_status(device), None):
            out = torch.full((T, hq, dh), 7.0, device=device)
            K.attention(q, k, v, kc, vc, torch.tensor([start], device=device), out, dh ** -0.5, ws, status=status)
            assert torch.equal(out.cpu(), torch.full((T, hq, dh), 7.0))
            assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
            if status is not None:
                assert status.tolist() == [1, start, 0, hi]
    if ws is not None:
        assert all(bool((buf == 3.0).all()) for buf in (ws.m, ws.l, ws.acc))
    # more tokens than cache rows: no start is valid
    if T > 1:
        status = new_status(device)
        K.attention(q, k, v, kc[:2], vc[:2], torch.tensor([0], device=device), out, 1.0, status=status)
        assert status.tolist() == [1, 0, 0, 2 - T + 1] and torch.equal(kc, kc0)
        assert torch.equal(out.cpu(), torch.full((T, hq, dh), 7.0))


def test_attention_errors(K, device):
    torch.set_default_device(device)
    try:
        _attention_errors(K)
    finally:
        torch.set_default_device(None)


def _attention_errors(K):
    q, kv, cache = torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(16, 2, 8)
    pos = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="divisible"):
        K.attention(torch.zeros(1, 3, 8), kv, kv, cache, cache, pos, torch.zeros(1, 3, 8), 1.0)
    with pytest.raises(ValueError, match="caches"):
        K.attention(q, kv, kv, torch.zeros(16, 1, 8), cache, pos, torch.zeros_like(q), 1.0)
    with pytest.raises(ValueError, match="dtype"):
        K.attention(q.half(), kv, kv, cache, cache, pos, torch.zeros_like(q), 1.0)
    ws = K.attention_workspace(torch.zeros(1, 2, 8), cache)
    with pytest.raises(ValueError, match="workspace"):
        K.attention(q, torch.ones_like(kv), kv, cache, cache, pos, torch.zeros_like(q), 1.0, ws)
    assert not cache.any()  # refused before the KV cache was written
    with pytest.raises(ValueError, match="status"):
        K.attention(q, kv, kv, cache, cache, pos, torch.zeros_like(q), 1.0, status=torch.zeros(4))


# ---------------------------------------------------------------- argmax

@pytest.mark.parametrize("dtype", FLOATS)
def test_argmax(K, device, dtype):
    g = gen(8)
    x = torch.randn(6, 4097, generator=g).to(dtype)
    x[1] = 0                                          # all tied: index 0
    x[2, 7] = x[2, 100] = float("nan")                # first NaN wins
    x[2, 3] = float("inf")
    x[3, 4000] = x[3, 4096] = 100                     # tie across tiles: the first
    x[4] = float("-inf")
    x[5, 4096] = float("nan")
    out = torch.empty(6, dtype=torch.int64, device=device)
    K.argmax(x.to(device), out)
    expected = torch.argmax(x.float(), dim=1).tolist()
    assert expected[1:] == [0, 7, 4000, 0, 4096]
    assert out.cpu().tolist() == expected


def test_argmax_small_rows(K, device):
    x = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), float("nan"), 2.0], [-1.0, -2.0, -1.0]])
    out = torch.empty(3, dtype=torch.int64, device=device)
    K.argmax(x.to(device), out)
    assert out.cpu().tolist() == [1, 0, 0]
    with pytest.raises(ValueError, match="int64"):
        K.argmax(x, torch.empty(3, dtype=torch.int32))


# ---------------------------------------------------------------- linear_w8a8

def w8a8_inputs(g, shape, N, bias):
    """x float32 ``shape`` with outliers and an all-zero row, int8 w_t [K, N] (a real per-channel
    quantization of a random weight), float32 w_scale [N], optional bias."""
    from yirage.ir.ops import quantize_rows_int8
    Kd = shape[-1]
    x = torch.randn(*shape, generator=g)
    flat = x.view(-1, Kd)
    flat[0, Kd // 3] = 40.0                            # outliers: one feature dominates its row/group
    flat[-1, Kd - 1] = -75.0
    if flat.shape[0] > 2:
        flat[1] = 0                                    # a zero row: scale 1, output = bias
    wq, ws = quantize_rows_int8(torch.randn(N, Kd, generator=g))
    b = torch.randn(N, generator=g) if bias else None
    return x, wq.t().contiguous(), ws.reshape(-1), b


def run_w8a8(K, device, x, w_t, ws, b, group):
    out = torch.empty(*x.shape[:-1], w_t.shape[1], device=device)
    xd = x.to(device)
    workspace = K.linear_w8a8_workspace(xd, group)
    K.linear_w8a8(xd, w_t.to(device), ws.to(device), b.to(device) if b is not None else None, out, workspace)
    return out.cpu(), workspace


def w8a8_close(got, ref):
    """Equal to float32 rounding: the int8 values, scales and int32 dots are exact; only the
    float32 sum over groups may differ in order."""
    torch.testing.assert_close(got, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("M,Kd,N", [(1, 64, 40), (7, 96, 33), (33, 128, 130), (70, 192, 17), (130, 256, 65)])
@pytest.mark.parametrize("group", [0, 64, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_w8a8(K, device, M, Kd, N, group, bias):
    from yirage.ir.ops import linear_w8a8_reference, quantize_rows_int8
    if group and Kd % group:
        pytest.skip("group must divide K")
    g = gen(100 + M + group)
    x, w_t, ws, b = w8a8_inputs(g, (M, Kd), N, bias)
    out, workspace = run_w8a8(K, device, x, w_t, ws, b, group)
    w8a8_close(out, linear_w8a8_reference(x, w_t, ws, b, group_size=group))
    q, s = quantize_rows_int8(x.reshape(M, -1, group or Kd))  # the quantize kernel is bit-exact
    assert torch.equal(workspace.q.cpu(), q.reshape(M, Kd))
    assert torch.equal(workspace.scale.cpu(), s.reshape(M, -1))


@pytest.mark.parametrize("group", [0, 4, 12, 16, 24, 48, 96])
def test_linear_w8a8_odd_groups(K, device, group):
    """Groups not a power of two (packed/padded small groups, masked chunks of large ones),
    a [..., K] input, and an ungrouped K longer than one quantize block (two-pass)."""
    from yirage.ir.ops import linear_w8a8_reference
    g = gen(200 + group)
    for shape, N in (((2, 5, 96), 9), ((3, 2400), 7)):
        if group and shape[-1] % group:
            continue
        x, w_t, ws, b = w8a8_inputs(g, shape, N, True)
        out, _ = run_w8a8(K, device, x, w_t, ws, b, group)
        assert out.shape == (*shape[:-1], N)
        w8a8_close(out, linear_w8a8_reference(x, w_t, ws, b, group_size=group))


def test_linear_w8a8_rounding(K, device):
    """Ties round half to even (torch.round) and values beyond 127 * s clamp, as the reference."""
    from yirage.ir.ops import linear_w8a8_reference, quantize_rows_int8
    x = torch.zeros(2, 32)
    x[0, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])  # scale exactly 1
    x[1, :4] = torch.tensor([-3.0, 1.0, 0.5, 1e-3])
    w_t = torch.eye(32, dtype=torch.int8)
    ws = torch.ones(32)
    out, workspace = run_w8a8(K, device, x, w_t, ws, None, 0)
    q, s = quantize_rows_int8(x)
    assert workspace.q[0, :8].cpu().tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    assert torch.equal(workspace.q.cpu(), q) and torch.equal(workspace.scale.cpu(), s)
    assert torch.equal(out, linear_w8a8_reference(x, w_t, ws, None))


def test_linear_w8a8_errors(K):
    x, w_t, ws = torch.randn(3, 64), torch.zeros(64, 8, dtype=torch.int8), torch.ones(8)
    out = torch.empty(3, 8)
    with pytest.raises(ValueError, match="group_size"):
        K.linear_w8a8_workspace(x, 48)
    ws_ok = K.linear_w8a8_workspace(x, 16)
    with pytest.raises(ValueError, match="w_t must be int8"):
        K.linear_w8a8(x, w_t.float(), ws, None, out, ws_ok)
    with pytest.raises(ValueError, match="x must be float32"):
        K.linear_w8a8(x.half(), w_t, ws, None, out, ws_ok)
    with pytest.raises(ValueError, match="bias must be float32"):
        K.linear_w8a8(x, w_t, ws, torch.ones(7), out, ws_ok)
    with pytest.raises(ValueError, match="out must hold"):
        K.linear_w8a8(x, w_t, ws, None, torch.empty(3, 9), ws_ok)
    with pytest.raises(ValueError, match="workspace"):
        K.linear_w8a8(x, w_t, ws, None, out, K.linear_w8a8_workspace(torch.randn(4, 64), 16))


@pytest.mark.parametrize("idx32", [True, False])
def test_strided_copy_int32_and_int64_indices(K, device, idx32):
    """A permute (BERT's head split [B, S, H, D] -> [B, H, S, D]) and a strided slice into an
    offset window of the output, with int32 and with int64 index arithmetic, against torch."""
    x = torch.randn(2, 7, 3, 5, device=device)
    out = torch.zeros(2, 3, 7, 5, device=device)
    sizes, src = (2, 3, 7, 5), (105, 5, 15, 1)   # x.permute(0, 2, 1, 3)'s strides
    assert K.fits_int32(sizes, src, (105, 35, 5, 1), 0, 0)
    K.strided_copy(x, out, K.strided_copy_meta(sizes, src, (105, 35, 5, 1), device), 210, 0, 0, idx32)
    torch.testing.assert_close(out, x.permute(0, 2, 1, 3), rtol=0, atol=0)
    window = torch.zeros(40, device=device)   # x[1, 2:6:2, 0, :] into window[7:17]
    K.strided_copy(x, window, K.strided_copy_meta((2, 5), (30, 1), (5, 1), device), 10, 105 + 30, 7, idx32)
    torch.testing.assert_close(window[7:17], x[1, 2:6:2, 0, :].reshape(-1), rtol=0, atol=0)
    assert window[:7].eq(0).all() and window[17:].eq(0).all()
    assert not K.fits_int32((2 ** 16, 2 ** 16), (2 ** 16, 1), (1, 2 ** 16), 0, 0)
