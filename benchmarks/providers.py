"""Is the measured kernel choice the fastest provider? (issue 18: within 5% on every timed shape)

For every shape class that ``yirage optimize`` measures (tools/optimize.py ``workload_cases``:
the default embedding model's linear layers in float32, bfloat16 and int8 at several M, and
Mirage's linears), this script

1. asks the CPU backend which provider it chooses (``cpu_providers.choose``: this machine's
   profile, a template, or a first-use measurement, exactly as binding a plan does), then
2. times every candidate provider again, afresh, in interleaved rounds (``runtime/timing.py``),
   and reports the chosen provider's median time over the fastest one's (1.0 = it chose the
   fastest; the target is <= 1.05).

Prints one JSON object: the machine (``machine_record``), one row per shape class, and a
summary (worst ratio, how many within 5%).

    python benchmarks/providers.py [--threads 2] [--rounds 9] [--min-sample 0.01] [--plot PATH.png]

``--plot`` draws, per shape class, the fastest provider's time over the chosen one's (1.0: the
choice was the fastest; the target is >= 0.95), beside the figure's data (``benchmarks/_plot.py``).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _threads  # noqa: E402,F401  (sets OMP_NUM_THREADS from --threads before torch loads)
from _plot import add_plot_option, figure, save  # noqa: E402

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from yirage.backends.cpu import providers as cpu_providers  # noqa: E402
from yirage.runtime import timing  # noqa: E402
from yirage.runtime.machine import machine_record  # noqa: E402
from yirage.tools.optimize import shape_classes  # noqa: E402


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds per shape class")
    ap.add_argument("--min-sample", type=float, default=0.01, help="seconds per sample at least")
    add_plot_option(ap)
    return ap


def plot_figure(report: dict) -> dict | None:
    """The figure (``benchmarks/_plot.py``): per shape class, the fastest provider's median time
    over the chosen provider's (1.0: the measured choice was the fastest)."""
    bars = [{"group": r["key"], "series": "fastest / chosen (1.0: chose the fastest)",
             "ratio": 1.0 / r["chosen_over_fastest"]} for r in report["rows"] if r.get("chosen_over_fastest")]
    return figure("providers", "the CPU backend's measured provider choice against the fastest candidate",
                  report["machine"], bars,
                  ylabel="fastest provider's time / the chosen one's (1.0: the choice was the fastest)") if bars else None


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for w, case, weights in shape_classes():
        cands = cpu_providers.candidates(case)
        if len(cands) < 2:
            continue
        provider, choice = cpu_providers.choose(case, weights)
        sample = cpu_providers.sample_args(case, weights)
        thunks = {n: p.bind(case, sample[0], sample[1], None) for n, p in cands.items()}
        c = timing.compare(thunks, rounds=args.rounds, min_sample_s=args.min_sample)
        fastest = c.fastest()
        rows.append({"workload": w.name, "key": case.key(), "chosen": provider.name, "chosen_by": choice.source,
                     "fastest": fastest, "median_us": {n: round(c.median(n) * 1e6, 1) for n in c.names},
                     "chosen_over_fastest": round(c.ratio(provider.name, fastest), 3)})
        print(f"[providers] {case.key()}: chose {provider.name} ({choice.source}), fastest {fastest}, "
              f"ratio {rows[-1]['chosen_over_fastest']}", file=sys.stderr, flush=True)
    ratios = [r["chosen_over_fastest"] for r in rows]
    report = {"machine": machine_record(), "rounds": args.rounds, "rows": rows,
              "summary": {"classes": len(rows), "worst": max(ratios, default=None),
                          "within_5_percent": sum(r <= 1.05 for r in ratios)}}
    print(json.dumps(report, indent=1))
    if args.plot:
        save(plot_figure(report), args.plot)


if __name__ == "__main__":
    main()
