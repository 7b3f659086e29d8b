"""Process-wide settings read from the environment.

- ``YIRAGE_BACKEND``: default backend name (or ``auto``).
- ``YIRAGE_LOG_LEVEL``: logging level of the ``yirage`` logger (DEBUG, INFO, WARNING, ...).
- ``YIRAGE_CACHE_DIR``: where compiled kernels and converted tokenizers are cached
  (default ``~/.cache/yirage``).

The cache root must be a writable directory. When it is a file, cannot be created or is
not writable, ``cache_dir()`` falls back to a private per-user directory in the
temporary directory (``<tmp>/yirage-cache-<uid>``, mode 0700, owned by this user) and logs
one warning per process saying what was wrong; a read-only cache is not read from either
(its entries are rebuilt in the fallback), so nothing is ever loaded from a directory this
process could not repair. When the fallback is unusable too, ``yirage.errors.CacheError``
is raised.

This module must never import a backend, torch, or any yirage module but ``errors``.
"""
from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

from .errors import CacheError

logger = logging.getLogger("yirage")


#: Cache roots (as configured) already warned about in this process: one warning each.
_warned: set[str] = set()


def configure_logging() -> None:
    """Apply ``YIRAGE_LOG_LEVEL`` (default WARNING) to the ``yirage`` logger."""
    level = os.environ.get("YIRAGE_LOG_LEVEL", "WARNING").upper()
    logger.setLevel(getattr(logging, level, logging.WARNING))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[yirage %(levelname)s] %(message)s"))
        logger.addHandler(handler)


def _unusable(path: Path) -> str | None:
    """Why ``path`` cannot be a cache directory (created here if missing); None if it can."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "is a file, not a directory"
    except OSError as e:
        return f"cannot be created ({e.strerror or e})"
    if not path.is_dir():
        return "is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is not writable"
    return None


def fallback_cache_dir() -> Path:
    """The per-user fallback cache root: ``<tempfile.gettempdir()>/yirage-cache-<uid>``."""
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return Path(tempfile.gettempdir()) / f"yirage-cache-{user}"


def _private_fallback(wanted: Path, problem: str) -> Path:
    """Create/check the fallback root: a real directory owned by this user, writable by no
    one else (the temporary directory is shared, and kernels are loaded from the cache)."""
    root = fallback_cache_dir()
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(root)
    except OSError as e:
        why = f"cannot be created ({e.strerror or e})"
    else:
        if not stat.S_ISDIR(st.st_mode):
            why = "is not a directory"
        elif hasattr(os, "getuid") and st.st_uid != os.getuid():
            why = "belongs to another user"
        elif st.st_mode & 0o022:
            why = "is writable by other users"
        elif not os.access(root, os.W_OK | os.X_OK):
            why = "is not writable"
        else:
            return root
    raise CacheError(f"cache directory {wanted} {problem}, and the fallback {root} {why}: "
                        f"point YIRAGE_CACHE_DIR at a writable directory")


def _fall_back(wanted: Path, problem: str, sub: str | None) -> Path:
    fallback = _private_fallback(wanted, problem)
    if sub is not None:
        fallback = fallback / sub
        why = _unusable(fallback)
        if why is not None:
            raise CacheError(f"cache directory {wanted} {problem}, and the fallback {fallback} "
                                f"{why}: point YIRAGE_CACHE_DIR at a writable directory")
    if str(wanted) not in _warned:
        _warned.add(str(wanted))
        source = "YIRAGE_CACHE_DIR" if os.environ.get("YIRAGE_CACHE_DIR") else "the default"
        logger.warning("cache directory %s (%s) %s; caching in %s for this process instead: "
                       "point YIRAGE_CACHE_DIR at a writable directory",
                       wanted, source, problem, fallback)
    return fallback


def cache_dir() -> Path:
    """The cache root (``YIRAGE_CACHE_DIR`` or ``~/.cache/yirage``), created if missing.

    Falls back to ``fallback_cache_dir()`` (one warning per process and root) when the
    configured root is a file, cannot be created or is not writable.

    Raises:
        CacheError: the fallback directory is unusable too (cannot be created, not a
        directory, owned by another user or writable by others).
    """
    configured = os.environ.get("YIRAGE_CACHE_DIR")
    try:
        root = Path(configured).expanduser() if configured else Path.home() / ".cache" / "yirage"
    except RuntimeError:  # no home directory
        return _fall_back(Path("~/.cache/yirage"), "cannot be resolved (no home directory)", None)
    problem = _unusable(root)
    return root if problem is None else _fall_back(root, problem, None)


def cache_subdir(name: str) -> Path:
    """``cache_dir() / name``, created if missing; falls back like ``cache_dir()`` (to
    ``fallback_cache_dir() / name``) when that subdirectory is unusable.

    Raises:
        CacheError: the fallback is unusable too.
    """
    sub = cache_dir() / name
    problem = _unusable(sub)
    return sub if problem is None else _fall_back(sub, problem, name)
