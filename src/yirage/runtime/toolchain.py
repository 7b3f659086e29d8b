"""Builds generated C++ into shared libraries and loads them with ctypes.

Libraries are cached on disk by the hash of (source, compiler, flags) under
``$YIRAGE_CACHE_DIR/cpp``. A build writes to a private temporary file and is moved into
place with ``os.replace`` (atomic on POSIX), so concurrent processes never see a
half-written library. Loaded libraries are also memoized per process.

This module must never generate code: it only builds and loads what it is given.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..config import cache_dir, logger
from ..errors import ToolchainError

CXXFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17",
            "-fno-math-errno", "-ffp-contract=fast"]

_INSTALL_HINT = ("install a C++ compiler with OpenMP (Debian/Ubuntu: 'apt-get install g++'; "
                 "Fedora: 'dnf install gcc-c++'; macOS: 'brew install gcc'), "
                 "or point the CXX environment variable at one")


@functools.lru_cache(maxsize=1)
def find_compiler() -> tuple[str, str]:
    """Return (path, version line) of the C++ compiler: ``$CXX``, else g++, else c++.

    Raises:
        ToolchainError: no compiler found; the message says how to install one.
    """
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            try:
                out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
            except OSError:
                continue
            return path, (out.stdout.splitlines() or ["unknown"])[0]
    raise ToolchainError(f"no C++ compiler found (tried {', '.join(candidates)}): {_INSTALL_HINT}")


def library_path(source: str) -> Path:
    """Where the library built from ``source`` is cached (it may not exist yet)."""
    cxx, version = find_compiler()
    key = hashlib.sha256("\0".join([source, cxx, version, *CXXFLAGS]).encode()).hexdigest()[:24]
    return cache_dir() / "cpp" / f"k_{key}.so"


@functools.lru_cache(maxsize=None)
def load_library(source: str) -> ctypes.CDLL:
    """Build ``source`` (if not cached) and load it.

    Args:
        source: a complete C++ translation unit whose entry points are ``extern "C"``.

    Raises:
        ToolchainError: no compiler, or the compiler rejected the source (message holds
        the first compiler errors and the path of the saved source).
    """
    path = library_path(source)
    if not path.exists():
        _build(source, path)
    return ctypes.CDLL(str(path))


def _build(source: str, path: Path) -> None:
    cxx, _ = find_compiler()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(source)
        out = Path(tmp) / path.name
        cmd = [cxx, *CXXFLAGS, str(src), "-o", str(out)]
        logger.debug("building %s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            keep = path.with_suffix(".failed.cpp")
            keep.write_text(source)
            err = "\n".join(proc.stderr.strip().splitlines()[:20])
            raise ToolchainError(f"C++ compiler failed on generated kernel (source kept at {keep}): {err}")
        os.replace(out, path)  # atomic: other processes see the old state or the whole file
