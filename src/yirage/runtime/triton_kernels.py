"""Fused row kernels for Triton devices: render (codegen/triton.py), write, import, bind.

``compile_triton`` renders a set of FusedKernels as one Python module, writes it to
``$YIRAGE_CACHE_DIR/triton/k_<sha256(source)[:24]>.py`` (a temporary file in the same
directory moved into place with ``os.replace``, so concurrent processes never import a
half-written file) and imports it: Triton's JIT reads the source of a ``@triton.jit``
function with ``inspect``, so it has to live in a real file. A cached file that does not
hold exactly the source its name hashes (truncated, corrupt) is rewritten with a warning;
the module is compiled from the in-memory source, never from an unchecked file or a
``__pycache__``. Compiling the Triton code to device code is Triton's own JIT, cached by
Triton's own cache. Imported modules are memoized per process by path.

``TritonKernel.bind(tensors, R)`` checks the tensors and computes the launch
(``codegen.triton.launch_config``) once; the thunk it returns only launches, so it can
be captured in a CUDA graph. Nothing here allocates device memory or synchronizes.

Under ``TRITON_INTERPRET=1`` (no GPU) the same kernels run in Triton's CPU interpreter,
with interpreter-friendly block sizes. This module must never import a backend.
"""
from __future__ import annotations

import hashlib
import importlib.util
import linecache
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

import torch

from ..codegen.triton import LaunchConfig, launch_config, render_module
from ..config import logger
from ..errors import CacheError
from ..kernels.triton import interpreting
from ..transforms.fusion import FusedKernel
from .toolchain import MISSING, cache_folder

_modules: dict[str, object] = {}
_lock = threading.Lock()


class TritonKernel:
    """A FusedKernel compiled to a ``@triton.jit`` function (see codegen/triton.py).

    Args:
        kernel: the fused kernel it was rendered from.
        fn: the jit function (``NAME(in.., out.., R, BLOCK_R, BLOCK_D)``).
        mode: the code-shape mode it was rendered with (``auto``/``persistent``/``looped``).
        interpreter: which launch heuristics to use; None: the interpreter's exactly when
            ``TRITON_INTERPRET=1`` (tests pass False to run GPU block sizes in the interpreter).
    """

    def __init__(self, kernel: FusedKernel, fn, mode: str = "auto", interpreter: bool | None = None):
        self.kernel = kernel
        self.fn = fn
        self.mode = mode
        self.interpreter = interpreter

    def launch_config(self, R: int) -> LaunchConfig:
        """Grid and block sizes used for ``R`` rows: the interpreter's heuristics under
        ``TRITON_INTERPRET=1`` (or when built with ``interpreter=True``), else the GPU's."""
        interp = interpreting() if self.interpreter is None else self.interpreter
        return launch_config(self.kernel, R, self.mode, interpreter=interp)

    def bind(self, tensors: list[torch.Tensor], R: int) -> Callable[[], None]:
        """Thunk that runs the kernel over ``R`` rows.

        ``tensors``: the kernel's inputs then its outputs (``kernel.inputs`` /
        ``kernel.outputs`` order), contiguous, of the kernel's dtypes, all on one device;
        ``full``/``expand`` inputs and vec outputs hold ``R * D`` elements, ``row`` inputs
        ``D``, ``col`` inputs and rs outputs ``R``, ``scalar`` inputs 1 (``expand`` inputs
        must already be materialized to full). Raises ValueError otherwise. The thunk does
        no Python work beyond the launch (no allocation, no host synchronization).
        """
        k = self.kernel
        if len(tensors) != len(k.inputs) + len(k.outputs):
            raise ValueError(f"kernel takes {len(k.inputs)} inputs and {len(k.outputs)} outputs, "
                             f"got {len(tensors)} tensors")
        D = k.D
        want = [({"full": R * D, "expand": R * D, "row": D, "col": R, "scalar": 1}[i.mode], i.dtype)
                for i in k.inputs]
        want += [(R * D if k.stmts[sid].kind == "vec" else R, d) for sid, _, d in k.outputs]
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"kernel tensors are on several devices: {sorted(map(str, devices))}")
        for n, (t, (numel, dt)) in enumerate(zip(tensors, want)):
            if t.numel() != numel or t.dtype != dt.torch_dtype or not t.is_contiguous():
                raise ValueError(f"tensor {n}: expected {numel} contiguous {dt.value} elements, got "
                                 f"{tuple(t.shape)} {t.dtype}{'' if t.is_contiguous() else ' (not contiguous)'}")
        if R == 0:
            return lambda: None
        cfg = self.launch_config(R)
        launch = self.fn[cfg.grid]
        args = (*tensors, R)
        kwargs = {"BLOCK_R": cfg.BLOCK_R, "BLOCK_D": cfg.BLOCK_D, "num_warps": cfg.num_warps}

        def thunk() -> None:
            launch(*args, **kwargs)
        return thunk


