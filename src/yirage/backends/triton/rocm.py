"""The ROCm backend: AMD GPUs through torch's HIP build; kernels are Triton (backends/triton/backend.py).

A ROCm build of torch exposes AMD GPUs through the ``torch.cuda`` API and the 'cuda'
device type, so this backend reuses the CUDA one and differs in detection
(``torch.version.hip`` set), versions (HIP) and compute capability (the gfx arch name).
It must never claim a CUDA build as ROCm.
"""
from __future__ import annotations

import torch

from yirage.backends.base import Backend, base_versions
from yirage.backends.triton.cuda import CUDABackend, _no_device_reason
from yirage.backends.triton.backend import triton_missing_reason


class ROCmBackend(CUDABackend):
    """AMD GPUs (torch device type 'cuda' on a HIP build)."""

    name = Backend.ROCM
    device_type = "cuda"

    def unavailable_reason(self) -> str | None:
        if torch.version.hip is None:
            return "torch was built without ROCm/HIP (torch.version.hip is None)"
        return _no_device_reason("ROCm") or triton_missing_reason()

    def versions(self) -> dict[str, str]:
        versions = base_versions()
        if torch.version.hip is not None:
            versions["hip"] = torch.version.hip
        return versions

    def compute_capability(self, props) -> str | None:
        """The gfx architecture (e.g. 'gfx90a:sramecc+:xnack-'), else 'major.minor'."""
        return getattr(props, "gcnArchName", None) or f"{props.major}.{props.minor}"
