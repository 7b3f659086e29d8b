"""GGUF block formats read in place (issue 8): Q4_0, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL, IQ4_XS.

The kernels (src/yirage/kernels/cpu/ggml_quants.h) run in three builds of library.cpp, as in
tests/codegen/test_cpp_library.py: native (AVX-512 here), AVX2 (-mno-avx512f) and baseline
x86-64 (scalar). References: gguf-py's ``gguf.quants.dequantize`` (bitwise, for dequantization
and embedding rows) and float64 products (linear layers). Blocks are random valid bytes with
finite fp16 scales (the gguf package cannot quantize to K-quants or IQ types). Then the Python side: the
CPU backend's binders (plan and persistent-kernel tasks) and the GGUF loader (in place, no copy;
unsupported types and broken files refused with one clear ModelLoadError).
"""
from __future__ import annotations

import ctypes
import math
import string
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import cross  # tests/cross: the aarch64 builds of the lib fixtures
import yirage as yr
from yirage.backends.cpu.native import GGML_FORMATS, library
from yirage.dtypes import DType
from yirage.errors import ModelLoadError
from yirage.ir.ops import dequantize

Q = gguf.GGMLQuantizationType
QTYPE = {f: Q[f.upper()] for f in GGML_FORMATS}
GEMM_MIN_M = 6      # library.cpp: packed GEMM from this many x rows


# ---------------------------------------------------------------------------------------
# Builds of the library (as tests/codegen/test_cpp_library.py)
# ---------------------------------------------------------------------------------------

# The ``lib`` fixture (native, AVX2 and scalar builds of the library) is in tests/conftest.py.


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------