def _module_file_problem(path: Path, data: bytes) -> str | None:
    """None when the cached module file holds exactly ``data`` (its name is the sha256 of
    ``data``), ``MISSING`` when there is no file, else what is wrong with it."""
    try:
        content = path.read_bytes()
    except FileNotFoundError:
        return MISSING
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if content == data:
        return None
    return (f"does not match the sha256 in its name ({len(content)} bytes, expected "
            f"{len(data)}: truncated or corrupt)")


def _load_module(source: str):
    """Write ``source`` to the cache (unless the file there already holds it) and import it;
    memoized per path.

    A cached file whose bytes differ from ``source`` (its name is their sha256) is rewritten
    with a warning and never imported. The module is compiled from ``source`` itself (no
    ``__pycache__`` is read or written), and linecache is primed with ``source``, so the
    code that runs and the text Triton's JIT reads are the verified text.

    Raises:
        CacheError: no usable cache directory, or the file cannot be written or still does
        not hold ``source`` after writing it.
    """
    data = source.encode()
    digest = hashlib.sha256(data).hexdigest()[:24]
    folder = cache_folder("triton")
    path = folder / f"k_{digest}.py"
    with _lock:
        mod = _modules.get(str(path))
        if mod is not None:
            return mod
        problem = _module_file_problem(path, data)
        if problem is not None:
            if problem != MISSING:
                logger.warning("cached Triton module %s %s; rewriting it", path, problem)
            try:
                _write_atomic(path, data)
            except OSError as e:
                raise CacheError(f"cannot write the Triton module cache file {path} "
                                 f"({e.strerror or e}): point YIRAGE_CACHE_DIR at a writable "
                                 f"directory") from None
            problem = _module_file_problem(path, data)
            if problem is not None:
                raise CacheError(f"the Triton module cache file {path} {problem} right after "
                                 f"writing it: is something else writing the cache?")
        name = f"yirage_triton_k_{digest}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
        sys.modules[name] = mod  # lets inspect/linecache and Triton find the module
        try:
            exec(compile(source, str(path), "exec", dont_inherit=True), mod.__dict__)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _modules[str(path)] = mod
        return mod


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def compile_triton(kernels: list[FusedKernel], mode: str = "auto",
                   interpreter: bool | None = None) -> list[TritonKernel]:
    """One ``TritonKernel`` per FusedKernel (structurally equal kernels share a function).

    ``mode`` forces a code shape (``persistent``/``looped``; tests use it) or lets the
    renderer pick (``auto``); ``interpreter`` picks the launch heuristics (None: detect).
    Device compilation happens at the first launch (Triton JIT). Raises
    NotImplementedError for a dtype or op the Triton renderer does not handle.
    """
    if not kernels:
        return []
    source, names = render_module(kernels, mode)
    mod = _load_module(source)
    return [TritonKernel(k, getattr(mod, n), mode, interpreter) for k, n in zip(kernels, names)]
