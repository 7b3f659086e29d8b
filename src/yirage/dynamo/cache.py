"""The compile cache of the torch.compile front end: compiled partitions across processes.

A partition variant (one partition, one input signature) is stored once compiled, as one
JSON file ``<cache dir>/dynamo/<key>.json``:
- the kernel graph its lowering emitted (ir/serialize.py JSON), its scalar constants and
  whether it returns a tuple;
- with ``mode="max-autotune"``, superoptimize's winner (its graph, description and report).

The key is the SHA-256 of: the partition's FX graph as code (``GraphModule.code``: its ops,
their arguments and literals), the input signature (``specialize.signature``), the options
that change what is built (mode, time budget, dtype), the backend, the versions of yirage,
torch and this cache format, a digest of the lowering table's source and of the code of
the emitters the partition's ops use now (a lowering replaced at run time), and, for
max-autotune, the machine and torch's thread count (the winner is a measurement).

A second process that compiles the same model finds every variant: it skips the lowering
(specialization and IR emission) and the superoptimize search; the C++ behind the fused
kernels is then found in the toolchain's own cache (runtime/toolchain.py), so no compiler
runs either. Dynamo's tracing and AOTAutograd still run (they are torch's).

Integrity: the file holds its payload (JSON text) and the payload's SHA-256; an entry that does not
parse, does not match its checksum or whose graph breaks a shape rule is logged at DEBUG,
counted as ``corrupt``, rebuilt and overwritten (writes go to a temporary file renamed into
place: readers never see a partial entry). A cache directory that cannot be written is
logged at DEBUG and the compile goes on without storing.

``stats()`` counts hits, misses, corrupt entries and stores in this process; every
``PartitionReport`` counts its own (``yr.explain`` prints them).

This module must never lower, compile or run a graph: it stores and returns what it is given.
"""
from __future__ import annotations

import functools
import hashlib
import json
import marshal
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import cache_subdir, logger
from ..errors import YirageError

FORMAT = 1

_STATS = {"hits": 0, "misses": 0, "corrupt": 0, "stores": 0}


def stats() -> dict[str, int]:
    """This process's counts of partition-cache ``hits``, ``misses`` (``corrupt`` entries
    included), ``corrupt`` entries (rebuilt) and ``stores``; a copy."""
    return dict(_STATS)


def reset_stats() -> None:
    """Set every count of ``stats()`` back to zero."""
    for k in _STATS:
        _STATS[k] = 0


@dataclass
class Entry:
    """One cached partition variant.

    Attributes:
        graph: the emitted kernel graph as JSON (ir/serialize.py).
        constants: the scalar constant inputs, each ``[values, dtype name]`` (values a list).
        tuple_out: whether the partition returns a tuple.
        winner: for max-autotune, ``{"graph": JSON, "description": str, "report": dict}``.
    """

    graph: str
    constants: list
    tuple_out: bool
    winner: dict | None = None

    def constant_tensors(self) -> list[torch.Tensor]:
        """The constants as (CPU) tensors; ValueError for an unknown dtype name."""
        out = []
        for values, dtype in self.constants:
            dt = getattr(torch, str(dtype).removeprefix("torch."), None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}")
            out.append(torch.tensor(values, dtype=dt))
        return out

    @staticmethod
    def constants_of(tensors: list[torch.Tensor]) -> list:
        """``tensors`` as ``Entry.constants``."""
        return [[t.cpu().tolist(), str(t.dtype).removeprefix("torch.")] for t in tensors]


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """SHA-256 of the source of the modules that decide what a partition emits."""
    from . import lowering, specialize
    h = hashlib.sha256()
    for mod in (lowering, specialize):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()


