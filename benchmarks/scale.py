"""Scale-out on Ray, on this machine: the embedding job and the serving replicas, each side in its own process.

Prints one JSON object (``-o`` also writes it):

- ``embed``: all-MiniLM-L6-v2 over ``--sentences`` sentences (``benchmarks/embed.py``'s
  deterministic mix, written as one text file), float32, batch 32, ``--threads`` cores in all:
  - ``in_process``: ``yirage embed FILE -o OUT.parquet`` (one process, ``--threads`` threads);
  - ``workers``: the same with ``--workers 2`` (the cores split between 2 processes);
  - ``ray``: the same with ``--ray --workers 2 --cpus-per-worker 1`` (a local Ray started by the
    command; 2 actors);
  - ``st_multi_process``: sentence-transformers' ``encode_multi_process`` on 2 CPU processes.

  Per side: ``wall_s`` (the whole command: imports, Ray's start, model loads, the job) and
  ``job_s`` (from the model's load to the last vector: what the job costs on a machine or
  cluster already running, so Ray's own start is out, and every side's worker processes, actors
  and model loads are in; yirage's figure is the one ``yirage embed`` prints at its end),
  ``rows_per_s`` = sentences / ``job_s``. Ratios:
  ``ray_vs_in_process`` (target >= 0.9), ``<side>_vs_st_multi_process`` (target >= 1.3). Every
  yirage side's vectors are checked to equal the in-process ones (``max_abs_diff``).
- ``serve``: SmolLM2 behind ``yirage serve`` with 16 concurrent streams of ``--output-tokens``
  tokens after ``--prompt-tokens``-token prompts (``benchmarks/serve.py``'s requests and figures:
  tokens/s, TTFT p50/p99):
  - ``plain``: ``yirage serve --parallel 16`` (no Ray), ``--threads`` threads;
  - ``ray_1x2``: ``--replicas 1 --cpus-per-replica 2 --parallel 16``;
  - ``ray_2x1``: ``--replicas 2 --cpus-per-replica 1 --parallel 8``;
  - ``llama-server`` with ``-np 16`` where ``--llama-server`` is given.

  ``replica_rss_mb``: each Ray replica's resident memory once loaded.
  ``ray_2x1_vs_ray_1x2`` (target >= 0.9) is the cost of splitting one machine's cores between
  two replicas behind Ray's router; ``ray_1x2_vs_plain`` the cost of the router alone.

    python benchmarks/scale.py [--sentences 20000] [--threads 2] [--llama-server PATH]
        [--output-tokens 64] [--prompt-tokens 128] [--skip-embed] [--skip-serve] [-o out.json]

``machine`` is ``yirage.runtime.machine.machine_record()``. The machine may be shared with other
jobs: figures are noisy; compare within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _threads  # noqa: E402,F401  (sets OMP_NUM_THREADS from --threads before torch loads)
from _plot import add_plot_option, check_plot, figure, save  # noqa: E402

import numpy as np  # noqa: E402

YIRAGE = [sys.executable, "-c", "import sys; from yirage.cli import main; sys.argv[0] = 'yirage'; main()"]

ST_SCRIPT = r"""
import json, sys, time
from sentence_transformers import SentenceTransformer
from yirage.models.registry import resolve_embedding_model
texts = open(sys.argv[1], encoding="utf-8").read().split("\n")[:-1]
t0 = time.perf_counter()
model = SentenceTransformer(str(resolve_embedding_model("all-minilm-l6-v2")), device="cpu")
pool = model.start_multi_process_pool(["cpu", "cpu"])
vectors = model.encode_multi_process(texts, pool, batch_size=32)
job = time.perf_counter() - t0
model.stop_multi_process_pool(pool)
print(json.dumps({"job_s": job, "rows": len(vectors)}))
"""


def run_embed_side(name: str, cmd: list[str], env: dict, timeout_s: float) -> dict:
    """Run one side's command; its wall time, the job seconds it reports, or its failure."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "after_s": timeout_s}
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"status": "failed", "exit_code": proc.returncode, "stderr_tail": proc.stderr.splitlines()[-5:]}
    if name == "st_multi_process":
        job = json.loads(proc.stdout.strip().splitlines()[-1])["job_s"]
    else:
        found = re.search(r"rows in \d+ shards .* in ([0-9.]+) s\]", proc.stderr)
        if not found:
            return {"status": "failed", "reason": "no job time in its output", "stderr_tail": proc.stderr[-500:]}
        job = float(found.group(1))
    return {"status": "ok", "wall_s": round(wall, 2), "job_s": round(job, 2)}


