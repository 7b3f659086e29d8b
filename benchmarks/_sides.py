"""Each side of a benchmark in its own process, timed in interleaved rounds.

A *side* is one contender of a comparison (yirage float32, sentence-transformers, llama.cpp
...). Running every side in the benchmark's own process means that one peer's crash
(llama.cpp's AMX kernels segfault on some Intel CPUs) or hang takes every figure down. So
the parent (``Sides``) starts one worker process per side and drives it over a pipe:

- the worker sets its thread count before anything is imported (``OMP_NUM_THREADS`` in its
  environment, then ``torch.set_num_threads`` if torch is loaded), builds its side from a
  factory (``"module:callable"`` with keyword arguments; the callable loads the model and
  warms up) and reports the side's ``info`` dict;
- then, per request, it calls ``side.sample(**request)``, which times one run of the side
  *inside the worker* and returns ``(figures, outputs)``: figures a dict of numbers (seconds
  and the like), outputs anything picklable that the cross-side checks need (greedy tokens,
  embedding vectors);
- the parent asks for the samples in rounds, one sample of every live side per round, in an
  order rotated from round to round (as ``yirage.runtime.timing.compare`` does), so that load
  from other processes hits every side alike; ``comparison`` turns the rounds into a
  ``yirage.runtime.timing.Comparison`` (median of paired ratios).

A side that crashes (the worker dies: its exit code or signal and the last lines of its
stderr are kept), hangs (no answer within ``timeout_s``: the worker is killed) or raises (its
traceback's last line) is marked as such in ``failures`` and leaves the rounds; the others go on.
A worker's stdout and stderr go to a temporary file, so the parent's stdout stays one JSON object.

This module is the protocol only: it never decides what a figure means, and it imports
neither torch nor yirage (``comparison`` alone imports ``yirage.runtime.timing``), so that a
side's worker loads only what its side needs. ``python _sides.py --fd N`` is the worker's entry point.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe

#: seconds a worker may take to build its side (load a model, compile, warm up)
SETUP_TIMEOUT_S = 900.0
#: seconds a worker may take to answer one sample request
TIMEOUT_S = 600.0
#: lines of a failed worker's stderr kept in its report
STDERR_LINES = 20


@dataclass
class SideSpec:
    """How to build one side in its worker: ``factory`` is ``"module:callable"``, imported in
    the worker with ``path`` prepended to sys.path (this directory by default) and called with
    ``kwargs`` (picklable); it returns an object with ``sample(**request) -> (figures, outputs)``,
    and optionally ``info`` (a JSON-ready dict) and ``close()``. ``threads``: OMP_NUM_THREADS
    and torch's thread count in the worker; ``env``: more environment variables."""

    factory: str
    kwargs: dict = field(default_factory=dict)
    threads: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    path: list[str] = field(default_factory=lambda: [os.path.dirname(os.path.abspath(__file__))])


