"""The machine profile: which provider runs each library op on this machine, chosen by measurement.

A library op such as a linear layer has several *providers* on one backend: yirage's own
kernels and vendor libraries through torch (MKL, oneDNN with AMX where the CPU has it). Which
is fastest depends on the CPU, the library versions and the shape: on an AMD EPYC (Zen 5)
yirage's packed float32 GEMM runs at 2.3x torch's BLAS, on an Intel Xeon with AMX oneDNN's
bfloat16 GEMM is out of reach of any AVX-512 kernel. So the choice is a measurement, made on
the machine at hand and kept (TorchInductor's ``select_algorithm`` does the same per kernel).

- A *shape class* names what is measured: op, dtype, a bucket of M (rows; the largest power of
  two <= M), N, K and the thread count, e.g. ``linear|float32|m512|n1536|k384|t2``.
- The *profile* holds, per shape class, every provider's measured median seconds and the
  choice. It lives in ``$YIRAGE_CACHE_DIR/tuning/<machine key>.json``, the machine key being a
  hash of the CPU model, its ISA flags, the torch/MKL/oneDNN versions, yirage's version and a
  digest of its kernel sources (``runtime.machine``, ``runtime.toolchain``), so a profile is
  never read on a machine, a library or a kernel it was not measured with. ``yirage optimize``
  writes ``<machine key>.optimize.json``; ``--apply`` merges it into the profile.
- *Templates* (``tuning/templates/*.json``, shipped) are profiles measured on real machines,
  each saying where; a template whose ``match`` fits this CPU answers for the shape classes
  this machine's own profile has not measured yet.
- ``choose()``: the profile, else a matching template, else a measurement at first use within
  ``FIRST_USE_BUDGET_S`` (``runtime/timing.py``: interleaved rounds), stored in the profile.
  ``YIRAGE_TUNE=off`` skips all of it: every op gets the backend's fixed default provider.

This module measures what it is given and remembers the result; it must never know what a
provider computes, and never import a backend.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import hashlib
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable, Mapping

from ..config import cache_subdir, logger
from ..errors import YirageError
from ..runtime import timing
from ..runtime.machine import all_isa_flags, cpu_generation, cpu_model_name, library_versions, usable_cpu_count
from ..runtime.toolchain import kernels_digest

FORMAT = 1
#: seconds a first-use measurement of one shape class may take (at least 3 rounds are taken)
FIRST_USE_BUDGET_S = 0.5
TUNE_ENV = "YIRAGE_TUNE"


def tune_mode() -> str:
    """``YIRAGE_TUNE``: 'on' (the default: profile, templates, measurement at first use) or
    'off' (fixed defaults). YirageError for any other value."""
    value = os.environ.get(TUNE_ENV, "on").strip().lower() or "on"
    if value in ("on", "1", "true", "yes"):
        return "on"
    if value in ("off", "0", "false", "no"):
        return "off"
    raise YirageError(f"{TUNE_ENV}={value!r}: use 'on' (measure kernel providers, the default) or 'off' "
                      "(fixed default providers)")


def m_bucket(m: int) -> int:
    """The bucket of M a measurement stands for: the largest power of two <= max(1, m)."""
    return 1 << (max(1, int(m)).bit_length() - 1)


def shape_class(op: str, dtype: str, m: int, n: int, k: int, threads: int) -> str:
    """The profile key of an (op, dtype, M bucket, N, K, threads) case."""
    return f"{op}|{dtype}|m{m_bucket(m)}|n{n}|k{k}|t{threads}"


def machine_identity() -> dict:
    """What a profile is valid for: CPU model and generation (x86 family/model: a virtual
    machine may call Zen 4 and Zen 5 both "AMD EPYC"), ISA flags, torch/MKL/oneDNN and yirage
    versions, and a digest of yirage's kernel sources (a changed kernel is measured again:
    choices made against its older self would stand otherwise)."""
    from .. import __version__

    v = library_versions()
    return {"cpu": cpu_model_name(), "cpu_generation": cpu_generation(), "isa": all_isa_flags(),
            "torch": v["torch"], "mkl": v["mkl"], "onednn": v["onednn"], "yirage": __version__,
            "kernels": kernels_digest()[:16]}


@functools.lru_cache(maxsize=1)
def machine_key() -> str:
    """A short hash of ``machine_identity()``: the profile's file name."""
    text = json.dumps(machine_identity(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Choice:
    """The provider chosen for a shape class: ``provider``, where the choice came from
    (``source``: 'profile', 'template <name>', 'measured', 'default (YIRAGE_TUNE=off)',
    'only candidate'), and the measured medians in seconds (``median_s``) when known."""

    provider: str
    source: str
    median_s: dict[str, float] = field(default_factory=dict)


class Profile:
    """A machine profile: ``entries[shape class] = {"choice", "median_s", "source", "when"}``,
    plus free-form ``extra`` sections (e.g. recommended threads per workload)."""

    def __init__(self, path: Path | None, entries: dict | None = None, extra: dict | None = None,
                 meta: dict | None = None):
        self.path, self.entries, self.extra, self.meta = path, dict(entries or {}), dict(extra or {}), dict(meta or {})

    @classmethod
    def read(cls, path: Path) -> "Profile":
        """The profile stored at ``path``; an empty one if the file is missing. A file that is not
        a profile of this format (damaged, another version) is ignored with a warning: it is a
        cache of measurements, and measuring again loses nothing."""
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return cls(path)
        except (OSError, ValueError) as e:
            logger.warning("machine profile %s is unreadable (%s); measuring again", path, e)
            return cls(path)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), dict):
            logger.warning("machine profile %s is not a format-%d profile; measuring again", path, FORMAT)
            return cls(path)
        meta = {k: v for k, v in doc.items() if k not in ("entries", "extra")}
        return cls(path, doc["entries"], doc.get("extra") or {}, meta)

    def to_dict(self) -> dict:
        """The JSON document: format, the machine it was measured on, entries, extra."""
        return {"format": FORMAT, "machine": machine_identity(), **{k: v for k, v in self.meta.items()
                                                                     if k not in ("format", "machine")},
                "entries": self.entries, "extra": self.extra}

    def save(self) -> None:
        """Merge into the file at ``path`` (entries measured by another process meanwhile are
        kept unless this profile has the same key; noisy entries are not written), atomically
        under a lock."""
        if self.path is None:
            raise YirageError("this profile has no file to save to")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(self.path):
            disk = Profile.read(self.path)
            disk.entries.update({k: e for k, e in self.entries.items() if "noisy" not in e})
            disk.extra.update(self.extra)
            self.entries, self.extra = disk.entries, disk.extra
            _write_json(self.path, self.to_dict())