def read_vectors(folder: str) -> dict:
    import pyarrow.parquet as pq

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("part-"):
            t = pq.read_table(os.path.join(folder, name))
            out.update(zip(t.column("id").to_pylist(), t.column("embedding").to_numpy(zero_copy_only=False)))
    return out


def bench_embed(args, tmp: str) -> dict:
    from embed import sentences

    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("".join(s + "\n" for s in sentences(args.sentences)))
    threads = str(args.threads)
    sides = {
        "in_process": (YIRAGE + ["embed", corpus, "-o", os.path.join(tmp, "in_process.parquet"), "--shard-rows",
                                 "2000"], {"OMP_NUM_THREADS": threads}),
        "workers": (YIRAGE + ["embed", corpus, "-o", os.path.join(tmp, "workers.parquet"), "--shard-rows", "2000",
                              "--workers", "2"], {"OMP_NUM_THREADS": threads}),
        "ray": (YIRAGE + ["embed", corpus, "-o", os.path.join(tmp, "ray.parquet"), "--shard-rows", "2000", "--ray",
                          "--workers", "2", "--cpus-per-worker", "1"], {"OMP_NUM_THREADS": threads}),
        "st_multi_process": ([sys.executable, "-c", ST_SCRIPT, corpus], {"OMP_NUM_THREADS": "1"}),
    }
    report: dict = {"sentences": args.sentences, "sides": {}}
    for name, (cmd, env) in sides.items():
        print(f"[scale bench] embed: {name} ...", file=sys.stderr, flush=True)
        side = run_embed_side(name, cmd, env, args.timeout)
        if side["status"] == "ok":
            side["rows_per_s"] = round(args.sentences / side["job_s"], 1)
        report["sides"][name] = side
        print(f"[scale bench] embed: {name}: {side}", file=sys.stderr, flush=True)
    s = report["sides"]
    ok = {k for k, v in s.items() if v["status"] == "ok"}
    if {"ray", "in_process"} <= ok:
        report["ray_vs_in_process"] = round(s["in_process"]["job_s"] / s["ray"]["job_s"], 3)
        report["ray_vs_in_process_wall"] = round(s["in_process"]["wall_s"] / s["ray"]["wall_s"], 3)
    for name in ("in_process", "workers", "ray"):
        if {name, "st_multi_process"} <= ok:
            report[f"{name}_vs_st_multi_process"] = round(s["st_multi_process"]["job_s"] / s[name]["job_s"], 3)
    if "in_process" in ok:
        ref = read_vectors(os.path.join(tmp, "in_process.parquet"))
        for name in ("workers", "ray"):
            if name in ok:
                got = read_vectors(os.path.join(tmp, f"{name}.parquet"))
                same_ids = sorted(got) == sorted(ref)
                s[name]["same_ids"] = same_ids
                if same_ids:
                    s[name]["max_abs_diff"] = float(max(np.abs(got[k] - ref[k]).max() for k in ref))
    return report


