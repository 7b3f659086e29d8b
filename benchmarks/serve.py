"""Serving throughput and latency: ``yirage serve`` vs llama.cpp's ``llama-server``.

Prints one JSON object (``-o`` also writes it to a file). Both servers serve the same GGUF file
(the one behind ``--model``) with the same threads (``--threads``) and slot count (``--slots``:
yirage's ``--parallel``, llama-server's ``-np``), each in its own process, one server at a time
(``--rounds`` alternates them). Every request is ``POST /v1/completions`` with a token-id prompt
(the same ids for both servers: windows of one long deterministic text, a different window per
request, so no prompt prefix is shared), ``stream: true``, greedy, and exactly ``--output-tokens``
new tokens (yirage: ``ignore_eos``; llama-server: ``n_predict`` and ``ignore_eos``; llama-server's
prompt cache is off).

Scenarios: every ``--concurrency`` level (clients sending requests back to back; ``--requests``
per client, at least 4 in all) times every ``--prompt-tokens`` length. Before each scenario the
same load runs once with 16 output tokens (warm-up: yirage compiles a step plan the first time
a batch shape occurs). Per scenario and server:

- ``output_tokens_per_s``: all generated tokens / the scenario's wall time; ``requests_per_s``;
- ``ttft_p50_s`` / ``ttft_p99_s``: request sent to its first streamed text;
- ``itl_p50_s`` / ``itl_p99_s``: the gaps between consecutive streamed text chunks;
  ``tpot_p50_s``: per request, (last chunk - first chunk) / (tokens - 1);
- ``errors``: requests that failed (HTTP status or a short output).

A server that does not start (``--start-timeout``), dies (its exit code or signal and the last
lines of its log are reported) or stops answering (a request past ``--timeout`` seconds) is
reported under its name with that status; the other server's figures still print.

    python benchmarks/serve.py --llama-server PATH [-m smollm2-135m-instruct] [--threads 2]
        [--slots 16] [--concurrency 1 4 16] [--prompt-tokens 128 512] [--output-tokens 128]
        [--requests 2] [--rounds 1] [--kv-cache-dtype float16] [--decode-dtype int8] [--no-yirage] [-o out.json]

``make bench-serve`` builds llama-server (``benchmarks/build_llama_server.sh``: llama-cpp-python
0.3.36's vendored llama.cpp, ~10+ minutes on 2 cores) and runs this. ``machine`` is
``yirage.runtime.machine.machine_record()``. The machine may be shared with other jobs: figures
are noisy; compare within one run.
"""
from __future__ import annotations

import _threads  # noqa: F401  (sets OMP_NUM_THREADS from --threads before torch loads)
from _plot import add_plot_option, check_plot, figure, save  # noqa: E402

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

