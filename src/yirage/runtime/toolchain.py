"""Builds C++ into shared libraries and loads them with ctypes.

A translation unit is built with the system compiler (``CXXFLAGS``, plus ``-I`` for the
kernel sources of ``yirage/kernels/cpu``, so generated code can include
``yirage_prelude.h``). Libraries are cached on disk under ``$YIRAGE_CACHE_DIR/cpp`` by a
hash of everything that decides the binary: the source, the contents of every header in
``kernels/cpu``, the compiler's path and version line, and the flags. A build writes to a
private temporary file and is moved into place with ``os.replace`` (atomic on POSIX), so
concurrent processes never see a half-written library. Loaded libraries are also memoized
per process.

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
from importlib import resources
from pathlib import Path
from typing import Sequence

from ..config import cache_dir, logger
from ..errors import ToolchainError

CXXFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17",
            "-fno-math-errno", "-ffp-contract=fast")

_INSTALL_HINT = ("install a C++ compiler with OpenMP (Debian/Ubuntu: 'apt-get install g++'; "
                 "Fedora: 'dnf install gcc-c++'; macOS: 'brew install gcc'), "
                 "or point the CXX environment variable at one")


def kernel_dir() -> Path:
    """The directory of the hand-written C++ sources (``yirage/kernels/cpu``)."""
    return Path(str(resources.files("yirage.kernels") / "cpu"))


def kernel_source(name: str) -> str:
    """The text of ``yirage/kernels/cpu/<name>`` (e.g. ``library.cpp``)."""
    return (kernel_dir() / name).read_text()


@functools.lru_cache(maxsize=1)
def _headers_digest() -> str:
    """sha256 over the names and contents of every header in kernels/cpu."""
    h = hashlib.sha256()
    for path in sorted(kernel_dir().glob("*.h")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


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


def library_path(source: str, flags: Sequence[str] = CXXFLAGS) -> Path:
    """Where the library built from ``source`` with ``flags`` is cached (it may not exist yet)."""
    cxx, version = find_compiler()
    parts = [source, _headers_digest(), cxx, version, *flags]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
    return cache_dir() / "cpp" / f"k_{key}.so"


@functools.lru_cache(maxsize=None)
def load_library(source: str, flags: Sequence[str] = CXXFLAGS) -> ctypes.CDLL:
    """Build ``source`` (if not cached) and load it.

    Args:
        source: a complete C++ translation unit whose entry points are ``extern "C"``;
            it may include the headers of ``yirage/kernels/cpu``.
        flags: compiler flags (a tuple, so that the call can be memoized).

    Raises:
        ToolchainError: no compiler, or the compiler rejected the source (message holds
        the first compiler errors and the path of the saved source).
    """
    flags = tuple(flags)
    path = library_path(source, flags)
    if not path.exists():
        _build(source, path, flags)
    return ctypes.CDLL(str(path))


def _build(source: str, path: Path, flags: tuple[str, ...]) -> None:
    cxx, _ = find_compiler()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(source)
        out = Path(tmp) / path.name
        cmd = [cxx, *flags, f"-I{kernel_dir()}", str(src), "-o", str(out)]
        logger.debug("building %s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            keep = path.with_suffix(".failed.cpp")
            keep.write_text(source)
            err = "\n".join(proc.stderr.strip().splitlines()[:20])
            raise ToolchainError(f"C++ compiler failed on generated kernel (source kept at {keep}): {err}")
        os.replace(out, path)  # atomic: other processes see the old state or the whole file
