"""WebGPU kernels for encoder attention and stacked linears (backends/webgpu/encoder.py, the WGSL
of kernels/webgpu/attention_varlen.wgsl and offsets_check.wgsl): attention_varlen,
attention_bidir, sdpa and linear_stack, float32.

Every conformance case of these ops runs on webgpu and must PASS (the float32 ones bound to
these kernels, the others still run as torch references); attention_varlen's bad offsets
raise IndexOutOfRangeError as the reference's do; odd sentence lengths agree with the reference;
and all-MiniLM-L6-v2 embeds four sentences on webgpu as it does on the CPU backend.

The backend's ``supports`` / ``bind_library_op`` are patched here to consult ``encoder.OPS``
first (the ``kernels`` fixture), which records the ops bound to these kernels. Without wgpu or
a WebGPU adapter the module is skipped."""
import pytest
from webgpu_kernels import bound_ops
import torch

import yirage as yr
from yirage.backends import get_backend_info

if not yr.is_backend_available("webgpu"):
    pytest.skip(f"webgpu unavailable: {get_backend_info('webgpu').reason}", allow_module_level=True)

from yirage.backends.webgpu import encoder as E  # noqa: E402
from yirage.tools.conformance import CASES, run_case  # noqa: E402

OPS = ("attention_varlen", "attention_bidir", "sdpa", "linear_stack")


@pytest.fixture
def kernels(monkeypatch):
    """The ops the webgpu backend bound to this module's kernels (the backend consults them itself)."""
    monkeypatch.setenv("YIRAGE_TUNE", "off")
    return bound_ops(monkeypatch, E.OPS)


_CASES = [c for c in CASES if c.op in OPS]


def test_every_op_has_cases():
    assert {c.op for c in _CASES} == set(OPS)


@pytest.mark.parametrize("case", _CASES, ids=[f"{c.op}:{c.name}" for c in _CASES])
def test_conformance(case, kernels):
    result = run_case(case, "webgpu")
    assert result.status == "PASS", result.message
    if "float16" not in case.name:   # bfloat16 / float16 cases keep their host references
        assert case.op in kernels
    else:
        assert case.op not in kernels


# ---- attention_varlen ------------------------------------------------------------------------------
def _varlen_graph(T, B, H, Dh):
    g = yr.new_kernel_graph()
    g.mark_output(g.attention_varlen(g.new_input((T, 3 * H * Dh)), g.new_input((B + 1,), yr.int64), H))
    return g


@pytest.mark.parametrize("lengths,pad,H,Dh", [([1, 7, 65], 3, 2, 16), ([65, 1], 0, 3, 72), ([7], 0, 1, 8)])
def test_attention_varlen_odd_lengths(lengths, pad, H, Dh, kernels):
    T = sum(lengths) + pad
    g = _varlen_graph(T, len(lengths), H, Dh)
    qkv = torch.randn(T, 3 * H * Dh)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    (got,) = g(inputs=[qkv, offsets], backend="webgpu")
    (want,) = g.interpret([qkv, offsets])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    if pad:
        assert torch.equal(got[-pad:], torch.zeros(pad, H * Dh))
    assert kernels == ["attention_varlen"]


@pytest.mark.parametrize("offsets,value,lo", [([1, 3, 5], 1, 0), ([0, 4, 3], 3, 4), ([0, 2, 6], 6, 2),
                                              ([0, -1, 5], -1, 0), ([0, 2**40, 5], 2**40, 0)])
def test_attention_varlen_bad_offsets_raise(offsets, value, lo, kernels):
    T = 5
    g = _varlen_graph(T, 2, 2, 8)
    qkv = torch.randn(T, 48)
    message = rf"attention_varlen: .* {value} is out of range \[{lo}, {T + 1}\)"
    with pytest.raises(yr.IndexOutOfRangeError, match=message):
        g(inputs=[qkv, torch.tensor(offsets)], backend="webgpu")
    with pytest.raises(yr.IndexOutOfRangeError, match=message):   # the reference says the same
        g.interpret([qkv, torch.tensor(offsets)])
    (got,) = g(inputs=[qkv, torch.tensor([0, 2, 5])], backend="webgpu")   # the plan recovers
    torch.testing.assert_close(got, g.interpret([qkv, torch.tensor([0, 2, 5])])[0], atol=1e-5, rtol=1e-4)
    assert set(kernels) == {"attention_varlen"}


# ---- an embedding model ----------------------------------------------------------------------------
def test_minilm_embeddings_match_cpu(kernels):
    sentences = ["hello", "The quick brown fox jumps over the lazy dog.",
                 "A somewhat longer sentence, with commas, to give the encoder a few dozen tokens to attend over.",
                 "日本語の文です。"]
    want = yr.EmbeddingModel("all-minilm-l6-v2", backend="cpu").encode(sentences)
    got = yr.EmbeddingModel("all-minilm-l6-v2", backend="webgpu").encode(sentences)
    want, got = torch.as_tensor(want), torch.as_tensor(got)
    assert got.shape == want.shape
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=1)
    assert bool((cos >= 0.99999).all()), cos.tolist()
    assert "attention_varlen" in kernels


