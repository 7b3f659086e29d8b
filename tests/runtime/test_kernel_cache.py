"""The on-disk kernel cache survives damage: every C++ library is loaded only after its
size and sha256 matched its checksum file, a damaged entry is rebuilt once with one
warning, a damaged Triton module file is rewritten, and an unusable cache directory falls
back to a private per-user directory (GitHub issue 6).

Cases that would kill the process with a signal if the check regressed (a truncated
library is mapped and then faults with SIGBUS) run in a child process, so a regression
fails the test instead of killing the test runner.
"""
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from yirage import config
from yirage.errors import CacheError, ToolchainError, YirageError
from yirage.runtime import toolchain, triton_kernels

SOURCE = 'extern "C" int yr_cache_probe(int x) { return x + 1; }\n'
OTHER = 'extern "C" int yr_cache_other(int x) { return x * 2; }\n'
SYMBOLS = ("yr_cache_probe",)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache root, a private fallback location, and cleared in-process memos."""
    root = tmp_path / "cache"
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(root))
    fallback_tmp = tmp_path / "tmp"
    fallback_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(fallback_tmp))
    toolchain.load_library.cache_clear()
    yield root
    toolchain.load_library.cache_clear()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "yirage" and r.levelno == logging.WARNING]


def _forge_checksum(path, data: bytes) -> None:
    """A checksum file for ``path`` that vouches for ``data`` (a well-formed lie)."""
    line = f"yirage-cpp-cache v1 size={len(data)} sha256={hashlib.sha256(data).hexdigest()} name={path.name}\n"
    toolchain.checksum_path(path).write_text(line)


def _damage(case: str, path) -> None:
    """Damage the cache entry at ``path`` (built, never loaded in this process)."""
    data = path.read_bytes()
    if case == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif case == "zero_bytes":
        path.write_bytes(b"")
    elif case == "random_bytes":
        path.write_bytes(os.urandom(len(data)))
    elif case == "other_kernel":
        shutil.copyfile(toolchain.build_library(OTHER), path)
    elif case == "other_kernel_with_its_checksum":
        other = toolchain.build_library(OTHER)
        shutil.copyfile(other, path)
        shutil.copyfile(toolchain.checksum_path(other), toolchain.checksum_path(path))
    elif case == "wrong_checksum":
        side = toolchain.checksum_path(path)
        side.write_text(side.read_text().replace("sha256=", "sha256=0000000000"))
    elif case == "missing_checksum":
        toolchain.checksum_path(path).unlink()
    elif case == "other_kernel_forged_checksum":  # verifies, then lacks the entry point
        other = toolchain.build_library(OTHER)
        shutil.copyfile(other, path)
        _forge_checksum(path, path.read_bytes())
    elif case == "unloadable_forged_checksum":  # verifies, then dlopen rejects it
        path.write_bytes(os.urandom(len(data)))
        _forge_checksum(path, path.read_bytes())
    else:
        raise AssertionError(case)


@pytest.mark.parametrize("case", ["zero_bytes", "random_bytes", "other_kernel",
                                  "other_kernel_with_its_checksum", "wrong_checksum",
                                  "missing_checksum", "other_kernel_forged_checksum",
                                  "unloadable_forged_checksum"])
def test_damaged_entry_is_rebuilt_once(cache, caplog, case):
    path = toolchain.build_library(SOURCE)
    assert toolchain.verify_library(path) is None
    _damage(case, path)
    # forged checksum files vouch for the damage; the load (dlopen/symbols) catches it
    assert (toolchain.verify_library(path) is None) == case.endswith("forged_checksum")
    with caplog.at_level(logging.WARNING, logger="yirage"):
        lib = toolchain.load_library(SOURCE, symbols=SYMBOLS)
        assert lib.yr_cache_probe(41) == 42
        assert toolchain.verify_library(path) is None
        toolchain.load_library.cache_clear()  # the repaired entry loads without a rebuild
        assert toolchain.load_library(SOURCE, symbols=SYMBOLS).yr_cache_probe(1) == 2
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0] and "rebuilding" in warnings[0]


_CHILD = textwrap.dedent("""
    import logging, sys
    from yirage.runtime import toolchain
    seen = []
    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    logging.getLogger("yirage").addHandler(Keep(logging.WARNING))
    lib = toolchain.load_library(sys.argv[1], symbols=("yr_cache_probe",))
    print("RESULT", lib.yr_cache_probe(41))
    print("REBUILD WARNINGS", sum("rebuilding" in m for m in seen), "OF", len(seen))
