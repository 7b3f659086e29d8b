"""YIRAGE_ISA: an AVX-512 machine capped at x86-64-v3 builds, reports and runs as an AVX2-only CPU
(an AMD Zen 3, an Intel client chip) would; a reduced precision the capped CPU only emulates is
never recommended, and warns once where asked for.

The reference for what a level holds is the x86-64 psABI's list (not yirage's), for what a
build holds the disassembly of the library it built (objdump), and for oneDNN's bfloat16 path
oneDNN itself.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import yirage as yr
from yirage.backends.cpu import precision as cpu_precision
from yirage.errors import ConfigError, EmulatedPrecisionWarning
from yirage.runtime import machine

X86 = platform.machine().lower() in ("x86_64", "amd64")


def _host_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


#: the SIMD flags of the x86-64-v3 level (x86-64 psABI: AVX, AVX2, FMA, F16C over SSE4.2)
V3_SIMD = {"avx", "avx2", "fma", "f16c", "sse4_1", "sse4_2"}

needs_v3 = pytest.mark.skipif(not (X86 and Path("/proc/cpuinfo").exists() and {"avx2", "fma", "f16c"} <= _host_flags()),
                              reason="caps an x86-64 CPU with AVX2, FMA and F16C")

_PROBE = r"""
import json, os, sys
import yirage
import torch
from yirage.backends.cpu import embed as cpu_embed, library as cpu_library, native, providers as cpu_providers
from yirage.runtime import machine, toolchain
lib = toolchain.library_path(toolchain.kernel_library_sources("library"))
native.library()
w = torch.randn(12, 16).bfloat16()
cpu_embed.mark_constant(w)
case = cpu_providers.case_of("linear", [torch.randn(8, 16), w], torch.empty(8, 12))
try:
    torch.ops.mkldnn._reorder_linear_weight(w, 4)
    reorders = True
except RuntimeError as e:
    reorders = str(e)
print(json.dumps({"flags": toolchain.cxx_flags(), "isa": machine.all_isa_flags(), "cap": machine.isa_cap(),
                  "torch": torch.backends.cpu.get_cpu_capability(), "simd_bits": cpu_library.simd_bits(),
                  "env": {k: os.environ.get(k) for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                                         "ATEN_CPU_CAPABILITY")},
                  "library": str(lib), "onednn_reorders_bf16": reorders,
                  "candidates": sorted(cpu_providers.candidates(case)),
                  "unavailable": cpu_providers.unavailable(case),
                  "record": machine.machine_record()["isa_cap"]}))
"""


def _probe(cap: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                                            "ATEN_CPU_CAPABILITY")}
    env["YIRAGE_ISA"] = cap
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def capped():
    """What a process started with YIRAGE_ISA=avx2 builds and sees (one subprocess)."""
    return _probe("avx2")


@needs_v3
def test_a_capped_process_builds_and_reports_x86_64_v3(capped):
    assert "-march=x86-64-v3" in capped["flags"] and "-march=native" not in capped["flags"]
    assert capped["cap"] == capped["record"] == "x86-64-v3"
    host = {f for f in _host_flags() if f.startswith(("avx", "amx", "fma", "f16c", "sse4", "vnni"))}
    assert set(capped["isa"]) == host & V3_SIMD       # no AVX-512, AVX-VNNI or AMX flag is reported
    assert capped["env"] == {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                             "ATEN_CPU_CAPABILITY": "avx2"}
    assert capped["torch"] == "AVX2"                  # torch's own kernels run as on an AVX2 CPU
    assert capped["simd_bits"] == 256


@needs_v3
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils) to read the library")
def test_the_capped_library_holds_no_avx512_instruction(capped):
    """The disassembly of the library the capped process built names no zmm or mask register."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", capped["library"]], capture_output=True,
                          text=True, timeout=300).stdout
    assert "vfmadd" in text                           # it is vectorized (AVX2 FMAs) ...
    assert "%zmm" not in text and "%k1" not in text   # ... and has no AVX-512


@needs_v3
def test_a_provider_the_capped_cpu_cannot_run_is_left_out_with_the_reason(capped):
    """oneDNN capped at AVX2 refuses a bfloat16 weight (as on an AMD Zen 3); onednn-packed is then
    no candidate, and ``unavailable`` says why."""
    assert capped["onednn_reorders_bf16"] is not True
    assert "onednn-packed" not in capped["candidates"] and {"yirage", "onednn"} <= set(capped["candidates"])
    assert "bfloat16" in capped["unavailable"]["onednn-packed"] and "x86-64-v3" in capped["unavailable"]["onednn-packed"]


