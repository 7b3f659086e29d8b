"""The CPU backend (backend.py), always available: fused kernels as generated C++, library ops on
the hand-written C++ of kernels/cpu.

Its modules import one way, each only those below it: backend.py > library.py (the op table) >
conv.py, precision.py > providers.py (linear layers on the provider chosen by measurement) >
embed.py (the packed GEMMs and their weight cache) > native.py (the kernel library loaded
through ctypes); indexing.py, strided.py and threadblock.py load kernels of their own.
"""
from .backend import CPUBackend, cpu_model_name, system_memory, usable_cpu_count

__all__ = ["CPUBackend", "cpu_model_name", "system_memory", "usable_cpu_count"]
