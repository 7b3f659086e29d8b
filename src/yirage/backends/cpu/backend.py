"""The CPU backend: always available; fused kernels are generated as C++ (OpenMP, SIMD) and
library ops run the hand-written C++ of kernels/cpu (see library.py).

It reads the CPU model, usable cores, SIMD/matrix ISA extensions and system memory from
the operating system (/proc on Linux, sysctl on macOS) so that code generation can pick
vector widths. It must never guess an ISA flag the OS does not report, and never start
threads or change torch's thread settings.
"""
from __future__ import annotations

import os
import platform

import torch

from yirage.backends.base import Backend, BackendImpl, BackendInfo, Kernel, MemoryInfo, Thunk
from yirage.dtypes import DType
from yirage.ir.ops import ROW_GROUP, ROW_GROUP_TYPES
from yirage.runtime.cpp_kernels import compile_cpp
from yirage.runtime.machine import (  # noqa: F401  (re-exported: the CPU's identity lives in runtime)
    KNOWN_ISA_FLAGS, _read_text, cpu_isa_flags, cpu_model_name, usable_cpu_count)

from . import conv, embed, library


def system_memory() -> MemoryInfo:
    """System RAM in bytes: /proc/meminfo (MemTotal, MemAvailable), else os.sysconf."""
    fields = _meminfo_kib()
    if "MemTotal" in fields and "MemAvailable" in fields:
        total, free = fields["MemTotal"] * 1024, fields["MemAvailable"] * 1024
        return MemoryInfo(total, free, total - free)
    return _sysconf_memory()


def _meminfo_kib() -> dict[str, int]:
    fields = {}
    for line in (_read_text("/proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[key.strip()] = int(parts[0])
    return fields


def _sysconf_memory() -> MemoryInfo:
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    if "SC_AVPHYS_PAGES" not in os.sysconf_names:
        return MemoryInfo(total, None, None)
    free = page * os.sysconf("SC_AVPHYS_PAGES")
    return MemoryInfo(total, free, total - free)


class CPUBackend(BackendImpl):
    """The host CPU through torch's CPU tensors."""

    name = Backend.CPU
    codegen = "cpp"
    device_type = "cpu"
    channels_last = True   # oneDNN's convolutions are fastest on NHWC (benchmarks/torch_compile.py)

    def unavailable_reason(self) -> str | None:
        return None

    def supports(self, node, graph) -> bool:
        """Library ops with a kernel here: see ``library.OPS``."""
        entry = library.OPS.get(node.op)
        return entry is not None and entry[0](node, graph)

    def strided_io(self, node, graph) -> bool:
        """Attention (``sdpa``: each of its providers reads and writes strided heads,
        ``library._sdpa``) and RoPE (``rotary_emb``)."""
        return node.op in ("sdpa", "rotary_emb") and self.supports(node, graph)

    def compile(self, kernels: list) -> list[Kernel]:
        """Fused kernels as C++ (codegen/cpp.py), built with the system compiler.

        Raises ToolchainError when no compiler is installed or the build fails.
        """
        return compile_cpp(kernels)

    def bind_library_op(self, node, graph, args, out, status=None) -> Thunk:
        """The C++ library kernel (or torch BLAS for float matmuls) for ``node``."""
        return library.OPS[node.op][1](node, graph, args, out, status)

    def merge_linears(self, case) -> bool:
        """Parallel float32 linears as one stacked GEMM where measurement says it is faster
        (``library.merge_linears``)."""
        return library.merge_linears(case)

    def merge_convs(self, case) -> bool:
        """Parallel float32 NHWC 1x1 convolutions as one GEMM where measurement says it is
        faster (``conv.merge_convs``)."""
        return conv.merge_convs(case)

    def linear_weight_layout(self, data, dtype, compute_dtype, embedding=False):
        """q4_1 and q8_0 weights whose decode GEMVs take float32 or int8 x become their row-group
        layouts (``q4_1r16`` / ``q8_0r16``: rows in groups of 16, ``library.to_row_groups``)
        where the library has those layouts' AVX-512 VNNI kernels and the rows are a multiple of
        16: the q4_1 GEMVs read 1.4-1.5x (float32 x) and 2.0-2.4x (int8 x) the GB/s
        (kernels/cpu/row_groups.h). A table the embedding op reads too: q8_0 only."""
        if (dtype in ROW_GROUP_TYPES and compute_dtype in ("float32", "int8") and data.dim() == 2
                and data.shape[0] % ROW_GROUP == 0 and not (embedding and dtype != DType.q8_0)
                and library.row_groups_native()):
            return library.to_row_groups(data.contiguous(), dtype), ROW_GROUP_TYPES[dtype]
        return data, dtype

    def declare_constant(self, tensors):
        """float32/bfloat16 weights become candidates for the packed providers
        (``embed.mark_constant``): 2-D ones for the GEMMs (``providers``), convolution
        weights and their batch-norm parameters for oneDNN's folded, reordered convolution
        (``conv``); each op chooses among its providers by measurement."""
        for t in tensors:
            if t.dtype in (torch.float32, torch.bfloat16):
                embed.mark_constant(t)

    def bind_library_op_epilogue(self, node, graph, args, out, kernel, kernel_args):
        """The embedding engine's GEMMs (float32 ``linear`` on a prepacked weight,
        ``linear_w8a8``) with the fused row kernel after them run on each block of finished
        rows (``library.bind_with_epilogue``); None for every other op."""
        return library.bind_with_epilogue(node, graph, args, out, kernel, kernel_args)

    def bind_customized_group(self, nodes, graph, args, outs):
        """All outputs of one block graph as one C++ kernel (threadblock.py)."""
        from .threadblock import bind_customized_group
        return bind_customized_group(nodes, graph, args, outs)

    def bind_library_task(self, node, graph, args, out, status, num_workers):
        """The task form of ``node`` for the CPU scheduler (``library.TASKS``), or None."""
        binder = library.TASKS.get(node.op)
        return binder(node, graph, args, out, status, num_workers) if binder else None

    def _device_info(self) -> BackendInfo:
        return BackendInfo(
            name=self.name,
            available=True,
            device_name=cpu_model_name(),
            compute_units=usable_cpu_count(),
            memory_total_bytes=system_memory().total_bytes,
            isa_flags=list(cpu_isa_flags()),
            versions=self.versions(),
            details={
                "logical_cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "openmp": torch.backends.openmp.is_available(),
                "machine": platform.machine(),
            },
        )

    def _device_memory_info(self) -> MemoryInfo:
        return system_memory()
