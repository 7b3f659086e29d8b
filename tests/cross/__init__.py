"""yirage's kernel libraries built for aarch64 and called under qemu-user, like the x86 ones.

``CrossLibrary(name, target)`` cross-compiles a hand-written library (``toolchain.KERNEL_LIBRARIES``)
with Debian's ``aarch64-linux-gnu-g++`` for one Arm target and calls its entry points through
``driver.cpp`` run by ``qemu-aarch64``: ``lib.yr_linear_q4_1(ptr(x), ptr(w), None, ptr(y), M, N, K)``
takes the arguments the ctypes library takes, so a kernel test (and yirage's own ctypes wrappers,
``cpu.embed.gemm_f32_packed(..., lib=lib)``) runs the same calls and checks against the same
reference on both architectures. A pointer is found in the tensor it points into (``ptr`` makes
an int that remembers its tensor; a plain ``data_ptr()`` is looked up among the live tensors):
each call ships the storages of its tensors to the driver and copies them back afterwards, so
outputs land where the caller reads them.

Builds are cached under ``$YIRAGE_CACHE_DIR/cross`` by a hash of the sources, the headers, the
flags and the compiler. ``unavailable()`` says why this machine cannot run them (the tests skip
with it); ``make test`` installs the cross compiler and qemu-user where it can
(``tests/cross/install.sh``).
"""
from __future__ import annotations

import concurrent.futures
import gc
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import ctypes

import torch

CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"
#: the Arm targets the libraries are built for: ARMv8.0 NEON (Raspberry Pi 4, AWS Graviton 1) and
#: ARMv8.2 with the dot product and float16 (Raspberry Pi 5, Graviton 2, Apple M1 and later)
TARGETS = {"armv8-a": ("-march=armv8-a",), "armv8.2-a+dotprod": ("-march=armv8.2-a+dotprod+fp16",)}
#: the target every library is built for (the CPU library is built for every target)
MAIN_TARGET = "armv8.2-a+dotprod"
FLAGS = ("-O2", "-fopenmp", "-fPIC", "-std=c++17", "-fno-math-errno", "-ffp-contract=fast")
#: qemu's CPU model per target (``max``: every feature qemu emulates)
QEMU_CPU = {"armv8-a": "cortex-a53", "armv8.2-a+dotprod": "max"}


def unavailable() -> str | None:
    """Why aarch64 builds cannot run here (no cross compiler, no qemu-user), or None."""
    missing = [t for t in (CROSS_CXX, QEMU) if shutil.which(t) is None]
    if missing:
        return (f"needs {' and '.join(missing)} (Debian: apt-get install g++-aarch64-linux-gnu qemu-user; "
                "make test installs them where it can)")
    return None


class TensorPtr(int):
    """A tensor's data pointer (an int, so ctypes takes it) that remembers the tensor."""

    tensor: torch.Tensor


def ptr(t: torch.Tensor | None):
    """``t.data_ptr()`` as a ``TensorPtr`` (None for None): what both libraries take."""
    if t is None:
        return None
    p = TensorPtr(t.data_ptr())
    p.tensor = t
    return p


def _cache() -> Path:
    from yirage.config import cache_subdir
    return cache_subdir("cross")


def _compile(args: list[str]) -> None:
    out = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} ... failed:\n" + "\n".join(out.stderr.splitlines()[:30]))


