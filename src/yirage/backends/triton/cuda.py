"""The CUDA backend: NVIDIA GPUs through torch.cuda; kernels are Triton (backends/triton/backend.py).

Available when ``torch.cuda.is_available()``, the torch build is CUDA
(``torch.version.cuda`` set, ``torch.version.hip`` None) and triton imports. It describes
the current device (name, SM count, compute capability, memory). It must never claim a ROCm build
as CUDA, never initialise a device when unavailable, and never change the current device.
"""
from __future__ import annotations

import torch

from yirage.backends.base import Backend, BackendInfo, MemoryInfo, Thunk
from yirage.dtypes import DType
from yirage.backends.triton.backend import TritonBackend, triton_missing_reason


class CUDABackend(TritonBackend):
    """NVIDIA GPUs; also the base of ROCmBackend, which shares the torch.cuda API."""

    name = Backend.CUDA
    device_type = "cuda"
    captures = True

    def unavailable_reason(self) -> str | None:
        if torch.version.hip is not None:
            return f"this torch build is ROCm/HIP {torch.version.hip}, not CUDA (use 'rocm')"
        if torch.version.cuda is None:
            return "torch was built without CUDA (torch.version.cuda is None)"
        return _no_device_reason("CUDA") or triton_missing_reason()

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

    def default_dtype(self) -> DType:
        """bfloat16 where the GPU has it (NVIDIA Ampere and later, AMD CDNA), else float16."""
        return DType.bfloat16 if torch.cuda.is_bf16_supported() else DType.float16

    def capture(self, run: Thunk) -> Thunk:
        """A CUDA graph (HIP graph on ROCm) of ``run``'s launches; returns its ``replay``.

        ``run`` is executed once on a side stream first, so that Triton compiles and
        autotunes outside the capture (as torch.cuda.graphs' documentation prescribes).
        """
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        return graph.replay


def _no_device_reason(kind: str) -> str | None:
    """Why torch.cuda has no usable device (shared by CUDA and ROCm), or None."""
    if torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if count == 0:
        return f"no {kind} device visible (torch.cuda.device_count() == 0)"
    return f"torch.cuda.is_available() is False with {count} device(s); check the driver"
