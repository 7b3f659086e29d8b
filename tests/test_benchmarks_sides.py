"""benchmarks/_sides.py: each side of a benchmark in its own process, timed in interleaved rounds.

The sides here are tiny classes of this module, built in their workers by name: one that
answers, and ones that segfault, abort, hang or raise. The harness must report each failure
as what it is while the answering side's figures still come back, round after round.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import _sides  # noqa: E402
import llama_cpp_cmake_args  # noqa: E402

HERE = [str(Path(__file__).resolve().parent), str(BENCHMARKS)]


def spec(cls: str, threads: int | None = None, **kwargs) -> "_sides.SideSpec":
    """A side of this module, built in its worker from this file's directory."""
    return _sides.SideSpec(f"{Path(__file__).stem}:{cls}", kwargs=kwargs, threads=threads, path=HERE)


class Steady:
    """Answers every sample: its pid, the clock when the sample started, its thread settings."""

    def __init__(self, seconds: float = 0.001, torch_threads: bool = False):
        self.seconds = seconds
        self.info = {"pid": os.getpid(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
        if torch_threads:
            import torch
            self.info["torch_threads"] = torch.get_num_threads()

    def sample(self, **request):
        t0 = time.monotonic()            # CLOCK_MONOTONIC: comparable across processes
        time.sleep(self.seconds)
        return {"seconds": self.seconds, "scale": request.get("scale", 1)}, {"pid": os.getpid(), "t0": t0}


class Segfault(Steady):
    def sample(self, **request):
        sys.stderr.write("reading address 0\n")
        sys.stderr.flush()
        ctypes.string_at(0)


class Abort(Steady):
    def sample(self, **request):
        os.abort()


class Hang(Steady):
    def sample(self, **request):
        time.sleep(3600)


class Raises(Steady):
    def sample(self, **request):
        raise ValueError("no figure today")


class CrashesAtSetup:
    def __init__(self):
        sys.stderr.write("loading the model\n")
        sys.stderr.flush()
        ctypes.string_at(0)


def test_failing_sides_are_reported_and_the_others_still_measure():
    with _sides.Sides(timeout_s=3.0, setup_timeout_s=60.0) as sides:
        for name, cls in (("a", "Steady"), ("segv", "Segfault"), ("abort", "Abort"), ("hang", "Hang"),
                          ("raises", "Raises"), ("b", "Steady")):
            assert sides.start(name, spec(cls, threads=1))
        assert not sides.start("setup_crash", spec("CrashesAtSetup"))
        sides.skip("absent", "not installed")
        rounds = sides.rounds(3, {"scale": 2})

    assert [sorted(r) for r in rounds] == [["a", "b"]] * 3                  # both answered every round
    assert all(r["a"][0] == {"seconds": 0.001, "scale": 2} for r in rounds)
    assert sides.info["a"]["pid"] != os.getpid() != sides.info["b"]["pid"] != sides.info["a"]["pid"]
    assert sides.info["a"]["omp_num_threads"] == "1"

    f = sides.failures
    assert f["segv"]["status"] == "crashed" and f["segv"]["signal"] == "SIGSEGV" and f["segv"]["exit_code"] < 0
    assert "reading address 0" in f["segv"]["stderr_tail"]
    assert f["abort"]["status"] == "crashed" and f["abort"]["signal"] == "SIGABRT"
    assert f["hang"]["status"] == "timed out" and f["hang"]["after_s"] >= 3.0
    assert f["raises"]["status"] == "failed" and f["raises"]["error"] == "ValueError: no figure today"
    assert f["setup_crash"]["phase"] == "setup" and f["setup_crash"]["signal"] == "SIGSEGV"
    assert "loading the model" in f["setup_crash"]["stderr_tail"]
    assert sides.report("absent") == {"status": "skipped", "reason": "not installed"}
    assert sides.report("a", {"x": 1})["status"] == "ok" and sides.report("a", {"x": 1})["x"] == 1


def test_rounds_interleave_the_sides_in_rotated_order():
    with _sides.Sides(timeout_s=30.0) as sides:
        for name in ("a", "b", "c"):
            sides.start(name, spec("Steady", seconds=0.02))
        rounds = sides.rounds(4, {})
    starts = [(out["t0"], r, name) for r, got in enumerate(rounds) for name, (_, out) in got.items()]
    order = [(r, name) for _, r, name in sorted(starts)]
    rotation = [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert order == [(r, n) for r in range(4) for n in rotation[r]]
    cmp = _sides.comparison(rounds, "seconds", ["a", "b"])
    assert len(cmp.rounds) == 4 and cmp.ratio("a", "b") == 1.0


def test_comparison_keeps_only_rounds_every_side_answered():
    rounds = [{"a": ({"s": 1.0}, None), "b": ({"s": 2.0}, None)}, {"a": ({"s": 3.0}, None)},
              {"a": ({"s": 2.0}, None), "b": ({"s": 8.0}, None)}]
    cmp = _sides.comparison(rounds, "s", ["a", "b"])
    assert cmp.rounds == [{"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 8.0}]
    assert cmp.ratios("a", "b") == [0.5, 0.25]
    assert _sides.comparison(rounds[1:2], "s", ["a", "b"]) is None


def test_worker_sets_torch_threads():
    with _sides.Sides(timeout_s=60.0, setup_timeout_s=120.0) as sides:
        assert sides.start("t", spec("Steady", torch_threads=True, threads=1))
    assert sides.info["t"]["torch_threads"] == 1 and sides.info["t"]["omp_num_threads"] == "1"


@pytest.mark.parametrize("flags,on,off", [
    # an AMX Xeon (Sapphire Rapids): everything up to AVX512-BF16, never AMX
    ("sse4_2 avx avx2 bmi2 fma f16c avx_vnni avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi "
     "avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16",
     {"GGML_AVX2", "GGML_AVX512", "GGML_AVX512_BF16", "GGML_AVX_VNNI"},
     {"GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"}),
    # an AVX-only CPU (Sandy Bridge): ggml's default-ON AVX2/FMA/F16C/BMI2 must be switched off
    ("sse4_2 avx", {"GGML_SSE42", "GGML_AVX"},
     {"GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AVX512", "GGML_AVX_VNNI"}),
    # AVX512F without the BW/DQ/VL subsets (Knights Landing): GGML_AVX512 adds -mavx512bw, so off
    ("sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd", {"GGML_AVX2"}, {"GGML_AVX512", "GGML_AVX512_VNNI"}),
])
def test_llama_cpp_cmake_args(flags, on, off):
    args = llama_cpp_cmake_args.cmake_args(set(flags.split()))
    values = dict(a.removeprefix("-D").split("=") for a in args)
    assert set(values) == {"GGML_NATIVE", *llama_cpp_cmake_args.X86_OPTIONS, *llama_cpp_cmake_args.AMX_OPTIONS}
    assert {k for k in on if values[k] != "ON"} == set() and {k for k in off if values[k] != "OFF"} == set()
    cpuinfo = f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    assert llama_cpp_cmake_args.cpu_flags(cpuinfo) == set(flags.split())
    assert llama_cpp_cmake_args.cpu_flags("processor\t: 0\nFeatures\t: fp asimd\n") is None


def test_llama_cpp_cmake_args_under_an_isa_cap():
    """YIRAGE_ISA=avx2 builds llama.cpp as for an AVX2-only CPU (the x86-64-v3 level), like yirage's own kernels."""
    zen5 = set("sse4_2 avx avx2 fma f16c bmi2 avx_vnni avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi "
               "avx512_vnni avx512_bf16".split())
    for isa in ("avx2", "x86-64-v3"):
        values = dict(a.removeprefix("-D").split("=") for a in
                      llama_cpp_cmake_args.cmake_args(llama_cpp_cmake_args.capped(zen5, isa)))
        assert {k for k, v in values.items() if v == "ON"} == {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2",
                                                             "GGML_FMA", "GGML_F16C"}
    assert llama_cpp_cmake_args.capped(zen5, None) == zen5 == llama_cpp_cmake_args.capped(zen5, "native")
    values = dict(a.removeprefix("-D").split("=") for a in
                  llama_cpp_cmake_args.cmake_args(llama_cpp_cmake_args.capped(zen5, "x86-64-v2")))
    assert {k for k, v in values.items() if v == "ON"} == {"GGML_SSE42"}