def _function_digest(fn) -> str:
    """SHA-256 of a function's compiled code (a lowering replaced at run time, as tests do,
    changes it)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return repr(fn)
    try:
        return hashlib.sha256(marshal.dumps(code)).hexdigest()
    except ValueError:
        return repr(fn)


def key(code: str, sig: tuple, options, backend: str, emitters=()) -> str:
    """The cache key of one partition variant (see the module docstring). ``code``: the
    partition's ``GraphModule.code``; ``sig``: ``specialize.signature`` of its inputs;
    ``options``: the ``CompileOptions``; ``backend``: the resolved backend name;
    ``emitters``: the lowering functions the partition's ops use (their code is hashed)."""
    from .. import __version__
    from ..ir.serialize import VERSION as IR_VERSION
    parts = {"format": FORMAT, "code": code, "signature": repr(sig), "mode": options.mode,
             "dtype": options.dtype, "backend": backend, "yirage": __version__, "torch": torch.__version__,
             "ir": IR_VERSION, "lowering": _code_digest(),
             "emitters": sorted({_function_digest(f) for f in emitters})}
    if options.mode == "max-autotune":
        from ..search.superoptimize import _machine
        parts.update(time_budget_s=options.time_budget_s, machine=_machine(backend), threads=torch.get_num_threads())
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def entry_path(k: str) -> Path:
    """Where the entry of key ``k`` lives (under the cache dir in effect now).

    Raises CacheError when no cache directory is usable."""
    return cache_subdir("dynamo") / f"{k}.json"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def load(k: str) -> tuple[Entry | None, str]:
    """The entry of key ``k`` and ``"hit"``; or None and ``"miss"`` (absent) or ``"corrupt"``
    (present but damaged: logged at DEBUG; the caller rebuilds and ``store``s it). Counted
    in ``stats()``. Never raises for a bad entry or an unusable cache directory (a miss)."""
    try:
        path = entry_path(k)
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        _STATS["misses"] += 1
        return None, "miss"
    except (OSError, YirageError, UnicodeDecodeError) as e:
        logger.debug("yirage compile cache: cannot read entry %s (%s); compiling it", k, e)
        _STATS["misses"] += 1
        return None, "miss"
    try:
        doc = json.loads(text)
        if doc.get("format") != FORMAT or doc.get("key") != k:
            raise ValueError(f"format {doc.get('format')!r} / key {str(doc.get('key'))[:12]!r}")
        if not isinstance(doc["payload"], str) or doc.get("sha256") != _digest(doc["payload"]):
            raise ValueError("the payload does not match its sha256")
        payload = json.loads(doc["payload"])
        entry = Entry(payload["graph"], payload["constants"], bool(payload["tuple_out"]), payload.get("winner"))
        if not isinstance(entry.graph, str) or not isinstance(entry.constants, list):
            raise ValueError("malformed payload")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        reject(k, path, e)
        return None, "corrupt"
    _STATS["hits"] += 1
    return entry, "hit"


def reject(k: str, path: Path | None, error: Exception) -> None:
    """Count the entry of key ``k`` as corrupt (and a miss) and log it at DEBUG; the caller
    rebuilds it (``load`` calls this; so does a caller whose loaded entry fails later)."""
    _STATS["misses"] += 1
    _STATS["corrupt"] += 1
    logger.debug("yirage compile cache: entry %s is damaged (%s: %s); rebuilding it",
                 path or k, type(error).__name__, error)


def store(k: str, entry: Entry) -> None:
    """Write ``entry`` under key ``k`` atomically (a temporary file renamed into place).
    A cache that cannot be written is logged at DEBUG, never raised."""
    payload = {"graph": entry.graph, "constants": entry.constants, "tuple_out": entry.tuple_out,
               "winner": entry.winner}
    body = json.dumps(payload)
    text = json.dumps({"format": FORMAT, "key": k, "sha256": _digest(body), "payload": body})
    try:
        path = entry_path(k)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except (OSError, YirageError) as e:
        logger.debug("yirage compile cache: cannot store entry %s (%s); going on without it", k, e)
        return
    _STATS["stores"] += 1
