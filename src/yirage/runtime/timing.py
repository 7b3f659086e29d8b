"""One measurement harness for every speed decision yirage makes: the superoptimizer's winner,
the CPU backend's kernel providers (``yirage.tuning``) and the benchmarks' figures.

Why a harness and not ``time.perf_counter()`` around a loop: on a shared machine a burst of
load from another process can slow one candidate's timing by 2x, and timings taken seconds
apart (a search times its candidates one after the other) do not compare. So:

- Samples, not calls. A sample is a batch of back-to-back calls lasting at least
  ``min_sample_s`` (the batch size is calibrated once per candidate from a warm call), so
  microsecond kernels are not timed at the resolution of the clock and the host overhead of
  one call is not all that is measured; the device is synchronized at the end of each sample.
- Interleaved rounds. Each round takes one sample of every candidate, in an order rotated
  from round to round, so that slow stretches fall on all of them alike.
- Paired ratios. Two candidates are compared by the ratio of their samples *within* each
  round (``Comparison.ratios``); the statistic is the median of those ratios, which one
  disturbed round cannot move. ``Comparison.beats`` adds a margin and a consistency rule.

Modelled on Triton's ``testing.do_bench`` (warm-up, repeated timing, quantiles) and on
TorchInductor's ``select_algorithm`` (several implementations of one op, timed alike, the
fastest kept). This module times callables; it must never decide what to do with a result
and never import a backend.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

#: default seconds per sample, and rounds per comparison
MIN_SAMPLE_S = 0.002
ROUNDS = 7


def no_sync() -> None:
    """The default ``sync``: CPU work is done when the call returns."""


def calibrate(fn: Callable[[], object], min_sample_s: float = MIN_SAMPLE_S, sync: Callable[[], None] = no_sync,
              warmup: int = 1, max_calls: int = 1 << 20) -> int:
    """Calls per sample so that one sample of ``fn`` lasts at least ``min_sample_s`` seconds,
    from one timed call after ``warmup`` untimed ones (at least 1, at most ``max_calls``)."""
    for _ in range(max(0, warmup)):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - t0, 1e-7)
    return max(1, min(max_calls, math.ceil(min_sample_s / once)))


def sample(fn: Callable[[], object], calls: int, sync: Callable[[], None] = no_sync) -> float:
    """Seconds per call of ``fn`` over one batch of ``calls`` back-to-back calls, the device
    synchronized (``sync``) once at the end."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls


@dataclass
class Comparison:
    """Interleaved samples of named candidates: ``rounds[r][name]`` is the seconds per call of
    ``name`` in round ``r`` (every candidate has a sample in every round), ``calls[name]`` the
    calls per sample."""

    rounds: list[dict[str, float]] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    #: cores other processes kept busy while it was measured (``tuning.measure`` sets it), or None
    others_cores: float | None = None

    @property
    def names(self) -> list[str]:
        """The candidates, in the order they were given."""
        return list(self.calls)

    def samples(self, name: str) -> list[float]:
        """Seconds per call of ``name``, one per round."""
        return [r[name] for r in self.rounds]

    def median(self, name: str) -> float:
        """Median seconds per call of ``name`` over the rounds."""
        return statistics.median(self.samples(name))

    def best(self, name: str) -> float:
        """Fastest sample of ``name`` (seconds per call)."""
        return min(self.samples(name))

    def ratios(self, name: str, baseline: str) -> list[float]:
        """Per round, ``name``'s time over ``baseline``'s in that same round (< 1: faster)."""
        return [r[name] / r[baseline] for r in self.rounds]

    def ratio(self, name: str, baseline: str) -> float:
        """The median of the paired ratios ``ratios(name, baseline)``: how long ``name`` takes
        relative to ``baseline`` (0.8: 20% less time), robust to a disturbed round."""
        return statistics.median(self.ratios(name, baseline))

    def beats(self, name: str, baseline: str, margin: float = 0.03, consistency: float = 2 / 3) -> bool:
        """True when ``name`` is faster than ``baseline`` by at least ``margin`` in the median
        paired ratio (ratio <= 1 - margin) *and* faster at all in at least ``consistency`` of
        the rounds: a win that a few lucky rounds make does not count."""
        return beats(self.ratios(name, baseline), margin, consistency)

    def fastest(self) -> str:
        """The candidate with the lowest median time."""
        return min(self.names, key=self.median)

    def merge(self, other: "Comparison") -> "Comparison":
        """The rounds of ``self`` and then ``other`` for the candidates both have (a later
        round of timing the same candidates; ``calls`` from ``other``)."""
        common = [n for n in self.names if n in other.calls]
        rounds = [{n: r[n] for n in common} for r in self.rounds + other.rounds]
        return Comparison(rounds, {n: other.calls[n] for n in common})

    def to_dict(self) -> dict:
        """JSON-ready: every round's seconds per call, calls per sample, medians."""
        return {"rounds_s": [dict(r) for r in self.rounds], "calls_per_sample": dict(self.calls),
                "median_s": {n: self.median(n) for n in self.names} if self.rounds else {}}


