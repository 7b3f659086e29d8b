"""What machine this is: CPU model, ISA extensions, usable cores, and the versions of the
libraries whose kernels yirage measures against its own (torch, MKL, oneDNN).

``machine_record()`` is the record every benchmark's JSON and every machine profile
(``yirage.tuning``) carries, so that a figure or a kernel choice is never read on a machine it
was not measured on. ``cpu_model_name``/``cpu_isa_flags`` read /proc/cpuinfo (sysctl on macOS).

``YIRAGE_ISA`` (``config.isa_cap``) caps what this module reports: at ``x86-64-v3`` (``avx2``)
an AVX-512 CPU reports only AVX2, FMA, F16C and SSE4 flags, as an AMD Zen 3 or an Intel client
chip would, so every provider and kernel choice that asks here sees the capped CPU;
``host_isa_flags`` is the uncapped list.

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
from dataclasses import dataclass

from ..config import isa_cap as _env_isa_cap
from ..errors import ConfigError

# ISA extensions that code generation cares about, spelled as in Linux /proc/cpuinfo
# (x86 "flags", Arm "Features": asimddp is the dot product, i8mm the int8 matrix multiply,
# bf16 the bfloat16 dot product, fphp/asimdhp float16 arithmetic).
KNOWN_ISA_FLAGS = (
    "avx", "avx2", "fma", "f16c",
    "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "avx_ne_convert",
    "amx_tile", "amx_bf16", "amx_int8",
    "neon", "asimd", "asimddp", "i8mm", "bf16", "fphp", "asimdhp", "sve", "sve2",
)

#: flags of /proc/cpuinfo that decide which kernels are fast here (vector widths, dot-product
#: and matrix extensions): every flag starting with one of these
_RECORDED_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "vnni", "neon", "asimd", "sve", "sme", "i8mm",
                           "bf16", "fphp")

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
    "hw.optional.arm.FEAT_DotProd": "asimddp",
    "hw.optional.arm.FEAT_I8MM": "i8mm",
    "hw.optional.arm.FEAT_BF16": "bf16",
    "hw.optional.arm.FEAT_FP16": "fphp",
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


def is_x86() -> bool:
    """Whether this is an x86-64 machine (the ``YIRAGE_ISA`` levels are x86-64 levels)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@functools.lru_cache(maxsize=1)
def host_isa_flags() -> frozenset[str]:
    """Every ISA flag the OS reports for this CPU (/proc/cpuinfo's x86 ``flags`` or Arm
    ``Features``; macOS sysctl for the ``KNOWN_ISA_FLAGS``), uncapped."""
    line = _cpuinfo_field("flags") or _cpuinfo_field("Features")
    if line is not None:
        return frozenset(line.split())
    return frozenset(_sysctl_isa_flags()) if sys.platform == "darwin" else frozenset()


#: the SIMD flags each capped x86-64 level may use (the psABI's levels, /proc/cpuinfo spellings);
#: any other flag with a prefix of ``_RECORDED_FLAG_PREFIXES`` (AVX-512, AMX, AVX-VNNI, ...) is
#: hidden under the cap
LEVEL_FLAGS = {"x86-64-v2": frozenset({"sse4_1", "sse4_2"}),
               "x86-64-v3": frozenset({"sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c"})}
#: what the CPU needs for a level to be a cap rather than an upgrade
_LEVEL_NEEDS = {"x86-64-v2": ("sse4_2", "popcnt", "ssse3"), "x86-64-v3": ("avx2", "fma", "f16c", "bmi2", "movbe")}


def isa_cap() -> str:
    """``YIRAGE_ISA``'s level ('native', 'x86-64-v3' or 'x86-64-v2'), checked against this CPU.

    Raises:
        ConfigError: an unknown value, an x86-64 level on another architecture, or a level above
        the CPU's (it would build kernels this CPU cannot run).
    """
    level = _env_isa_cap()
    if level == "native":
        return level
    if not is_x86():
        raise ConfigError(f"YIRAGE_ISA={level} caps an x86-64 CPU, and this one is {platform.machine()}: "
                          "unset YIRAGE_ISA (or set it to native)")
    missing = [f for f in _LEVEL_NEEDS[level] if f not in host_isa_flags()]
    if missing:
        raise ConfigError(f"YIRAGE_ISA={level} is above this CPU ({cpu_model_name()} lacks {', '.join(missing)}): "
                          "set a lower level or unset YIRAGE_ISA")
    return level


