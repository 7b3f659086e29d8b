"""The C++ toolchain: on-disk cache by source hash, concurrent builds, missing compiler."""
import os
import multiprocessing as mp
import subprocess
import sys

import pytest

from yirage.errors import ToolchainError
from yirage.runtime import toolchain

SOURCE = 'extern "C" int yr_answer(int x) { return x + %d; }\n'


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path))
    toolchain.load_library.cache_clear()
    yield tmp_path
    toolchain.load_library.cache_clear()


def test_build_load_and_cache(fresh_cache):
    lib = toolchain.load_library(SOURCE % 1)
    assert lib.yr_answer(41) == 42
    built = list((fresh_cache / "cpp").glob("*.so"))
    assert len(built) == 1 and built[0] == toolchain.library_path(SOURCE % 1)
    toolchain.load_library.cache_clear()
    mtime = built[0].stat().st_mtime_ns
    toolchain.load_library(SOURCE % 1)  # cached on disk: not rebuilt
    assert built[0].stat().st_mtime_ns == mtime


def _build_in_child(cache, n, q):
    import os
    os.environ["YIRAGE_CACHE_DIR"] = cache
    from yirage.runtime import toolchain as tc
    q.put(tc.load_library(SOURCE % n).yr_answer(0))


def test_concurrent_processes_share_the_cache(fresh_cache):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(fresh_cache), 7, q)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert sorted(q.get() for _ in procs) == [7] * 4
    assert len(list((fresh_cache / "cpp").glob("*.so"))) == 1
    assert not list((fresh_cache / "cpp").glob(".build-*"))


def test_compile_error_keeps_source(fresh_cache):
    with pytest.raises(ToolchainError, match=r"C\+\+ compiler failed"):
        toolchain.load_library("this is not C++")
    assert list((fresh_cache / "cpp").glob("*.failed.cpp"))


