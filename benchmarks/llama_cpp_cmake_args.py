"""Prints the CMAKE_ARGS that build llama-cpp-python's llama.cpp for this x86 CPU without AMX.

Why: llama.cpp built natively (``GGML_NATIVE=ON``, its default, i.e. ``-march=native``)
compiles its AMX kernels on a CPU with AMX-INT8 (Sapphire Rapids and later Xeons), and
llama-cpp-python 0.3.36 built that way crashes (SIGSEGV) on any prompt longer than one token
there (GitHub issue 18). So ``make bench`` builds it with ``-DGGML_NATIVE=OFF`` and every
instruction-set option of ggml set explicitly: ON where /proc/cpuinfo reports the extension,
OFF otherwise, and the AMX options always OFF. Explicit OFFs matter: with ``GGML_NATIVE=OFF``
ggml turns SSE4.2, AVX, AVX2, BMI2, FMA and F16C on by default (``INS_ENB``), which would
fail with SIGILL on an older CPU.

The option names and the compiler flags each one adds are those of
``vendor/llama.cpp/ggml/CMakeLists.txt`` and ``ggml/src/ggml-cpu/CMakeLists.txt`` in the
llama-cpp-python 0.3.36 sdist (``GGML_AVX512`` adds ``-mavx512f -mavx512cd -mavx512vl
-mavx512dq -mavx512bw``, hence it needs all five flags).

    python benchmarks/llama_cpp_cmake_args.py [--cpuinfo /proc/cpuinfo]

With ``YIRAGE_ISA=avx2`` (or ``x86-64-v3``, ``x86-64-v2``) it builds llama.cpp for that level, as
yirage's kernels are built under the same cap: every option above the level OFF (``GGML_AVX512``,
``GGML_AVX_VNNI``, ...), so both sides of ``benchmarks/decode.py`` run as on an AVX2-only CPU.

On a CPU that is not x86 (or where /proc/cpuinfo has no ``flags`` line) it prints nothing:
llama.cpp's native build is used there. Standard library only (it runs before any
dependency is installed); it must never print an AMX option other than OFF.
"""
from __future__ import annotations

import argparse
import os

#: ggml's x86 options, in ggml's order, and the /proc/cpuinfo flags each one needs
X86_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512vbmi"),
    "GGML_AVX512_VNNI": ("avx512f", "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512_bf16"),
}
#: never ON: the kernels these enable crash llama-cpp-python 0.3.36 on AMX CPUs
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


#: the flags of X86_OPTIONS each YIRAGE_ISA level keeps (the x86-64 psABI levels)
LEVEL_FLAGS = {"x86-64-v2": {"sse4_2"}, "x86-64-v3": {"sse4_2", "avx", "avx2", "bmi2", "fma", "f16c"}}
LEVEL_NAMES = {"avx2": "x86-64-v3", "x86-64-v3": "x86-64-v3", "x86-64-v2": "x86-64-v2"}


def capped(flags: set[str], isa: str | None) -> set[str]:
    """``flags`` under a ``YIRAGE_ISA`` value (None, '' or 'native': all of them)."""
    level = LEVEL_NAMES.get((isa or "").strip().lower())
    if level is None:
        return flags
    return {f for f in flags if f in LEVEL_FLAGS[level] or not any(f in need for need in X86_OPTIONS.values())}


def cpu_flags(cpuinfo: str) -> set[str] | None:
    """The x86 ``flags`` of the first CPU in the text of /proc/cpuinfo, or None if it has none."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return None


def cmake_args(flags: set[str]) -> list[str]:
    """``-D`` options for ggml on an x86 CPU reporting ``flags``: native off, each option of
    X86_OPTIONS ON exactly when all its flags are present, the AMX options OFF."""
    args = ["-DGGML_NATIVE=OFF"]
    args += [f"-D{opt}={'ON' if set(need) <= flags else 'OFF'}" for opt, need in X86_OPTIONS.items()]
    return args + [f"-D{opt}=OFF" for opt in AMX_OPTIONS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpuinfo", default="/proc/cpuinfo", help="the file to read the CPU flags from")
    args = ap.parse_args()
    try:
        with open(args.cpuinfo, encoding="utf-8", errors="replace") as f:
            flags = cpu_flags(f.read())
    except OSError:
        flags = None
    if flags is not None:
        print(" ".join(cmake_args(capped(flags, os.environ.get("YIRAGE_ISA")))))


if __name__ == "__main__":
    main()
