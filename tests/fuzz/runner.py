"""Run mutation recipes in fuzz worker processes (tests/fuzz/worker.py) and classify the outcomes.

    with FuzzRunner(seeds, workers=2, timeout=20) as runner:
        results = runner.run(make_recipes(Context.from_seeds(seeds), per_category=42))
    print(outcome_table(results)); bad = failures(results)

Outcomes of one mutant:

- ``clean_error``: a yirage exception (YirageError or a subclass) at load, build or generation;
- ``identical``: loaded and generated the same greedy token ids as the unmutated seed;
- ``changed``: loaded, generated other ids, logits finite;
- ``nonfinite``: loaded and generated, but the prompt's logits hold NaN/inf;
- ``crash``: the process died of a signal (SIGSEGV, SIGBUS, SIGABRT, ...) or exited without a result;
- ``hang``: no result within the timeout (killed);
- ``other_exception``: any exception that is not a yirage exception (type and message kept);
- ``harness_error``: the fuzzer itself failed to build the mutant (a bug here, not in yirage).

``crash``, ``hang``, ``other_exception`` and ``harness_error`` are failures (``FAILING``).
"""
from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from . import mutate

OUTCOMES = ["clean_error", "identical", "changed", "nonfinite", "crash", "hang", "other_exception",
            "harness_error"]
FAILING = ("crash", "hang", "other_exception", "harness_error")
WORKER = Path(__file__).with_name("worker.py")
STARTUP_TIMEOUT = 300.0


@dataclass
class Result:
    recipe: dict
    outcome: str
    raw: dict = field(repr=False)

    @property
    def seconds(self) -> float:
        return float(self.raw.get("seconds") or 0.0)

    def message(self) -> str:
        """One line: the exception type and message, or the signal and the crashing frame."""
        raw = self.raw
        if self.outcome in ("clean_error", "other_exception"):
            return f"{raw.get('exc_type', '?')} at {raw.get('stage', '?')}: {_one_line(raw.get('message', ''))}"
        if self.outcome == "crash":
            what = raw.get("signal") or raw.get("message", "")
            return f"{what}{' in ' + crash_frame(raw.get('log', '')) if raw.get('log') else ''}"
        if self.outcome in ("hang", "harness_error"):
            frame = crash_frame(raw.get("log", "")) if raw.get("log") else ""
            return _one_line(raw.get("message", "")) + (f" (last frame: {frame})" if frame else "")
        if self.outcome in ("changed", "nonfinite", "identical"):
            return f"token ids {raw.get('token_ids')}"
        return ""

    def describe(self) -> str:
        r = self.recipe
        return f"[{r['category']} #{r.get('id')}] {r['desc']} -> {self.outcome}: {self.message()}"


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def crash_frame(log: str) -> str:
    """The innermost Python frame of a faulthandler dump (``file:line in func``); the innermost
    yirage frame when there is one too."""
    frames = _FRAME.findall(log.split("Current thread")[-1] if "Current thread" in log else log)
    if not frames:
        lines = [ln for ln in log.strip().splitlines() if ln.strip()]
        return _one_line(lines[-1], 200) if lines else ""
    top = frames[0]
    where = f"{Path(top[0]).name}:{top[1]} in {top[2]}"
    ours = next((f for f in frames if "/yirage/" in f[0]), None)
    if ours and ours != top:
        where += f" (from {Path(ours[0]).name}:{ours[1]} in {ours[2]})"
    return where


def classify(raw: dict, reference: list[int] | None) -> str:
    status = raw.get("status")
    if status == "loaded":
        if not raw.get("finite", True):
            return "nonfinite"
        return "identical" if raw.get("token_ids") == reference else "changed"
    if status == "exception":
        return "clean_error" if raw.get("yirage") else "other_exception"
    if status in ("crash", "no_result"):
        return "crash"
    if status == "hang":
        return "hang"
    return "harness_error"