@contextlib.contextmanager
def _locked(path: Path):
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_json(path: Path, doc: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


#: where profiles live when set (a directory); else ``$YIRAGE_CACHE_DIR/tuning`` (the test suite
#: points it elsewhere, subprocesses included, so that measurements taken under its load never
#: reach a user's profile)
PROFILE_DIR_ENV = "YIRAGE_PROFILE_DIR"


def profile_path(suffix: str = "") -> Path:
    """``$YIRAGE_CACHE_DIR/tuning/<machine key><suffix>.json``, or in ``$YIRAGE_PROFILE_DIR``."""
    override = os.environ.get(PROFILE_DIR_ENV)
    folder = Path(override) if override else cache_subdir("tuning")
    return folder / f"{machine_key()}{suffix}.json"


_active: dict[tuple, Profile] = {}


def _where() -> tuple:
    """What decides ``profile_path()``, without touching the file system: the environment it
    reads and the machine key. A plan's kernel choices ask for the profile hundreds of times
    (an embedding model's first encode: 361 times); ``profile_path`` creates and checks the
    cache directory each time (~0.1 ms)."""
    env = os.environ
    return env.get(PROFILE_DIR_ENV), env.get("YIRAGE_CACHE_DIR"), env.get("HOME"), machine_key()


def active_profile() -> Profile:
    """This machine's profile (read once per process and cache directory)."""
    where = _where()
    profile = _active.get(where)
    if profile is None:
        profile = _active[where] = Profile.read(profile_path())
    return profile


def reload_profile() -> Profile:
    """Forget the profile read by this process (after ``yirage optimize --apply`` wrote it)."""
    _active.pop(_where(), None)
    return active_profile()


# ---- templates ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def templates() -> tuple[tuple[str, dict], ...]:
    """(name, document) of every shipped template, in file-name order."""
    out = []
    folder = resources.files("yirage.tuning") / "templates"
    for item in sorted(folder.iterdir(), key=lambda p: p.name) if folder.is_dir() else []:
        if item.name.endswith(".json"):
            out.append((item.name[:-5], json.loads(item.read_text())))
    return tuple(out)


def _matches(match: dict, identity: dict) -> bool:
    """Does a template's ``match`` ({"cpu": model name, "cpu_generation": a prefix of
    "family/model" such as "26/" (AMD Zen 5) or "25/17", "isa_all": [...], "isa_none": [...],
    "torch": version prefix}) fit this machine?"""
    isa = set(identity["isa"])
    return (match.get("cpu", identity["cpu"]) == identity["cpu"]
            and (identity.get("cpu_generation") or "").startswith(match.get("cpu_generation", ""))
            and set(match.get("isa_all", [])) <= isa and not set(match.get("isa_none", [])) & isa
            and identity["torch"].startswith(match.get("torch", "")))


@functools.lru_cache(maxsize=1)
def matching_template() -> tuple[str, dict] | None:
    """The first shipped template that fits this machine, or None."""
    ident = machine_identity()
    return next(((n, d) for n, d in templates() if _matches(d.get("match", {}), ident)), None)


# ---- the choice ---------------------------------------------------------------------------
def lookup(key: str, candidates: Mapping[str, object]) -> Choice | None:
    """The recorded choice for ``key`` among ``candidates`` (names): this machine's profile,
    then a matching template; None when neither has one, its provider is not a candidate, or
    the entry's timings lack a candidate (a provider added since: measure again; an entry
    without timings is a choice made by hand and kept)."""
    def usable(entry) -> bool:
        timed = set(entry.get("median_s") or {}) if entry else set()
        return bool(entry) and entry.get("choice") in candidates and (not timed or set(candidates) <= timed)
    entry = active_profile().entries.get(key)
    if usable(entry):
        return Choice(entry["choice"], "profile", dict(entry.get("median_s", {})))
    tpl = matching_template()
    if tpl is not None:
        entry = tpl[1].get("entries", {}).get(key)
        if usable(entry):
            return Choice(entry["choice"], f"template {tpl[0]}", dict(entry.get("median_s", {})))
    return None


def measure(candidates: Mapping[str, Callable[[], object]], budget_s: float = FIRST_USE_BUDGET_S,
            min_sample_s: float = 0.001, sync: Callable[[], None] = timing.no_sync) -> timing.Comparison:
    """Time ready-to-run candidates ({name: thunk}) in interleaved rounds for about
    ``budget_s`` seconds (at least 3 rounds); ``sync`` waits for a device's queued work after
    each sample (GPU candidates). The comparison's ``others_cores`` says how many cores other
    processes kept busy meanwhile (``busy_reason`` judges by it)."""
    start = cpu_sample()
    comparison = timing.compare(candidates, rounds=9, min_sample_s=min_sample_s, sync=sync,
                                deadline=time.perf_counter() + budget_s, min_rounds=3)
    comparison.others_cores = others_cores(start)
    return comparison


#: a winner faster than the runner-up in fewer than this share of the paired rounds won a close
#: race: within noise of it, so either serves (recorded as such, see ``record``)
STEADY_SHARE = 2 / 3


#: cores of other processes' work during a measurement above which its figures are not kept
OTHERS_CORES_LIMIT = 0.5


def cpu_sample() -> tuple[float, float, float] | None:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process, monotonic
    seconds) from /proc/stat and ``os.times``; None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    ticks = [int(v) for v in fields[1:]]
    busy = sum(ticks[:3]) + sum(ticks[5:8])   # user nice system, irq softirq steal (not idle, iowait)
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.monotonic()


