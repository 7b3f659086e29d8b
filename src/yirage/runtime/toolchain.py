"""Builds C++ into shared libraries and loads them with ctypes, from a verified disk cache.

A translation unit is built with the system compiler (``cxx_flags()``, plus ``-I`` for the
kernel sources of ``yirage/kernels/cpu``, so generated code can include
``yirage_prelude.h``); a library of several units (``load_library`` given a tuple: the
hand-written CPU library, ``KERNEL_LIBRARIES``) has them compiled to objects in parallel and
linked. Libraries are cached on disk under ``$YIRAGE_CACHE_DIR/cpp`` by a hash of everything
that decides the binary: the sources, the contents of every header in ``kernels/cpu``, the
compiler's path and version line, and the flags. ``prebuild`` (``python -m
yirage.runtime.toolchain``, the last step of ``make setup``) builds the hand-written ones
ahead of their first use.

A cache entry is two files: the library ``k_<key>.so`` and its checksum file
``k_<key>.sha256``, one line ``yirage-cpp-cache v1 size=<bytes> sha256=<hex> name=k_<key>.so``.
A build compiles into a private temporary directory, moves the library into place with
``os.replace`` (atomic on POSIX) and then, the same way, its checksum file; builders of one
entry are serialized by an ``flock`` on ``k_<key>.lock``, and a process that waited for the
lock finds the entry built and does not build it again. Before a library is loaded its size
and sha256 must match the checksum file; an entry that does not (truncated, corrupt,
another library's bytes, no or a foreign checksum file) is treated as absent: it is rebuilt
once, with a warning on the ``yirage`` logger, and so is a verified library that ``dlopen``
rejects or that lacks an entry point the caller asked for. If the rebuilt entry fails
again, ``ToolchainError`` is raised. Loaded libraries are also memoized per process.

Build flags per target (``cxx_flags``): ``-march=native`` on x86-64, or the ``YIRAGE_ISA`` cap's
level (``-march=x86-64-v3 -mtune=native``: the AVX2 paths of every kernel, as an AVX2-only CPU
builds them); ``-mcpu=native`` on Arm; ``-fopenmp`` where the compiler has OpenMP, Homebrew's
libomp for Apple's clang, else (or under ``YIRAGE_OPENMP=0``) ``-fopenmp-simd`` alone: the
kernels then run on yirage's own thread pool (``kernels/cpu/yr_threads.h``), with one warning
where the compiler lacks OpenMP.

This module must never generate code (it only builds and loads what it is given), and
must never ``dlopen`` a cached file whose checksum has not just matched: mapping a
truncated library kills the process with SIGBUS.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import itertools
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Iterator, Sequence

from ..config import cache_subdir, logger
from ..errors import CacheError, ToolchainError

try:
    import fcntl
except ImportError:  # not POSIX: builders are not serialized (writes stay atomic)
    fcntl = None

#: flags of every build besides the target's (``target_flags``) and OpenMP's (``openmp_flags``).
#: ``-fno-trapping-math`` (no floating-point trap is ever enabled; no result changes): without it
#: g++ 12 will not if-convert a compare-and-select (std::max, the clamp of yr_exp) into a blend
#: for AVX2 or NEON, and every row loop holding one stays scalar: softmax at -march=x86-64-v3 (and
#: znver3) ran 0.25x torch eager, AVX-512's masked selects were spared.
BASE_CXXFLAGS = ("-O3", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno", "-fno-trapping-math",
                 "-ffp-contract=fast")

_INSTALL_HINT = ("install a C++ compiler with OpenMP (Debian/Ubuntu: 'apt-get install g++'; "
                 "Fedora: 'dnf install gcc-c++'; macOS: 'brew install gcc'), "
                 "or point the CXX environment variable at one")

_CHECKSUM_HEADER = "yirage-cpp-cache v1"
#: ``_verify`` result for an entry whose library does not exist (built without a warning).
MISSING = "is missing"
#: Numbers the retry spellings of a library path (see ``load_library``).
_respell = itertools.count(1)
#: Library path -> the spelling its rebuilt file was loaded under in this process (the
#: plain path still names the rejected handle here).
_spellings: dict[str, str] = {}


def target_flags() -> tuple[str, ...]:
    """The code-generation target: ``-march=native`` on x86-64 (``-march=<level> -mtune=native``
    under ``YIRAGE_ISA``'s cap), ``-mcpu=native`` elsewhere (Arm: NEON, and dotprod/i8mm/bf16
    where the CPU has them). Raises ConfigError for a bad ``YIRAGE_ISA``."""
    from .machine import is_x86, isa_cap

    level = isa_cap()
    if level != "native":
        return (f"-march={level}", "-mtune=native")
    return ("-march=native",) if is_x86() else ("-mcpu=native",)


#: where Homebrew installs libomp (Apple's clang has OpenMP's pragmas but not its runtime)
_LIBOMP_PREFIXES = ("/opt/homebrew/opt/libomp", "/usr/local/opt/libomp")


#: ``YIRAGE_OPENMP=0`` builds every kernel without OpenMP (``openmp_flags``).
OPENMP_ENV = "YIRAGE_OPENMP"


def openmp_flags(cxx: str | None = None) -> tuple[str, ...]:
    """The flags that give the compiler ``cxx`` (default ``find_compiler``'s) OpenMP: ``-fopenmp``
    where a probe program builds with it, else libomp's ``-Xpreprocessor -fopenmp ... -lomp`` where
    Homebrew's is installed, else ``-fopenmp-simd`` alone, with one warning. Without OpenMP the
    ``omp simd`` loops still vectorize and the kernels' parallel loops run on yirage's own thread
    pool (``kernels/cpu/yr_threads.h``: ``OMP_NUM_THREADS`` threads, else one per hardware
    thread). ``YIRAGE_OPENMP=0`` in the environment forces that build (``-fopenmp-simd`` alone,
    no probe, no warning) on any compiler; the flags are part of every cache key, so the two
    builds are cached apart. Probed once per compiler (its path and version line) and remembered
    in the kernel cache: a probe compiles and links a program, about 40 ms that every process's
    first kernel waited for."""
    if os.environ.get(OPENMP_ENV, "").strip() == "0":
        return ("-fopenmp-simd",)
    return _openmp_flags(cxx or find_compiler()[0])


@functools.lru_cache(maxsize=None)
def _openmp_flags(cxx: str) -> tuple[str, ...]:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1] \
        if cxx != find_compiler()[0] else [find_compiler()[1]]
    memo = cache_folder("cpp") / f"openmp-{hashlib.sha256(chr(0).join([cxx, *version]).encode()).hexdigest()[:16]}.flags"
    try:
        known = memo.read_text().split()
        if known and all(f.startswith("-") for f in known):
            return tuple(known)
    except OSError:
        pass
    flags = _probe_openmp(cxx)
    try:   # written whole under another name, then renamed: a reader sees all of it or nothing
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(" ".join(flags))
        os.replace(tmp, memo)
    except OSError:
        pass
    return flags


def _probe_openmp(cxx: str) -> tuple[str, ...]:
    """The OpenMP flags of ``openmp_flags``, found by building a probe program with each."""
    probe = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
    tries = [("-fopenmp",)] + [("-Xpreprocessor", "-fopenmp", f"-I{p}/include", f"-L{p}/lib", "-lomp")
                               for p in _LIBOMP_PREFIXES if os.path.isdir(p)]
    with tempfile.TemporaryDirectory(prefix="yirage-omp-") as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(probe)
        for flags in tries:
            try:
                ok = subprocess.run([cxx, *flags, str(src), "-o", str(Path(tmp) / "probe")],
                                    capture_output=True, timeout=120).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
            if ok:
                return flags
    logger.warning("the C++ compiler %s has no OpenMP (macOS: 'brew install libomp'): yirage's CPU kernels "
                   "will run on yirage's own thread pool instead of OpenMP's", cxx)
    return ("-fopenmp-simd",)


def cxx_flags() -> tuple[str, ...]:
    """The flags of every kernel build on this machine now: ``-O3``, ``target_flags()``,
    ``openmp_flags()`` and ``BASE_CXXFLAGS``' rest. Part of every cache key, so a ``YIRAGE_ISA``
    cap builds (and caches) its own libraries. Raises ConfigError for a bad ``YIRAGE_ISA``,
    ToolchainError without a compiler."""
    return (BASE_CXXFLAGS[0], *target_flags(), *openmp_flags(), *BASE_CXXFLAGS[1:])


def kernel_dir() -> Path:
    """The directory of the hand-written C++ sources (``yirage/kernels/cpu``)."""
    return Path(str(resources.files("yirage.kernels") / "cpu"))


def kernel_source(name: str) -> str:
    """The text of ``yirage/kernels/cpu/<name>`` (e.g. ``library.cpp``)."""
    return (kernel_dir() / name).read_text()


#: The hand-written C++ libraries: name -> the translation units of ``yirage/kernels/cpu``
#: linked into it. A library of several units has them compiled in parallel (the CPU library
#: as one unit took g++ 12 about 30 s; its three share ``library_core.h``).
KERNEL_LIBRARIES: dict[str, tuple[str, ...]] = {
    "library": ("library.cpp", "library_quants.cpp", "library_encoder.cpp"),
    "persistent": ("persistent.cpp",),
    "strided": ("strided.cpp",),
    "indexing": ("indexing.cpp",),
    "conv": ("conv.cpp",),
    "allreduce": ("allreduce.cpp",),
}


def kernel_library_sources(name: str) -> tuple[str, ...]:
    """The source texts of the hand-written library ``name`` (a key of ``KERNEL_LIBRARIES``),
    one per translation unit, the form ``load_library`` takes."""
    return tuple(kernel_source(unit) for unit in KERNEL_LIBRARIES[name])


def load_kernel_library(name: str, flags: Sequence[str] | None = None, symbols: Sequence[str] = ()) -> ctypes.CDLL:
    """``load_library`` of the hand-written library ``name`` (a key of ``KERNEL_LIBRARIES``),
    e.g. ``load_kernel_library("strided", symbols=("yr_strided_copy",))``; ``flags`` default to
    ``cxx_flags()``. Raises as ``load_library``."""
    return load_library(kernel_library_sources(name), tuple(flags or cxx_flags()), tuple(symbols))


def cache_folder(name: str) -> Path:
    """``$YIRAGE_CACHE_DIR/<name>``, created if missing (or its fallback, see
    ``config.cache_dir``).

    Raises:
        CacheError: neither the cache directory nor the per-user fallback is usable.
    """
    return cache_subdir(name)


@functools.lru_cache(maxsize=1)
def _headers_digest() -> str:
    """sha256 over the names and contents of every header in kernels/cpu."""
    h = hashlib.sha256()
    for path in sorted(kernel_dir().glob("*.h")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def kernels_digest() -> str:
    """sha256 (hex) over the names and contents of every hand-written kernel source (the C++
    files of kernels/cpu, the Triton modules of kernels/triton, the WGSL of kernels/webgpu): a measurement of a kernel is
    valid for this digest only (``tuning.machine_identity``)."""
    h = hashlib.sha256()
    root = Path(str(resources.files("yirage.kernels")))
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in (".h", ".cpp", ".py", ".wgsl"):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
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


def _units(source: str | Sequence[str]) -> tuple[str, ...]:
    """``source`` as a tuple of translation units (a str is one)."""
    return (source,) if isinstance(source, str) else tuple(source)


def library_path(source: str | Sequence[str], flags: Sequence[str] | None = None) -> Path:
    """Where the library built from ``source`` (one translation unit, or a tuple of them) with
    ``flags`` (default ``cxx_flags()``) is cached (it may not exist yet).

    Raises:
        ToolchainError: no compiler (the compiler is part of the cache key).
        CacheError: no usable cache directory.
    """
    cxx, version = find_compiler()
    flags = tuple(flags or cxx_flags())
    units = _units(source)
    head = list(units) if len(units) == 1 else [f"{len(units)} translation units", *units]
    parts = [*head, _headers_digest(), cxx, version, *flags]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
    return cache_folder("cpp") / f"k_{key}.so"


def checksum_path(path: Path) -> Path:
    """The checksum file of the cached library ``path`` (``k_<key>.so`` -> ``k_<key>.sha256``)."""
    return path.with_suffix(".sha256")


def _digest(f) -> str:
    h = hashlib.sha256()
    while chunk := f.read(1 << 20):
        h.update(chunk)
    return h.hexdigest()


def _checksum_line(name: str, size: int, sha256: str) -> str:
    return f"{_CHECKSUM_HEADER} size={size} sha256={sha256} name={name}\n"


def verify_library(path: Path) -> str | None:
    """Check the cached library ``path`` against its checksum file, without loading it.

    Returns None when the library's size and sha256 match, else what is wrong, as a
    phrase to follow the path in a message (``MISSING`` when there is no library).
    Never raises for a bad entry; reads the whole library once (sha256).
    """
    try:
        recorded = checksum_path(path).read_text(encoding="ascii")
    except FileNotFoundError:
        recorded = None
    except (OSError, UnicodeDecodeError) as e:
        recorded = e
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return MISSING
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    with f:
        if recorded is None:
            return "has no checksum file (an interrupted build, or a cache from an older yirage)"
        if isinstance(recorded, Exception):
            return f"has an unreadable checksum file ({recorded})"
        fields = recorded.split()
        try:
            head, rest = " ".join(fields[:2]), dict(kv.split("=", 1) for kv in fields[2:])
            size, sha256, name = int(rest["size"]), rest["sha256"], rest["name"]
        except (ValueError, KeyError):
            return "has a malformed checksum file"
        if head != _CHECKSUM_HEADER:
            return f"has a checksum file of an unknown format ({head!r})"
        if name != path.name:
            return f"has the checksum file of another library ({name})"
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            return f"is {actual} bytes, its checksum file says {size} (truncated or overwritten)"
        if _digest(f) != sha256:
            return "does not match its sha256 (corrupt, or another library's bytes)"
    return None


@contextlib.contextmanager
def _entry_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the entry's lock file (serializes its builders)."""
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # the cache folder was checked writable; build unserialized
        logger.debug("cannot lock %s (%s); building without the lock", path, e)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _ensure_built(source: tuple[str, ...], path: Path, flags: tuple[str, ...], rebuild: str | None = None) -> bool:
    """Make ``path`` a verified entry; return whether this call built it.

    ``rebuild``: the reason a verified entry must be rebuilt anyway (it would not load).
    """
    if rebuild is None and verify_library(path) is None:
        return False
    with _entry_lock(path):
        problem = verify_library(path)
        if rebuild is None and problem is None:
            return False  # another process built it while we waited
        if rebuild is not None or problem != MISSING:
            logger.warning("cached kernel library %s %s; rebuilding it", path, rebuild or problem)
        _build(source, path, flags)
        problem = verify_library(path)
    if problem is not None:
        raise ToolchainError(f"the kernel library just built at {path} {problem}: "
                             f"is another process writing the cache at the same time?")
    return True


def _load(path: Path, symbols: tuple[str, ...], spelling: str) -> tuple[ctypes.CDLL | None, str]:
    """dlopen the (verified) library as ``spelling``; (lib, "") or (None, what went wrong)."""
    try:
        lib = ctypes.CDLL(spelling)
    except OSError as e:
        return None, f"cannot be loaded ({e})"
    missing = [s for s in symbols if not hasattr(lib, s)]
    if missing:
        return None, f"lacks the entry points {', '.join(missing)}"
    return lib, ""


def build_library(source: str | Sequence[str], flags: Sequence[str] | None = None) -> Path:
    """Build ``source`` with ``flags`` (default ``cxx_flags()``) unless a verified entry is
    cached; return the library's path.

    Does not load the library. A cached entry that fails its checksum is rebuilt with a
    warning.

    Raises:
        ToolchainError: no compiler, or the compiler rejected the source.
        CacheError: no usable cache directory, or the entry cannot be written.
    """
    flags, source = tuple(flags or cxx_flags()), _units(source)
    path = library_path(source, flags)
    _ensure_built(source, path, flags)
    return path


def load_library(source: str | tuple[str, ...], flags: Sequence[str] | None = None,
                 symbols: Sequence[str] = ()) -> ctypes.CDLL:
    """Build ``source`` (unless a verified entry is cached) and load it; ``flags`` default to
    ``cxx_flags()`` (the ``YIRAGE_ISA`` cap's build).

    The cached library is loaded only after its size and sha256 matched its checksum file.
    A truncated, corrupt, foreign or unloadable entry, or one lacking a name of
    ``symbols``, is rebuilt once with a warning on the ``yirage`` logger.

    Args:
        source: a complete C++ translation unit whose entry points are ``extern "C"``;
            it may include the headers of ``yirage/kernels/cpu``. A tuple of them is
            one library: the units are compiled in parallel and linked together.
        flags: compiler flags (a tuple, so that the call can be memoized).
        symbols: entry points the caller will look up (a tuple); a library lacking one
            is rebuilt once, then rejected.

    Raises:
        ToolchainError: no compiler; the compiler rejected the source (message holds the
        first compiler errors and the path of the saved source); or the rebuilt library
        still cannot be loaded or lacks one of ``symbols``.
        CacheError: no usable cache directory, or the entry cannot be written.
    """
    return _load_library(source, tuple(flags or cxx_flags()), tuple(symbols))


@functools.lru_cache(maxsize=None)
def _load_library(source: str | tuple[str, ...], flags: tuple[str, ...], symbols: tuple[str, ...]) -> ctypes.CDLL:
    """``load_library`` with its arguments resolved (memoized per process)."""
    source = _units(source)
    path = library_path(source, flags)
    built = _ensure_built(source, path, flags)
    lib, problem = _load(path, symbols, _spellings.get(str(path), str(path)))
    if lib is not None:
        return lib
    if not built:
        _ensure_built(source, path, flags, rebuild=problem)
        # dlopen returns the handle already open under the same name, so name the rebuilt
        # file differently ("dir/./k.so"); its new inode is then mapped afresh.
        spelling = os.path.join(str(path.parent), *["."] * next(_respell), path.name)
        lib, problem = _load(path, symbols, spelling)
        if lib is not None:
            _spellings[str(path)] = spelling
            return lib
    raise ToolchainError(f"the kernel library {path}, built just now, {problem}: "
                         f"check the compiler ({find_compiler()[0]}) and the source's extern \"C\" "
                         f"entry points, or remove {path.parent} and retry")


load_library.cache_clear = _load_library.cache_clear   # forget this process's loaded libraries


def kernel_libraries() -> tuple[str, ...]:
    """Names of the hand-written C++ libraries (the keys of ``KERNEL_LIBRARIES``), sorted."""
    return tuple(sorted(KERNEL_LIBRARIES))


def prebuild(jobs: int | None = None) -> list[tuple[str, Path, bool, float]]:
    """Build every hand-written kernel library into the cache now, ``jobs`` compilers at a
    time (default: one per CPU), so that the first model a process compiles does not wait for
    them (the CPU library takes about 34 s of g++ 12's time, 19 s on 2 cores). An install step:
    ``make setup`` runs it as ``python -m yirage.runtime.toolchain``.

    Returns one ``(name, library path, built by this call, seconds)`` per library, in
    ``kernel_libraries()`` order; a library already cached is verified, not rebuilt. The
    units of one library compile in parallel too, so up to ``jobs`` plus its unit count
    compilers run at once.

    Raises:
        ToolchainError: no compiler, or the compiler rejected a source.
        CacheError: no usable cache directory, or an entry cannot be written.
    """
    def one(name: str) -> tuple[str, Path, bool, float]:
        t0 = time.perf_counter()
        source = kernel_library_sources(name)
        path = library_path(source, flags)
        built = _ensure_built(source, path, flags)   # the compiler runs as a subprocess: threads overlap
        return name, path, built, time.perf_counter() - t0

    flags = cxx_flags()
    names = kernel_libraries()
    # the longest first, so that it never starts last
    order = sorted(names, key=lambda n: -sum(map(len, kernel_library_sources(n))))
    with ThreadPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 1)) as pool:
        done = dict((r[0], r) for r in pool.map(one, order))
    return [done[n] for n in names]


