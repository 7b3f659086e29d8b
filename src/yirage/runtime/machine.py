"""What machine this is: CPU model, ISA extensions, usable cores, and the versions of the
libraries whose kernels yirage measures against its own (torch, MKL, oneDNN).

``machine_record()`` is the record every benchmark's JSON and every machine profile
(``yirage.tuning``) carries, so that a figure or a kernel choice is never read on a machine it
was not measured on. ``cpu_model_name``/``cpu_isa_flags`` read /proc/cpuinfo (sysctl on macOS).

This module must never guess an ISA flag the OS does not report, start threads or change
torch's thread settings.
"""
from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
import sys

# ISA extensions that code generation cares about, spelled as in Linux /proc/cpuinfo
# (x86 "flags", Arm "Features").
KNOWN_ISA_FLAGS = (
    "avx", "avx2", "fma", "f16c",
    "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
    "amx_tile", "amx_bf16", "amx_int8",
    "neon", "asimd", "sve",
)

# macOS sysctl keys (hw.optional.*) for the same extensions.
_SYSCTL_ISA_KEYS = {
    "hw.optional.avx1_0": "avx",
    "hw.optional.avx2_0": "avx2",
    "hw.optional.fma": "fma",
    "hw.optional.f16c": "f16c",
    "hw.optional.avx512f": "avx512f",
    "hw.optional.avx512bw": "avx512bw",
    "hw.optional.avx512vnni": "avx512_vnni",
    "hw.optional.neon": "neon",
    "hw.optional.AdvSIMD": "asimd",
    "hw.optional.arm.FEAT_SVE": "sve",
}


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _cpuinfo_field(name: str) -> str | None:
    """The first value of ``name`` in /proc/cpuinfo, or None."""
    for line in (_read_text("/proc/cpuinfo") or "").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


def _sysctl(args: list[str]) -> str | None:
    """Output of ``sysctl <args>`` (macOS), or None if it fails."""
    try:
        result = subprocess.run(["sysctl", *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def cpu_model_name() -> str:
    """The CPU model name as the OS reports it (e.g. 'AMD EPYC 9654')."""
    name = _cpuinfo_field("model name")
    if not name and sys.platform == "darwin":
        name = (_sysctl(["-n", "machdep.cpu.brand_string"]) or "").strip()
    return name or platform.processor() or platform.machine() or "unknown CPU"


def cpu_generation() -> str | None:
    """The CPU's x86 family and model numbers as "family/model" (e.g. "25/17": AMD Zen 4,
    "26/2": Zen 5), which tell apart generations a virtual machine reports under one model name
    ("AMD EPYC"); None where /proc/cpuinfo does not give them."""
    family, model = _cpuinfo_field("cpu family"), _cpuinfo_field("model")
    return f"{family}/{model}" if family and model and family.isdigit() and model.isdigit() else None


@functools.lru_cache(maxsize=1)
def cpu_isa_flags() -> tuple[str, ...]:
    """The entries of KNOWN_ISA_FLAGS this CPU reports, in KNOWN_ISA_FLAGS order."""
    reported: set[str] = set()
    line = _cpuinfo_field("flags") or _cpuinfo_field("Features")
    if line is not None:
        reported = set(line.split())
    elif sys.platform == "darwin":
        reported = _sysctl_isa_flags()
    return tuple(flag for flag in KNOWN_ISA_FLAGS if flag in reported)


def _sysctl_isa_flags() -> set[str]:
    flags = set()
    for line in (_sysctl(["hw.optional"]) or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in _SYSCTL_ISA_KEYS and value.strip() == "1":
            flags.add(_SYSCTL_ISA_KEYS[key.strip()])
    return flags


def usable_cpu_count() -> int:
    """CPUs this process may run on (its affinity mask), else all logical CPUs."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


#: flags of /proc/cpuinfo that decide which kernels are fast here (vector widths, dot-product
#: and matrix extensions): every flag starting with one of these
_RECORDED_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "vnni", "neon", "asimd", "sve")


def all_isa_flags() -> list[str]:
    """Every reported ISA flag that changes kernel choice (``_RECORDED_FLAG_PREFIXES``), sorted."""
    line = _cpuinfo_field("flags") or _cpuinfo_field("Features") or ""
    flags = set(line.split()) or set(cpu_isa_flags())
    return sorted(f for f in flags if f.startswith(_RECORDED_FLAG_PREFIXES) or f in ("sme", "sme2"))


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    """Versions of torch and of the vendor libraries in it: MKL and oneDNN (from
    ``torch.__config__.show()``), OpenMP; '' for a library this torch build lacks."""
    import torch

    shown = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", shown) or re.search(r"MKL[^\n]*?(\d{4}\.\d[\w.]*)", shown)
    dnn = re.search(r"MKL-DNN v([\w.]+)", shown) or re.search(r"oneDNN v([\w.]+)", shown)
    return {"torch": torch.__version__, "python": platform.python_version(),
            "mkl": mkl.group(1) if mkl and torch.backends.mkl.is_available() else "",
            "onednn": dnn.group(1) if dnn and torch.backends.mkldnn.is_available() else ""}


def machine_record(threads: int | None = None) -> dict:
    """The machine a measurement was taken on, as JSON-ready fields: cpu (model name),
    cpu_generation (``cpu_generation``: x86 family/model), isa (``all_isa_flags``), amx (bool),
    cores (usable by this process), threads (``threads`` or torch's intra-op thread count), os,
    gpu (the CUDA/ROCm device's name, or None) and ``library_versions()`` plus yirage's version."""
    import torch

    from .. import __version__

    flags = all_isa_flags()
    return {"cpu": cpu_model_name(), "cpu_generation": cpu_generation(), "isa": flags,
            "amx": any(f.startswith("amx") for f in flags),
            "cores": usable_cpu_count(), "threads": threads if threads is not None else torch.get_num_threads(),
            "os": f"{platform.system()} {platform.release()}", "machine": platform.machine(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            **library_versions(), "yirage": __version__}