class _Worker:
    def __init__(self, runner: "FuzzRunner", index: int):
        self.index = index
        self.log = open(runner.work / f"worker-{index}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(runner.seeds_dir), str(runner.work / "mutants"), str(runner.timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=runner.env, text=True, bufsize=1)
        self.item: dict | None = None
        self.sent_at = 0.0
        self.ready: dict | None = None

    def send(self, recipe: dict) -> None:
        self.item = recipe
        self.sent_at = time.monotonic()
        self.proc.stdin.write(json.dumps({"recipe": recipe}) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


class FuzzRunner:
    """A pool of fuzz workers (tests/fuzz/worker.py), each forking one child per mutant.

    Args:
        seeds: the seed files (``mutate.build_seeds``); they must lie in one directory as
            ``seed.gguf`` and ``seed-hf``.
        workers: worker processes (default: the usable CPUs, at most 4).
        timeout: seconds a mutant may take before it counts as a hang.
        work_dir: where mutants and worker logs go (default: a new temporary directory,
            removed on close).
    """

    def __init__(self, seeds: mutate.Seeds, workers: int | None = None, timeout: float = 20.0,
                 work_dir: str | os.PathLike | None = None):
        self.seeds = seeds
        self.seeds_dir = Path(seeds.gguf).parent
        if Path(seeds.hf).parent != self.seeds_dir:
            raise ValueError("the seeds must share one directory")
        self.workers_n = workers or max(1, min(4, len(os.sched_getaffinity(0))))
        self.timeout = float(timeout)
        self._own_work = work_dir is None
        self.work = Path(work_dir or tempfile.mkdtemp(prefix="yirage-fuzz-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                        HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1")
        self.workers: list[_Worker] = []
        self.references: dict[str, list[int]] = {}
        self.startup_s = 0.0

    # ---- lifecycle
    def __enter__(self) -> "FuzzRunner":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the workers; RuntimeError (workers stopped) when one cannot start or an
        unmutated seed does not load and generate cleanly."""
        t0 = time.monotonic()
        try:
            self.workers = [_Worker(self, i) for i in range(self.workers_n)]
            for w in self.workers:
                self._wait_ready(w)
            warm = self.workers[0].ready["warm"]
            for target, out in warm.items():
                if out.get("status") != "loaded" or not out.get("finite"):
                    raise RuntimeError(f"the unmutated {target} seed does not load and generate cleanly: "
                                       f"{json.dumps(out)[:2000]}")
                self.references[target] = out["token_ids"]
        except BaseException:
            self.close()
            raise
        self.startup_s = time.monotonic() - t0

    def _wait_ready(self, w: _Worker) -> None:
        sel = selectors.DefaultSelector()
        sel.register(w.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while w.ready is None:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"fuzz worker {w.index} did not start in {STARTUP_TIMEOUT:.0f} s; "
                                   f"see {self.work / f'worker-{w.index}.log'}")
            line = w.proc.stdout.readline()
            if not line:
                log = (self.work / f"worker-{w.index}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"fuzz worker {w.index} exited at start-up:\n{log}")
            msg = json.loads(line)
            if msg.get("ready"):
                w.ready = msg
        sel.close()

    def close(self) -> None:
        for w in self.workers:
            try:
                w.proc.stdin.close()
            except OSError:
                pass
        for w in self.workers:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            w.kill()
        self.workers = []
        if self._own_work:
            shutil.rmtree(self.work, ignore_errors=True)

    # ---- running
    def run(self, recipes: Iterable[dict], on_result: Callable[[Result], None] | None = None) -> list[Result]:
        """Run every recipe once; results in the order of ``recipes``."""
        todo = list(recipes)
        queue = list(range(len(todo)))[::-1]
        results: dict[int, Result] = {}
        busy: dict[int, int] = {}  # worker index -> position in todo
        guard = self.timeout + 60.0
        while queue or busy:
            for w in self.workers:
                if w.index not in busy and queue:
                    pos = queue.pop()
                    busy[w.index] = pos
                    w.send(todo[pos])
            sel = selectors.DefaultSelector()
            for w in self.workers:
                if w.index in busy:
                    sel.register(w.proc.stdout, selectors.EVENT_READ, w)
            events = sel.select(timeout=5.0)
            sel.close()
            now = time.monotonic()
            for key, _ in events:
                w = key.data
                line = w.proc.stdout.readline()
                pos = busy.pop(w.index)
                if not line:  # the worker itself died: count the mutant as a crash, start a new worker
                    raw = {"status": "crash", "signal": f"worker exited ({w.proc.poll()})", "id": todo[pos].get("id")}
                    self._replace(w)
                else:
                    raw = json.loads(line)
                results[pos] = self._result(todo[pos], raw, on_result)
            for w in list(self.workers):
                if w.index in busy and now - w.sent_at > guard:  # the worker's own timeout failed
                    pos = busy.pop(w.index)
                    raw = {"status": "hang", "message": f"worker gave no answer in {guard:.0f} s"}
                    results[pos] = self._result(todo[pos], raw, on_result)
                    self._replace(w)
        return [results[i] for i in range(len(todo))]

    def _result(self, recipe: dict, raw: dict, on_result) -> Result:
        res = Result(recipe, classify(raw, self.references.get(recipe["target"])), raw)
        if on_result:
            on_result(res)
        return res

    def _replace(self, w: _Worker) -> None:
        w.kill()
        new = _Worker(self, w.index)
        self._wait_ready(new)
        self.workers[self.workers.index(w)] = new


# ---- reports

def outcome_counts(results: list[Result]) -> dict[str, Counter]:
    table: dict[str, Counter] = {}
    for r in results:
        table.setdefault(r.recipe["category"], Counter())[r.outcome] += 1
    return table


def outcome_table(results: list[Result]) -> str:
    """A plain-text table: one row per category, one column per outcome, and a total row."""
    table = outcome_counts(results)
    cats = [c for c in mutate.CATEGORIES if c in table] + sorted(c for c in table if c not in mutate.CATEGORIES)
    cols = ["total"] + OUTCOMES
    width = max([len(c) for c in cats] + [8])
    lines = [f"{'category':<{width}} " + " ".join(f"{c:>{max(5, len(c))}}" for c in cols)]
    total: Counter = Counter()
    for cat in cats + ["TOTAL"]:
        counts = table[cat] if cat != "TOTAL" else total
        if cat != "TOTAL":
            total.update(counts)
        row = [sum(counts.values())] + [counts.get(o, 0) for o in OUTCOMES]
        lines.append(f"{cat:<{width}} " + " ".join(f"{v:>{max(5, len(c))}}" for v, c in zip(row, cols)))
    return "\n".join(lines)


def failures(results: list[Result]) -> list[Result]:
    return [r for r in results if r.outcome in FAILING]


def failure_signature(r: Result) -> str:
    """What identifies a distinct bug: outcome plus exception type and stage, or the crash signal
    and frame (numbers and paths in messages stripped)."""
    raw = r.raw
    if r.outcome == "other_exception":
        msg = re.sub(r"\d+", "N", _one_line(raw.get("message", ""), 80))
        msg = re.sub(r"/\S+", "PATH", msg)
        return f"other_exception {raw.get('exc_type')} at {raw.get('stage')}: {msg}"
    if r.outcome == "crash":
        return f"crash {raw.get('signal')} in {crash_frame(raw.get('log', ''))}"
    if r.outcome == "hang":
        return f"hang (last frame: {crash_frame(raw.get('log', ''))})"
    return f"{r.outcome}: {_one_line(raw.get('message', ''), 80)}"


def failure_report(results: list[Result], limit: int = 200) -> str:
    """Every failing mutant, one per line, grouped by distinct signature."""
    groups: dict[str, list[Result]] = {}
    for r in failures(results):
        groups.setdefault(failure_signature(r), []).append(r)
    lines = []
    for sig, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"== {len(rs)} x {sig}")
        for r in rs[:limit]:
            lines.append("   " + r.describe())
    return "\n".join(lines)
