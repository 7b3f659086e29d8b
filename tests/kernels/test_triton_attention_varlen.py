"""The Triton ``attention_varlen`` kernel (kernels/triton/attention_varlen.py) against
``ir.ops.attention_varlen_reference``.

"cpu" runs the kernel in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when there is no GPU); "cuda" runs it compiled on a GPU. References are computed on the CPU
(float32 inside, cast to the input dtype). Shapes are small: the interpreter is slow.
"""
import itertools

import pytest
import torch

import yirage as yr
from yirage.ir.ops import attention_varlen_reference

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def new_status(device):
    """A bounds-check status: int64 (4,), zero on entry."""
    return torch.zeros(4, dtype=torch.int64, device=device)


def offsets_of(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)


def run_case(K, device, lengths, pad, heads, dh, dtype=torch.float32, seed=0, scale=None, check_offsets=True):
    """Run the kernel on random qkv for sentences of ``lengths`` plus ``pad`` padding rows (out
    prefilled with NaN, so every row must be written) and compare with the reference."""
    g = gen(seed)
    T = sum(lengths) + pad
    qkv = torch.randn(T, 3 * heads * dh, generator=g).to(dtype)
    offsets = offsets_of(lengths)
    scale = dh ** -0.5 if scale is None else scale
    out = torch.full((T, heads * dh), float("nan"), dtype=dtype, device=device)
    K.attention_varlen(qkv.to(device), offsets.to(device), out, heads, scale, check_offsets=check_offsets)
    ref = attention_varlen_reference(qkv, offsets, heads, scale)
    torch.testing.assert_close(out.cpu(), ref, **TOL[dtype])
    assert not out[sum(lengths):].cpu().any()  # padding rows: zeros, as the reference
    return out


@pytest.mark.parametrize("lengths,pad,heads,dh", [
    ([5, 5, 3, 1], 3, 4, 8),            # test_embed's case: Dh below the 16-wide tiles
    ([1, 1, 1, 1, 1, 1, 1], 0, 2, 32),  # one-token sentences only, no padding
    ([70, 1, 2, 40], 9, 3, 48),         # Dh = 48 (padded to 64), sentences across tile borders
    ([130], 2, 1, 64),                  # one sentence longer than two 64-row tiles
    ([3, 0, 0, 4, 0], 5, 2, 16),        # empty sentences between and after the others
])
def test_matches_reference(K, device, lengths, pad, heads, dh):
    run_case(K, device, lengths, pad, heads, dh, seed=len(lengths) + pad)


def test_random_lengths(K, device):
    """Many random sentences of 1 to 40 tokens (a few empty), bucket padding, 2 heads."""
    g = gen(7)
    lengths = [int(n) for n in torch.randint(0, 41, (24,), generator=g)]
    lengths[3] = 1
    run_case(K, device, lengths, 11, 2, 32, seed=3)


@pytest.mark.parametrize("dtype", FLOATS)
def test_dtypes(K, device, dtype):
    run_case(K, device, [9, 1, 30, 17], 4, 2, 32, dtype=dtype, seed=5)


def test_scale_and_no_host_check(K, device):
    """Another scale; ``check_offsets=False`` (no host sync) computes the same."""
    run_case(K, device, [6, 12, 1], 3, 2, 16, scale=0.37, check_offsets=False)


def test_no_sentences(K, device):
    """B = 0 (offsets [0]) and B sentences all empty: every row is padding, written as zeros."""
    for offsets in ([0], [0, 0, 0]):
        out = torch.full((5, 32), 7.0, device=device)
        K.attention_varlen(torch.randn(5, 96, device=device), torch.tensor(offsets, device=device), out, 2, 0.25)
        assert not out.cpu().any()
    out = torch.empty(0, 32, device=device)  # T = 0: nothing to do
    K.attention_varlen(torch.empty(0, 96, device=device), torch.tensor([0], device=device), out, 2, 0.25)


#: (offsets, the first bad one's [value, previous offset]) for T = 8
BAD_OFFSETS = [([0, 5, 4, 8], [4, 5]), ([0, 5, 9], [9, 5]), ([1, 5, 8], [1, 0]), ([-1, 5, 8], [-1, 0]),
               ([0, 3, -2, 8], [-2, 3]), ([0, 2**62], [2**62, 0]), ([0, 4, 3, 9], [3, 4])]