def others_cores(since: tuple[float, float, float] | None) -> float | None:
    """Cores kept busy by other processes (the machine's busy time less this process's) since the
    ``cpu_sample`` ``since``, on average; None when unknown."""
    now = cpu_sample()
    if since is None or now is None or now[2] - since[2] <= 0:
        return None
    return max(0.0, ((now[0] - since[0]) - (now[1] - since[1])) / (now[2] - since[2]))


def busy_reason(comparison: timing.Comparison | None = None) -> str | None:
    """Why figures measured now (or ``comparison``'s) are not worth keeping, or None: other
    processes kept more than ``OTHERS_CORES_LIMIT`` cores busy while ``comparison`` was measured
    (this process's own threads do not count: on 2 cores a measurement's own 2 threads made the
    load average read as busy, so no first-use choice was ever saved and every process measured
    again); without such a figure, a 1-minute load average above the usable cores."""
    others = getattr(comparison, "others_cores", None)
    if others is not None:
        return f"other processes kept {others:.1f} cores busy while it was measured" if others > OTHERS_CORES_LIMIT \
            else None
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    cores = usable_cpu_count()
    return f"load average {load:.1f} on {cores} cores" if load > cores else None


def close_race(comparison: timing.Comparison) -> str | None:
    """Why ``comparison``'s winner (lowest median) is within noise of the runner-up, or None:
    it was faster in fewer than ``STEADY_SHARE`` of the rounds (a one-off slow round of another
    candidate does not count)."""
    if len(comparison.names) < 2:
        return None
    best = comparison.fastest()
    runner_up = min((n for n in comparison.names if n != best), key=comparison.median)
    ratios = comparison.ratios(best, runner_up)
    won = sum(r < 1.0 for r in ratios)
    if won < STEADY_SHARE * len(ratios):
        return f"{best} was faster than {runner_up} in {won} of {len(ratios)} rounds"
    return None


