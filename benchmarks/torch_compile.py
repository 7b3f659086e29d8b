"""yr.compile (torch.compile with yirage) against torch eager and Inductor on a model suite.

Prints one JSON object. Models are built from transformers configs with random weights (no
network): BERT, GPT-2, a small Llama, ViT, DistilBERT, T5's encoder and all-MiniLM-L6-v2 (the
shipped sentence-transformers model's architecture) at sequence 128 (ViT: 224x224 images), and
the conv nets ResNet-50, ConvNeXt-tiny, MobileNetV2 and EfficientNet-B0 at 224x224, each at every
--batch-sizes, float32 (or --dtype bfloat16), in inference (eval, no_grad).

    python benchmarks/torch_compile.py [--models bert,resnet50,...] [--batch-sizes 1 8]
                                       [--dtype float32] [--rounds 5] [--threads 2] [--small]
                                       [--device cpu|cuda] [--compile-samples 1]

``--small`` uses tiny configs (hidden 64, 2 layers; 64x64 images) for a quick smoke run.
``--device cuda`` puts models and inputs on the GPU: Inductor generates Triton there, and the
yirage side compiles its partitions for yirage's ``cuda`` backend (Triton kernels); each
timed forward ends with ``torch.cuda.synchronize()``.

Conv nets get the initialization issue 21 asks for, so that activations neither vanish nor
turn into denormals: Kaiming convolutions, BatchNorm affine parameters reset, and BatchNorm
running statistics calibrated on a few random batches in train mode.

Every (model, batch) has three sides, each in its own process (``_sides.py``): eager,
``torch.compile`` (Inductor) and ``yr.compile`` (``torch.compile`` with the yirage backend,
precompiled: yirage/dynamo/precompile.py). A side builds the model from the same seed, runs its
first call (``compile_s``: the cold compile, for eager its first call), warms up, then times one
forward per sample; the sides are sampled in interleaved rounds and ratios are medians of
per-round ratios.

Cold means empty disk caches for both compilers: each case gives Inductor a new
``TORCHINDUCTOR_CACHE_DIR`` (no FX graph, AOTAutograd or kernel cache) and yirage a new
``YIRAGE_CACHE_DIR`` and ``YIRAGE_PROFILE_DIR`` (no precompiled model, no measured kernel
choices, no generated kernels), each a new ``TRITON_CACHE_DIR`` too. yirage's new cache holds
only its hand-written C++ kernel libraries, which ``make setup`` builds at install
(``python -m yirage.runtime.toolchain``); the run builds them first if they are missing and
reports that time as ``kernel_libraries_build_s``, outside every compile time. A second
process of each compiler, on the caches the first one left, gives ``warm_compile_s`` (yirage:
``warm_precompile`` says whether it loaded the precompiled graph;
``warm_compile_beyond_call_s`` is that first call less one timed forward). yirage's
``kernel_choice_s`` is the part of its first call spent choosing kernels by measurement
(``tuning.first_use_spent``: preparing and timing the candidates of ``kernel_choices_measured``
shape classes; on a GPU their Triton compiles and autotuning), ``warm_kernel_choice_s`` the same
in the second process.
``--profile-dir DIR`` gives the yirage sides the tuning profile in DIR (e.g. the machine's
long-lived one, ``$YIRAGE_CACHE_DIR/tuning``) instead of an empty one: its kernel choices are
then the ones measured before, and its compile is no longer cold.
``--compile-samples N`` takes N cold first calls of Inductor and of yirage, each in a fresh
process with empty caches, and reports their median as ``compile_s`` (and all of them as
``compile_s_samples``). Per model the JSON has each side's
median seconds, peak RSS (MiB), the yirage and Inductor outputs' max abs error and cosine to
eager, and the speedups against eager, Inductor and the faster of the two (what a user would
pick); ``summary`` has their geomeans and the pass rate (outputs within tolerance). With
``--dtype bfloat16`` every side is also compared with the model run in float32
(``vs_float32``), and yirage passes when it is no further from float32 than eager bfloat16
(see ``_against_float32``).
``machine`` is ``yirage.runtime.machine.machine_record()``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _sides import Sides, SideSpec, comparison  # noqa: E402
from _plot import add_plot_option, figure, save  # noqa: E402

TRANSFORMERS = ("bert", "gpt2", "llama", "vit", "distilbert", "t5-encoder", "minilm")
#: efficientnet-b0: the issue's example of Inductor far slower than eager on an Intel CPU (depthwise
#: convolutions, squeeze-and-excitation)
CONV_NETS = ("resnet50", "convnext-tiny", "mobilenetv2", "efficientnet-b0")
#: (atol, rtol) of an output against eager, by dtype
TOLERANCE = {"float32": (1e-3, 1e-3), "bfloat16": (5e-2, 5e-2)}


def _config(name: str, small: bool):
    """(model class, config) for ``name``; tiny sizes with ``small``."""
    import transformers as tf

    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    if name == "bert":
        return tf.BertModel, tf.BertConfig(**(tiny if small else {}))
    if name == "minilm":
        return tf.BertModel, tf.BertConfig(**{"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
                                              "intermediate_size": 1536, **({"num_hidden_layers": 2} if small else {})})
    if name == "gpt2":
        return tf.GPT2Model, tf.GPT2Config(**({"n_embd": 64, "n_layer": 2, "n_head": 2} if small else {}))
    if name == "llama":
        return tf.LlamaModel, tf.LlamaConfig(hidden_size=64 if small else 512, num_hidden_layers=2 if small else 8,
                                             num_attention_heads=2 if small else 8, num_key_value_heads=1 if small else 4,
                                             intermediate_size=128 if small else 1536, vocab_size=32000)
    if name == "vit":
        return tf.ViTModel, tf.ViTConfig(**({**tiny, "image_size": 64, "patch_size": 16} if small else {}))
    if name == "distilbert":
        return tf.DistilBertModel, tf.DistilBertConfig(**({"dim": 64, "n_layers": 2, "n_heads": 2, "hidden_dim": 128}
                                                           if small else {}))
    if name == "t5-encoder":
        return tf.T5EncoderModel, tf.T5Config(**({"d_model": 64, "num_layers": 2, "num_heads": 2, "d_ff": 128, "d_kv": 32}
                                                 if small else {}))
    if name == "resnet50":
        return tf.ResNetModel, tf.ResNetConfig(**({"embedding_size": 8, "hidden_sizes": [8, 16, 32, 64],
                                                    "depths": [1, 1, 1, 1]} if small else {}))
    if name == "convnext-tiny":
        return tf.ConvNextModel, tf.ConvNextConfig(**({"hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1]}
                                                      if small else {}))
    if name == "efficientnet-b0":   # transformers' defaults are B7's: B0's width, depth and size
        return tf.EfficientNetModel, tf.EfficientNetConfig(width_coefficient=1.0, depth_coefficient=0.5 if small else 1.0,
                                                           image_size=64 if small else 224, hidden_dim=1280)
    if name == "mobilenetv2":
        return tf.MobileNetV2Model, tf.MobileNetV2Config(**({"depth_multiplier": 0.25, "image_size": 64} if small else {}))
    raise SystemExit(f"unknown model {name!r}: choose from {', '.join(TRANSFORMERS + CONV_NETS)}")


def build(name: str, batch: int, dtype: str, small: bool, device: str = "cpu"):
    """(model in eval mode, its input kwargs) with random weights from seed 0, on ``device``
    (built and calibrated on the CPU, then moved)."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    cls, cfg = _config(name, small)
    model = cls(cfg)
    if name in CONV_NETS:
        size = 64 if small else 224
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)) and m.weight is not None:
                nn.init.ones_(m.weight), nn.init.zeros_(m.bias)
        model.train()
        with torch.no_grad():
            for _ in range(3):
                model(pixel_values=torch.randn(4, 3, size, size))
        inputs = {"pixel_values": torch.randn(batch, 3, size, size)}
    elif name == "vit":
        size = 64 if small else 224
        inputs = {"pixel_values": torch.randn(batch, 3, size, size)}
    else:
        seq = 32 if small else 128
        inputs = {"input_ids": torch.randint(0, cfg.vocab_size, (batch, seq))}
    model = model.eval().to(device=device, dtype=getattr(torch, dtype))
    inputs = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v).to(device) for k, v in inputs.items()}
    return model, inputs


