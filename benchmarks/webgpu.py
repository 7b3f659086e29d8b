"""The webgpu backend against the same GPU's torch (cuda or mps, where both exist) and yirage's own
cpu backend: Mirage's six graphs, a square float32 GEMM, and SmolLM2 decode; prints one JSON object.

- ``graphs``: the graphs of ``benchmarks/superoptimize.py`` (gated_mlp, rmsnorm_matmul, lora, gqa,
  norm_transformer, qknorm_gqa), yirage's fixed fusion on ``webgpu`` and on ``cpu``, and the
  graph written as torch ops on the GPU's torch device where there is one. Every input but the
  first (the activation) is declared constant, as a model's weights are: webgpu keeps them
  resident, so a call uploads the activation and downloads the output (what a caller sees).
- ``gemm``: ``x @ w`` of two ``--gemm`` x ``--gemm`` float32 matrices, likewise; GFLOP/s per side.
- ``decode``: SmolLM2-135M greedy decode tokens/s (``--tokens`` after a short prompt) on webgpu,
  on cpu, and (where torch has the GPU) transformers' eager model on it.

Ratios: ``webgpu_vs_torch_gpu`` (target: GEMM >= 0.5, decode >= 1.0) and ``webgpu_vs_cpu``.
Times are medians of interleaved rounds (``yirage.runtime.timing.compare``). ``adapter`` is the
WebGPU adapter of every figure (name, Vulkan/Metal/D3D12, adapter type); ``machine`` the host.
On a software adapter (Mesa's lavapipe, adapter type CPU) the figures say nothing about a GPU:
``--small`` (the default there) divides the big dims by 8 and the GEMM by 16.

    python benchmarks/webgpu.py [--graphs a,b] [--gemm 4096] [--tokens 32] [--rounds 5]
                                [--min-time 2.0] [--small | --full] [--skip-decode] [-o out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _threads  # noqa: E402,F401  (OMP_NUM_THREADS from --threads before torch loads)
from _plot import add_plot_option, check_plot, figure, save  # noqa: E402

import torch  # noqa: E402

import yirage as yr  # noqa: E402
from yirage.backends import get_backend_impl  # noqa: E402
from yirage.runtime import timing, webgpu  # noqa: E402
from yirage.runtime.machine import machine_record  # noqa: E402


def torch_gpu() -> torch.device | None:
    """The GPU torch runs on here (cuda, then mps), or None."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return None


def _sync(dev):
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize()
    elif dev is not None and dev.type == "mps":
        torch.mps.synchronize()


def _sides(g, inputs, eager, gpu) -> dict:
    """{side: thunk}: webgpu and cpu fixed fusion, and torch on the GPU."""
    get_backend_impl("webgpu").declare_constant(inputs[1:])
    sides = {"yirage_webgpu": lambda: g(inputs=inputs, backend="webgpu"),
             "yirage_cpu": lambda: g(inputs=inputs, backend="cpu")}
    if gpu is not None:
        on_gpu = [x.to(gpu) for x in inputs]

        def run():
            out = eager(*on_gpu)
            _sync(gpu)
            return out
        sides["torch_gpu"] = run
    return sides


def _compare(sides: dict, args) -> dict:
    cmp = timing.compare(sides, rounds=args.rounds, min_sample_s=args.min_time / args.rounds, warmup=2)
    out = {"us": {k: round(cmp.median(k) * 1e6, 1) for k in cmp.names}}
    for other in ("torch_gpu", "yirage_cpu"):
        if other in cmp.names:
            out[f"webgpu_vs_{other.replace('yirage_', '')}"] = round(cmp.ratio(other, "yirage_webgpu"), 3)
    return out


def bench_graphs(args, gpu) -> dict:
    from superoptimize import GRAPHS

    out = {}
    for name in args.graphs.split(","):
        torch.manual_seed(0)
        g, inputs, eager, shapes = GRAPHS[name](8 if args.small else 1)
        with torch.no_grad():
            ref = eager(*inputs)
            got = g(inputs=inputs, backend="webgpu")[0]
            res = {"shapes": {k: "x".join(map(str, v)) for k, v in shapes.items()},
                   "max_abs_err": float((got - ref).abs().max())}
            res.update(_compare(_sides(g, inputs, eager, gpu), args))
        out[name] = res
        print(f"[webgpu bench] {name}: {res}", file=sys.stderr, flush=True)
    return out