def beats(ratios: list[float], margin: float = 0.03, consistency: float = 2 / 3) -> bool:
    """True when paired ratios (a candidate's time over the baseline's, one per round) show a
    win: median <= 1 - ``margin`` and below 1 in at least ``consistency`` of the rounds."""
    if not ratios:
        return False
    return statistics.median(ratios) <= 1.0 - margin and sum(r < 1.0 for r in ratios) >= consistency * len(ratios)


def compare(candidates: Mapping[str, Callable[[], object]], rounds: int = ROUNDS,
            min_sample_s: float = MIN_SAMPLE_S, sync: Callable[[], None] = no_sync, warmup: int = 1,
            deadline: float | None = None, min_rounds: int = 3,
            calls: Mapping[str, int] | None = None) -> Comparison:
    """Time ``candidates`` ({name: zero-argument callable}) in interleaved rounds.

    Args:
        candidates: at least one; each is called as is (bind inputs beforehand).
        rounds: rounds to take; each round has one sample of every candidate, in an order
            rotated by one place from the round before.
        min_sample_s: seconds per sample at least (calibrated per candidate after ``warmup``
            untimed calls), unless ``calls`` gives the calls per sample.
        sync: waits for queued device work (a backend's ``synchronize``); called after each
            sample.
        deadline: a ``time.perf_counter()`` value; rounds stop once it has passed and at
            least ``min_rounds`` were taken.

    Returns: a ``Comparison``. Raises ValueError for no candidates or rounds < 1; whatever a
    candidate raises propagates.
    """
    if not candidates:
        raise ValueError("compare: no candidates to time")
    if rounds < 1:
        raise ValueError(f"compare: rounds must be >= 1, got {rounds}")
    names = list(candidates)
    per_call = dict(calls) if calls else {n: calibrate(candidates[n], min_sample_s, sync, warmup) for n in names}
    result = Comparison([], per_call)
    for r in range(rounds):
        if deadline is not None and r >= min_rounds and time.perf_counter() > deadline:
            break
        order = names[r % len(names):] + names[:r % len(names)]
        result.rounds.append({n: sample(candidates[n], per_call[n], sync) for n in order})
    return result


def bench(fn: Callable[[], object], rounds: int = ROUNDS, min_sample_s: float = MIN_SAMPLE_S,
          sync: Callable[[], None] = no_sync, warmup: int = 1) -> float:
    """Median seconds per call of one callable (``compare`` with one candidate)."""
    return compare({"fn": fn}, rounds, min_sample_s, sync, warmup).median("fn")


__all__ = ["Comparison", "compare", "beats", "bench", "calibrate", "sample", "MIN_SAMPLE_S", "ROUNDS"]
