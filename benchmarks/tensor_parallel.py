"""Tensor parallelism on this machine (issue 45): the allreduce per decode step, and a decode step on 2 ranks.

Prints one JSON object (``-o`` also writes it):

- ``allreduce``: 2 ranks on 127.0.0.1 (``yirage.runtime.distributed.ProcessGroup``, 1 thread
  each) summing a float32 [1, hidden] tensor (the model's hidden size: what follows o and down in a
  decode step) ``--iters`` times after a warm-up, with each transport (``gloo``: TCP; ``shm``: the
  shared-memory allreduce): ``us_p50`` / ``us_p90`` per allreduce, and ``ms_per_decode_step`` =
  2 x layers x ``us_p50``; ``shm_vs_gloo`` the ratio of the medians.
- ``decode``: ``--steps`` greedy decode steps after a short prompt, median ms per step, each side
  in turn:
  - ``one_rank_plan``: ``yr.LLM(persistent=False)`` in this process with ``--threads`` threads (the
    launch-per-op plan, which the ranks run too);
  - ``one_rank_persistent``: ``yr.LLM()`` (the CPU default: the persistent kernel);
  - ``two_ranks``: ``yr.LLM(tensor_parallel_size=2)``'s ranks (the persistent kernel; transport
    'auto': the faster by measurement, ``two_ranks_transport``), ``--threads`` / 2 threads per
    rank (the step includes sending the token to both ranks and rank 0's logits back);
    ``two_ranks_plan``: the same on the launch-per-op plans; ``two_ranks_gloo``: on gloo.
  ``two_ranks_vs_one_rank_persistent`` = one_rank_persistent ms / two_ranks ms (speed; target
  >= 0.8) and ``two_ranks_vs_one_rank_plan`` (the plans on both sides); ``allreduce_share`` = allreduce ms per step / two_ranks ms.
  Greedy tokens of every side are checked equal (``tokens_equal``).
- ``greedy_chunk``: ms per step of one ``run_greedy`` call of ``--steps`` steps (the persistent
  kernel's decode loop, what ``generate`` runs for greedy decoding; on 2 ranks no step crosses
  to the caller): ``one_rank`` (``--threads`` threads) and ``two_ranks``, and their ratio
  ``two_ranks_vs_one_rank`` (target >= 0.8).
- ``rss_mb``: each rank's resident memory once loaded.

    python benchmarks/tensor_parallel.py [--model smollm2-135m-instruct] [--threads 2] [--steps 64]
        [--iters 2000] [-o out.json]

``machine`` is ``yirage.runtime.machine.machine_record()``. The machine may be shared with other
jobs: figures are noisy; compare within one run. Two cores cannot show a speed-up: the ratio says
what the collectives and the process boundary cost.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _threads  # noqa: E402,F401  (sets OMP_NUM_THREADS from --threads before torch loads)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."


def _allreduce_rank(rank: int, port: int, hidden: int, iters: int, transport: str, out) -> None:
    from yirage.runtime.distributed import ProcessGroup
    torch.set_num_threads(1)
    group = ProcessGroup(rank, 2, "127.0.0.1", port, timeout_s=60, transport=transport).init()
    try:
        x = torch.randn(1, hidden)
        times = []
        for i in range(iters + 100):
            t0 = time.perf_counter()
            group.all_reduce_(x)
            if i >= 100:
                times.append(time.perf_counter() - t0)
            x.mul_(0.5)
        if rank == 0:
            times.sort()
            out.put((times[len(times) // 2] * 1e6, times[int(len(times) * 0.9)] * 1e6))
    finally:
        group.shutdown()


def measure_allreduce(hidden: int, layers: int, iters: int, transport: str) -> dict:
    from yirage.engines.tensor_parallel import free_port
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, hidden, iters, transport, out)) for r in range(2)]
    for p in procs:
        p.start()
    p50, p90 = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return {"us_p50": round(p50, 2), "us_p90": round(p90, 2), "ms_per_decode_step": round(2 * layers * p50 / 1e3, 3)}


def time_decode(steps, prompt_ids: list[int], n: int) -> tuple[float, list[int]]:
    """Median ms of ``n`` greedy decode steps of ``steps`` (a StepRunner or TensorParallelSteps)."""
    logits, argmax = steps.run(prompt_ids, 0)
    tokens, pos, times = [int(argmax[0])], len(prompt_ids), []
    for _ in range(n):
        t0 = time.perf_counter()
        logits, argmax = steps.run([tokens[-1]], pos)
        times.append(time.perf_counter() - t0)
        tokens.append(int(argmax[0]))
        pos += 1
    return statistics.median(times) * 1e3, tokens


def time_greedy(steps, prompt_ids: list[int], n: int) -> tuple[float, list[int]]:
    """Mean ms per step of one ``run_greedy`` call of ``n`` steps (the persistent kernels' decode
    loop, as ``generate`` runs greedy decoding)."""
    _, argmax = steps.run(prompt_ids, 0)
    t0 = time.perf_counter()
    got = steps.run_greedy(int(argmax[0]), len(prompt_ids), n)
    return (time.perf_counter() - t0) / max(1, len(got)) * 1e3, [int(argmax[0]), *got]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    import yirage as yr
    from yirage.runtime.machine import machine_record
    torch.set_num_threads(args.threads)
    out: dict = {"model": args.model, "threads": args.threads, "machine": machine_record(args.threads)}
    seq = args.steps + 64
    plan = yr.LLM(args.model, persistent=False, max_seq_length=seq)
    cfg = plan.config
    timed = {t: measure_allreduce(cfg.hidden_size, cfg.num_layers, args.iters, t) for t in ("gloo", "shm")}
    out["allreduce"] = {"shape": [1, cfg.hidden_size], "dtype": "float32", "iters": args.iters,
                        "allreduces_per_step": 2 * cfg.num_layers, **timed,
                        "shm_vs_gloo": round(timed["gloo"]["us_p50"] / timed["shm"]["us_p50"], 1)}
    ids = plan.prompt_ids(PROMPT)
    decode, tokens = {}, {}
    decode["one_rank_plan"], tokens["one_rank_plan"] = time_decode(plan.steps, ids, args.steps)
    del plan
    persistent = yr.LLM(args.model, max_seq_length=seq)
    decode["one_rank_persistent"], tokens["one_rank_persistent"] = time_decode(persistent.steps, ids, args.steps)
    greedy = {"one_rank": time_greedy(persistent.steps, ids, args.steps)[0]}
    del persistent
    from yirage.engines.tensor_parallel import TensorParallelSteps
    for name, transport, persistent in (("two_ranks", "auto", True), ("two_ranks_plan", "auto", False),
                                        ("two_ranks_gloo", "gloo", True)):
        tp = TensorParallelSteps(args.model, 2, seq, threads_per_rank=max(1, args.threads // 2),
                                 transport=transport, persistent=persistent)
        decode[name], tokens[name] = time_decode(tp, ids, args.steps)
        if name == "two_ranks":
            greedy["two_ranks"], tokens["two_ranks_greedy"] = time_greedy(tp, ids, args.steps)
        out[f"{name}_transport"] = {"chosen": tp.transport, "timed_us": tp.transport_us}
        out["rss_mb"] = {"ranks": [round(b / 2 ** 20, 1) for b in tp.rss_bytes]}
        tp.close()
    out["decode"] = {k: {"ms_per_step_p50": round(v, 3)} for k, v in decode.items()}
    out["decode"]["steps"] = args.steps
    out["two_ranks_vs_one_rank_plan"] = round(decode["one_rank_plan"] / decode["two_ranks_plan"], 3)
    out["two_ranks_vs_one_rank_persistent"] = round(decode["one_rank_persistent"] / decode["two_ranks"], 3)
    out["greedy_chunk"] = {k: {"ms_per_step": round(v, 3)} for k, v in greedy.items()}
    out["greedy_chunk"]["two_ranks_vs_one_rank"] = round(greedy["one_rank"] / greedy["two_ranks"], 3)
    chosen = out["two_ranks_transport"]["chosen"]
    out["allreduce_share"] = round(out["allreduce"][chosen]["ms_per_decode_step"] / decode["two_ranks"], 3)
    out["tokens_equal"] = all(t == tokens["one_rank_plan"] for t in tokens.values())
    text = json.dumps(out, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
