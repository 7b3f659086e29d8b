"""The backend registry: which backends exist, which are usable here, and the default.

The default backend is, in this order: the one given to ``set_backend``, else the
``YIRAGE_BACKEND`` environment variable (a name or 'auto'), else the ``backend`` of the user
config file (``yirage set NAME``; read by ``yirage.config``), else 'auto', which picks the
first available backend by priority CUDA > ROCm > XPU > WebGPU (a real GPU adapter only, never a
software one) > MPS > CPU. Names are accepted
case-insensitively, as are ``Backend`` members. 'triton-interpret' (Triton's CPU
interpreter, for testing kernels) is listed after CPU, so 'auto' never picks it.

This module must never substitute one backend for another: an unknown or unavailable
backend raises BackendUnavailableError naming it, saying why, and listing the available ones.
Adding a backend = one module + one line in ``_IMPLS``.
"""
from __future__ import annotations

import os

from yirage.backends.base import (
    Backend,
    BackendImpl,
    BackendInfo,
    MemoryInfo,
    unavailable_error,
)
from yirage.backends.cpu import CPUBackend
from yirage.backends.mps import MPSBackend
from yirage.backends.triton import CUDABackend, ROCmBackend, TritonInterpreterBackend, XPUBackend
from yirage.backends.webgpu import WebGPUBackend
from yirage.config import user_backend, user_config_path
from yirage.errors import BackendUnavailableError

__all__ = [
    "Backend",
    "BackendImpl",
    "BackendInfo",
    "MemoryInfo",
    "get_available_backends",
    "is_backend_available",
    "set_backend",
    "get_backend",
    "get_backend_source",
    "get_backend_impl",
    "resolve_backend",
    "get_backend_info",
    "get_memory_info",
]

ENV_VAR = "YIRAGE_BACKEND"

# One instance per backend, in 'auto' priority order.
_IMPLS: dict[Backend, BackendImpl] = {
    impl.name: impl
    for impl in (CUDABackend(), ROCmBackend(), XPUBackend(), WebGPUBackend(), MPSBackend(), CPUBackend(),
                 TritonInterpreterBackend())
}

# The backend chosen with set_backend(), or None to follow the environment / auto.
_explicit_backend: Backend | None = None


def _parse(name: str | Backend) -> Backend:
    """The Backend named by ``name`` (case-insensitive); raises if the name is unknown."""
    if isinstance(name, Backend):
        return name
    try:
        return Backend(str(name).strip().lower())
    except ValueError:
        known = ", ".join(b.value for b in Backend)
        raise unavailable_error(str(name), f"unknown (known backends: {known}, auto)") from None


def _is_auto(name: str | Backend) -> bool:
    return isinstance(name, str) and name.strip().lower() == "auto"


def _auto_backend() -> Backend:
    """The first available backend by priority that 'auto' may pick (CPU is always available;
    webgpu only on a real GPU adapter, ``BackendImpl.auto_eligible``). Eligibility is asked
    first, so a backend 'auto' cannot pick here is never probed (webgpu's adapter on a machine
    without a GPU device node)."""
    return next(b for b, impl in _IMPLS.items() if impl.auto_eligible() and impl.is_available())


def get_available_backends() -> list[Backend]:
    """Backends usable on this machine, in priority order CUDA, ROCm, XPU, WebGPU, MPS, CPU
    (then 'triton-interpret' when TRITON_INTERPRET=1). WebGPU is listed wherever wgpu finds an
    adapter, a software one too ('auto' skips that one)."""
    return [b for b, impl in _IMPLS.items() if impl.is_available()]


def is_backend_available(name: str | Backend) -> bool:
    """True if ``name`` is a known backend usable here; False for unknown names."""
    try:
        backend = _parse(name)
    except BackendUnavailableError:
        return False
    return _IMPLS[backend].is_available()


def resolve_backend(name: str | Backend | None) -> Backend:
    """The Backend that ``name`` means here.

    None -> the current default (see ``get_backend``); 'auto' -> the first available by
    priority; otherwise the named backend. Raises BackendUnavailableError if the name is
    unknown or the backend is unavailable.
    """
    if name is None:
        return get_backend()
    if _is_auto(name):
        return _auto_backend()
    backend = _parse(name)
    _IMPLS[backend].require_available()
    return backend


def set_backend(name: str | Backend) -> Backend:
    """Make ``name`` (or 'auto', resolved now) the default backend; returns it.

    Overrides YIRAGE_BACKEND. Raises BackendUnavailableError if the name is unknown or
    the backend is unavailable; the previous default is then kept.
    """
    global _explicit_backend
    if name is None:
        raise unavailable_error("None", "not a backend name (use a name or 'auto')")
    _explicit_backend = resolve_backend(name)
    return _explicit_backend


def get_backend() -> Backend:
    """The default backend: set_backend's choice, else YIRAGE_BACKEND, else the user config
    file's ``backend`` (``yirage set``), else 'auto'.

    Raises:
        BackendUnavailableError: YIRAGE_BACKEND or the config file names an unknown or
            unavailable backend (the message names which of the two).
        ConfigError: the config file is consulted and cannot be read or is malformed.
    """
    if _explicit_backend is not None:
        return _explicit_backend
    env_value = os.environ.get(ENV_VAR, "").strip()
    if env_value:
        try:
            return resolve_backend(env_value)
        except BackendUnavailableError as error:
            raise BackendUnavailableError(f"{ENV_VAR}={env_value!r}: {error}") from None
    configured = user_backend()
    if configured is None:
        return _auto_backend()
    try:
        return resolve_backend(configured)
    except BackendUnavailableError as error:
        raise BackendUnavailableError(f"the config file {user_config_path()} sets backend {configured!r}: {error}; "
                                      "change it with 'yirage set NAME' or remove it with 'yirage set --unset'"
                                      ) from None


def get_backend_source() -> str:
    """Where the default backend comes from: 'set_backend', 'env' (YIRAGE_BACKEND), 'config'
    (the user config file, ``yirage.config.user_config_path()``) or 'auto'.

    Raises ConfigError when the config file is consulted and is unusable.
    """
    if _explicit_backend is not None:
        return "set_backend"
    if os.environ.get(ENV_VAR, "").strip():
        return "env"
    return "config" if user_backend() is not None else "auto"


def get_backend_impl(name: str | Backend | None = None) -> BackendImpl:
    """The implementation of ``name`` (None = default, 'auto' allowed).

    Raises BackendUnavailableError if the backend is unknown or unavailable.
    """
    return _IMPLS[resolve_backend(name)]


def get_backend_info(name: str | Backend | None = None) -> BackendInfo:
    """Describe backend ``name`` (None = default, 'auto' allowed).

    An unavailable backend is described (available=False, with the reason) rather than
    raising; an unknown name raises BackendUnavailableError.
    """
    if name is None or _is_auto(name):
        return _IMPLS[resolve_backend(name)].info()
    return _IMPLS[_parse(name)].info()


def get_memory_info(name: str | Backend | None = None) -> MemoryInfo:
    """Memory of backend ``name`` in bytes (None = default, 'auto' allowed).

    Raises BackendUnavailableError if the backend is unknown or unavailable.
    """
    return get_backend_impl(name).memory_info()