def replica_rss_mb() -> list[float]:
    """The resident memory (MiB) of each yirage replica process of Ray Serve on this machine."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::ServeReplica:yirage"):
                    continue
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            out.append(round(kb / 1024, 1))
        except (OSError, StopIteration):
            continue
    return sorted(out)


def bench_serve(args) -> dict:
    import serve as serve_bench
    from yirage.models.loading import load_model
    from yirage.models.registry import resolve_model

    gguf = str(resolve_model(args.model).path)
    loaded = load_model(args.model)
    prompts = serve_bench.prompt_windows(loaded.tokenizer, args.prompt_tokens, 32, salt=3)
    del loaded
    scenarios = [(16, args.prompt_tokens, prompts)]
    bench_args = argparse.Namespace(start_timeout=args.timeout, timeout=args.timeout, output_tokens=args.output_tokens)
    threads = str(args.threads)
    common = ["serve", "-m", args.model, "--ctx-size", "1024", "--max-queue", "1024"]
    sides = {
        "plain": lambda port: YIRAGE + common + ["--port", str(port), "--parallel", "16"],
        "ray_1x2": lambda port: YIRAGE + common + ["--port", str(port), "--parallel", "16", "--replicas", "1",
                                                  "--cpus-per-replica", threads],
        "ray_2x1": lambda port: YIRAGE + common + ["--port", str(port), "--parallel", "8", "--replicas", "2",
                                                  "--cpus-per-replica", str(max(1, args.threads // 2))],
    }
    report: dict = {"model": args.model, "streams": 16, "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens, "servers": {}}
    for name, cmd in sides.items():
        port = serve_bench.free_port()
        server = serve_bench.ServerProcess(name, cmd(port), port, env={"OMP_NUM_THREADS": threads})
        rss = None
        if name.startswith("ray") and server.wait_ready(args.timeout) is None:
            rss = replica_rss_mb()
        result = serve_bench.bench_server(server, bench_args, args.model, scenarios)
        if rss is not None:
            result["replica_rss_mb"] = rss
        report["servers"][name] = result
        print(f"[scale bench] serve: {name}: {result.get('status')}", file=sys.stderr, flush=True)
    if args.llama_server:
        port = serve_bench.free_port()
        report["servers"]["llama-server"] = serve_bench.bench_server(
            serve_bench.llama_server(args.llama_server, gguf, port, args.threads, 16, 1024), bench_args, args.model,
            scenarios)
    else:
        report["servers"]["llama-server"] = {"status": "skipped", "reason": "no --llama-server binary given"}

    def tps(name):
        r = report["servers"].get(name, {})
        return r["scenarios"][0]["output_tokens_per_s"] if r.get("status") == "ok" else None

    for a, b in (("ray_2x1", "ray_1x2"), ("ray_1x2", "plain"), ("ray_2x1", "plain"), ("ray_2x1", "llama-server"),
                 ("plain", "llama-server")):
        if tps(a) and tps(b):
            report[f"{a}_vs_{b}"] = round(tps(a) / tps(b), 3)
    return report


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct", help="the LLM of the serving part")
    ap.add_argument("--sentences", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None, help="the llama-server binary (benchmarks/build_llama_server.sh)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a side may take")
    ap.add_argument("--skip-embed", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("-o", "--output", default=None)
    add_plot_option(ap)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    check_plot(ap, args)
    from yirage.runtime.machine import machine_record

    out: dict = {"threads": args.threads, "machine": machine_record(args.threads)}
    with tempfile.TemporaryDirectory(prefix="yirage-scale-bench-") as tmp:
        if not args.skip_embed:
            out["embed"] = bench_embed(args, tmp)
    if not args.skip_serve:
        out["serve"] = bench_serve(args)
    text = json.dumps(out, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    if args.plot:
        save(plot_figure(out), args.plot)


#: the ratios a figure shows: (part, key, label); each is the first side's speed over the second's
PLOT_RATIOS = (("embed", "ray_vs_in_process", "Ray Data vs in-process"),
               ("embed", "in_process_vs_st_multi_process", "in-process vs ST pool"),
               ("embed", "workers_vs_st_multi_process", "--workers 2 vs ST pool"),
               ("embed", "ray_vs_st_multi_process", "Ray Data vs ST pool"),
               ("serve", "ray_2x1_vs_ray_1x2", "2 replicas x 1 core vs 1 x 2"),
               ("serve", "ray_1x2_vs_plain", "Ray Serve 1 x 2 vs no Ray"),
               ("serve", "plain_vs_llama-server", "no Ray vs llama-server"),
               ("serve", "ray_2x1_vs_llama-server", "Ray Serve 2 x 1 vs llama-server"))


def plot_figure(out: dict) -> dict | None:
    """The figure (``benchmarks/_plot.py``): the embedding job's rows/s (job time) and the
    serving sides' output tokens/s, each ratio of the report as a bar."""
    parts = {"embed": f"embedding job ({out.get('embed', {}).get('sentences', '?')} sentences)",
             "serve": "serving (16 streams)"}
    bars = [{"group": label, "series": parts[part], "ratio": out[part][key]}
            for part, key, label in PLOT_RATIOS if isinstance(out.get(part), dict) and out[part].get(key)]
    return figure("scale", "scale-out on Ray on one machine: each side's speed over the other's", out["machine"], bars,
                  ylabel="speed ratio (x; higher: the first side faster)") if bars else None


if __name__ == "__main__":
    main()
