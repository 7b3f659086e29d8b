"""benchmarks/serve.py's harness without a model: a server that crashes, dies of a signal or
never becomes ready is reported as what it is (with its log's tail); the request bodies ask
each server for exactly N greedy tokens; the quantiles are numpy's; the prompts are windows of
exactly the asked length, all different. (make bench-serve runs the real servers.)"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
serve_bench = pytest.importorskip("serve", reason="benchmarks/serve.py needs httpx")


def server(code: str) -> "serve_bench.ServerProcess":
    return serve_bench.ServerProcess("fake", [sys.executable, "-c", code], serve_bench.free_port())


def wait_for_line(proc: "serve_bench.ServerProcess", line: str, timeout_s: float) -> None:
    """Return once the server process has printed ``line``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while line not in proc.tail():
        assert proc.proc.poll() is None, f"the process exited before printing {line!r}: {proc.tail()}"
        assert time.monotonic() < deadline, f"no {line!r} from the process within {timeout_s} s"
        time.sleep(0.05)


def test_a_server_that_exits_crashes_or_hangs_is_reported():
    r = server("import sys; print('cannot load the model'); sys.exit(3)").wait_ready(60)
    assert r["status"] == "crashed" and r["exit_code"] == 3 and r["phase"] == "start"
    assert "cannot load the model" in r["log_tail"]
    r = server("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)").wait_ready(60)
    assert r["status"] == "crashed" and r["signal"] == "SIGSEGV"
    hung = server("import time; print('loading', flush=True); time.sleep(600)")
    wait_for_line(hung, "loading", timeout_s=60)   # however slow this machine starts a Python
    r = hung.wait_ready(0.5)
    assert r["status"] == "timed out" and r["log_tail"] == ["loading"]
    assert hung.proc.poll() is not None   # stopped, not left running


def test_request_bodies_ask_for_exactly_n_greedy_tokens():
    y = serve_bench.request_body("yirage", "m", [1, 2, 3], 128)
    ll = serve_bench.request_body("llama-server", "m", [1, 2, 3], 128)
    for b in (y, ll):
        assert b["max_tokens"] == 128 and b["ignore_eos"] is True and b["temperature"] == 0.0 and b["stream"]
        assert b["prompt"] == [1, 2, 3]
    assert ll["n_predict"] == 128 and ll["cache_prompt"] is False and "n_predict" not in y


def test_quantiles_are_numpys():
    values = list(np.random.default_rng(0).exponential(size=37))
    for q in (0.5, 0.99, 0.0, 1.0):
        assert serve_bench._q(values, q) == pytest.approx(np.quantile(values, q), abs=1e-5)
    assert serve_bench._q([], 0.5) is None


def test_prompt_windows_have_the_length_and_differ():
    class Words:   # a tokenizer: one id per word
        def encode(self, text, add_special_tokens=False):
            return [hash(w) % 50000 for w in text.split()]
    prompts = serve_bench.prompt_windows(Words(), 128, 16, salt=0)
    assert [len(p) for p in prompts] == [128] * 16 and len({tuple(p) for p in prompts}) == 16
    assert serve_bench.prompt_windows(Words(), 128, 1, salt=40)[0] not in prompts