LOG_LINES = 30


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server in its own process, its output in a temporary file.

    Args:
        name: the server's name in the report.
        cmd: its command line; env: extra environment variables.
        port: where it listens (127.0.0.1).
    """

    def __init__(self, name: str, cmd: list[str], port: int, env: dict | None = None):
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> dict | None:
        """None once ``GET /health`` answers 200, else a failure report (it exited, or did not
        answer within ``timeout_s``: it is then stopped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return self.exit_report("start")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        return {"status": "timed out", "phase": "start", "after_s": timeout_s, "log_tail": self.tail()}

    def exit_report(self, phase: str) -> dict | None:
        """A 'crashed' report if the process has exited (exit code, signal, log tail), else None."""
        rc = self.proc.poll()
        if rc is None:
            return None
        report = {"status": "crashed", "phase": phase, "exit_code": rc}
        if rc < 0:
            report["signal"] = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
        report["log_tail"] = self.tail()
        return report

    def tail(self, lines: int = LOG_LINES) -> list[str]:
        """The last ``lines`` lines of the server's output."""
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace").splitlines()[-lines:]

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (SIGINT for uvicorn's graceful exit works too), then SIGKILL after ``timeout_s``;
        its log stays readable (``tail``) until this object is gone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def yirage_server(model: str, port: int, threads: int, slots: int, ctx: int,
                  batch_tokens: int | None = None, kv_cache_dtype: str | None = None,
                  decode_dtype: str | None = None) -> ServerProcess:
    """``yirage serve`` (this Python, this checkout's yirage) with ``--parallel slots`` (and
    ``--max-batch-tokens``, ``--kv-cache-dtype``, ``--decode-dtype`` if given)."""
    cmd = [sys.executable, "-c", "import sys; from yirage.cli import main; sys.argv[0] = 'yirage'; main()",
           "serve", "-m", model, "--port", str(port), "--parallel", str(slots), "--ctx-size", str(ctx),
           "--max-queue", "1024", *(["--max-batch-tokens", str(batch_tokens)] if batch_tokens else []),
           *(["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype else []),
           *(["--decode-dtype", decode_dtype] if decode_dtype else [])]
    return ServerProcess("yirage", cmd, port, env={"OMP_NUM_THREADS": str(threads)})


def llama_server(binary: str, gguf: str, port: int, threads: int, slots: int, ctx: int) -> ServerProcess:
    """llama.cpp's ``llama-server`` with ``-np slots`` slots of ``ctx`` tokens each."""
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-np", str(slots), "-c", str(ctx * slots), "--no-webui"]
    return ServerProcess("llama-server", cmd, port, env={"OMP_NUM_THREADS": str(threads)})


def request_body(name: str, model: str, prompt: list[int], tokens: int) -> dict:
    """The streamed, greedy completion request of exactly ``tokens`` new tokens, in each server's terms."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if name == "llama-server":
        body.update(n_predict=tokens, cache_prompt=False)
    return body


async def one_request(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    """Send one streamed completion; its timings: ttft_s, the chunk gaps, tokens, e2e_s, error."""
    t0 = time.perf_counter()
    times: list[float] = []
    usage = None
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                return {"error": str(event["error"])[:200]}
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens")
            for c in event.get("choices") or []:
                if c.get("text"):
                    times.append(time.perf_counter())
    end = time.perf_counter()
    tokens = usage if usage is not None else len(times)
    out = {"ttft_s": times[0] - t0 if times else None, "gaps": [b - a for a, b in zip(times, times[1:])],
           "tokens": tokens, "e2e_s": end - t0,
           "tpot_s": (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None}
    if tokens != body["max_tokens"]:
        out["error"] = f"{tokens} tokens instead of {body['max_tokens']}"
    return out


async def run_scenario(name: str, url: str, model: str, prompts: list[list[int]], concurrency: int, tokens: int,
                       timeout_s: float) -> dict:
    """``len(prompts)`` requests from ``concurrency`` clients back to back; the figures (see the
    module docstring). asyncio.TimeoutError when one request takes more than ``timeout_s``."""
    queue = list(enumerate(prompts))
    results: list[dict] = []

    async def client(http):
        while queue:
            _, prompt = queue.pop(0)
            try:
                results.append(await asyncio.wait_for(one_request(http, url, request_body(name, model, prompt, tokens)),
                                                      timeout_s))
            except httpx.HTTPError as e:
                results.append({"error": f"{type(e).__name__}: {e}"})

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    total = sum(r["tokens"] for r in ok)
    return {"concurrency": concurrency, "prompt_tokens": len(prompts[0]), "output_tokens": tokens,
            "requests": len(prompts), "errors": [r["error"] for r in results if "error" in r][:5],
            "wall_s": round(wall, 3), "output_tokens_per_s": round(total / wall, 2),
            "requests_per_s": round(len(ok) / wall, 4),
            "ttft_p50_s": _q(ttft, 0.5), "ttft_p99_s": _q(ttft, 0.99),
            "itl_p50_s": _q(gaps, 0.5), "itl_p99_s": _q(gaps, 0.99), "tpot_p50_s": _q(tpot, 0.5)}


def _q(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (linear interpolation), rounded; None when empty."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return round(v[lo] + (v[hi] - v[lo]) * (k - lo), 5)


def prompt_windows(tokenizer, length: int, count: int, salt: int) -> list[list[int]]:
    """``count`` distinct prompts of exactly ``length`` token ids: windows at different offsets
    of one deterministic text (``salt`` shifts them, so each scenario gets new prompts)."""
    words = ["river", "engine", "lantern", "orchard", "signal", "harbor", "meadow", "copper", "violet", "summit"]
    lines = [f"Note {i}: the {words[i % 10]} near the {words[(i * 7) % 10]} counted {i * 37 % 1009} "
             f"{words[(i * 3) % 10]}s before noon." for i in range(4000)]
    ids = tokenizer.encode(" ".join(lines), add_special_tokens=False)
    step = 97
    need = (salt + count) * step + length
    assert len(ids) >= need, "the prompt text is too short"
    return [ids[(salt + k) * step:(salt + k) * step + length] for k in range(count)]


def bench_server(server: ServerProcess, args, model_name: str, scenarios: list[tuple[int, int, list]]) -> dict:
    """Start ``server``, run every scenario (after its warm-up), stop it; its report."""
    failure = server.wait_ready(args.start_timeout)
    if failure is not None:
        return failure
    results = []
    try:
        for concurrency, length, prompts in scenarios:
            for tokens in (16, args.output_tokens):   # warm-up, then measured
                try:
                    res = asyncio.run(run_scenario(server.name, server.url, model_name, prompts, concurrency, tokens,
                                                   args.timeout))
                except asyncio.TimeoutError:
                    crash = server.exit_report(f"c={concurrency} prompt={length}")
                    return crash or {"status": "timed out", "phase": f"c={concurrency} prompt={length}",
                                     "after_s": args.timeout, "log_tail": server.tail(), "scenarios": results}
                crash = server.exit_report(f"c={concurrency} prompt={length}")
                if crash is not None:
                    return {**crash, "scenarios": results}
            results.append(res)
            print(f"[serve bench] {server.name} c={concurrency} prompt={length}: {res['output_tokens_per_s']} tok/s, "
                  f"TTFT p50 {res['ttft_p50_s']} s, ITL p50 {res['itl_p50_s']} s", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return {"status": "ok", "scenarios": results}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--llama-server", default=None, help="the llama-server binary (benchmarks/build_llama_server.sh)")
    ap.add_argument("--no-yirage", action="store_true", help="run llama-server only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=16, help="yirage --parallel and llama-server -np")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="yirage serve --max-batch-tokens")
    ap.add_argument("--ctx", type=int, default=1024, help="tokens of KV cache per slot")
    ap.add_argument("--kv-cache-dtype", choices=("float32", "float16"), default=None,
                    help="yirage serve --kv-cache-dtype (llama-server keeps float16 by default)")
    ap.add_argument("--decode-dtype", choices=("float32", "int8"), default=None,
                    help="yirage serve --decode-dtype (int8: llama-server's 8-bit activations)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=2, help="requests per client per scenario (at least 4 in all)")
    ap.add_argument("--rounds", type=int, default=1, help="times each server runs every scenario, alternating")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to be ready")
    ap.add_argument("-o", "--output", default=None)
    add_plot_option(ap)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    check_plot(ap, args)

    from yirage.models.loading import load_model
    from yirage.models.registry import resolve_model
    from yirage.runtime.machine import machine_record

    gguf = str(resolve_model(args.model).path)
    loaded = load_model(args.model)
    scenarios = []
    for concurrency in args.concurrency:
        for length in args.prompt_tokens:
            count = max(4, concurrency * args.requests)
            scenarios.append((concurrency, length, prompt_windows(loaded.tokenizer, length, count, salt=len(scenarios) * 40)))
    del loaded
    sides = []
    if not args.no_yirage:
        sides.append("yirage")
    if args.llama_server:
        sides.append("llama-server")
    out: dict = {"model": args.model, "gguf": gguf, "threads": args.threads, "slots": args.slots,
                 "max_batch_tokens": args.max_batch_tokens, "yirage_kv_cache_dtype": args.kv_cache_dtype or "float32",
                 "yirage_decode_dtype": args.decode_dtype or "float32",
                 "ctx_per_slot": args.ctx, "output_tokens": args.output_tokens, "machine": machine_record(args.threads),
                 "servers": {}, "rounds": []}
    if not args.llama_server:
        out["servers"]["llama-server"] = {"status": "skipped", "reason": "no --llama-server binary given"}
    for r in range(args.rounds):
        got = {}
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            port = free_port()
            server = (yirage_server(args.model, port, args.threads, args.slots, args.ctx, args.max_batch_tokens,
                                    args.kv_cache_dtype, args.decode_dtype)
                      if side == "yirage" else
                      llama_server(args.llama_server, gguf, port, args.threads, args.slots, args.ctx))
            got[side] = bench_server(server, args, args.model, scenarios)
        out["rounds"].append(got)
    for side in sides:
        reports = [rd[side] for rd in out["rounds"]]
        bad = next((x for x in reports if x.get("status") != "ok"), None)
        if bad is not None:
            out["servers"][side] = bad
            continue
        merged = []
        for i, first in enumerate(reports[0]["scenarios"]):   # the median over rounds of each figure
            rows = [x["scenarios"][i] for x in reports]
            merged.append({k: (statistics.median([row[k] for row in rows]) if isinstance(v, (int, float))
                               and not isinstance(v, bool) and k not in ("concurrency", "prompt_tokens",
                                                                          "output_tokens", "requests") else v)
                           for k, v in first.items()})
        out["servers"][side] = {"status": "ok", "scenarios": merged}
    if all(out["servers"].get(s, {}).get("status") == "ok" for s in ("yirage", "llama-server")):
        ratios = []
        for a, b in zip(out["servers"]["yirage"]["scenarios"], out["servers"]["llama-server"]["scenarios"]):
            ratios.append({"concurrency": a["concurrency"], "prompt_tokens": a["prompt_tokens"],
                           "output_tokens_per_s": _ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
                           "ttft_p50": _ratio(a["ttft_p50_s"], b["ttft_p50_s"]),
                           "itl_p50": _ratio(a["itl_p50_s"], b["itl_p50_s"])})
        out["yirage_vs_llama_server"] = ratios
    if args.rounds == 1:
        del out["rounds"]
    text = json.dumps(out, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    if args.plot:
        save(plot_figure(out), args.plot)


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def plot_figure(out: dict) -> dict | None:
    """The figure (``benchmarks/_plot.py``): yirage's aggregate output tokens/s over
    llama-server's, per concurrency and prompt length (the medians over the rounds)."""
    bars = [{"group": f"concurrency {r['concurrency']}", "series": f"{r['prompt_tokens']}-token prompts",
             "ratio": r["output_tokens_per_s"]} for r in out.get("yirage_vs_llama_server", [])]
    return figure("serve", f"{out['model']}: yirage serve's output tokens/s over llama-server's "
                           f"({out['slots']} slots, {out['output_tokens']} tokens per request)", out["machine"], bars,
                  ylabel="yirage output tokens/s / llama-server's (x; higher: yirage faster)") if bars else None


if __name__ == "__main__":
    main()