def bench_gemm(args, gpu) -> dict:
    n = args.gemm // (16 if args.small else 1)
    g = yr.new_kernel_graph()
    x, w = g.new_input((n, n)), g.new_input((n, n))
    g.mark_output(g.matmul(x, w))
    torch.manual_seed(0)
    inputs = [torch.randn(n, n), torch.randn(n, n) / n ** 0.5]
    with torch.no_grad():
        res = {"n": n, "max_abs_err": float((g(inputs=inputs, backend="webgpu")[0] - inputs[0] @ inputs[1]).abs().max())}
        res.update(_compare(_sides(g, inputs, torch.matmul, gpu), args))
    res["gflops"] = {k: round(2 * n ** 3 / (us * 1e-6) / 1e9, 1) for k, us in res["us"].items()}
    return res


def bench_decode(args, gpu) -> dict:
    prompt = "The capital of France is"
    res: dict = {"tokens": args.tokens}
    for backend in ("webgpu", "cpu"):
        llm = yr.LLM("smollm2-135m-instruct", backend=backend, max_seq_length=256)
        llm.generate(prompt, max_new_tokens=4, temperature=0)   # plans built, kernels chosen
        r = llm.generate(prompt, max_new_tokens=args.tokens, temperature=0)
        res[f"yirage_{backend}_tokens_per_s"] = round(r.decode_tokens_per_s, 2)
    if gpu is not None:
        import transformers
        from yirage.models.registry import resolve_model   # the registry's local copy

        found = resolve_model("smollm2-135m-instruct")
        kw = ({"gguf_file": found.path.name} if found.format == "gguf" else {})
        where = str(found.path.parent if found.format == "gguf" else found.path)
        tok = transformers.AutoTokenizer.from_pretrained(where, **kw)
        model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).to(gpu).eval()
        ids = tok(prompt, return_tensors="pt").input_ids.to(gpu)
        model.generate(ids, max_new_tokens=4, do_sample=False)
        _sync(gpu)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
        _sync(gpu)
        res["torch_gpu_eager_tokens_per_s"] = round(args.tokens / (time.perf_counter() - t0), 2)
        res["webgpu_vs_torch_gpu"] = round(res["yirage_webgpu_tokens_per_s"] / res["torch_gpu_eager_tokens_per_s"], 3)
    res["webgpu_vs_cpu"] = round(res["yirage_webgpu_tokens_per_s"] / res["yirage_cpu_tokens_per_s"], 3)
    return res


def parser() -> argparse.ArgumentParser:
    from superoptimize import GRAPHS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graphs", default=",".join(GRAPHS))
    ap.add_argument("--gemm", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=None)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", default=None, help="smaller dims (the default on a software adapter)")
    size.add_argument("--full", dest="small", action="store_false")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("-o", "--output")
    add_plot_option(ap)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    check_plot(ap, args)
    if not yr.is_backend_available("webgpu"):
        print(json.dumps({"skipped": yr.get_backend_info("webgpu").reason}))
        return
    adapter = webgpu.adapter_record()
    if args.small is None:
        args.small = adapter["adapter_type"] in ("CPU", "cpu")
    gpu = torch_gpu()
    report = {"adapter": {k: adapter[k] for k in ("device", "backend_type", "adapter_type", "description")},
              "torch_gpu": str(gpu) if gpu is not None else None, "small": args.small,
              "software_adapter": adapter["adapter_type"] in ("CPU", "cpu"),
              "graphs": bench_graphs(args, gpu), "gemm": bench_gemm(args, gpu)}
    if not args.skip_decode:
        report["decode"] = bench_decode(args, gpu)
    report["machine"] = machine_record()
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    if args.plot:
        save(plot_figure(report), args.plot)


def plot_figure(report: dict) -> dict | None:
    """The figure (``benchmarks/_plot.py``): yirage on webgpu over torch on the same GPU and over
    yirage's own cpu backend, per graph, for the GEMM and for SmolLM2's decode."""
    cases = {**{name: r for name, r in report["graphs"].items()}, f"GEMM {report['gemm']['n']}": report["gemm"]}
    if "decode" in report:
        cases["SmolLM2 decode"] = report["decode"]
    bars = [{"group": name, "series": label, "ratio": r[key]} for name, r in cases.items()
            for key, label in (("webgpu_vs_torch_gpu", "vs torch on the GPU"), ("webgpu_vs_cpu", "vs yirage cpu"))
            if r.get(key)]
    adapter = report["adapter"]
    return figure("webgpu", f"yirage webgpu on {adapter['device']} ({adapter['backend_type']}) over each peer"
                  + (" (smaller dims)" if report["small"] else ""), report["machine"], bars) if bars else None


if __name__ == "__main__":
    main()
