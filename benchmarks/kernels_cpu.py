"""Benchmark of the C++ library linear kernels against torch on CPU; prints JSON.

For each weight shape (N, K) it times, in one process with ``torch.set_num_threads(2)``:
``yr_linear_q4_1`` and ``yr_linear_q8_0`` (x of M rows, weights in GGML blocks) and
``torch.nn.functional.linear`` on the dequantized fp32 weight. Times are medians over
many batches (rounds of the three contenders are interleaved, so that load from other
processes hits them alike); GB/s counts the weight bytes each one reads.

- ``hot``: the same weight on every call, so it stays in the caches (L2/L3).
- ``cold``: every call uses the next of several copies of the weight, more than the L3
  holds in total, so weights come from DRAM as in a real decode step, where each
  layer's weights were evicted since their last use.

``ggml_gemv``: the GEMV (M = 1) of every GGML block format (q4_1, q8_0 and the formats of
ggml_quants.h: q4_0, q5_0, q5_1, q2_k .. q6_k, iq4_nl, iq4_xs) in GB/s of weight bytes, hot and cold, on 1
and 2 threads, each beside q4_1 measured in the same rounds (``*_vs_q4_1``). Weights are
random valid blocks (finite fp16 scales); K is a multiple of 256 (the K-quant block).

``--row-groups``: the decode GEMVs of SmolLM2-135M's shapes (q4_1 projections, the q8_0 LM head)
in their plain layout and in groups of 16 rows (``q4_1r16`` / ``q8_0r16``, kernels/cpu/row_groups.h),
x of M = 1, 4 and 16 rows in float32 and int8 (``compute_dtype='int8'``), cold (copies cycled
through), all four contenders of a shape and M in the same interleaved rounds; GB/s of weight
bytes and each layout's ratio to the plain one.

``machine`` is ``yirage.runtime.machine.machine_record()`` (threads: --threads).

``--gemm``: the embedding encoder's packed GEMMs on the MiniLM shapes (M rows x (N, K)):
yirage's bfloat16 GEMM (``cpu_embed.bind_linear_bf16_packed``: x rounded to bf16, float32 sums
rounded to bf16, float32 bias) against torch's oneDNN bf16 linear, as the GEMM alone on x
already in bf16 (``onednn_bf16_gemm``) and as the same semantics (``onednn_bf16_linear``: x to
bf16, linear, float32 result plus bias), and against yirage's float32 packed GEMM, with
``yirage.runtime.timing.compare`` (interleaved rounds; ``ratio_*`` are medians of the paired
per-round ratios of times, < 1: yirage's bf16 GEMM takes less time) and the machine record.

Usage: PYTHONPATH=src python benchmarks/kernels_cpu.py [--threads 2] [--min-time 0.4]
       [--ggml-only | --gemm | --row-groups | --skip-ggml] [--plot PATH.png]
"""
from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf import quants

from yirage.backends.cpu import embed as cpu_embed
from yirage.backends.cpu.native import library
from yirage.dtypes import DType
from yirage.runtime.machine import machine_record
from yirage.runtime.timing import compare

