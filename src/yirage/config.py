"""Process-wide settings read from the environment and from the user config file.

- ``YIRAGE_BACKEND``: default backend name (or ``auto``); it overrides the user config file.
- ``YIRAGE_LOG_LEVEL``: logging level of the ``yirage`` logger (DEBUG, INFO, WARNING, ...).
- ``YIRAGE_CACHE_DIR``: where compiled kernels and converted tokenizers are cached
  (default ``~/.cache/yirage``).
- ``YIRAGE_ISA``: the highest x86-64 instruction-set level yirage may use (``isa_cap``):
  ``native`` (the default: what the CPU has), ``avx2`` / ``x86-64-v3`` or ``x86-64-v2``. A cap
  makes this machine behave as an older CPU: the kernel libraries are built for that level,
  providers see only its flags, and the vendor libraries in torch are capped to match
  (``apply_isa_cap``), so that ``make test`` proves AVX2-only CPUs on an AVX-512 machine.

The cache root must be a writable directory. When it is a file, cannot be created or is
not writable, ``cache_dir()`` falls back to a private per-user directory in the
temporary directory (``<tmp>/yirage-cache-<uid>``, mode 0700, owned by this user) and logs
one warning per process saying what was wrong; a read-only cache is not read from either
(its entries are rebuilt in the fallback), so nothing is ever loaded from a directory this
process could not repair. When the fallback is unusable too, ``yirage.errors.CacheError``
is raised.

The user config file, ``$XDG_CONFIG_HOME/yirage/config.json`` (default
``~/.config/yirage/config.json``; the XDG Base Directory specification ignores a relative
``XDG_CONFIG_HOME``), is a JSON object written by ``yirage set``: ``{"backend": "cpu"}``.
Keys this module does not know are kept when it rewrites the file, which it does atomically
(a temporary file in the same directory, then ``os.replace``). A file that cannot be read or
is malformed raises ``ConfigError`` naming it and saying how to repair it; it is never
ignored. Which backend names are valid is the backend registry's business
(``yirage.backends.get_backend``), not this module's.

This module must never import a backend, torch, or any yirage module but ``errors``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
from pathlib import Path

from .errors import CacheError, ConfigError

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


# ---- the instruction-set cap (YIRAGE_ISA) -------------------------------------------------

ISA_ENV = "YIRAGE_ISA"
#: ``YIRAGE_ISA`` spellings -> the level they name (``native``, or an x86-64 psABI level)
ISA_LEVELS = {"native": "native", "avx2": "x86-64-v3", "x86-64-v3": "x86-64-v3", "x86-64-v2": "x86-64-v2"}
#: per capped level, the caps of the libraries inside torch (set before they start): oneDNN's
#: ``ONEDNN_MAX_CPU_ISA``, MKL's ``MKL_ENABLE_INSTRUCTIONS`` and ATen's own vectorized kernels'
#: ``ATEN_CPU_CAPABILITY`` (torch eager, yirage's reference, then runs as on such a CPU too)
VENDOR_ISA_ENV = {
    "x86-64-v3": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "x86-64-v2": {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ATEN_CPU_CAPABILITY": "default"},
}


def isa_cap() -> str:
    """The instruction-set level of ``YIRAGE_ISA``: 'native' (unset or empty: all the CPU has),
    'x86-64-v3' (``avx2``: AVX2, FMA, F16C; no AVX-512, AVX-VNNI or AMX) or 'x86-64-v2' (SSE4.2).

    Raises:
        ConfigError: any other value (the message lists the valid ones).
    """
    value = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if value not in ISA_LEVELS:
        raise ConfigError(f"{ISA_ENV}={value!r} is not an instruction-set level: use one of "
                          f"{', '.join(ISA_LEVELS)} (or unset it for the CPU's own)")
    return ISA_LEVELS[value]


def apply_isa_cap() -> dict[str, str]:
    """Cap the vendor libraries inside torch to ``isa_cap()``'s level: set ``VENDOR_ISA_ENV``'s
    variables that are not set already (a user's own setting wins), before torch starts them
    (``import yirage`` calls this first; torch reads them at its first GEMM or vectorized op).
    Returns what it set; nothing for 'native' or an invalid ``YIRAGE_ISA`` (``isa_cap`` raises
    for that where the level is used)."""
    try:
        level = isa_cap()
    except ConfigError:
        return {}
    applied = {}
    for name, value in VENDOR_ISA_ENV.get(level, {}).items():
        if name not in os.environ:
            os.environ[name] = applied[name] = value
    return applied


# ---- the user config file ----------------------------------------------------------------

#: What to do about a config file that cannot be used (completes an error message).
_REPAIR = "run 'yirage set --unset' to reset it, or edit or delete the file"

#: path -> ((mtime_ns, size, inode), parsed object): a file is parsed again only when it changes
_parsed: dict[str, tuple[tuple[int, int, int], dict]] = {}


def thread_env(threads: int) -> dict[str, str]:
    """The environment variables that give a new process ``threads`` OpenMP and MKL threads
    (read once, when their runtimes load: so set before the process starts)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


@contextlib.contextmanager
def scoped_environ(values: dict[str, str]):
    """``values`` set in ``os.environ`` while the block runs (e.g. for the processes it
    starts), then each variable restored to what it was, or removed."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def user_config_path() -> Path:
    """The user config file: ``$XDG_CONFIG_HOME/yirage/config.json`` when XDG_CONFIG_HOME is an
    absolute path, else ``~/.config/yirage/config.json``.

    Raises:
        ConfigError: XDG_CONFIG_HOME is unset or relative and there is no home directory.
    """
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "yirage" / "config.json"
    try:
        return Path.home() / ".config" / "yirage" / "config.json"
    except RuntimeError:
        raise ConfigError("cannot locate the user config file: there is no home directory; set "
                          "XDG_CONFIG_HOME to an absolute path") from None


class _MalformedConfig(ConfigError):
    """The config file was read but holds no JSON object (``update_user_config`` sets it aside)."""


def _parse_config(path: Path) -> dict:
    """The JSON object in ``path``; ConfigError naming the file when it cannot be read,
    _MalformedConfig when it holds something else."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path} ({e.strerror or e}): {_REPAIR}") from None
    except UnicodeDecodeError:
        raise _MalformedConfig(f"the config file {path} is not UTF-8 text: {_REPAIR}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _MalformedConfig(f"the config file {path} is not valid JSON ({e.msg} at line {e.lineno} "
                               f"column {e.colno}): {_REPAIR}") from None
    if not isinstance(data, dict):
        raise _MalformedConfig(f"the config file {path} must hold a JSON object ({{\"backend\": \"cpu\"}}), "
                               f"got a {type(data).__name__}: {_REPAIR}")
    return data


def read_user_config() -> dict:
    """The user config file's settings (a dict; empty when there is no file, or no home
    directory to hold one). Parsed again only when the file changes (its mtime, size or inode).

    Raises:
        ConfigError: the file cannot be read, is not UTF-8, not JSON, or not a JSON object.
    """
    try:
        path = user_config_path()
        st = os.stat(path)
    except (ConfigError, FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path} ({e.strerror or e}): {_REPAIR}") from None
    key = (st.st_mtime_ns, st.st_size, st.st_ino)
    cached = _parsed.get(str(path))
    if cached is None or cached[0] != key:
        cached = _parsed[str(path)] = (key, _parse_config(path))
    return dict(cached[1])


def user_backend() -> str | None:
    """The ``backend`` setting of the user config file (a name or 'auto', not checked here), or
    None when the file sets none.

    Raises:
        ConfigError: the file is unusable (``read_user_config``) or its ``backend`` is not a
        non-empty string.
    """
    value = read_user_config().get("backend")
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"the config file {user_config_path()} sets backend to {value!r}, not a backend "
                          f"name: {_REPAIR}")
    return value.strip()


