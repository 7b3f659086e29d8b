"""Every hand-written kernel library builds for aarch64 (ARMv8.2 with dotprod and fp16; the CPU
library for ARMv8.0 too) and runs there under qemu-user (tests/cross): the build's SIMD path
is NEON, and the conv and strided kernels (whose float16 type once did not build for Arm) give
torch's results in float32 and float16. The CPU library's own cases run on aarch64 through the
``lib`` fixtures (tests/codegen/test_cpp_library.py, tests/kernels/test_ggml_quants.py,
tests/kernels/test_embed_kernels.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cross
from yirage.runtime.toolchain import KERNEL_LIBRARIES, kernel_library_sources

pytestmark = pytest.mark.skipif(cross.unavailable() is not None, reason=str(cross.unavailable()))

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.mark.parametrize("name", sorted(KERNEL_LIBRARIES))
def test_every_kernel_library_builds_for_aarch64(name):
    path = cross.build(kernel_library_sources(name), cross.MAIN_TARGET)
    assert path.read_bytes()[:4] == b"\x7fELF" and path.read_bytes()[18] == 183   # e_machine EM_AARCH64


@pytest.mark.parametrize("target", list(cross.TARGETS))
def test_the_aarch64_library_takes_its_neon_path(target):
    from yirage.backends.cpu.native import SIGNATURES

    lib = cross.CrossLibrary("library", target, SIGNATURES)
    out = torch.zeros(1, dtype=torch.int64)
    lib.yr_simd_bits(cross.ptr(out))
    assert int(out[0]) == 128


@pytest.fixture(scope="module")
def conv():
    from yirage.backends.cpu.conv import SIGNATURES
    return cross.CrossLibrary("conv", cross.MAIN_TARGET, SIGNATURES)


@pytest.fixture(scope="module")
def strided():
    from yirage.backends.cpu.strided import SIGNATURES
    return cross.CrossLibrary("strided", cross.MAIN_TARGET, SIGNATURES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pools_on_aarch64(conv, dtype):
    x = torch.randn(2, 3, 9, 11).to(dtype)
    N, C, H, W = x.shape
    want = F.max_pool2d(x.float(), 3, 2, 1).to(dtype)
    y = torch.full(want.shape, float("nan"), dtype=dtype)
    conv.yr_max_pool2d(cross.ptr(x), cross.ptr(y), N, C, H, W, 3, 3, 2, 2, 1, 1, 1, 1, *want.shape[2:],
                       DTYPE_CODES[dtype])
    assert torch.equal(y, want)   # a max is exact in any type
    want = F.avg_pool2d(x.float(), 3, 2, 1, count_include_pad=True).to(dtype)
    y = torch.full(want.shape, float("nan"), dtype=dtype)
    conv.yr_avg_pool2d(cross.ptr(x), cross.ptr(y), N, C, H, W, 3, 3, 2, 2, 1, 1, *want.shape[2:], 1,
                       DTYPE_CODES[dtype])
    torch.testing.assert_close(y, want, rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_kernels_on_aarch64(strided, dtype):
    x = torch.randn(4, 37, 5).to(dtype)
    out = torch.full_like(x, float("nan"))
    strided.yr_softmax_mid(cross.ptr(x), cross.ptr(out), 4, 37, 5, 0, DTYPE_CODES[dtype])
    torch.testing.assert_close(out, torch.softmax(x.float(), dim=1).to(dtype),
                               rtol=2e-3 if dtype == torch.float16 else 1e-5, atol=1e-6)
    # a permuted copy: x [4, 37, 5] read as its transpose [5, 37, 4]
    y = torch.full((5, 37, 4), float("nan"), dtype=dtype)
    sizes = torch.tensor([5, 37, 4], dtype=torch.int64)
    src_strides = torch.tensor(x.permute(2, 1, 0).stride(), dtype=torch.int64)
    dst_strides = torch.tensor(y.stride(), dtype=torch.int64)
    strided.yr_strided_copy(cross.ptr(x), cross.ptr(y), 3, cross.ptr(sizes), cross.ptr(src_strides), 0,
                            cross.ptr(dst_strides), 0, x.element_size())
    assert torch.equal(y, x.permute(2, 1, 0))