@functools.lru_cache(maxsize=4)
def _capped(level: str) -> frozenset[str]:
    flags = host_isa_flags()
    if level == "native":
        return flags
    return frozenset(f for f in flags if not f.startswith(_RECORDED_FLAG_PREFIXES) or f in LEVEL_FLAGS[level])


def isa_flags() -> frozenset[str]:
    """The ISA flags yirage may use here: the host's (``host_isa_flags``) under ``isa_cap()``.
    Raises ConfigError as ``isa_cap``."""
    return _capped(isa_cap())


def cpu_isa_flags() -> tuple[str, ...]:
    """The entries of KNOWN_ISA_FLAGS this CPU reports under ``YIRAGE_ISA``'s cap, in
    KNOWN_ISA_FLAGS order. Raises ConfigError as ``isa_cap``."""
    flags = isa_flags()
    return tuple(flag for flag in KNOWN_ISA_FLAGS if flag in flags)


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


def all_isa_flags() -> list[str]:
    """Every ISA flag that changes kernel choice (``_RECORDED_FLAG_PREFIXES``) under
    ``YIRAGE_ISA``'s cap, sorted. Raises ConfigError as ``isa_cap``."""
    return sorted(f for f in isa_flags() if f.startswith(_RECORDED_FLAG_PREFIXES))


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


#: per precision, the ISA flags any one of which gives it a hardware dot product; without one,
#: the precision is *emulated* (converted to float32 or widened integers and multiplied there)
NATIVE_PRECISION_FLAGS = {
    "bfloat16": ("amx_bf16", "avx512_bf16", "avx_ne_convert", "bf16"),
    "int8": ("amx_int8", "avx512_vnni", "avx_vnni", "i8mm", "asimddp"),
}


def native_precision_flag(dtype: str) -> str | None:
    """The ISA flag (under ``YIRAGE_ISA``'s cap) that gives ``dtype`` ('bfloat16' or 'int8') its
    hardware dot product here, or None where it is emulated. 'float32' is native everywhere
    ('fp32'). Raises KeyError for another dtype, ConfigError as ``isa_cap``."""
    if dtype == "float32":
        return "fp32"
    flags = isa_flags()
    return next((f for f in NATIVE_PRECISION_FLAGS[dtype] if f in flags), None)


def torch_cpu_capability() -> str:
    """The vector ISA torch's own CPU kernels run at ('AVX512', 'AVX2', 'DEFAULT', 'SVE256', ...),
    which ``ATEN_CPU_CAPABILITY`` caps (``config.apply_isa_cap``)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def onednn_bfloat16() -> bool:
    """Whether torch's oneDNN has a bfloat16 GEMM path on this CPU, as torch answers it (it
    honours ``ONEDNN_MAX_CPU_ISA``): False where ``torch.ops.mkldnn._reorder_linear_weight`` of a
    bfloat16 weight would raise (no AVX512BW/VL/DQ and no AVX-NE-CONVERT on x86)."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def vendor_cap_problem() -> str | None:
    """Why torch's kernels do not honour ``YIRAGE_ISA``'s cap, or None: torch started its CPU
    kernels before ``import yirage`` could cap them (``config.apply_isa_cap``), or the user's own
    ``ATEN_CPU_CAPABILITY`` says otherwise."""
    want = {"x86-64-v3": ("AVX2",), "x86-64-v2": ("DEFAULT",)}.get(isa_cap())
    if want is None:
        return None
    got = torch_cpu_capability()
    if got in want:
        return None
    return (f"YIRAGE_ISA={isa_cap()} but torch's CPU kernels run at {got}: set YIRAGE_ISA in the environment "
            "before the process starts (or import yirage before torch runs any op)")