def test_missing_compiler_says_how_to_install(fresh_cache):
    code = ("import yirage as yr\n"
            "g = yr.new_kernel_graph(backend='cpu'); x = g.new_input((2, 3)); g.mark_output(g.exp(x))\n"
            "import torch\n"
            "try:\n    g(inputs=[torch.randn(2, 3)])\n"
            "except yr.ToolchainError as e:\n    print('ERR', e)\n")
    env = {"CXX": "/nonexistent/g++", "YIRAGE_CACHE_DIR": str(fresh_cache), "PATH": "/usr/bin:/bin", **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "ERR no C++ compiler found" in out.stdout and "apt-get install g++" in out.stdout


def test_kernels_digest_follows_the_kernel_sources(tmp_path, monkeypatch):
    """The tuning profile's key carries this digest: it must change with any kernel source (C++
    or Triton) and with nothing else in the package (build outputs, caches)."""
    from importlib import resources

    from yirage.tuning import profile as tuning

    (tmp_path / "cpu").mkdir()
    (tmp_path / "triton").mkdir()
    (tmp_path / "cpu" / "library.cpp").write_text("int a;\n")
    (tmp_path / "cpu" / "tiles.h").write_text("int b;\n")
    (tmp_path / "triton" / "gemm.py").write_text("x = 1\n")
    monkeypatch.setattr(resources, "files", lambda pkg: tmp_path)

    def digest():
        toolchain.kernels_digest.cache_clear()
        return toolchain.kernels_digest()
    try:
        first = digest()
        (tmp_path / "triton" / "gemm.pyc").write_bytes(b"\0")
        (tmp_path / "cpu" / "notes.txt").write_text("not a source")
        assert digest() == first
        seen = {first}
        for name, text in (("cpu/tiles.h", "int c;\n"), ("triton/gemm.py", "x = 2\n"), ("cpu/extra.cpp", "")):
            (tmp_path / name).write_text(text)
            seen.add(digest())
        assert len(seen) == 4
        tuning.machine_key.cache_clear()
        assert tuning.machine_identity()["kernels"] == digest()[:16]
    finally:
        toolchain.kernels_digest.cache_clear()
        tuning.machine_key.cache_clear()


def test_prebuild_builds_each_kernel_library_once(fresh_cache, monkeypatch, capsys):
    """``python -m yirage.runtime.toolchain`` (make setup's last step) builds the hand-written
    libraries in parallel into the cache that their loaders then read without a compiler run.
    Two small ones stand for all (the CPU library takes about 20 s)."""
    monkeypatch.setattr(toolchain, "kernel_libraries", lambda: ("indexing", "strided"))
    assert toolchain.main(["--jobs", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["indexing", "strided"]
    assert all(" built in " in ln for ln in lines)
    for name, path, built, seconds in toolchain.prebuild():
        assert not built and seconds >= 0
        assert path == toolchain.library_path(toolchain.kernel_library_sources(name))
        assert toolchain.verify_library(path) is None
    from yirage.backends.cpu import indexing as cpu_indexing

    before = toolchain.builds()
    cpu_indexing.library.cache_clear()
    try:
        assert cpu_indexing.library() is not None
        assert toolchain.builds() == before   # the loader found the prebuilt library
    finally:
        cpu_indexing.library.cache_clear()


def test_every_kernel_source_is_in_one_library():
    units = [u for name in toolchain.kernel_libraries() for u in toolchain.KERNEL_LIBRARIES[name]]
    assert sorted(units) == sorted(p.name for p in toolchain.kernel_dir().glob("*.cpp"))


UNIT_A = 'extern "C" int yr_twice(int x) { return 2 * x; }\n'
UNIT_B = 'extern "C" int yr_twice(int x);\nextern "C" int yr_quad(int x) { return yr_twice(yr_twice(x)) + %d; }\n'


def test_several_translation_units_link_into_one_library(fresh_cache):
    lib = toolchain.load_library((UNIT_A, UNIT_B % 0), symbols=("yr_twice", "yr_quad"))
    assert lib.yr_quad(3) == 12 and lib.yr_twice(5) == 10
    assert toolchain.library_path((UNIT_A, UNIT_B % 0)) != toolchain.library_path(UNIT_A + UNIT_B % 0)
    assert toolchain.library_path((UNIT_A, UNIT_B % 0)) != toolchain.library_path((UNIT_A, UNIT_B % 1))
    assert len(list((fresh_cache / "cpp").glob("*.so"))) == 1
    with pytest.raises(ToolchainError, match=r"C\+\+ compiler failed"):
        toolchain.load_library((UNIT_A, "this is not C++"))
    kept = list((fresh_cache / "cpp").glob("*.failed.cpp"))
    assert len(kept) == 1 and kept[0].name.endswith(".1.failed.cpp") and kept[0].read_text() == "this is not C++"


def test_openmp_flags_are_probed_once_per_compiler_and_remembered(fresh_cache, tmp_path, caplog):
    """A compiler without OpenMP (a stand-in that refuses -fopenmp) gets -fopenmp-simd and one
    warning; the answer is kept in the cache, so a later process does not probe again."""
    import logging

    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\ncase \"$*\" in *--version*) echo 'fake c++ 1.0';; *-fopenmp*) exit 1;; "
                    "*) exec g++ \"$@\";; esac\n")
    fake.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="yirage"):
        assert toolchain.openmp_flags(str(fake)) == ("-fopenmp-simd",)
    assert any("has no OpenMP" in r.getMessage() for r in caplog.records)
    memo = list((fresh_cache / "cpp").glob("openmp-*.flags"))
    assert len(memo) == 1 and memo[0].read_text() == "-fopenmp-simd"
    toolchain._openmp_flags.cache_clear()
    fake.write_text("#!/bin/sh\necho 'fake c++ 1.0'\nexit 1\n")   # probing again would now fail differently
    assert toolchain.openmp_flags(str(fake)) == ("-fopenmp-simd",)   # read from the cache, not probed
    toolchain._openmp_flags.cache_clear()