@pytest.mark.parametrize("offsets,first", BAD_OFFSETS)
def test_bad_offsets(K, device, offsets, first):
    """Host check: IndexOutOfRangeError (as the reference) and nothing written. Device check
    (``check_offsets=False``): status names the first bad offset, no access outside the buffers."""
    T, H, Dh = 8, 2, 8
    qkv = torch.randn(T, 3 * H * Dh, device=device)
    offs = torch.tensor(offsets, device=device)
    out = torch.full((T, H * Dh), 7.0, device=device)
    with pytest.raises(yr.IndexOutOfRangeError, match="attention_varlen") as err:
        K.attention_varlen(qkv, offs, out, H, 0.5)
    with pytest.raises(yr.IndexOutOfRangeError) as ref_err:
        attention_varlen_reference(qkv.cpu(), offs.cpu(), H, 0.5)
    assert str(err.value) == str(ref_err.value)
    assert bool((out == 7.0).all())
    status = new_status(device)
    K.attention_varlen(qkv, offs, out, H, 0.5, status=status, check_offsets=False)
    assert status.tolist() == [1, *first, T + 1]
    assert bool(torch.isfinite(out).all())
    K.attention_varlen(qkv, offs, out, H, 0.5, check_offsets=False)  # unreported, still in bounds


def test_good_offsets_leave_status_clear(K, device):
    status = new_status(device)
    qkv = torch.randn(6, 24, device=device)
    out = torch.empty(6, 8, device=device)
    K.attention_varlen(qkv, torch.tensor([0, 2, 2, 5], device=device), out, 1, 0.5, status=status,
                       check_offsets=False)
    assert status.tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(out.cpu(), attention_varlen_reference(qkv.cpu(), torch.tensor([0, 2, 2, 5]), 1, 0.5),
                               **TOL[torch.float32])


def test_errors(K):
    qkv, offs, out = torch.zeros(4, 24), torch.tensor([0, 4]), torch.zeros(4, 8)
    cases = [
        (dict(num_heads=3), "qkv must be"),                              # 24 not a multiple of 9
        (dict(num_heads=0), "num_heads"),
        (dict(qkv=torch.zeros(4, 24, dtype=torch.int32)), "float32/float16/bfloat16"),
        (dict(offsets=torch.tensor([0, 4], dtype=torch.int32)), "offsets must be int64"),
        (dict(offsets=torch.zeros(1, 2, dtype=torch.int64)), "offsets must be int64"),
        (dict(out=torch.zeros(4, 9)), "out must be"),
        (dict(out=torch.zeros(4, 8, dtype=torch.float16)), "out must be"),
        (dict(out=torch.zeros(8, 4).T), "contiguous"),
        (dict(qkv=torch.zeros(4, 48)[:, :24]), "contiguous"),
        (dict(scale=float("inf")), "finite"),
        (dict(status=torch.zeros(4)), "status"),
    ]
    for change, match in cases:
        kw = dict(qkv=qkv, offsets=offs, out=out, num_heads=1, scale=0.5)
        kw.update(change)
        with pytest.raises(yr.YirageError, match=match):
            K.attention_varlen(**kw)
    with pytest.raises(yr.YirageError, match="overlap"):
        K.attention_varlen(qkv, offs, qkv.view(-1)[:32].view(4, 8), 1, 0.5)  # out aliases qkv


def test_graph_on_triton_interpret(device):
    """The graph op through the 'triton-interpret' backend now runs this kernel (no fallback to
    the torch reference), with bad offsets raising IndexOutOfRangeError as on the CPU."""
    if device.type != "cpu":
        pytest.skip("the interpreter backend runs on CPU tensors")
    from yirage.backends.triton import backend as tb
    calls = []
    real = tb._lib().attention_varlen

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    H, Dh, lengths = 2, 16, [4, 1, 7]
    T = sum(lengths) + 4
    g = yr.new_kernel_graph()
    Q = g.new_input((T, 3 * H * Dh))
    O = g.new_input((len(lengths) + 1,), dtype=yr.int64)
    g.mark_output(g.attention_varlen(Q, O, H))
    qkv, offsets = torch.randn(T, 3 * H * Dh), offsets_of(lengths)
    lib = tb._lib()
    try:
        lib.attention_varlen = spy
        out = g(inputs=[qkv, offsets], backend="triton-interpret")[0]
        assert calls, "the triton-interpret backend did not call the Triton kernel"
        torch.testing.assert_close(out, attention_varlen_reference(qkv, offsets, H, Dh ** -0.5), **TOL[torch.float32])
        with pytest.raises(yr.IndexOutOfRangeError, match="attention_varlen"):
            g(inputs=[qkv, torch.tensor([0, 4, 3, 12])], backend="triton-interpret")
    finally:
        lib.attention_varlen = real
