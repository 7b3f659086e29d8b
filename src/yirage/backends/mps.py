"""The MPS backend: Apple-silicon GPUs through torch.mps; kernels run as torch ops on the device
(no Metal code generator yet).

Available when ``torch.backends.mps.is_available()``. Apple GPUs share system memory, so
the memory figures are torch's recommended working-set limit and its own allocations.
It must never call ``torch.mps`` functions when MPS is unavailable.
"""
from __future__ import annotations

import platform

import torch

from yirage.backends.base import Backend, BackendImpl, BackendInfo, MemoryInfo
from yirage.backends.cpu import cpu_model_name, system_memory


class MPSBackend(BackendImpl):
    """Apple-silicon GPUs (torch device type 'mps')."""

    name = Backend.MPS
    codegen = None  # fused kernels run as torch ops until a Metal generator lands
    device_type = "mps"

    def unavailable_reason(self) -> str | None:
        if not torch.backends.mps.is_built():
            return "torch was built without MPS (torch.backends.mps.is_built() is False)"
        if not torch.backends.mps.is_available():
            return "MPS is built but unavailable (needs macOS 12.3+ on Apple silicon)"
        return None

    def versions(self) -> dict[str, str]:
        versions = super().versions()
        macos = platform.mac_ver()[0]
        if macos:
            versions["macos"] = macos
        return versions

    def _device_info(self) -> BackendInfo:
        return BackendInfo(
            name=self.name,
            available=True,
            device_name=cpu_model_name(),  # the SoC, e.g. 'Apple M2 Max'
            memory_total_bytes=self._device_memory_info().total_bytes,
            versions=self.versions(),
        )

    def _device_memory_info(self) -> MemoryInfo:
        mps = torch.mps
        if not hasattr(mps, "recommended_max_memory"):  # older torch: report shared RAM
            return system_memory()
        total = mps.recommended_max_memory()
        used = mps.current_allocated_memory() if hasattr(mps, "current_allocated_memory") else None
        free = None if used is None else max(total - used, 0)
        return MemoryInfo(total, free, used)

    def _device_synchronize(self) -> None:
        torch.mps.synchronize()