def write_user_config(settings: dict) -> Path:
    """Replace the user config file by ``settings`` (a JSON-ready dict), atomically: written to a
    temporary file in the same directory (created if missing), then ``os.replace``d over it.
    Returns the file's path.

    Raises:
        ConfigError: the directory or file cannot be written (the message names it).
    """
    path = user_config_path()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(settings, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise ConfigError(f"cannot write the config file {path} ({e.strerror or e}): check the "
                          f"permissions of {path.parent}") from None
    return path


def update_user_config(**changes) -> dict:
    """Set the given keys of the user config file (a value of None removes the key), keeping
    every other key; returns the settings it replaced (empty when there was no file). A file
    that holds no JSON object is set aside as ``config.json.bad`` first (a warning says so), so
    that ``yirage set --unset`` repairs it.

    Raises:
        ConfigError: the file cannot be read (other than malformed) or written.
    """
    path = user_config_path()
    try:
        settings = read_user_config()
    except _MalformedConfig:
        bad = path.with_name(path.name + ".bad")
        try:
            os.replace(path, bad)
        except OSError as e:
            raise ConfigError(f"cannot move the malformed config file {path} aside ({e.strerror or e}): "
                              "edit or delete it") from None
        logger.warning("the config file %s was malformed: moved it to %s and started a new one", path, bad)
        settings = {}
    previous = dict(settings)
    for key, value in changes.items():
        if value is None:
            settings.pop(key, None)
        else:
            settings[key] = value
    if settings != previous:  # nothing to change, nothing written (no file made to remove nothing)
        write_user_config(settings)
    return previous