class _Worker:
    """The parent's handle on one worker process."""

    def __init__(self, name: str, spec: SideSpec):
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+b")
        parent_end, child_end = Pipe()
        env = {**os.environ, **spec.env}
        if spec.threads is not None:
            env["OMP_NUM_THREADS"] = str(spec.threads)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--fd", str(child_end.fileno())],
            pass_fds=(child_end.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=self.log,
            stderr=subprocess.STDOUT)
        child_end.close()
        self.conn = parent_end
        self.conn.send((spec.factory, spec.kwargs, spec.threads, spec.path))

    def ask(self, request: dict | None, timeout_s: float) -> tuple[str, object]:
        """Send ``request`` (None: only wait for the setup's answer) and wait for the answer:
        ('ok', payload), or ('failed' | 'crashed' | 'timed out', report dict)."""
        t0 = time.perf_counter()
        try:
            if request is not None:
                self.conn.send(("sample", request))
            if not self.conn.poll(timeout_s):
                self.kill()
                return "timed out", {"after_s": round(time.perf_counter() - t0, 1)}
            status, payload = self.conn.recv()
        except (EOFError, OSError):
            return "crashed", self._exit_report()
        if status == "error":
            return "failed", {"error": payload.strip().splitlines()[-1], "traceback": payload}
        return "ok", payload

    def _exit_report(self) -> dict:
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = self.proc.returncode
        report: dict = {"exit_code": rc}
        if rc is not None and rc < 0:
            report["signal"] = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
        report["stderr_tail"] = self.tail()
        return report

    def tail(self, lines: int = STDERR_LINES) -> list[str]:
        """The last ``lines`` lines the worker wrote (stdout and stderr)."""
        self.log.seek(0)
        text = self.log.read().decode("utf-8", "replace")
        return text.splitlines()[-lines:]

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the worker to close its side and exit; kill it if it does not in ``timeout_s``."""
        if self.proc.poll() is None:
            try:
                self.conn.send(("close", None))
                self.proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self.conn.close()
        self.log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Sides:
    """Worker processes, one per side, driven in interleaved rounds. Use as a context manager
    (every worker is closed, or killed, on exit).

    ``start(name, spec)`` builds a side (waits up to ``setup_timeout_s``); ``rounds(n,
    request)`` takes ``n`` rounds of samples of the live sides (each answer within
    ``timeout_s``). ``info[name]`` is a side's info, ``failures[name]`` the report of a side
    that was skipped, crashed ({"status": "crashed", "phase", "exit_code", "signal",
    "stderr_tail"}), hung ({"status": "timed out", "after_s"}) or raised ({"status":
    "failed", "error", "traceback"}).
    """

    def __init__(self, timeout_s: float = TIMEOUT_S, setup_timeout_s: float = SETUP_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.setup_timeout_s = setup_timeout_s
        self.workers: dict[str, _Worker] = {}
        self.info: dict[str, dict] = {}
        self.failures: dict[str, dict] = {}

    def __enter__(self) -> "Sides":
        return self

    def __exit__(self, *exc) -> bool:
        for w in self.workers.values():
            w.close()
        self.workers.clear()
        return False

    @property
    def live(self) -> list[str]:
        """The sides that are running, in the order they were started."""
        return list(self.workers)

    def skip(self, name: str, reason: str) -> None:
        """Record a side that is not run at all (its library is not installed, ...)."""
        self.failures[name] = {"status": "skipped", "reason": reason}

    def start(self, name: str, spec: SideSpec) -> bool:
        """Start ``name``'s worker and wait until its side is built; False (and a failure
        report) if it crashed, hung or raised meanwhile."""
        w = _Worker(name, spec)
        status, payload = w.ask(None, self.setup_timeout_s)
        if status != "ok":
            self._fail(w, status, payload, "setup")
            return False
        self.workers[name] = w
        self.info[name] = payload or {}
        return True

    def sample(self, name: str, request: dict) -> tuple[dict, object] | None:
        """One sample of side ``name``: (figures, outputs), or None if the side failed now
        (it is then dropped) or had failed before."""
        w = self.workers.get(name)
        if w is None:
            return None
        status, payload = w.ask(request, self.timeout_s)
        if status != "ok":
            self._fail(w, status, payload, "sample")
            del self.workers[name]
            return None
        return payload

    def rounds(self, n: int, request: dict, sides: list[str] | None = None,
               limit: dict[str, int] | None = None) -> list[dict[str, tuple]]:
        """``n`` rounds of one sample of every live side of ``sides`` (default: all), in an order
        rotated by one place per round; a side of ``limit`` takes part in its first
        ``limit[side]`` rounds only (a slow reference). Returns, per round, {side: (figures,
        outputs)} for the sides that answered."""
        out = []
        limit = limit or {}
        for r in range(n):
            names = [s for s in (sides if sides is not None else self.live)
                     if s in self.workers and r < limit.get(s, n)]
            k = r % len(names) if names else 0
            got = {}
            for name in names[k:] + names[:k]:
                s = self.sample(name, request)
                if s is not None:
                    got[name] = s
            out.append(got)
        return out

    def _fail(self, w: _Worker, status: str, payload: dict, phase: str) -> None:
        self.failures[w.name] = {"status": status, "phase": phase, **payload}
        if status == "timed out":
            self.failures[w.name]["stderr_tail"] = w.tail()
        w.close()
        print(f"[benchmarks] side {w.name} {status} during {phase}", file=sys.stderr, flush=True)

    def report(self, name: str, figures: dict | None = None) -> dict:
        """A side's JSON entry: {"status": "ok", **info, **figures}, or its failure report."""
        if name in self.failures:
            return dict(self.failures[name])
        return {"status": "ok", **self.info.get(name, {}), **(figures or {})}


def comparison(rounds: list[dict[str, tuple]], metric: str, names: list[str]):
    """``yirage.runtime.timing.Comparison`` of ``names`` over ``figures[metric]`` (seconds, lower
    is better), from the rounds in which every one of ``names`` has a sample (None if none)."""
    from yirage.runtime.timing import Comparison

    kept = [{n: r[n][0][metric] for n in names} for r in rounds if all(n in r for n in names)]
    return Comparison(kept, {n: 1 for n in names}) if kept else None


# ---- the worker ---------------------------------------------------------------------------
def _build(factory: str, kwargs: dict, threads: int | None, path: list[str]):
    sys.path[:0] = [p for p in path if p not in sys.path]
    module, _, attr = factory.partition(":")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if threads is not None and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    return fn(**kwargs)


def serve(conn: Connection) -> None:
    """The worker loop: build the side from the first message, then answer 'sample' requests
    until 'close' (or the parent is gone)."""
    factory, kwargs, threads, path = conn.recv()
    try:
        side = _build(factory, kwargs, threads, path)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", dict(getattr(side, "info", None) or {})))
    while True:
        try:
            kind, request = conn.recv()
        except EOFError:
            return
        if kind == "close":
            close = getattr(side, "close", None)
            if callable(close):
                close()
            return
        try:
            answer = ("ok", tuple(side.sample(**request)))
        except Exception:
            answer = ("error", traceback.format_exc())
        conn.send(answer)


def _main() -> None:
    ap = argparse.ArgumentParser(description="a benchmark side's worker process (benchmarks/_sides.py)")
    ap.add_argument("--fd", type=int, required=True, help="the pipe to the parent")
    serve(Connection(ap.parse_args().fd))


if __name__ == "__main__":
    _main()