from _plot import add_plot_option, figure, save

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]
GGML_SHAPES = [(2048, 2048), (640, 2048), (4096, 4096)]    # (N, K), K % 256 == 0
GGML_FORMATS = ("q4_1", "q8_0", "q4_0", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")
GGML_COLD_BYTES = 256 << 20                      # quantized bytes cycled through when cold
PREFILL = [(64, 1536, 576), (64, 576, 1536)]     # (M, N, K)
GEMM_M = (32, 128, 640, 2048)                                 # --gemm: rows (tokens of a batch)
GEMM_NK = ((1152, 384), (384, 384), (1536, 384), (384, 1536))  # MiniLM: qkv, attention out, FFN up, down
COLD_BYTES = 128 << 20                           # fp32 weight bytes cycled through when cold


def _bench(contenders: dict, min_time: float, rounds: int = 15) -> dict[str, float]:
    """Median seconds per call of each contender over ``rounds`` interleaved rounds of samples of
    ``min_time / rounds`` seconds (``yirage.runtime.timing.compare``), after 3 warm-up calls."""
    c = compare(contenders, rounds=rounds, min_sample_s=min_time / rounds, warmup=3)
    return {name: c.median(name) for name in c.names}


def _case(lib, M: int, N: int, K: int, min_time: float, cold: bool = False) -> dict:
    rng = np.random.default_rng(N * K)
    w = (rng.standard_normal((N, K), dtype=np.float32) * 0.05).astype(np.float32)
    x = torch.randn(M, K)
    raw = {fmt: torch.from_numpy(np.ascontiguousarray(quants.quantize(w, q)))
           for fmt, q in (("q4_1", QT.Q4_1), ("q8_0", QT.Q8_0))}
    w_f32 = torch.from_numpy(quants.dequantize(raw["q4_1"].numpy(), QT.Q4_1)).contiguous()
    copies = max(1, -(-COLD_BYTES // (w_f32.numel() * 4))) if cold else 1
    ws = [w_f32] + [w_f32.clone() for _ in range(copies - 1)]
    raws = {fmt: [r] + [r.clone() for _ in range(copies - 1)] for fmt, r in raw.items()}
    y = {fmt: torch.empty(M, N) for fmt in raw}
    px = x.data_ptr()
    f_q4 = lib.yr_linear_q4_1
    f_q8 = lib.yr_linear_q8_0
    a_q4 = itertools.cycle([(px, r.data_ptr(), None, y["q4_1"].data_ptr(), M, N, K) for r in raws["q4_1"]])
    a_q8 = itertools.cycle([(px, r.data_ptr(), None, y["q8_0"].data_ptr(), M, N, K) for r in raws["q8_0"]])
    w_it = itertools.cycle(ws)
    times = _bench({
        "torch_f32": lambda: F.linear(x, next(w_it)),
        "yr_q4_1": lambda: f_q4(*next(a_q4)),
        "yr_q8_0": lambda: f_q8(*next(a_q8)),
    }, min_time)
    f_q4(px, raw["q4_1"].data_ptr(), None, y["q4_1"].data_ptr(), M, N, K)
    ref = F.linear(x, w_f32)
    nbytes = {"torch_f32": w_f32.numel() * 4, "yr_q4_1": raw["q4_1"].numel(), "yr_q8_0": raw["q8_0"].numel()}
    out = {"M": M, "N": N, "K": K, "weight_copies": copies}
    for name, t in times.items():
        out[name] = {"us": round(t * 1e6, 2), "weight_MB": round(nbytes[name] / 1e6, 3),
                     "GB_per_s": round(nbytes[name] / t / 1e9, 2)}
    out["speedup_q4_1_vs_torch"] = round(times["torch_f32"] / times["yr_q4_1"], 2)
    out["speedup_q8_0_vs_torch"] = round(times["torch_f32"] / times["yr_q8_0"], 2)
    # sanity: the q4_1 kernel computes the same product as torch on the dequantized weight
    out["max_abs_diff_q4_1"] = float((y["q4_1"] - ref).abs().max())
    return out


def _random_blocks(fmt: str, rows: int, K: int, rng) -> torch.Tensor:
    """uint8 [rows, K / per * bytes] of random valid fmt blocks: random bytes, finite fp16 scales."""
    dt = DType(fmt)
    per, nbytes = dt.block
    raw = rng.integers(0, 256, size=(rows * K // per, nbytes), dtype=np.uint8)
    for off in dt.scale_offsets:
        raw[:, off:off + 2] = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(rows, K // per * nbytes))


def _ggml_case(lib, N: int, K: int, threads: int, min_time: float) -> dict:
    """GB/s of the M = 1 GEMV of every format, hot and cold, all formats in the same rounds."""
    torch.set_num_threads(threads)
    rng = np.random.default_rng(N + K)
    x, y = torch.randn(1, K), torch.empty(1, N)
    hot, cold, nbytes, weights = {}, {}, {}, []     # weights: keeps every copy alive
    for fmt in GGML_FORMATS:
        w = _random_blocks(fmt, N, K, rng)
        copies = [w] + [w.clone() for _ in range(max(1, GGML_COLD_BYTES // w.numel()))]
        weights.append(copies)
        fn = getattr(lib, f"yr_linear_{fmt}")
        nbytes[fmt] = w.numel()
        args = [(x.data_ptr(), c.data_ptr(), None, y.data_ptr(), 1, N, K) for c in copies]
        hot[fmt] = (lambda f, a: lambda: f(*a))(fn, args[0])
        cold[fmt] = (lambda f, i: lambda: f(*next(i)))(fn, itertools.cycle(args[1:]))
    out = {"threads": threads, "N": N, "K": K}
    for mode, fns in (("hot", hot), ("cold", cold)):
        t = _bench(fns, min_time / 2, rounds=9)
        gbs = {fmt: round(nbytes[fmt] / t[fmt] / 1e9, 2) for fmt in GGML_FORMATS}
        out[f"{mode}_GB_per_s"] = gbs
        out[f"{mode}_vs_q4_1"] = {fmt: round(g / gbs["q4_1"], 2) for fmt, g in gbs.items()}
    return out


def _gemm_case(M: int, N: int, K: int, rounds: int, min_sample_s: float) -> dict:
    """Times of yirage's bf16 and f32 packed GEMMs and torch's oneDNN bf16 linear on one shape,
    interleaved, with paired ratios; max_abs_diff: yirage bf16 vs oneDNN's result."""
    x, w, bias = torch.randn(M, K), torch.randn(N, K) / K ** 0.5, torch.randn(N)
    wb, xb = w.to(torch.bfloat16), x.to(torch.bfloat16)
    out = {name: torch.empty(M, N) for name in ("bf16", "f32", "onednn")}
    cpu_embed.prepack_linear(w)
    cand = {"yirage_bf16": cpu_embed.bind_linear_bf16_packed(x, wb, bias, out["bf16"]),
            "onednn_bf16_gemm": lambda: F.linear(xb, wb),
            "onednn_bf16_linear": lambda: torch.add(F.linear(x.to(torch.bfloat16), wb), bias, out=out["onednn"]),
            "yirage_f32": cpu_embed.bind_linear_f32_packed(x, w, bias, out["f32"])}
    c = compare(cand, rounds=rounds, min_sample_s=min_sample_s, warmup=3)
    flop = 2 * M * N * K
    return {"M": M, "N": N, "K": K,
            "GFLOP_per_s": {n: round(flop / c.median(n) / 1e9, 1) for n in c.names},
            **{f"ratio_vs_{n}": round(c.ratio("yirage_bf16", n), 3) for n in c.names if n != "yirage_bf16"},
            "max_abs_diff_vs_onednn": float((out["bf16"] - out["onednn"]).abs().max()),
            "timing": c.to_dict()}


def _row_groups_case(lib, fmt: str, M: int, N: int, K: int, min_time: float) -> dict:
    """GB/s (cold) of the plain and row-group layouts' GEMVs, float32 and int8 x, one round set."""
    from yirage.backends.cpu.library import to_row_groups
    rng = np.random.default_rng(N + K + M)
    w = _random_blocks(fmt, N, K, rng)
    copies = [w.clone() for _ in range(max(2, GGML_COLD_BYTES // w.numel()))]
    grouped = [to_row_groups(c, DType(fmt)) for c in copies]
    x, y = torch.randn(M, K), torch.empty(M, N)
    fns = {}
    for layout, ws in (("plain", copies), ("row_groups", grouped)):
        name = fmt if layout == "plain" else f"{fmt}r16"
        for act, suffix in (("float32", ""), ("int8", "_q8")):
            fn = getattr(lib, f"yr_linear_{name}{suffix}")
            args = itertools.cycle([(x.data_ptr(), c.data_ptr(), None, y.data_ptr(), M, N, K) for c in ws])
            fns[f"{act}/{layout}"] = (lambda f, a: lambda: f(*next(a)))(fn, args)
    t = _bench(fns, min_time, rounds=9)
    gbs = {k: round(w.numel() / v / 1e9, 2) for k, v in t.items()}
    return {"format": fmt, "M": M, "N": N, "K": K, "cold_GB_per_s": gbs,
            "row_groups_vs_plain": {a: round(gbs[f"{a}/row_groups"] / gbs[f"{a}/plain"], 2) for a in ("float32", "int8")},
            "int8_vs_float32_row_groups": round(gbs["int8/row_groups"] / gbs["float32/row_groups"], 2)}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=0.4, help="seconds per contender and shape")
    ap.add_argument("--ggml-only", action="store_true", help="only the per-format GEMV section")
    ap.add_argument("--gemm", action="store_true", help="only the encoder's packed GEMMs (bf16, f32) vs oneDNN bf16")
    ap.add_argument("--rounds", type=int, default=9, help="--gemm: interleaved rounds per shape")
    ap.add_argument("--row-groups", action="store_true", help="only the plain vs row-group decode GEMVs")
    ap.add_argument("--skip-ggml", action="store_true", help="the default run without the per-format GEMV section")
    add_plot_option(ap)
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.row_groups:
        torch.set_num_threads(args.threads)
        cases = [_row_groups_case(library(), "q4_1" if N != 49152 else "q8_0", M, N, K, args.min_time)
                 for N, K in SHAPES for M in (1, 4, 16)]
        return emit({"machine": machine_record(args.threads), "row_groups": cases}, args)
    if args.gemm:
        torch.set_num_threads(args.threads)
        cases = [_gemm_case(M, N, K, args.rounds, args.min_time / args.rounds) for M in GEMM_M for N, K in GEMM_NK]
        return emit({"machine": machine_record(args.threads), "gemm": cases}, args)
    lib = library()
    ggml = [] if args.skip_ggml else [_ggml_case(lib, N, K, t, args.min_time) for t in (1, 2) for N, K in GGML_SHAPES]
    if args.ggml_only:
        return emit({"machine": machine_record(args.threads), "ggml_gemv": ggml}, args)
    torch.set_num_threads(args.threads)
    noop = lib.yr_argmax   # R = 0: returns at once, measures the ctypes call itself
    overhead = _bench({"call": lambda: noop(0, 0, 0, 1)}, 0.2)["call"]
    result = {
        "machine": machine_record(),
        "ctypes_call_overhead_us": round(overhead * 1e6, 2),
        "decode_M1_hot": [_case(lib, 1, N, K, args.min_time) for N, K in SHAPES],
        "decode_M1_cold": [_case(lib, 1, N, K, args.min_time, cold=True) for N, K in SHAPES],
        "prefill_hot": [_case(lib, M, N, K, args.min_time) for M, N, K in PREFILL],
        "ggml_gemv": ggml,
    }
    emit(result, args)


def emit(result: dict, args) -> None:
    """Print ``result`` as JSON, then draw its figure into ``args.plot`` if asked."""
    print(json.dumps(result, indent=1))
    if args.plot:
        save(plot_figure(result), args.plot)


def plot_figure(result: dict) -> dict | None:
    """The figure (``benchmarks/_plot.py``): yirage's kernels over torch's (the default run: the
    q4_1 and q8_0 linears over torch's float32 linear on the dequantized weight, decode M = 1 hot
    and cold and prefill; ``--gemm``: yirage's bf16 GEMM over oneDNN's bf16 GEMM and linear).
    None for ``--ggml-only`` and ``--row-groups``, which compare yirage's kernels with each other."""
    bars = []
    for section, label in (("decode_M1_hot", "M=1 hot"), ("decode_M1_cold", "M=1 cold"), ("prefill_hot", "hot")):
        for c in result.get(section, []):
            group = f"{c['M']}x{c['N']}x{c['K']} {label}"
            bars += [{"group": group, "series": f"{fmt} vs torch float32 linear", "ratio": c[f"speedup_{fmt}_vs_torch"]}
                     for fmt in ("q4_1", "q8_0")]
    for c in result.get("gemm", []):   # ratio_vs_*: yirage bf16 time / the peer's; the speedup is its inverse
        bars += [{"group": f"{c['M']}x{c['N']}x{c['K']}", "series": f"bf16 GEMM vs {peer}", "ratio": 1 / c[f"ratio_vs_{peer}"]}
                 for peer in ("onednn_bf16_gemm", "onednn_bf16_linear") if c.get(f"ratio_vs_{peer}")]
    if not bars:
        return None
    what = ("yirage's packed bf16 GEMM over oneDNN's (MiniLM's shapes, M x N x K)" if "gemm" in result else
            "yirage's q4_1 / q8_0 linear over torch's float32 linear (M x N x K)")
    return figure("kernels", what, result["machine"], bars)


if __name__ == "__main__":
    main()