def random_blocks(fmt: str, n: int, seed: int = 0) -> np.ndarray:
    """n valid blocks of ``fmt`` as uint8 [n, bytes]: random quant and sub-block scale bytes,
    fp16 scales (d, m, dmin) finite: random normals * 0.01, the first min(16, n // 2) subnormal."""
    rng = np.random.default_rng(seed)
    per, nbytes = DType(fmt).block
    raw = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    for off in DType(fmt).scale_offsets:
        half = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint16)
        k = min(16, n // 2)
        half[:k] = rng.integers(0, 0x400, k, dtype=np.uint16) | (rng.integers(0, 2, k, dtype=np.uint16) << 15)
        raw[:, off:off + 2] = half.view(np.uint8).reshape(n, 2)
    return raw


def reference(fmt: str, raw: np.ndarray) -> np.ndarray:
    """gguf-py's dequantization of the blocks (float32, one row per block)."""
    return gguf.quants.dequantize(raw, QTYPE[fmt]).astype(np.float32)


def weight(fmt: str, N: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw blocks uint8 [N, K / per * bytes], reference float32 [N, K])."""
    per, nbytes = DType(fmt).block
    raw = random_blocks(fmt, N * K // per, seed)
    return (torch.from_numpy(raw.reshape(N, K // per * nbytes).copy()),
            torch.from_numpy(reference(fmt, raw).reshape(N, K).copy()))


def _ptr(t: torch.Tensor | None):
    """``t.data_ptr()`` as an int that keeps ``t`` alive and names it (``cross.ptr``): a temporary
    passed straight to a kernel lives through the call, and the aarch64 builds can ship it."""
    if t is None:
        return None
    assert t.is_contiguous()
    return cross.ptr(t)


def _status() -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int64)


def assert_linear_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    """y equals x @ w.T (+ bias) computed in float64, within a float32 tolerance that grows with
    sqrt(K) times the magnitude sum_k |x_k w_k| (float32 accumulation in any order)."""
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    mag = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    tol = 2e-7 * math.sqrt(x.shape[-1]) * mag + 1e-30
    err = (y.double() - ref).abs()
    assert not torch.isnan(y).any()
    assert bool((err <= tol).all()), f"max error {float(err.max())}, its tolerance {float(tol.flatten()[err.argmax()])}"


def _task_args(*values) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*[0 if v is None else int(v) for v in values])


def _task_fn(lib, name):
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64], None
    return fn


# ---------------------------------------------------------------------------------------
# Dequantization, bit for bit
# ---------------------------------------------------------------------------------------

def test_dtypes():
    for fmt in GGML_FORMATS:
        per, nbytes = DType(fmt).block
        assert (per, nbytes) == gguf.GGML_QUANT_SIZES[QTYPE[fmt]]
        assert getattr(yr, fmt) is DType(fmt) and DType(fmt).is_quantized
        assert DType(fmt).storage_shape((3, 2 * per)) == (3, 2 * nbytes)
    with pytest.raises(ValueError):
        DType.q4_k.storage_shape((2, 32))


@pytest.mark.parametrize("fmt", GGML_FORMATS)
def test_dequant_bitwise(lib, fmt):
    per, _ = DType(fmt).block
    n = 2048
    raw = random_blocks(fmt, n, seed=len(fmt))
    out = np.full(n * per, np.nan, dtype=np.float32)
    getattr(lib, f"yr_dequant_{fmt}")(raw.ctypes.data, out.ctypes.data, n)
    ref = reference(fmt, raw).reshape(-1)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0", "q5_1"])
def test_dequant_of_gguf_quantized_values(lib, fmt):
    """Blocks made by gguf.quants.quantize (the types it can quantize), constant rows included."""
    w = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    w[0] = 0.0
    w[1] = 0.75
    raw = np.ascontiguousarray(gguf.quants.quantize(w, QTYPE[fmt]))
    out = np.empty(w.size, dtype=np.float32)
    getattr(lib, f"yr_dequant_{fmt}")(raw.ctypes.data, out.ctypes.data, w.size // 32)
    assert np.array_equal(out.view(np.uint32), reference(fmt, raw).reshape(-1).view(np.uint32))


def test_ir_reference_dequantize():
    for fmt in GGML_FORMATS:
        raw, ref = weight(fmt, 3, DType(fmt).block[0] * 2, seed=5)
        got = dequantize(raw, DType(fmt), (3, ref.shape[1]))
        assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("fmt", ["iq4_nl", "iq4_xs"])
def test_iq4_every_nibble_and_scale(lib, fmt):
    """IQ4_NL / IQ4_XS: every nibble value in every quant position (low and high nibble of every
    byte), and for IQ4_XS every 6-bit sub-block scale 0..63 in every sub-block (the scales_h /
    scales_l bit fields), with fp16 d of both signs, subnormal, zero and large; bitwise vs gguf."""
    per, nbytes = DType(fmt).block
    qoff = 2 if fmt == "iq4_nl" else 8
    ds = np.array([1.0, -0.5, 0.0, -0.0, 6e-8, -3e-5, 1000.0, 0.0123], dtype=np.float16)
    blocks = []
    for s in range(64):                       # IQ4_XS: scale s in sub-block i, (s + 7 i) % 64 elsewhere
        for k, d in enumerate(ds):
            b = np.zeros(nbytes, dtype=np.uint8)
            b[0:2] = np.array([d]).view(np.uint8)
            nib = (np.arange(nbytes - qoff) + s + k) % 16
            b[qoff:] = nib | (((nib + 5 + s) % 16) << 4)
            if fmt == "iq4_xs":
                ls = [(s + 7 * i) % 64 for i in range(8)]
                b[2:4] = np.array([sum((v >> 4) << (2 * i) for i, v in enumerate(ls))], dtype=np.uint16).view(np.uint8)
                b[4:8] = [(ls[2 * j] & 15) | ((ls[2 * j + 1] & 15) << 4) for j in range(4)]
            blocks.append(b)
        if fmt == "iq4_nl" and s == 15:
            break
    raw = np.ascontiguousarray(np.stack(blocks))
    out = np.full(len(raw) * per, np.nan, dtype=np.float32)
    getattr(lib, f"yr_dequant_{fmt}")(raw.ctypes.data, out.ctypes.data, len(raw))
    ref = reference(fmt, raw).reshape(-1)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
    # the table itself: block 0 (d = 1; IQ4_XS sub-block 0 has scale 0: dl = -32) holds each
    # value of kvalues_iq4nl in its first 32 weights
    kv = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)
    assert set(ref[:32].tolist()) == set((kv * (1.0 if fmt == "iq4_nl" else -32.0)).tolist())


# ---------------------------------------------------------------------------------------
# Linear layers: GEMV (M < 6, blocks read in registers) and packed GEMM (M >= 6)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", GGML_FORMATS)
@pytest.mark.parametrize("M", [1, 2, 3, GEMM_MIN_M, 9])
def test_linear(lib, fmt, M):
    per = DType(fmt).block[0]
    for N, nblocks in ((13, 3), (37, 1), (8, 2)):     # N not a multiple of the 4/8-row groups
        K = per * nblocks
        raw, w = weight(fmt, N, K, seed=M * 100 + N)
        g = torch.Generator().manual_seed(N + M)
        x = torch.randn(M, K, generator=g)
        bias = torch.randn(N, generator=g) if N % 2 else None
        y = torch.full((M, N), float("nan"))
        getattr(lib, f"yr_linear_{fmt}")(_ptr(x), _ptr(raw), _ptr(bias), _ptr(y), M, N, K)
        assert_linear_close(y, x, w, bias)


@pytest.mark.parametrize("fmt", ["q2_k", "q3_k"])
@pytest.mark.parametrize("fill", [0x00, 0xFF])
def test_linear_extreme_blocks(lib, fmt, fill):
    """The integer GEMV (x split into int8 parts, int32 sums per lane) at its extremes: every
    quant and sub-block scale byte ``fill`` (q3_k 0x00: scale -32 and q -4 everywhere, the
    largest |weight|), x all equal (every product of a sum of one sign), and x small but for one
    large element per block (the splits' remainders at their largest)."""
    per, nbytes = DType(fmt).block
    N, K = 11, 3 * per
    raw = np.full((N * K // per, nbytes), fill, dtype=np.uint8)
    for off in DType(fmt).scale_offsets:
        raw[:, off:off + 2] = np.full((len(raw), 1), 0.01, dtype=np.float16).view(np.uint8)
    w = torch.from_numpy(reference(fmt, raw).reshape(N, K).copy())
    raw = torch.from_numpy(raw.reshape(N, K // per * nbytes).copy())
    spiky = torch.randn(2, K, generator=torch.Generator().manual_seed(fill)) * 1e-3
    spiky[:, ::per] = torch.tensor([[100.0], [-100.0]])
    for x in (torch.full((1, K), 3.0), torch.full((1, K), -3.0), spiky):
        y = torch.full((len(x), N), float("nan"))
        getattr(lib, f"yr_linear_{fmt}")(_ptr(x), _ptr(raw), None, _ptr(y), len(x), N, K)
        assert_linear_close(y, x, w, None)


@pytest.mark.parametrize("fmt", ["q2_k", "q3_k"])
def test_linear_int_gemv_x_at_half_steps(lib, fmt):
    """The integer GEMV's split of x into int8 parts where every element sits half a step of the
    first part from a grid point (x = +-0.5 with max|x| = 127: the first part's scale is 1): the
    remainder is exactly half a step, the worst case of the second part's range. The parts must
    still carry x to float32's precision (with 256 steps per part the second part needed 128 and
    saturated at 127, losing 0.002 per element)."""
    per = DType(fmt).block[0]
    N, K = 9, 2 * per
    raw, w = weight(fmt, N, K, seed=5)
    x = torch.full((1, K), 0.5)
    x[0, 1::2] = -0.5
    x[0, ::per] = 127.0
    y = torch.full((1, N), float("nan"))
    getattr(lib, f"yr_linear_{fmt}")(_ptr(x), _ptr(raw), None, _ptr(y), 1, N, K)
    assert_linear_close(y, x, w, None)


@pytest.fixture(scope="module")
def lib_no_vbmi():
    """The native build without AVX512-VBMI: the K-quants' integer GEMV of AVX512-VNNI CPUs
    without VBMI (ggml_quants.h gemv_rows_int; with VBMI, gemv_rows_q2k/q3k run instead)."""
    from yirage.backends.cpu.native import bind_signatures
    from yirage.runtime.toolchain import cxx_flags, load_kernel_library

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx512_vnni" not in flags or " avx512vbmi" not in flags:
        pytest.skip("needs a CPU with AVX512-VNNI and VBMI (the build without VBMI must differ from native)")
    cxx = tuple(f for f in cxx_flags() if not f.startswith("-march")) + ("-march=native", "-mno-avx512vbmi")
    return bind_signatures(load_kernel_library("library", cxx))


@pytest.mark.parametrize("fmt", ["q2_k", "q3_k"])
def test_linear_int_gemv_without_vbmi(lib_no_vbmi, fmt):
    for M, N, K in ((1, 37, 768), (2, 13, 512)):
        raw, w = weight(fmt, N, K, seed=N)
        x, bias = torch.randn(M, K, generator=torch.Generator().manual_seed(N)), torch.randn(N)
        y = torch.full((M, N), float("nan"))
        getattr(lib_no_vbmi, f"yr_linear_{fmt}")(_ptr(x), _ptr(raw), _ptr(bias), _ptr(y), M, N, K)
        assert_linear_close(y, x, w, bias)
    test_linear_int_gemv_x_at_half_steps(lib_no_vbmi, fmt)   # its own split of x (gemv_rows_int)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_0", "q2_k", "q3_k", "iq4_nl", "iq4_xs"])
@pytest.mark.parametrize("M,N,K", [(1, 1030, 2048), (2, 640, 1024), (33, 70, 512)])
def test_linear_model_shapes(fmt, M, N, K):
    """Larger shapes (the parallel paths) on the native build; K a multiple of 256."""
    raw, w = weight(fmt, N, K, seed=K)
    x, bias = torch.randn(M, K), torch.randn(N)
    y = torch.full((M, N), float("nan"))
    getattr(library(), f"yr_linear_{fmt}")(_ptr(x), _ptr(raw), _ptr(bias), _ptr(y), M, N, K)
    assert_linear_close(y, x, w, bias)


@pytest.mark.parametrize("fmt", GGML_FORMATS)
def test_task_linear_over_a_row_range(lib, fmt):
    """yr_task_linear_T computes the weight rows [lo, hi) of y and nothing else."""
    per = DType(fmt).block[0]
    M, N, K = 2, 21, 2 * per
    raw, w = weight(fmt, N, K, seed=3)
    x, bias = torch.randn(M, K), torch.randn(N)
    y = torch.full((M, N), float("nan"))
    lo, hi = 5, 19
    _task_fn(lib, f"yr_task_linear_{fmt}")(_task_args(_ptr(x), _ptr(raw), _ptr(bias), _ptr(y), M, N, K, 0), lo, hi)
    assert torch.isnan(y[:, :lo]).all() and torch.isnan(y[:, hi:]).all()
    assert_linear_close(y[:, lo:hi].contiguous(), x, w[lo:hi], bias[lo:hi])


# ---------------------------------------------------------------------------------------
# Embedding rows
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", GGML_FORMATS)
def test_embedding_bitwise_and_bad_ids(lib, fmt):
    per = DType(fmt).block[0]
    V, D = 23, 2 * per
    raw, table = weight(fmt, V, D, seed=7)
    ids = torch.tensor([0, V - 1, 3, 3, 17], dtype=torch.int64)
    out, st = torch.full((5, D), float("nan")), _status()
    getattr(lib, f"yr_embedding_{fmt}")(_ptr(ids), _ptr(raw), _ptr(out), 5, D, V, _ptr(st))
    assert st.tolist() == [0, 0, 0, 0]
    assert torch.equal(out.view(torch.int32), table[ids].view(torch.int32))
    # an id outside [0, V): reported in status, its row zero, the others still right
    bad = torch.tensor([2, V, 4], dtype=torch.int64)
    out, st = torch.full((3, D), 7.0), _status()
    getattr(lib, f"yr_embedding_{fmt}")(_ptr(bad), _ptr(raw), _ptr(out), 3, D, V, _ptr(st))
    assert st.tolist() == [1, V, 0, V]
    assert not out[1].any() and torch.equal(out[[0, 2]], table[[2, 4]])
    # the persistent kernel's task: tokens [lo, hi)
    out, st = torch.full((3, D), 7.0), _status()
    _task_fn(lib, f"yr_task_embedding_{fmt}")(_task_args(_ptr(bad), _ptr(raw), _ptr(out), 3, D, V, _ptr(st), 0), 1, 3)
    assert st.tolist() == [1, V, 0, V]
    assert torch.equal(out[0], torch.full((D,), 7.0)) and not out[1].any() and torch.equal(out[2], table[4])


# ---------------------------------------------------------------------------------------
# The CPU backend: launch plan and persistent-kernel tasks
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", GGML_FORMATS)
def test_cpu_backend_linear_and_embedding(fmt):
    """A graph with a linear layer and an embedding on fmt weights, on the CPU backend (its
    library kernels) and on the reference interpreter (gguf dequantization)."""
    per = DType(fmt).block[0]
    N, K, V = 19, 2 * per, 11
    raw_w, w = weight(fmt, N, K, seed=11)
    raw_t, table = weight(fmt, V, K, seed=12)
    g = yr.new_kernel_graph()
    x, wt, ids, tt = g.new_input((2, K)), g.new_input((N, K), DType(fmt)), g.new_input((3,), yr.int64), \
        g.new_input((V, K), DType(fmt))
    g.mark_output(g.linear(x, wt))
    g.mark_output(g.embedding(ids, tt))
    xs, idx = torch.randn(2, K), torch.tensor([4, 0, 10])
    out = g(inputs=[xs, raw_w, idx, raw_t], backend="cpu")
    ref = g.interpret([xs, raw_w, idx, raw_t])
    assert_linear_close(out[0], xs, w, None)
    torch.testing.assert_close(out[0], ref[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(out[1], table[idx]) and torch.equal(ref[1], table[idx])


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_0", "q2_k", "iq4_nl", "iq4_xs"])
def test_persistent_kernel_tasks(fmt):
    """The task forms (yr_task_linear_T over row slices, yr_task_embedding_T) on 2 workers."""
    from yirage.runtime.task_graph import TaskGraphPlan, get_pool

    per = DType(fmt).block[0]
    N, K, V = 1030, 2 * per, 50
    raw_w, w = weight(fmt, N, K, seed=13)
    raw_t, table = weight(fmt, V, K, seed=14)
    g = yr.new_kernel_graph()
    ids, tt, wt = g.new_input((1,), yr.int64), g.new_input((V, K), DType(fmt)), g.new_input((N, K), DType(fmt))
    h = g.embedding(ids, tt)
    g.mark_output(h)
    g.mark_output(g.linear(h, wt))
    inputs = [torch.tensor([7]), raw_t, raw_w]
    plan = TaskGraphPlan(g.compile("cpu"), inputs, get_pool(2, adaptive=False))
    assert plan.segments == 1          # every op ran as tasks (no launch fallback)
    out = plan.run()
    assert torch.equal(out[0], table[[7]])
    assert_linear_close(out[1], table[[7]], w, None)


# ---------------------------------------------------------------------------------------
# GGUF loading: in place, no copy; clear errors
# ---------------------------------------------------------------------------------------

_NAMES = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
          "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "output.weight",
          "blk.1.attn_q.weight", "blk.1.attn_k.weight", "blk.1.attn_v.weight", "blk.1.attn_output.weight"]


def _blocks_of(fmt: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, cols / per * bytes] of fmt: quantized by gguf where it can, else random valid."""
    if fmt in ("q4_0", "q5_0", "q5_1"):
        w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(w, QTYPE[fmt]))
    per, nbytes = DType(fmt).block
    return random_blocks(fmt, rows * cols // per, seed).reshape(rows, cols // per * nbytes)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _read(path: Path):
    """(reader, {HF name: Weight}) as _load_gguf reads them: layout and types checked first."""
    from yirage.models import gguf_file

    reader = gguf_file._open_gguf(path)
    table, _ = gguf_file._gguf_table(reader, path)
    by_name = {t.name: t for t in reader.tensors}
    return reader, {name: gguf_file._gguf_tensor(by_name[info.name]) for name, info in table.items()}


def test_gguf_tensors_load_in_place(tmp_path):
    assert len(_NAMES) >= len(GGML_FORMATS)
    tensors = {name: (_blocks_of(fmt, 3, 512, seed=i), QTYPE[fmt]) for i, (name, fmt) in
               enumerate(zip(_NAMES, GGML_FORMATS))}
    reader, weights = _read(_write(tmp_path / "m.gguf", tensors))
    lo = reader.data.ctypes.data
    hi = lo + reader.data.nbytes
    assert len(weights) == len(GGML_FORMATS)
    for (name, (data, qtype)), w in zip(tensors.items(), weights.values()):
        fmt = qtype.name.lower()
        assert w.dtype == DType(fmt) and w.shape == (3, 512)
        assert w.data.dtype == torch.uint8 and tuple(w.data.shape) == DType(fmt).storage_shape((3, 512))
        assert lo <= w.data.data_ptr() and w.data.data_ptr() + w.data.numel() <= hi   # over the file: no copy
        assert np.array_equal(w.data.numpy(), data)
        got = dequantize(w.data, w.dtype, w.shape)
        assert torch.equal(got, torch.from_numpy(reference(fmt, data).reshape(3, 512)))


def test_gguf_unsupported_type_is_one_clear_error(tmp_path):
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS]
    tensors = {"blk.0.attn_q.weight": (_blocks_of("q4_k", 2, 256, 0), Q.Q4_K),
               "blk.0.ffn_up.weight": (np.zeros((2, 256 // block * size), dtype=np.uint8), Q.IQ2_XXS)}
    path = _write(tmp_path / "m.gguf", tensors)
    with pytest.raises(ModelLoadError) as info:
        _read(path)
    msg = str(info.value)
    assert "blk.0.ffn_up.weight has type IQ2_XXS, which yirage does not support" in msg
    assert ("supported types: F32, F16, BF16, Q8_0, Q4_1, Q4_0, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, "
            "IQ4_NL, IQ4_XS") in msg


def test_gguf_truncated_data_is_refused(tmp_path):
    path = _write(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (_blocks_of("q6_k", 4, 512, 0), Q.Q6_K)})
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match="not a valid or complete GGUF file"):
        _read(path)


def test_gguf_rows_not_whole_blocks_are_refused(tmp_path):
    """A Q4_K tensor whose declared rows (384 values) are not a whole number of 256-blocks."""
    path = _write(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (_blocks_of("q4_k", 3, 256, 0), Q.Q4_K)})
    reader = gguf.GGUFReader(str(path), "r+")
    dims = reader.tensors[0].field.parts[3]
    dims[0], dims[1] = 384, 2
    reader.data.flush()
    del reader
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight \(Q4_K, shape \(2, 384\)\) has rows of 384 "
                                             r"values, not a whole number of Q4_K blocks of 256"):
        _read(path)


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0", "q2_k", "q3_k", "q6_k", "iq4_nl", "iq4_xs"])
def test_nonfinite_check_reads_the_scales(fmt):
    """Finite scales with quant bytes that look like fp16 inf/NaN must not be refused."""
    from yirage.models.checks import _nonfinite
    from yirage.models.loaded_model import Weight

    per, nbytes = DType(fmt).block
    raw = random_blocks(fmt, 64, seed=1)
    scales = set(DType(fmt).scale_offsets) | {o + 1 for o in DType(fmt).scale_offsets}
    for off in range(nbytes):
        if off not in scales:
            raw[:, off] = 0xFF                     # every other byte: an fp16 NaN pattern
    w = Weight(torch.from_numpy(raw.reshape(8, -1).copy()), DType(fmt), (8, 8 * per))
    assert _nonfinite(w) is None
    bad = raw.copy()
    bad[3, DType(fmt).scale_offsets[0] + 1] = 0x7C  # one scale = inf
    bad[3, DType(fmt).scale_offsets[0]] = 0x00
    assert _nonfinite(Weight(torch.from_numpy(bad.reshape(8, -1).copy()), DType(fmt), (8, 8 * per))) is not None


def _tiny_llama(path: Path) -> Path:
    """A 2-layer Llama (hidden 256, so that K-quant rows are whole blocks) whose embedding and
    projections cycle through the formats; F32 norms; a 64-token byte-level tokenizer."""
    V_, H, F_, heads, kv = 64, 256, 512, 4, 2
    tokens = (["<|endoftext|>"] + list(string.ascii_letters) + ["ab", "cd"] + [f"x{i}" for i in range(V_)])[:V_]
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 2, "context_length": 128, "embedding_length": H, "feed_forward_length": F_,
                       "attention.head_count": heads, "attention.head_count_kv": kv, "vocab_size": V_,
                       "rope.dimension_count": H // heads}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3] + [1] * (V_ - 1))
    writer.add_array("tokenizer.ggml.merges", ["a b", "c d"])
    for key, value in {"bos": 1, "eos": 2, "unknown": 0}.items():
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    fmts = iter(list(GGML_FORMATS) * 3)

    def mat(rows, cols):
        fmt = next(fmts)
        return _blocks_of(fmt, rows, cols, seed=rows * cols), QTYPE[fmt]

    ones = (np.ones(H, np.float32), Q.F32)
    tensors = {"token_embd.weight": mat(V_, H)}
    for i in range(2):
        tensors.update({f"blk.{i}.attn_norm.weight": ones, f"blk.{i}.attn_q.weight": mat(H, H),
                        f"blk.{i}.attn_k.weight": mat(kv * H // heads, H), f"blk.{i}.attn_v.weight": mat(kv * H // heads, H),
                        f"blk.{i}.attn_output.weight": mat(H, H), f"blk.{i}.ffn_norm.weight": ones,
                        f"blk.{i}.ffn_gate.weight": mat(F_, H), f"blk.{i}.ffn_up.weight": mat(F_, H),
                        f"blk.{i}.ffn_down.weight": mat(H, F_)})
    tensors["output_norm.weight"] = ones
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_llama_loads_in_place_and_generates(tmp_path):
    """load_model keeps every format as stored (the non-finite check reads each format's scales,
    not its quant bytes); plan and persistent kernel decode alike. The default cache keeps the
    compiled kernels (the file is the same every run: one tokenizer entry)."""
    from yirage.models.loading import load_model

    path = _tiny_llama(tmp_path / "tiny.gguf")
    loaded = load_model(str(path))
    kinds = {w.dtype for w in loaded.weights.values()}
    assert set(map(DType, GGML_FORMATS)) <= kinds and kinds <= set(map(DType, GGML_FORMATS)) | {DType.float32}
    assert loaded.weights["model.layers.0.self_attn.q_proj.weight"].dtype == DType(GGML_FORMATS[1])
    tokens = [yr.LLM(str(path), backend="cpu", max_seq_length=64,
                     persistent=persistent).generate("abcd", max_new_tokens=6, chat=False).token_ids
              for persistent in (False, True)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6