""")


@pytest.mark.parametrize("case", ["truncated", "zero_bytes", "random_bytes"])
def test_damaged_entry_never_crashes_a_process(cache, case):
    path = toolchain.build_library(SOURCE)  # built here, loaded only by the child
    _damage(case, path)
    proc = subprocess.run([sys.executable, "-c", _CHILD, SOURCE], capture_output=True, text=True,
                          env={**os.environ, "YIRAGE_CACHE_DIR": str(cache)}, timeout=300)
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RESULT 42" in proc.stdout and "REBUILD WARNINGS 1 OF 1" in proc.stdout, proc.stdout
    assert toolchain.verify_library(path) is None


def test_entry_format(cache):
    path = toolchain.build_library(SOURCE)
    data = path.read_bytes()
    assert toolchain.checksum_path(path).read_text() == (
        f"yirage-cpp-cache v1 size={len(data)} sha256={hashlib.sha256(data).hexdigest()} "
        f"name={path.name}\n")
    assert not list((cache / "cpp").glob(".build-*"))


def test_rebuilt_library_that_still_fails_raises(cache):
    with pytest.raises(ToolchainError, match="lacks the entry points yr_not_defined"):
        toolchain.load_library(SOURCE, symbols=("yr_not_defined",))


# ---- an unusable cache directory --------------------------------------------------------

def test_cache_dir_is_a_file_falls_back(cache, caplog, monkeypatch):
    afile = cache.parent / "not-a-dir"
    afile.write_text("x")
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(afile))
    with caplog.at_level(logging.WARNING, logger="yirage"):
        lib = toolchain.load_library(SOURCE, symbols=SYMBOLS)
        assert lib.yr_cache_probe(1) == 2
        assert config.cache_dir() == config.fallback_cache_dir()  # warned once per process
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert str(afile) in warnings[0] and "is a file" in warnings[0] and "YIRAGE_CACHE_DIR" in warnings[0]
    assert str(config.fallback_cache_dir()) in warnings[0]
    fallback = config.fallback_cache_dir()
    assert fallback.parent == cache.parent / "tmp" and (fallback.stat().st_mode & 0o777) == 0o700
    assert toolchain.verify_library(fallback / "cpp" / toolchain.library_path(SOURCE).name) is None


def _check_read_only_falls_back(cache, caplog):
    with caplog.at_level(logging.WARNING, logger="yirage"):
        assert toolchain.load_library(SOURCE, symbols=SYMBOLS).yr_cache_probe(1) == 2
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "is not writable" in warnings[0], warnings
    assert toolchain.library_path(SOURCE).parent == config.fallback_cache_dir() / "cpp"
    assert not (cache / "cpp").exists()


def test_read_only_cache_dir_falls_back(cache, caplog):
    cache.mkdir()
    cache.chmod(0o555)
    try:
        if os.access(cache, os.W_OK):
            pytest.skip("chmod does not stop this user (root) from writing")
        _check_read_only_falls_back(cache, caplog)
    finally:
        cache.chmod(0o755)


def test_read_only_cache_dir_falls_back_simulated(cache, caplog, monkeypatch):
    """The same, runnable as root: os.access says the cache root is not writable."""
    cache.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(cache)
                        else real_access(p, mode, **kw))
    _check_read_only_falls_back(cache, caplog)


def test_unusable_cache_subdir_falls_back(cache, caplog):
    cache.mkdir()
    (cache / "cpp").write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="yirage"):
        assert toolchain.load_library(SOURCE, symbols=SYMBOLS).yr_cache_probe(1) == 2
    assert len(_warnings(caplog)) == 1
    assert toolchain.library_path(SOURCE).parent == config.fallback_cache_dir() / "cpp"


@pytest.mark.parametrize("bad", ["file", "group_writable"])
def test_unusable_fallback_raises(cache, monkeypatch, bad):
    afile = cache.parent / "not-a-dir"
    afile.write_text("x")
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(afile))
    fallback = config.fallback_cache_dir()
    if bad == "file":
        fallback.write_text("x")
    else:
        fallback.mkdir()
        fallback.chmod(0o777)
    with pytest.raises(CacheError):
        config.cache_dir()
    with pytest.raises(CacheError) as info:
        toolchain.load_library(SOURCE)
    assert isinstance(info.value, YirageError)
    message = str(info.value)
    assert "\n" not in message and str(afile) in message and str(fallback) in message
    assert "point YIRAGE_CACHE_DIR at a writable directory" in message


# ---- the Triton module cache ------------------------------------------------------------

def _exp_graph(x):
    import yirage as yr
    g = yr.new_kernel_graph()
    t = g.new_input((3, 5))
    g.mark_output(g.exp(t))
    return g(inputs=[x], backend="triton-interpret")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_corrupt_triton_module_is_rewritten(cache, caplog):
    pytest.importorskip("triton")
    x = torch.randn(3, 5)
    out = _exp_graph(x)
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, torch.exp(x))
    files = list((cache / "triton").glob("k_*.py"))
    assert files
    for f in files:
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
    triton_kernels._modules.clear()
    with caplog.at_level(logging.WARNING, logger="yirage"):
        out = _exp_graph(x)
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, torch.exp(x))
    warnings = _warnings(caplog)
    assert len(warnings) == len(files) and all("rewriting" in w for w in warnings), warnings
    for f in files:
        assert f.stem == "k_" + hashlib.sha256(f.read_bytes()).hexdigest()[:24]
    assert not list((cache / "triton").glob("__pycache__"))
