"""yirage's Triton path on a GPU vs torch eager and torch.compile, and LLM decode vs transformers.

Prints one JSON object. Every side of every comparison runs in this process on the same
device with the same inputs:

- Mirage's benchmark graphs (mirage-project/mirage demos and docs), in float16:
  gated MLP          O = silu(X @ W1) * (X @ W2)          X [8, 4096], W1, W2 [4096, 4096]
  RMSNorm + linear   O = rms_norm(X) @ W                  X [16, 4096], W [4096, 6144]
  group-query attn.  O = softmax-by-hand(Q @ K) @ V        Q [2, 256, 64], K [2, 64, 4096], V [2, 4096, 64]
  LoRA               O = X @ W + (X @ A) @ B              X [16, 256], W [256, 4096], A [256, 16], B [16, 4096]
  each timed as yirage (fused + compiled, launched from a prepared plan), torch eager and
  torch.compile (Inductor, default mode); median milliseconds over --iters after warm-up,
  and the largest absolute difference from eager.
- LLM decode: yr.LLM on the backend (its default dtype) against Hugging Face transformers
  eager on the same device and dtype, same prompt, greedy (benchmarks/decode.py's method).

    python benchmarks/gpu.py [--backend cuda] [--iters 100] [--tokens 64] [--skip-llm]

Targets (issue 5, on an H100): fused graphs at least as fast as torch.compile; decode at
least 2x transformers eager. ``--backend cpu`` runs the same comparison on the CPU (C++
path) to check the script where no GPU is present; its figures are not GPU figures.
``machine`` is ``yirage.runtime.machine.machine_record()`` (the host: CPU, torch and library
versions), ``device`` the GPU's name.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import yirage as yr  # noqa: E402
from _plot import add_plot_option, figure, save  # noqa: E402
from yirage.backends import get_backend_impl  # noqa: E402
from yirage.runtime.machine import machine_record  # noqa: E402


def gated_mlp(g, dt):
    X, W1, W2 = g.new_input((8, 4096), dt), g.new_input((4096, 4096), dt), g.new_input((4096, 4096), dt)
    g.mark_output(g.mul(g.silu(g.matmul(X, W1)), g.matmul(X, W2)))
    return lambda x, w1, w2: torch.nn.functional.silu(x @ w1) * (x @ w2)


def rmsnorm_linear(g, dt):
    X, W = g.new_input((16, 4096), dt), g.new_input((4096, 6144), dt)
    g.mark_output(g.matmul(g.rms_norm(X, normalized_shape=(4096,)), W))
    return lambda x, w: torch.nn.functional.rms_norm(x.float(), (4096,), eps=1e-6).to(x.dtype) @ w


def gqa(g, dt):
    Q, K, V = g.new_input((2, 256, 64), dt), g.new_input((2, 64, 4096), dt), g.new_input((2, 4096, 64), dt)
    E = g.exp(g.matmul(Q, K))
    g.mark_output(g.matmul(g.div(E, g.reduction(E, 2)), V))

    def eager(q, k, v):
        e = torch.exp(q @ k)
        return (e / e.sum(2, keepdim=True)) @ v
    return eager


def lora(g, dt):
    X, W = g.new_input((16, 256), dt), g.new_input((256, 4096), dt)
    A, B = g.new_input((256, 16), dt), g.new_input((16, 4096), dt)
    g.mark_output(g.add(g.matmul(X, W), g.matmul(g.matmul(X, A), B)))
    return lambda x, w, a, b: x @ w + (x @ a) @ b


GRAPHS = {"gated_mlp": gated_mlp, "rmsnorm_linear": rmsnorm_linear, "gqa": gqa, "lora": lora}


def time_ms(fn, sync, iters: int) -> float:
    """Median wall time of ``fn()`` in milliseconds (device synchronized around each call)."""
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_graph(name: str, backend: str, dtype: yr.DType, iters: int) -> dict:
    impl = get_backend_impl(backend)
    dev = impl.torch_device
    g = yr.new_kernel_graph()
    eager = GRAPHS[name](g, dtype)
    torch.manual_seed(0)
    inputs = [(torch.randn(g.tensors[t].shape) * 0.1).to(dev, dtype.torch_dtype) for t in g.inputs]
    if name == "gqa":  # keep exp in range
        inputs[0] = inputs[0] * 0.1
    plan = g.compile(backend).plan(inputs)
    compiled = torch.compile(eager)
    ref = eager(*inputs)
    out = plan.run()[0]
    result = {
        "yirage_ms": time_ms(plan.run, impl.synchronize, iters),
        "torch_eager_ms": time_ms(lambda: eager(*inputs), impl.synchronize, iters),
        "torch_compile_ms": time_ms(lambda: compiled(*inputs), impl.synchronize, iters),
        "max_abs_diff_vs_eager": float((out.float() - ref.float()).abs().max()),
        "launches": g.compile(backend).num_kernels,
    }
    result["speedup_vs_compile"] = result["torch_compile_ms"] / result["yirage_ms"]
    result["speedup_vs_eager"] = result["torch_eager_ms"] / result["yirage_ms"]
    if impl.torch_device.type == "cuda":
        # Launch overhead removed on both sides: the plan's launches captured in one CUDA graph
        # (Plan.capture) against torch.compile's mode="reduce-overhead" (CUDA graphs too).
        plan.capture()
        replayed = plan.run()[0]
        reduce_overhead = torch.compile(eager, mode="reduce-overhead")
        result["yirage_cudagraph_ms"] = time_ms(plan.run, impl.synchronize, iters)
        result["torch_compile_reduce_overhead_ms"] = time_ms(lambda: reduce_overhead(*inputs), impl.synchronize,
                                                             iters)
        result["cudagraph_max_abs_diff_vs_eager"] = float((replayed.float() - ref.float()).abs().max())
        result["cudagraph_speedup_vs_compile"] = result["torch_compile_ms"] / result["yirage_cudagraph_ms"]
        result["cudagraph_speedup_vs_reduce_overhead"] = (result["torch_compile_reduce_overhead_ms"]
                                                          / result["yirage_cudagraph_ms"])
    return result


PROMPT = "Explain in two sentences why the sky is blue."


def bench_llm(model: str, backend: str, tokens: int, runs: int) -> dict:
    """Greedy decode of ``tokens`` new tokens after PROMPT (chat template applied), ``runs``
    times: yr.LLM on ``backend`` (its default dtype) and transformers eager on the same device
    in that dtype (benchmarks/decode.py's bench_transformers, same prompt ids); tokens/s medians,
    and how many leading greedy tokens the two sides share."""
    from decode import _matching_prefix, bench_transformers

    impl = get_backend_impl(backend)
    t0 = time.perf_counter()
    llm = yr.LLM(model, backend=backend, max_seq_length=512)
    load_s = time.perf_counter() - t0
    ids = llm.encode_prompt(PROMPT)
    llm.generate(PROMPT, max_new_tokens=4)  # warm-up: compiles and captures outside the timings
    prefill, decode, toks = [], [], None
    for _ in range(runs):
        r = llm.generate(PROMPT, max_new_tokens=tokens)
        prefill.append(r.prefill_s)
        decode.append(r.decode_tokens_per_s)
        toks = toks if toks is not None else list(r.token_ids)
    y = {"dtype": llm.dtype.value, "load_s": load_s, "prompt_tokens": len(ids),
         "prefill_s": statistics.median(prefill), "decode_tokens_per_s": statistics.median(decode),
         "runs_decode_tokens_per_s": [round(x, 1) for x in decode], "text": r.text[:80]}
    t, t_toks = bench_transformers(model, {"prompt": ids}, tokens, runs, device=str(impl.torch_device),
                                   dtype=llm.dtype.value)
    t_tok = t_toks["prompt"]
    return {"model": model, "yirage": y, "transformers_eager": t,
            "decode_speedup": y["decode_tokens_per_s"] / t["prompt"]["decode_tokens_per_s"],
            "greedy_tokens_equal_prefix": _matching_prefix(toks, t_tok), "new_tokens": len(t_tok)}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-llm", action="store_true")
    add_plot_option(ap)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    try:
        impl = get_backend_impl(args.backend)
    except yr.BackendUnavailableError as e:
        sys.exit(f"benchmarks/gpu.py: {e}")
    dtype = yr.DType(args.dtype)
    report = {"backend": args.backend, "device": impl.info().device_name, "dtype": args.dtype,
              "machine": machine_record(), "iters": args.iters, "graphs": {}}
    for name in GRAPHS:
        report["graphs"][name] = bench_graph(name, args.backend, dtype, args.iters)
    if not args.skip_llm:
        report["llm"] = bench_llm(args.model, args.backend, args.tokens, args.runs)
    print(json.dumps(report, indent=2))
    if args.plot:
        save(plot_figure(report), args.plot)


def plot_figure(report: dict) -> dict | None:
    """The figure (``benchmarks/_plot.py``): each of Mirage's graphs over torch eager and
    torch.compile (launched per kernel, and replayed from a CUDA graph where captured), and
    the LLM's decode over transformers eager on the same GPU."""
    bars = []
    for name, r in report["graphs"].items():
        for key, label in (("speedup_vs_eager", "vs torch eager"), ("speedup_vs_compile", "vs torch.compile"),
                           ("cudagraph_speedup_vs_compile", "CUDA graph vs torch.compile"),
                           ("cudagraph_speedup_vs_reduce_overhead", "CUDA graph vs reduce-overhead")):
            if r.get(key):
                bars.append({"group": name, "series": label, "ratio": r[key]})
    if report.get("llm", {}).get("decode_speedup"):
        bars.append({"group": "LLM decode", "series": "vs transformers eager", "ratio": report["llm"]["decode_speedup"]})
    return figure("gpu", f"yirage on {report['device']} ({report['backend']}, {report['dtype']}) over torch on the "
                         "same GPU", report["machine"], bars) if bars else None


if __name__ == "__main__":
    main()