def test_the_native_library_is_as_wide_as_the_cpu():
    """Without a cap the library is built for the CPU's widest vectors (the flags from
    /proc/cpuinfo, not yirage's reading of them)."""
    if os.environ.get("YIRAGE_ISA", "native") != "native":
        pytest.skip("this process runs under YIRAGE_ISA's cap")
    from yirage.backends.cpu import library as cpu_library

    flags = _host_flags()
    if not X86:
        want = 128 if ({"asimd", "neon"} & flags or platform.machine() == "arm64") else 0
    else:
        want = 512 if {"avx512f", "avx512bw", "f16c"} <= flags else 256 if {"avx2", "fma", "f16c"} <= flags else 0
    assert cpu_library.simd_bits() == want


def test_bad_levels_are_one_clear_error(monkeypatch):
    monkeypatch.setenv("YIRAGE_ISA", "avx9")
    with pytest.raises(ConfigError, match="YIRAGE_ISA='avx9' is not an instruction-set level: use one of native, avx2"):
        machine.isa_cap()
    monkeypatch.setenv("YIRAGE_ISA", "x86-64-v3")
    if not X86:
        with pytest.raises(ConfigError, match="caps an x86-64 CPU"):
            machine.isa_cap()
    elif {"avx2", "fma", "f16c", "bmi2", "movbe"} <= _host_flags():
        assert machine.isa_cap() == "x86-64-v3"
    else:
        with pytest.raises(ConfigError, match="above this CPU"):
            machine.isa_cap()


def test_yirage_info_names_the_level_and_the_precisions():
    env = {**os.environ, "YIRAGE_ISA": "avx9"}
    out = subprocess.run([sys.executable, "-m", "yirage.cli", "info"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "yirage: error: YIRAGE_ISA='avx9' is not an instruction-set level: use one of native, avx2, x86-64-v3, "
        "x86-64-v2 (or unset it for the CPU's own)"]
    out = subprocess.run([sys.executable, "-m", "yirage.cli", "info"], capture_output=True, text=True, timeout=300)
    line = next(x for x in out.stdout.splitlines() if x.startswith("CPU instruction set:"))
    bf16 = {"avx512_bf16", "amx_bf16", "avx_ne_convert", "bf16"} & machine.isa_flags()
    assert ("bfloat16 native" in line) == bool(bf16) and ("bfloat16 emulated" in line) == (not bf16)


def test_an_emulated_precision_warns_once_with_what_it_measured(monkeypatch):
    """Asked for bfloat16 on a CPU without a bfloat16 dot product: one EmulatedPrecisionWarning
    naming the measured speed against float32 (kept in the machine profile), then none."""
    monkeypatch.setattr(cpu_precision, "native_precision_flag", lambda d: None)
    monkeypatch.setattr(cpu_precision, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu_precision.warn_if_emulated("bfloat16", "EmbeddingModel(dtype='bfloat16')")
        cpu_precision.warn_if_emulated("bfloat16", "EmbeddingModel(dtype='bfloat16')")
    assert [w.category for w in caught] == [EmulatedPrecisionWarning]
    measured = cpu_precision.measured_speed("bfloat16")
    text = str(caught[0].message)
    assert text.startswith("EmbeddingModel(dtype='bfloat16'): bfloat16 is emulated on this CPU")
    assert f"{measured['speed_vs_float32']:.2f}x float32's speed" in text and "It runs as asked." in text
    assert measured["shape"] == "128x768x768" and measured["threads"] == torch.get_num_threads()
    assert measured["speed_vs_float32"] > 0


def test_a_native_precision_does_not_warn(monkeypatch):
    monkeypatch.setattr(cpu_precision, "native_precision_flag", lambda d: "avx512_bf16")
    monkeypatch.setattr(cpu_precision, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmulatedPrecisionWarning)
        cpu_precision.warn_if_emulated("bfloat16", "LLM(prefill_dtype='bfloat16')")


def test_the_engines_warn_where_the_cpu_emulates(monkeypatch):
    """EmbeddingModel(dtype='bfloat16') on a CPU without a bfloat16 dot product warns (and runs)."""
    monkeypatch.setattr(cpu_precision, "native_precision_flag", lambda d: None)
    monkeypatch.setattr(cpu_precision, "_warned", set())
    with pytest.warns(EmulatedPrecisionWarning, match=r"EmbeddingModel\(dtype='bfloat16'\): bfloat16 is emulated"):
        m = yr.EmbeddingModel(backend="cpu", dtype="bfloat16")
    assert m.encode(["a short sentence"]).shape == (1, m.get_sentence_embedding_dimension())