def unsteady_reason(comparison: timing.Comparison) -> str | None:
    """Why ``comparison``'s figures are not a clear verdict, or None: a busy machine
    (``busy_reason``) or a close race (``close_race``)."""
    return busy_reason(comparison) or close_race(comparison)


def record(key: str, comparison: timing.Comparison, source: str, profile: Profile | None = None) -> Choice:
    """Store the fastest candidate of ``comparison`` (lowest median) for ``key`` in ``profile``
    (default: this machine's); return it. The profile is saved to disk unless the machine was
    busy (``busy_reason``: the figures are unreliable; the choice serves this process and the
    next one measures again). A close race (``close_race``) is saved, marked ``close``: the
    candidates are within noise of each other, so measuring them again in every process would
    cost a measurement (packing every candidate's weights) for nothing."""
    best = comparison.fastest()
    medians = {n: comparison.median(n) for n in comparison.names}
    profile = profile if profile is not None else active_profile()
    busy = busy_reason(comparison)
    close = close_race(comparison)
    profile.entries[key] = {"choice": best, "median_s": medians, "source": source,
                            "when": datetime.date.today().isoformat(), **({"noisy": busy} if busy else {}),
                            **({"close": close} if close else {})}
    if busy:
        logger.info("%s: %s chosen, but not saved to the profile (%s)", key, best, busy)
    elif profile.path is not None:
        profile.save()
    return Choice(best, "measured", medians)


def choose(key: str, candidates: Mapping[str, Callable[[], Callable[[], object]]], default: str,
           budget_s: float = FIRST_USE_BUDGET_S, sync: Callable[[], None] = timing.no_sync) -> Choice:
    """The provider for shape class ``key``.

    Args:
        candidates: {provider name: factory}; a factory prepares the provider (packs its
            weights) and returns a thunk running the op once on sample inputs of the class; it
            is only called when a measurement is needed. A factory that raises leaves its
            provider out (logged at DEBUG).
        default: the provider used with ``YIRAGE_TUNE=off`` (must be a candidate).
        sync: waits for queued device work; called after each timed sample (GPU providers).

    Returns: a ``Choice``. Raises YirageError for a bad ``YIRAGE_TUNE`` or a default that is not
    a candidate.
    """
    if default not in candidates:
        raise YirageError(f"choose({key}): the default provider {default!r} is not among {list(candidates)}")
    if tune_mode() == "off":
        return Choice(default, f"default ({TUNE_ENV}=off)")
    if len(candidates) == 1:
        return Choice(default, "only candidate")
    known = lookup(key, candidates)
    if known is not None:
        return known
    t0 = time.perf_counter()
    thunks = {}
    for name, factory in candidates.items():
        try:
            thunks[name] = factory()
        except Exception as e:  # noqa: BLE001 - a provider this build of a library cannot run
            logger.debug("provider %s left out of %s: %s: %s", name, key, type(e).__name__, e)
    if len(thunks) <= 1:   # nothing to compare: not recorded, asked again by the next process
        _account(time.perf_counter() - t0, measured=False)
        return Choice(next(iter(thunks), default), "only candidate")
    choice = record(key, measure(thunks, budget_s, sync=sync), "first use")
    took = time.perf_counter() - t0
    _account(took, measured=True)
    logger.info("%s: %s chosen by measurement in %.2f s (%s)", key, choice.provider, took,
                ", ".join(f"{n} {t * 1e6:.0f} us" for n, t in choice.median_s.items()))
    return choice


_SPENT = {"measured": 0, "seconds": 0.0}
_SPENT_LOCK = threading.Lock()


def _account(seconds: float, measured: bool) -> None:
    with _SPENT_LOCK:   # plans bind in several threads (the serve engine's and a caller's)
        _SPENT["seconds"] += seconds
        _SPENT["measured"] += int(measured)


def first_use_spent() -> dict:
    """What first-use kernel choices have cost this process so far: ``{"measured": shape classes
    measured, "seconds": wall seconds in ``choose`` preparing and timing candidates}``. The
    seconds include each candidate's first run, so a GPU kernel's JIT compile and autotuning
    are counted here (e.g. the share of a ``torch.compile`` first call that is kernel choice;
    ``benchmarks/torch_compile.py`` reports it)."""
    with _SPENT_LOCK:
        return dict(_SPENT)


__all__ = ["Choice", "Profile", "choose", "first_use_spent", "lookup", "measure", "record", "shape_class", "m_bucket",
           "tune_mode",
           "active_profile", "reload_profile", "profile_path", "machine_key", "machine_identity", "templates",
           "matching_template", "FIRST_USE_BUDGET_S"]