def builds() -> int:
    """How many times this process has run the C++ compiler (cache misses and rebuilds)."""
    return _builds


_builds = 0


def _compile(cmd: list[str], source: str, keep: Path) -> None:
    """Run the compiler command ``cmd``; on failure keep ``source`` at ``keep`` and raise
    ToolchainError with the first 20 lines of the compiler's errors."""
    logger.debug("building %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ToolchainError(f"cannot run the C++ compiler {cmd[0]} ({e}): {_INSTALL_HINT}") from None
    if proc.returncode != 0:
        keep.write_text(source)
        err = "\n".join(proc.stderr.strip().splitlines()[:20])
        raise ToolchainError(f"C++ compiler failed on generated kernel (source kept at {keep}): {err}")


def _build(source: tuple[str, ...], path: Path, flags: tuple[str, ...]) -> None:
    """Compile the translation units ``source`` (several: each to an object file, in
    parallel, then linked) and publish the library, then its checksum file (both atomic)."""
    global _builds
    _builds += 1
    cxx, _ = find_compiler()
    include = f"-I{kernel_dir()}"
    try:
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
            out = Path(tmp) / path.name
            srcs = [Path(tmp) / f"kernel{i}.cpp" for i in range(len(source))]
            for src, text in zip(srcs, source):
                src.write_text(text)
            if len(source) == 1:
                _compile([cxx, *flags, include, str(srcs[0]), "-o", str(out)], source[0],
                         path.with_suffix(".failed.cpp"))
            else:
                objs = [src.with_suffix(".o") for src in srcs]
                unit_flags = [f for f in flags if f != "-shared"]
                with ThreadPoolExecutor(max_workers=min(len(source), os.cpu_count() or 1)) as pool:
                    list(pool.map(lambda i: _compile([cxx, *unit_flags, include, "-c", str(srcs[i]), "-o", str(objs[i])],
                                                     source[i], path.with_suffix(f".{i}.failed.cpp")),
                                  range(len(source))))
                _compile([cxx, *flags, *map(str, objs), "-o", str(out)], "\n".join(source),
                         path.with_suffix(".failed.cpp"))
            with open(out, "rb") as f:
                line = _checksum_line(path.name, os.fstat(f.fileno()).st_size, _digest(f))
            record = Path(tmp) / checksum_path(path).name
            record.write_text(line, encoding="ascii")
            os.replace(out, path)  # atomic: other processes see the old state or the whole file
            os.replace(record, checksum_path(path))  # after the library: it vouches for it
    except OSError as e:
        raise CacheError(f"cannot write the kernel cache entry {path} ({e.strerror or e}): "
                         f"point YIRAGE_CACHE_DIR at a writable directory") from None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m yirage.runtime.toolchain [--jobs N]``: ``prebuild`` with a line per library;
    exit status 1 with the error's message when a build fails."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m yirage.runtime.toolchain",
                                 description="Build yirage's C++ kernel libraries into the cache now.")
    ap.add_argument("--jobs", type=int, default=None, help="compilers at a time (default: one per CPU)")
    args = ap.parse_args(argv)
    try:
        for name, path, built, seconds in prebuild(args.jobs):
            print(f"{name}: {'built' if built else 'cached'} in {seconds:.1f} s ({path})")
    except (ToolchainError, CacheError) as e:
        print(f"yirage: {e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