# ---- sdpa and attention_bidir beyond the conformance cases ---------------------------------------
@pytest.mark.parametrize("B,H,Hk,S,T,D,Dv,mask_shape,causal,scale", [
    (1, 2, 1, 9, 5, 80, 24, None, True, None),          # S > T causal, q.k over 80 (two per thread), Dv != D
    (2, 3, 3, 4, 70, 8, 130, (1, 3, 1, 70), False, 0.2),  # keys past one tile, Dv past two tiles of threads
    (1, 4, 2, 6, 6, 16, 16, (1, 1, 6, 6), True, None),
])
def test_sdpa_shapes(B, H, Hk, S, T, D, Dv, mask_shape, causal, scale, kernels):
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((B, H, S, D)), g.new_input((B, Hk, T, D)), g.new_input((B, Hk, T, Dv))
    m = g.new_input(mask_shape) if mask_shape else None
    g.mark_output(g.sdpa(q, k, v, m, causal=causal, scale=scale))
    inputs = [torch.randn(B, H, S, D), torch.randn(B, Hk, T, D), torch.randn(B, Hk, T, Dv)]
    inputs += [torch.randn(mask_shape)] if mask_shape else []
    (got,) = g(inputs=inputs, backend="webgpu")
    (want,) = g.interpret(inputs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert kernels == ["sdpa"]


def test_sdpa_fully_masked_row_and_minus_inf_drops_keys(kernels):
    B, H, S, T, D = 1, 1, 3, 4, 8
    g = yr.new_kernel_graph()
    g.mark_output(g.sdpa(g.new_input((B, H, S, D)), g.new_input((B, H, T, D)), g.new_input((B, H, T, D)),
                         g.new_input((1, 1, S, T))))
    mask = torch.zeros(1, 1, S, T)
    mask[0, 0, 0, :] = float("-inf")    # row 0 keeps no key: as torch (zeros in torch 2.13)
    mask[0, 0, 1, 1:] = float("-inf")   # row 1 keeps key 0 only
    inputs = [torch.randn(B, H, S, D), torch.randn(B, H, T, D), torch.randn(B, H, T, D), mask]
    (got,) = g(inputs=inputs, backend="webgpu")
    (want,) = g.interpret(inputs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(got[0, 0, 1], inputs[2][0, 0, 0])
    assert kernels == ["sdpa"]


def test_unsupported_dtypes_keep_their_references():
    g = yr.new_kernel_graph()
    out = g.attention_varlen(g.new_input((4, 48), yr.bfloat16), g.new_input((2,), yr.int64), 2)
    g.mark_output(out)
    (node,) = [n for n in g.ops if n.op == "attention_varlen"]
    assert not E.supports_attention_varlen(node, g)
    g32 = _varlen_graph(4, 1, 2, 8)
    (node32,) = [n for n in g32.ops if n.op == "attention_varlen"]
    assert E.supports_attention_varlen(node32, g32)


def test_sdpa_mask_of_the_lowest_float(kernels):
    """HF models mask with torch.finfo(float32).min: a row masked that way everywhere is uniform."""
    g = yr.new_kernel_graph()
    g.mark_output(g.sdpa(g.new_input((1, 2, 3, 8)), g.new_input((1, 2, 5, 8)), g.new_input((1, 2, 5, 8)),
                         g.new_input((1, 1, 3, 5))))
    mask = torch.zeros(1, 1, 3, 5)
    mask[..., 0, :] = torch.finfo(torch.float32).min
    mask[..., 1, 2:] = torch.finfo(torch.float32).min
    inputs = [torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), mask]
    (got,) = g(inputs=inputs, backend="webgpu")
    torch.testing.assert_close(got, g.interpret(inputs)[0], atol=1e-5, rtol=1e-4)
    assert kernels == ["sdpa"]


def test_attention_bidir_fully_masked_row_is_nan(kernels):
    B, S, H, Dh = 2, 4, 2, 8
    g = yr.new_kernel_graph()
    g.mark_output(g.attention_bidir(g.new_input((B, S, 3 * H * Dh)), g.new_input((B, S)), H))
    mask = torch.zeros(B, S)
    mask[1, :] = float("-inf")   # batch 1 keeps no key: NaN rows, as the reference's softmax
    mask[0, 2:] = float("-inf")
    inputs = [torch.randn(B, S, 3 * H * Dh), mask]
    (got,) = g(inputs=inputs, backend="webgpu")
    (want,) = g.interpret(inputs)
    assert torch.isnan(want[1]).all()
    bits = got[1].view(torch.int32) & 0x7FFFFFFF
    assert bool((bits > 0x7F800000).all())   # NaN, by its bits
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)
    assert kernels == ["attention_bidir"]


# ---- kernels bound directly, at nonzero offsets, out sharing the inputs' buffer --------------------
def test_attention_varlen_bound_at_offsets_in_one_buffer():
    from yirage.runtime import webgpu as wg

    H, Dh, lengths = 2, 8, [3, 4]
    T = sum(lengths)
    qkv = torch.randn(T, 3 * H * Dh)
    offsets = torch.tensor([0, 3, 7])
    g = _varlen_graph(T, 2, H, Dh)
    (node,) = [n for n in g.ops if n.op == "attention_varlen"]
    arena = wg.DeviceTensor.empty((5 + qkv.numel() + 3 + T * H * Dh,), torch.float32)
    x = arena[5:5 + qkv.numel()].view(T, 3 * H * Dh)
    out = arena[8 + qkv.numel():].view(T, H * Dh)
    x.upload(qkv)
    off_buf = wg.DeviceTensor.empty((7,), torch.int64)
    off = off_buf[3:6]
    off.upload(offsets)
    status = wg.DeviceTensor.empty((4,), torch.int64)
    E.bind_attention_varlen(node, g, [x, off], out, status)()
    want = g.interpret([qkv, offsets])[0]
    torch.testing.assert_close(out.to_host(), want, atol=1e-5, rtol=1e-4)
    assert torch.equal(status.to_host(), torch.zeros(4, dtype=torch.int64))