@functools.lru_cache(maxsize=1)
def int_mm_exact() -> bool:
    """Whether ``torch._int_mm`` (int8 x int8 -> int32; oneDNN where torch finds VNNI) returns
    exact sums here, asked by running it: int8 products that saturate a 16-bit pair sum
    (127 x 127 + 127 x 127) and random ones, against the integer matmul in int64. False where
    torch hands the GEMM to a oneDNN capped below VNNI (``YIRAGE_ISA``'s ``ONEDNN_MAX_CPU_ISA``:
    its AVX2 kernel saturates), so the int8 provider that uses it is no candidate there."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (8, 64), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (64, 16), dtype=torch.int8, generator=g)
    a[0], b[:, 0] = 127, 127
    try:
        return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())
    except RuntimeError:
        return False


#: what a kernel path may need of the libraries inside torch, and how torch is asked
LIBRARY_CAPABILITIES = {
    "mkldnn": lambda: __import__("torch").backends.mkldnn.is_available(),
    "mkldnn_bf16": onednn_bfloat16,
    "int_mm": int_mm_exact,
}


@dataclass(frozen=True)
class Needs:
    """What a kernel path (a provider, a dtype path) needs of this machine to run: every flag of
    ``isa``, at least one of ``isa_any`` (both under ``YIRAGE_ISA``'s cap), and every
    ``library`` capability of ``LIBRARY_CAPABILITIES`` (torch is asked, never a list of CPUs)."""

    isa: tuple[str, ...] = ()
    isa_any: tuple[str, ...] = ()
    library: tuple[str, ...] = ()

    def unmet(self) -> str | None:
        """Why this machine cannot run the path (a phrase), or None when it can."""
        flags = isa_flags()
        missing = [f for f in self.isa if f not in flags]
        if missing:
            return f"needs the ISA flags {', '.join(missing)}{_capped_note()}"
        if self.isa_any and not set(self.isa_any) & flags:
            return f"needs one of the ISA flags {', '.join(self.isa_any)}{_capped_note()}"
        for lib in self.library:
            if not LIBRARY_CAPABILITIES[lib]():
                return f"torch's {_LIBRARY_NAMES[lib]} has no {_LIBRARY_WORDS[lib]} on this CPU{_capped_note()}"
        return None


_LIBRARY_NAMES = {"mkldnn": "mkldnn", "mkldnn_bf16": "mkldnn", "int_mm": "_int_mm"}
_LIBRARY_WORDS = {"mkldnn": "oneDNN support", "mkldnn_bf16": "bfloat16 path", "int_mm": "exact int8 GEMM"}


def _capped_note() -> str:
    level = isa_cap()
    return "" if level == "native" else f" (YIRAGE_ISA caps this CPU at {level})"


def machine_record(threads: int | None = None) -> dict:
    """The machine a measurement was taken on, as JSON-ready fields: cpu (model name),
    cpu_generation (``cpu_generation``: x86 family/model), isa (``all_isa_flags``: under the cap),
    isa_cap (``YIRAGE_ISA``'s level: 'native', 'x86-64-v3', ...), torch_cpu_capability, amx (bool),
    cores (usable by this process), threads (``threads`` or torch's intra-op thread count), os,
    gpu (the CUDA/ROCm device's name, or None) and ``library_versions()`` plus yirage's version."""
    import torch

    from .. import __version__

    flags = all_isa_flags()
    return {"cpu": cpu_model_name(), "cpu_generation": cpu_generation(), "isa": flags, "isa_cap": isa_cap(),
            "torch_cpu_capability": torch_cpu_capability(),
            "amx": any(f.startswith("amx") for f in flags),
            "cores": usable_cpu_count(), "threads": threads if threads is not None else torch.get_num_threads(),
            "os": f"{platform.system()} {platform.release()}", "machine": platform.machine(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            **library_versions(), "yirage": __version__}
