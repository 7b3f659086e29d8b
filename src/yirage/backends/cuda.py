"""The CUDA backend: NVIDIA GPUs through torch.cuda; kernels are generated as Triton.

Available when ``torch.cuda.is_available()`` and the torch build is CUDA
(``torch.version.cuda`` set, ``torch.version.hip`` None). It describes the current
device (name, SM count, compute capability, memory). It must never claim a ROCm build
as CUDA, never initialise a device when unavailable, and never change the current device.
"""
from __future__ import annotations

import torch

from yirage.backends.base import Backend, BackendImpl, BackendInfo, MemoryInfo


class CUDABackend(BackendImpl):
    """NVIDIA GPUs; also the base of ROCmBackend, which shares the torch.cuda API."""

    name = Backend.CUDA
    codegen = None  # Triton code generation: see backends/triton.py (issue 5)
    device_type = "cuda"

    def unavailable_reason(self) -> str | None:
        if torch.version.hip is not None:
            return f"this torch build is ROCm/HIP {torch.version.hip}, not CUDA (use 'rocm')"
        if torch.version.cuda is None:
            return "torch was built without CUDA (torch.version.cuda is None)"
        return _no_device_reason("CUDA")

    def versions(self) -> dict[str, str]:
        versions = super().versions()
        if torch.version.cuda is not None:
            versions["cuda"] = torch.version.cuda
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if cudnn is not None:
            versions["cudnn"] = str(cudnn)
        return versions

    def compute_capability(self, props) -> str | None:
        """'major.minor' of the device (e.g. '9.0' for H100)."""
        return f"{props.major}.{props.minor}"

    def _device_info(self) -> BackendInfo:
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return BackendInfo(
            name=self.name,
            available=True,
            device_name=props.name,
            compute_units=props.multi_processor_count,
            memory_total_bytes=props.total_memory,
            compute_capability=self.compute_capability(props),
            versions=self.versions(),
            details={"device_index": index, "device_count": torch.cuda.device_count()},
        )

    def _device_memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(torch.cuda.current_device())
        return MemoryInfo(total, free, total - free)

    def _device_synchronize(self) -> None:
        torch.cuda.synchronize()


def _no_device_reason(kind: str) -> str | None:
    """Why torch.cuda has no usable device (shared by CUDA and ROCm), or None."""
    if torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if count == 0:
        return f"no {kind} device visible (torch.cuda.device_count() == 0)"
    return f"torch.cuda.is_available() is False with {count} device(s); check the driver"
