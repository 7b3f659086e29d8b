"""Parallel 1x1 convolutions of one input, apart and merged into one GEMM, on the CPU; prints JSON.

The groups are those of real conv nets, float32, NHWC, each branch with its BatchNorm (folded)
and its activation as the nets have them:

- ResNet-50's first bottleneck: the 64 -> 64 1x1 convolution (ReLU) and the 64 -> 256
  projection shortcut (no activation) of one 56x56 input;
- Inception-v3's 1x1 branches of one input: module A (35x35x192 -> 64, 48, 64), C (17x17x768 ->
  192, 160, 160) and E (8x8x1280 -> 320, 384, 448), all with ReLU;
- GoogLeNet's inception 3a (28x28x192 -> 64, 96, 16), with ReLU.

For each group and batch (1 and 8) it times, with ``yirage.runtime.timing.compare``
(interleaved rounds), the two candidates the CPU backend measures before merging
(``backends/cpu/conv.py`` ``stack_candidates``): "separate", each convolution on the provider chosen
for its own shape class (oneDNN or yirage's GEMM, as a compiled model would run it), and
"stacked", the one GEMM (``conv2d_stack``). ``speedup`` is the median of the per-round ratios
separate / stacked (> 1: merging is faster), and ``merge_convs`` what the backend decides (its
own measurement, cached in the tuning profile). ``machine`` is
``yirage.runtime.machine.machine_record()``.

Usage: PYTHONPATH=src python benchmarks/parallel_convs.py [--threads 2] [--rounds 9] [--plot PATH.png]

``--plot`` draws each group's ``speedup`` (merged over separate) at each batch, beside the
figure's data (``benchmarks/_plot.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _plot import add_plot_option, figure, save  # noqa: E402

from yirage.backends.cpu import conv as cpu_conv
from yirage.runtime.machine import machine_record
from yirage.runtime.timing import compare
from yirage.transforms.parallel import ConvGroup

#: name -> (H, W, C, [(out channels, activation)])
GROUPS = {
    "resnet50 stage-1 conv1 + shortcut": (56, 56, 64, [(64, "relu"), (256, None)]),
    "inception-v3 A 1x1 branches": (35, 35, 192, [(64, "relu"), (48, "relu"), (64, "relu")]),
    "inception-v3 C 1x1 branches": (17, 17, 768, [(192, "relu"), (160, "relu"), (160, "relu")]),
    "inception-v3 E 1x1 branches": (8, 8, 1280, [(320, "relu"), (384, "relu"), (448, "relu")]),
    "googlenet 3a 1x1 branches": (28, 28, 192, [(64, "relu"), (96, "relu"), (16, "relu")]),
}


def group(batch: int, H: int, W: int, C: int, branches) -> ConvGroup:
    """The ConvGroup of 1x1 stride-1 NHWC branches with BatchNorm and the given activations."""
    def attrs(act):
        return {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1, "layout": "nhwc",
                "bias": False, "bn": {"eps": 1e-5, "affine": True}, **({"activation": act} if act else {})}
    return ConvGroup((batch, H, W, C), "float32", tuple((O, C, 1, 1) for O, _ in branches),
                     tuple(attrs(act) for _, act in branches))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    add_plot_option(ap)
    return ap


def plot_figure(report: dict) -> dict | None:
    """The figure (``benchmarks/_plot.py``): each group's separate / stacked time (> 1: merging
    into one GEMM is faster) at each batch."""
    bars = [{"group": r["group"], "series": f"batch {r['batch']}: separate / stacked", "ratio": r["speedup"]}
            for r in report["results"] if r.get("speedup")]
    return figure("parallel_convs", "parallel 1x1 convolutions: one merged GEMM over each apart",
                  report["machine"], bars,
                  ylabel="separate time / merged time (> 1: merging is faster)") if bars else None


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for name, (H, W, C, branches) in GROUPS.items():
        for batch in args.batch_sizes:
            case = group(batch, H, W, C, branches)
            cands = cpu_conv.stack_candidates(case)
            thunks = {n: make() for n, make in cands.items()}
            c = compare(thunks, rounds=args.rounds, min_sample_s=0.05, warmup=3)
            results.append({"group": name, "batch": batch, "widths": [O for O, _ in branches],
                            "separate_ms": round(c.median("separate") * 1e3, 3),
                            "stacked_ms": round(c.median("stacked") * 1e3, 3),
                            "speedup": round(1 / c.ratio("stacked", "separate"), 3),
                            "merge_convs": cpu_conv.merge_convs(case)})
            print(json.dumps(results[-1]), flush=True)
    report = {"machine": machine_record(args.threads), "results": results}
    print(json.dumps(report, indent=1))
    if args.plot:
        save(plot_figure(report), args.plot)


if __name__ == "__main__":
    main()
