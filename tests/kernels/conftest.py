"""Fixtures of the Triton kernel library tests (test_triton_*.py): the device they run on and
the kernels module."""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """cpu (under Triton's interpreter, TRITON_INTERPRET=1) and cuda (a GPU), each skipped where
    it cannot run."""
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU runs need Triton's interpreter (TRITON_INTERPRET=1)")
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(request.param)


@pytest.fixture(scope="module")
def K():
    """The kernels module, imported after conftest has set TRITON_INTERPRET."""
    import yirage.kernels.triton as kernels
    return kernels