class CompiledSide:
    """One side in its worker: ``mode`` 'eager', 'inductor' or 'yirage'."""

    def __init__(self, model: str, batch: int, dtype: str, small: bool, mode: str,
                 device: str = "cpu", compile_only: bool = False):
        import torch

        self.torch = torch
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        net, self.inputs = build(model, batch, dtype, small, device)
        if mode == "yirage":   # its disk caches are the ones ColdCaches.env gave this process
            import yirage as yr
            self.fn = yr.compile(net, options={"backend": "cuda"} if device == "cuda" else None)
        else:
            self.fn = net if mode == "eager" else torch.compile(net, backend="inductor")
        with torch.no_grad():
            t0 = time.perf_counter()
            self.out = self._first(self.fn(**self.inputs))   # .cpu() synchronizes
            compile_s = time.perf_counter() - t0
            for _ in range(0 if compile_only else 2):
                self.fn(**self.inputs)
        self.info = {"compile_s": compile_s, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if mode == "yirage":   # the share of the first call that chose kernels (GPU: their compiles too)
            from yirage.tuning.profile import first_use_spent
            spent = first_use_spent()
            self.info.update(kernel_choice_s=spent["seconds"], kernel_choices_measured=spent["measured"])
        if mode == "yirage" and not compile_only:   # the first positional argument of every suite model is its input
            self.info["precompile"] = self.fn.precompile_status.split(" /")[0]
            with torch.no_grad():
                d = yr.explain(net, *self.inputs.values()).to_dict()
            self.info["ops_in_yirage"] = sum(len(p["ops"]) for g in d["graphs"] for p in g["partitions"]
                                             if p["runs_in"] == "yirage")
            self.info["ops_in_torch"] = sum(len(g["torch_ops"]) for g in d["graphs"])

    @staticmethod
    def _first(out):
        t = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", None)
        if t is None:
            t = out.pooler_output if hasattr(out, "pooler_output") else out
        return t.detach().float().cpu().numpy()   # numpy: torch tensors would travel through shared memory

    def sample(self):
        with self.torch.no_grad():
            self.sync()
            t0 = time.perf_counter()
            self.fn(**self.inputs)
            self.sync()
            return {"seconds": time.perf_counter() - t0}, self.out


def _compare_outputs(ref, out, dtype: str) -> dict:
    import torch

    ref, out = torch.from_numpy(ref), torch.from_numpy(out)
    err = (out - ref).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    atol, rtol = TOLERANCE[dtype]
    return {"max_abs_error": err, "cosine": cos, "ok": bool(torch.allclose(out, ref, atol=atol, rtol=rtol))}


def _against_float32(sides, kw: dict, args, entry: dict, outs: dict) -> None:
    """Half-precision runs: every side's output against the same model run eager in float32
    (``vs_float32``: max abs error, cosine). A bfloat16 conv net drifts from eager bfloat16 by
    as much as eager bfloat16 drifts from float32 (50 layers of rounding, which folding
    BatchNorm into the weights moves), so ``ok`` there means: no further from float32 than
    eager bfloat16 is (cosine within 1e-3, max error within 1.5x); ``ok_vs_eager`` keeps the
    tolerance test against eager."""
    if not sides.start("float32", SideSpec("torch_compile:CompiledSide", {**kw, "dtype": "float32", "mode": "eager"},
                                           threads=args.threads)):
        return
    got = sides.sample("float32", {})
    if got is None:
        return
    ref = got[1]
    for mode in ("eager", "inductor", "yirage"):
        if mode in outs:
            entry[mode]["vs_float32"] = {k: v for k, v in _compare_outputs(ref, outs[mode], args.dtype).items()
                                         if k != "ok"}
    e, y = entry["eager"].get("vs_float32"), entry["yirage"].get("vs_float32")
    if e and y:
        entry["yirage"]["ok_vs_eager"] = entry["yirage"].get("ok")
        entry["yirage"]["ok"] = bool(y["cosine"] >= e["cosine"] - 1e-3
                                     and y["max_abs_error"] <= 1.5 * e["max_abs_error"] + 1e-3)


def kernel_libraries() -> tuple[list, float]:
    """yirage's hand-written C++ libraries, built into the user's cache if missing (what
    ``make setup`` does at install): (their cache paths, seconds this call spent)."""
    from yirage.runtime import toolchain

    t0 = time.perf_counter()
    built = toolchain.prebuild()
    return [path for _, path, _, _ in built], time.perf_counter() - t0


class ColdCaches:
    """Empty disk caches for one case: ``env(mode)`` is the environment of a side whose
    compiler starts with nothing cached (Inductor: ``TORCHINDUCTOR_CACHE_DIR``; yirage:
    ``YIRAGE_CACHE_DIR`` holding only the installed kernel ``libraries``, and
    ``YIRAGE_PROFILE_DIR``; both: ``TRITON_CACHE_DIR``). A later side given the same
    ``env(mode)`` finds what the first one left (the warm compile). Removed on exit."""

    def __init__(self, libraries: list, profile_dir: str | None = None):
        self.root = tempfile.mkdtemp(prefix="yirage-bench-caches-")
        self.libraries = libraries
        self.profile_dir = profile_dir   # yirage's tuning profile, when not an empty one
        self._envs: dict[str, dict] = {}

    def env(self, mode: str, fresh: bool = False) -> dict:
        """The side's cache environment; ``fresh``: new empty caches, not the case's."""
        if mode == "eager":
            return {}
        if mode in self._envs and not fresh:
            return self._envs[mode]
        d = tempfile.mkdtemp(prefix=f"{mode}-", dir=self.root)
        env = {"TRITON_CACHE_DIR": os.path.join(d, "triton")}
        if mode == "inductor":
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(d, "inductor")
        else:
            from yirage.runtime import toolchain

            cpp = os.path.join(d, "yirage", "cpp")
            os.makedirs(cpp)
            for lib in self.libraries:   # the library, then the checksum file that vouches for it
                shutil.copy2(lib, cpp)
                shutil.copy2(toolchain.checksum_path(lib), cpp)
            env.update(YIRAGE_CACHE_DIR=os.path.join(d, "yirage"),
                       YIRAGE_PROFILE_DIR=self.profile_dir or os.path.join(d, "tuning"))
        if not fresh:
            self._envs[mode] = env
        return env

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        shutil.rmtree(self.root, ignore_errors=True)


def run_case(name: str, batch: int, args) -> dict:
    with ColdCaches(args.kernel_libraries, args.profile_dir) as caches:
        return _run_case(name, batch, args, caches)


def _run_case(name: str, batch: int, args, caches: ColdCaches) -> dict:
    kw = {"model": name, "batch": batch, "dtype": args.dtype, "small": args.small, "device": args.device}
    entry: dict = {}
    with Sides(timeout_s=args.timeout) as sides:
        for mode in ("eager", "inductor", "yirage"):
            sides.start(mode, SideSpec("torch_compile:CompiledSide", {**kw, "mode": mode}, threads=args.threads,
                                       env=caches.env(mode)))
        rounds = sides.rounds(args.rounds, {})
        outs = {m: r[m][1] for r in rounds for m in r}
        for mode in ("eager", "inductor", "yirage"):
            c = comparison(rounds, "seconds", [mode])
            entry[mode] = sides.report(mode, {"median_s": c.median(mode)} if c else {})
            if mode != "eager" and mode in outs and "eager" in outs:
                entry[mode].update(_compare_outputs(outs["eager"], outs[mode], args.dtype))
        if args.dtype != "float32":   # how far each side is from the model in float32
            _against_float32(sides, kw, args, entry, outs)
        for peer in ("eager", "inductor"):
            c = comparison(rounds, "seconds", [peer, "yirage"])
            if c is not None:
                entry[f"yirage_speedup_vs_{peer}"] = c.ratio(peer, "yirage")
        if "yirage_speedup_vs_eager" in entry and "yirage_speedup_vs_inductor" in entry:
            entry["yirage_speedup_vs_best"] = min(entry["yirage_speedup_vs_eager"], entry["yirage_speedup_vs_inductor"])
    _more_compile_samples(kw, args, entry, caches)
    for mode in ("inductor", "yirage"):   # a second process of each: its disk caches are warm now
        with Sides(timeout_s=args.timeout) as warm:
            if not (mode in entry and warm.start(mode, SideSpec("torch_compile:CompiledSide", {**kw, "mode": mode},
                                                                threads=args.threads, env=caches.env(mode)))):
                continue
            entry[mode]["warm_compile_s"] = warm.info[mode]["compile_s"]
            if mode == "yirage":
                entry[mode]["warm_precompile"] = warm.info[mode]["precompile"]
                entry[mode]["warm_kernel_choice_s"] = warm.info[mode]["kernel_choice_s"]
                if entry[mode].get("median_s"):   # the first call less one forward: what loading adds
                    entry[mode]["warm_compile_beyond_call_s"] = entry[mode]["warm_compile_s"] - entry[mode]["median_s"]
    return entry


def _more_compile_samples(kw: dict, args, entry: dict, caches: ColdCaches) -> None:
    """With ``--compile-samples N`` > 1: N - 1 more cold first calls of Inductor and yirage,
    each in a fresh process with empty caches (alternating, so that a slow spell of the
    machine hits both), after
    the timed rounds; ``compile_s`` becomes the median of all N and ``compile_s_samples`` lists
    them. One process's first call moves by a second or more on a shared virtual machine."""
    samples = {m: [entry[m]["compile_s"]] for m in ("inductor", "yirage") if "compile_s" in entry.get(m, {})}
    for _ in range(args.compile_samples - 1):
        for mode in samples:
            with Sides(timeout_s=args.timeout) as one:
                if one.start(mode, SideSpec("torch_compile:CompiledSide", {**kw, "mode": mode, "compile_only": True},
                                            threads=args.threads, env=caches.env(mode, fresh=True))):
                    samples[mode].append(one.info[mode]["compile_s"])
    if args.compile_samples > 1:
        for mode, xs in samples.items():
            entry[mode]["compile_s_samples"] = xs
            entry[mode]["compile_s"] = statistics.median(xs)


def _geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(TRANSFORMERS + CONV_NETS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtype", choices=tuple(TOLERANCE), default="float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a side may take per sample")
    ap.add_argument("--small", action="store_true", help="tiny configs: a quick smoke run")
    ap.add_argument("--compile-samples", type=int, default=1,
                    help="cold first calls of Inductor and yirage per case, each in a fresh process; "
                         "compile_s is their median")
    ap.add_argument("--profile-dir", default=None,
                    help="the yirage sides' tuning profile directory (default: a new, empty one per case)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: models on the GPU, yirage's cuda backend against Inductor's Triton")
    add_plot_option(ap)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/torch_compile.py: --device cuda, but torch sees no CUDA device")
    from yirage.runtime.machine import machine_record

    args.kernel_libraries, build_s = kernel_libraries()
    results = {}
    for name in args.models.split(","):
        for b in args.batch_sizes:
            print(f"[torch_compile] {name} batch {b}", file=sys.stderr, flush=True)
            results[f"{name} b{b}"] = run_case(name, b, args)
            print(f"[torch_compile] {name} b{b}: {json.dumps(results[f'{name} b{b}'])}", file=sys.stderr, flush=True)

    def group(names):
        keys = [k for k in results if k.split(" ")[0] in names]
        return {f"geomean_vs_{p}": _geomean([results[k].get(f"yirage_speedup_vs_{p}") for k in keys])
                for p in ("eager", "inductor", "best")}
    passed = [k for k, e in results.items() if e.get("yirage", {}).get("ok")]
    report = {"machine": machine_record(args.threads), "device": args.device, "dtype": args.dtype,
              "rounds": args.rounds, "small": args.small, "kernel_libraries_build_s": build_s, "models": results,
              "summary": {"pass_rate": f"{len(passed)}/{len(results)}", "transformers": group(TRANSFORMERS),
                          "conv_nets": group(CONV_NETS)}}
    print(json.dumps(report, indent=1))
    if args.plot:
        save(plot_figure(report), args.plot)


def plot_figure(report: dict) -> dict | None:
    """The figure (``benchmarks/_plot.py``): yirage's speed over eager's and Inductor's per model
    and batch (the median of the paired ratios of the rounds)."""
    bars = [{"group": case, "series": f"vs {label}", "ratio": entry[f"yirage_speedup_vs_{peer}"]}
            for case, entry in report["models"].items() for peer, label in (("eager", "eager"), ("inductor", "Inductor"))
            if entry.get(f"yirage_speedup_vs_{peer}")]
    return figure("torch_compile", f"torch.compile(backend=yirage) over eager and Inductor, {report['dtype']} "
                                   f"on {report['device']} (forward, median of {report['rounds']} rounds)",
                  report["machine"], bars) if bars else None


if __name__ == "__main__":
    main()
