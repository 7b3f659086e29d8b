"""Where a compiled model's GPU time goes: torch.profiler's per-kernel table of one model of
``torch_compile.py``'s suite compiled by yirage (``yr.compile``) and by Inductor, side by side,
and which provider yirage's kernel choice took for each shape class (``backends/triton/providers.py``).

    python benchmarks/gpu_profile.py --models bert,resnet50 --batch 8 --calls 10

Prints, per model and compiler, the top kernels by total GPU time (milliseconds over
``--calls`` forwards) and the wall time per forward; then the machine profile's GPU entries
(shape class, choice, median microseconds per provider). Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def _profile(fn, calls: int, top: int) -> tuple[float, str]:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / calls
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70)
    return wall, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert,resnet50")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    import yirage as yr
    from torch_compile import build
    from yirage.tuning import profile as tuning

    for name in args.models.split(","):
        model, inputs = build(name, args.batch, "float32", False, device="cuda")
        for label, compiled in (("inductor", torch.compile(model)), ("yirage", yr.compile(model))):
            t0 = time.perf_counter()
            with torch.no_grad():
                compiled(**inputs)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            wall, table = _profile(lambda: compiled(**inputs), args.calls, args.top)
            print(f"== {name} batch {args.batch} {label}: {wall * 1e3:.2f} ms per forward, first call {first:.1f} s")
            print(table, flush=True)
        torch._dynamo.reset()
    entries = {k: v for k, v in tuning.active_profile().entries.items() if "|t0" in k}
    print(json.dumps({k: {"choice": v["choice"], "us": {p: round(t * 1e6, 1) for p, t in v.get("median_s", {}).items()}}
                      for k, v in sorted(entries.items())}, indent=1))


if __name__ == "__main__":
    main()
