"""The XPU backend: Intel GPUs through torch.xpu; kernels are Triton (backends/triton/backend.py).

Available when this torch has a ``torch.xpu`` module, ``torch.xpu.is_available()`` and
triton (Intel's XPU build of it) imports.
It must never touch ``torch.xpu`` before checking that the module exists, and never
initialise a device when unavailable.
"""
from __future__ import annotations

import torch

from yirage.backends.base import Backend, BackendInfo, MemoryInfo
from yirage.backends.triton.backend import TritonBackend, triton_missing_reason


class XPUBackend(TritonBackend):
    """Intel GPUs (torch device type 'xpu')."""

    name = Backend.XPU
    device_type = "xpu"

    def unavailable_reason(self) -> str | None:
        if not hasattr(torch, "xpu"):
            return f"torch {torch.__version__} has no torch.xpu module"
        if not torch.xpu.is_available():
            return "torch.xpu.is_available() is False (torch built without XPU or no Intel GPU)"
        return triton_missing_reason()

    def versions(self) -> dict[str, str]:
        versions = super().versions()
        xpu_version = getattr(torch.version, "xpu", None)
        if xpu_version:
            versions["xpu"] = str(xpu_version)
        return versions

    def _device_info(self) -> BackendInfo:
        index = torch.xpu.current_device()
        props = torch.xpu.get_device_properties(index)
        units = getattr(props, "max_compute_units", None) or getattr(props, "gpu_eu_count", None)
        return BackendInfo(
            name=self.name,
            available=True,
            device_name=props.name,
            compute_units=units,
            memory_total_bytes=props.total_memory,
            versions=self.versions(),
            details={
                "device_index": index,
                "device_count": torch.xpu.device_count(),
                "driver_version": getattr(props, "driver_version", None),
            },
        )

    def _device_memory_info(self) -> MemoryInfo:
        index = torch.xpu.current_device()
        if hasattr(torch.xpu, "mem_get_info"):
            free, total = torch.xpu.mem_get_info(index)
            return MemoryInfo(total, free, total - free)
        total = torch.xpu.get_device_properties(index).total_memory
        used = torch.xpu.memory_allocated(index)
        return MemoryInfo(total, total - used, used)

    def _device_synchronize(self) -> None:
        torch.xpu.synchronize()