def build(units: tuple[str, ...], target: str, shared: bool = True, extra: tuple[str, ...] = ()) -> Path:
    """Cross-compile C++ ``units`` (source texts) into one library (or, ``shared=False``, an
    executable) for ``target`` (a key of ``TARGETS``); the cached path. Raises RuntimeError with
    the compiler's first errors."""
    from yirage.runtime.toolchain import kernel_dir

    flags = (*FLAGS, *TARGETS[target], *extra)
    headers = b"".join(p.name.encode() + p.read_bytes() for p in sorted(kernel_dir().glob("*.h")))
    version = subprocess.run([CROSS_CXX, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    key = hashlib.sha256("\0".join([*units, version, *flags, str(shared)]).encode() + headers).hexdigest()[:24]
    path = _cache() / f"{'lib' if shared else 'exe'}_{key}{'.so' if shared else ''}"
    if path.exists():
        return path
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        srcs = [Path(tmp) / f"unit{i}.cpp" for i in range(len(units))]
        for s, text in zip(srcs, units):
            s.write_text(text)
        objs = [s.with_suffix(".o") for s in srcs]
        with concurrent.futures.ThreadPoolExecutor(len(srcs)) as pool:
            list(pool.map(lambda i: _compile([CROSS_CXX, *flags, f"-I{kernel_dir()}", "-c", str(srcs[i]),
                                              "-o", str(objs[i])]), range(len(srcs))))
        out = Path(tmp) / "out"
        _compile([CROSS_CXX, *flags, *(["-shared"] if shared else []), *map(str, objs), "-o", str(out), "-ldl"])
        os.replace(out, path)
    return path


def driver(target: str) -> Path:
    """The call driver (driver.cpp) built for ``target``."""
    return build(((Path(__file__).parent / "driver.cpp").read_text(),), target, shared=False)


#: argtypes of a task entry point: fn(int64 args [n], lo, hi)
TASK_ARGTYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


class _Entry:
    """A callable entry point; ``argtypes``/``restype`` may be set (as on a ctypes function) and
    are ignored: the library's signature table decides."""

    def __init__(self, fn):
        self._fn = fn
        self.argtypes, self.restype = None, None

    def __call__(self, *args):
        return self._fn(*args)


class Region:
    """A span of host memory a pointer may point into: ``base`` address, ``nbytes``, and ``data``,
    a uint8 tensor over it (a tensor's storage, or a numpy array's buffer)."""

    def __init__(self, base: int, nbytes: int, data: torch.Tensor):
        self.base, self.nbytes, self.data = base, nbytes, data

    def holds(self, address: int) -> bool:
        return self.base <= address <= self.base + self.nbytes


def _tensor_region(t: torch.Tensor) -> Region:
    st = t.untyped_storage()
    return Region(st.data_ptr(), st.nbytes(), torch.empty(0, dtype=torch.uint8).set_(st))


def _candidates():
    """Live tensors (gc tracks them) and the tensors and numpy arrays held by the callers' frames
    (numpy arrays are not tracked by gc), one level into lists, tuples and dicts."""
    import sys

    yield from gc.get_objects()
    frame = sys._getframe(1)
    while frame is not None:
        for v in list(frame.f_locals.values()):
            yield v
            if isinstance(v, (list, tuple)):
                yield from v
            elif isinstance(v, dict):
                yield from v.values()
        frame = frame.f_back


def _live_regions() -> list[Region]:
    """The memory of every live CPU tensor and numpy array (a raw pointer is looked up in it)."""
    import warnings

    import numpy as np

    seen, out = set(), []
    for o in _candidates():
        if type(o) is np.ndarray:
            while isinstance(o.base, np.ndarray):
                o = o.base
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu":
            try:
                r = _tensor_region(o)
            except RuntimeError:   # a fake or functional tensor (torch.compile's tracing) has no data
                continue
        elif type(o) is np.ndarray and o.flags.c_contiguous and o.nbytes:
            with warnings.catch_warnings():   # a read-only array is only read here
                warnings.simplefilter("ignore")
                data = torch.from_numpy(o.reshape(-1).view(np.uint8))
            r = Region(o.ctypes.data, o.nbytes, data)
        else:
            continue
        if r.base not in seen:
            seen.add(r.base)
            out.append(r)
    return out


def _region_of(address: int, live: list[Region]) -> Region:
    for r in live:
        if r.holds(address):
            return r
    raise TypeError(f"no live tensor or array holds the address {address:#x}")


class CrossLibrary:
    """A kernel library built for an Arm ``target`` and called under qemu-user. Attribute access
    gives callables with the ctypes library's arguments (``SIGNATURES`` says which are floats);
    each call runs the driver once."""

    def __init__(self, library: str | Path, target: str, signatures: dict[str, tuple]):
        from yirage.runtime.toolchain import kernel_library_sources

        self.target, self.signatures = target, signatures
        self.path = Path(library) if isinstance(library, Path) else build(kernel_library_sources(library), target)
        self.driver = driver(target)

    def __getattr__(self, name: str):
        if name.startswith("yr_task_"):   # fn(int64 args [n], lo, hi): the args hold pointers
            return _Entry(lambda *args: self.call(name, *args, indirect=True))
        if name not in self.signatures:
            raise AttributeError(name)
        return _Entry(lambda *args: self.call(name, *args))

    def call(self, name: str, *args, indirect: bool = False) -> None:
        """Run entry point ``name`` with ``args`` (``ptr``s, None, ints, floats) on aarch64.
        ``indirect``: a task entry point (``yr_task_*``: an int64 argument block, lo, hi), whose
        block's values that point into live tensors are relocated to the driver's copies."""
        argtypes = TASK_ARGTYPES if indirect else self.signatures[name]
        if len(args) != len(argtypes):
            raise TypeError(f"{name} takes {len(argtypes)} arguments, got {len(args)}")
        regions: dict[int, tuple[int, Region]] = {}   # base -> (buffer index, region)
        encoded, live = [], None

        def index(r: Region) -> int:
            if r.base not in regions:
                regions[r.base] = (len(regions), r)
            return regions[r.base][0]

        def region(a) -> Region:
            nonlocal live
            if isinstance(a, TensorPtr):
                return _tensor_region(a.tensor)
            if isinstance(a, ctypes.Array):
                return regions[ctypes.addressof(a)][1]
            live = live if live is not None else _live_regions()
            return _region_of(a, live)

        for a, t in zip(args, argtypes):
            if t is ctypes.c_float:
                encoded.append(b"F" + struct.pack("<f", float(a)))
            elif t is ctypes.c_int64:
                encoded.append(b"I" + struct.pack("<q", int(a)))
            elif a is None or (isinstance(a, int) and not isinstance(a, TensorPtr) and a == 0):
                encoded.append(b"N")
            elif isinstance(a, ctypes.Array):   # a ctypes array passed as the pointer to its data
                r = Region(ctypes.addressof(a), ctypes.sizeof(a), torch.frombuffer(a, dtype=torch.uint8))
                regions.setdefault(r.base, (len(regions), r))
                encoded.append(b"P" + struct.pack("<qq", index(r), 0))
            elif isinstance(a, int):
                r = region(a)
                encoded.append(b"P" + struct.pack("<qq", index(r), int(a) - r.base))
            else:
                raise TypeError(f"{name}: a pointer must be an int (a tensor's data_ptr), got {a!r}")
        relocs = []
        if indirect:   # the argument block (the first pointer): its values that are addresses
            block = region(args[0])
            values = block.data[:block.nbytes - block.nbytes % 8].view(torch.int64).tolist()
            live = live if live is not None else _live_regions()
            for pos, v in enumerate(values):
                target = next((r for r in live if v and r.base <= v < r.base + max(1, r.nbytes) and r.base != block.base),
                              None)
                if target is not None:
                    relocs.append((index(block), 8 * pos, index(target), v - target.base))
        storages = sorted(regions.values(), key=lambda e: e[0])
        blob = [b"YRC1", struct.pack("<q", len(storages))]
        for _, r in storages:
            data = r.data.numpy().tobytes()
            blob += [struct.pack("<q", len(data)), data]
        blob += [struct.pack("<q", 1), struct.pack("<q", len(name)), name.encode(), struct.pack("<q", len(encoded)),
                 *encoded, struct.pack("<q", len(relocs)), *(struct.pack("<qqqq", *r) for r in relocs)]
        with tempfile.TemporaryDirectory(prefix="yirage-cross-") as tmp:
            calls, out = Path(tmp) / "calls.bin", Path(tmp) / "out.bin"
            calls.write_bytes(b"".join(blob))
            env = {**os.environ, "QEMU_LD_PREFIX": SYSROOT, "OMP_NUM_THREADS": "2"}
            run = subprocess.run([QEMU, "-cpu", QEMU_CPU[self.target], str(self.driver), str(self.path), str(calls),
                                  str(out)], capture_output=True, text=True, env=env, timeout=900)
            if run.returncode != 0:
                raise RuntimeError(f"{name} on {self.target} exited {run.returncode}: {run.stderr[-2000:]}")
            data = out.read_bytes()
        assert data[:4] == b"YRO1" and struct.unpack_from("<q", data, 4)[0] == len(storages)
        at = 12
        for _, r in storages:
            (n,) = struct.unpack_from("<q", data, at)
            at += 8
            if r.data.numpy().tobytes() != data[at:at + n]:   # written by the call (read-only inputs stay)
                r.data.copy_(torch.frombuffer(bytearray(data[at:at + n]), dtype=torch.uint8))
            at += n
