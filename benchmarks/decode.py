"""Decode and prefill speed and load time of yirage vs llama.cpp and Hugging Face transformers.

Prints one JSON object. All sides run the same model file (the GGUF behind --model), the
same prompt token ids (yirage's ``encode_prompt``: the chat template applied), the same
thread count and greedy decoding; each side generates --tokens new tokens (fewer if the
model emits EOS first: the counts are in the output); the median of --runs runs is reported
(--transformers-runs for transformers, the slow reference).

    python benchmarks/decode.py [-m smollm2-135m-instruct | gemma3-270m] [--threads=2] [--tokens 128]
                                [--runs 3] [--transformers-runs 1] [--no-transformers]
                                [--no-llamacpp] [--scenario idle|busy] [--prompts short,long]

Two prompts: ``short`` (a one-line chat prompt, about 42 tokens) and ``long`` (a fixed,
deterministic set of notes in the chat template, about 790 tokens; the exact count is in
the output).

Measures, per side and prompt:
  - prefill_s: seconds from the start of the prompt to the first new token (time to first
    token: the prompt's forward pass plus the first greedy pick); prefill_tokens_per_s =
    prompt_tokens / prefill_s;
  - decode_tokens_per_s: tokens/s over the decode steps after the first new token;
  - load: the constructor's seconds (``yr.LLM(...)`` / ``llama_cpp.Llama(...)``): ``first_s``
    the first one of that side in this process (for the first yirage config, the first load
    after ``import yirage``), ``warm_s`` the median of the next two (disk and compile caches warm).

yirage (each config) and llama.cpp are all loaded, then take turns run by run, so that other
load on a shared machine spreads over every side; transformers runs afterwards on its own.

llama.cpp comes from llama-cpp-python (the optional ``bench`` extra: ``make bench`` installs it;
it compiles llama.cpp for about 10 minutes). Without it the llama.cpp side is skipped.

``--scenario busy``: a separate process spins on one core (the last one this process may use)
while yirage (its default engine) and llama.cpp decode with --threads threads; run by run,
yirage with one worker on the idle machine runs just before, and the ratio of each such pair
is reported (their median is issue 7's busy-core figure).

If ``yr.LLM`` takes a ``persistent`` keyword, yirage is measured with persistent=True and
persistent=False; if it takes a thread-count keyword (num_threads, threads, num_workers), it
gets --threads. OMP_NUM_THREADS and torch's thread count are set from --threads too.
The machine may be shared with other jobs: figures are noisy; compare within one run.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _threads  # noqa: E402,F401  (sets OMP_NUM_THREADS from --threads before torch loads)

import torch  # noqa: E402

import yirage as yr  # noqa: E402
from yirage.models.loading import load_model  # noqa: E402

PROMPT = "Write a detailed story about a robot who learns to paint."
LONG_TARGET_TOKENS = 790
MAX_SEQ = 1024  # KV cache / context of every side: the long prompt plus 128 new tokens fits

_LONG_INTRO = ("Below are the notes a museum curator kept while a small maintenance robot taught "
               "itself to paint. Read them, then write a short story based on them.\n\n")
_LONG_NOTES = [
    "The robot was built to sweep the floors of the east gallery after closing time.",
    "It stopped every night in front of the same landscape, a river under a grey sky.",
    "One evening it picked up a brush a restorer had left on a trolley and held it for an hour.",
    "The next morning there were small blue marks on a sheet of packing paper near the loading dock.",
    "The curator kept the sheet and pinned it above her desk without telling anyone.",
    "Over the following weeks the marks became lines, then shapes that looked like windows.",
    "The robot mixed colours in the lids of old paint tins and cleaned every lid afterwards.",
    "It measured the light from the skylights with its floor sensors and painted only at dawn.",
    "Its first finished picture showed the gallery itself, empty, with the benches in perfect rows.",
    "Visitors who saw it said it felt lonely, although nobody could say exactly why.",
    "The robot began to add people to its paintings, always seen from the height of a broom.",
    "A child asked whether the robot was happy, and the curator did not know what to answer.",
    "The director wanted to sell the paintings; the curator wanted to hang them in the east gallery.",
    "In the end they hung one painting, the river under the grey sky, next to the original.",
    "The robot still sweeps the floors, and it still stops in front of the river every night.",
]


def long_prompt(encode, target: int = LONG_TARGET_TOKENS) -> str:
    """A deterministic prompt of about ``target`` tokens (``encode(text)`` counts them): the
    notes numbered and cycled, as many as bring the count closest to ``target``."""
    text, i, prev = _LONG_INTRO, 0, None
    while (n := len(encode(text))) < target:
        prev = (target - n, text)
        text += f"Note {i + 1}: {_LONG_NOTES[i % len(_LONG_NOTES)]}\n"
        i += 1
    return prev[1] if prev is not None and prev[0] < n - target else text


def _matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _compare(ids: list[int], ref: list[int]) -> dict:
    """How ``ids`` (another side's greedy tokens) agree with yirage's ``ref``."""
    return {"matching_prefix": _matching_prefix(ids, ref), "of": len(ref), "equal": ids == ref}


def _median(xs):
    return statistics.median(xs)


def _summary(prompt_tokens: int, prefills: list[float], decodes: list[float], counts: list[int],
             text: str) -> dict:
    p = _median(prefills)
    return {"prompt_tokens": prompt_tokens, "prefill_s": p, "prefill_tokens_per_s": prompt_tokens / p,
            "decode_tokens_per_s": _median(decodes), "new_tokens": counts,
            "runs": {"prefill_s": [round(x, 4) for x in prefills],
                     "decode_tokens_per_s": [round(x, 1) for x in decodes]},
            "text": text[:80]}


class BusyCore:
    """A separate process spinning on one CPU (pinned to the last core this process may use)."""

    def __init__(self):
        self.core = max(os.sched_getaffinity(0))
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        code = f"import os\nos.sched_setaffinity(0, {{{self.core}}})\nwhile True:\n    pass\n"
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(0.3)  # let it start spinning
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        return False


# ---- the engines ----------------------------------------------------------------------------
# Each side: ``info`` (load times, settings), ``run(text, ids, n)`` -> (prefill_s, decode
# tokens/s, new token ids, text) for one greedy generation of at most n tokens, ``close()``.
def _llm_params() -> set[str]:
    return set(inspect.signature(yr.LLM).parameters)


def yirage_configs() -> dict[str, dict]:
    """The yr.LLM keyword sets to measure: both persistent modes if LLM takes ``persistent``."""
    if "persistent" in _llm_params():
        return {"persistent=True": {"persistent": True}, "persistent=False": {"persistent": False}}
    return {"default": {}}


def _thread_kwargs(threads: int) -> dict:
    params = _llm_params()
    for name in ("num_threads", "threads", "num_workers", "n_threads"):
        if name in params:
            return {name: threads}
    return {}


def _make_llm(model: str, threads: int, extra: dict):
    t0 = time.perf_counter()
    llm = yr.LLM(model, backend="cpu", max_seq_length=MAX_SEQ, **_thread_kwargs(threads), **extra)
    return llm, time.perf_counter() - t0


def _close(llm) -> None:
    close = getattr(llm, "close", None)
    if callable(close):
        close()
    del llm
    gc.collect()


class YirageSide:
    """yr.LLM(model, **extra) on the CPU. ``first`` is an (llm, seconds) pair already built in
    this process: its seconds are the first load, and it is the throwaway load before the two
    timed warm ones (the second is kept)."""

    def __init__(self, model: str, threads: int, extra: dict, first=None):
        first = first or _make_llm(model, threads, extra)
        _close(first[0])
        llm, warm1 = _make_llm(model, threads, extra)
        _close(llm)
        self.llm, warm2 = _make_llm(model, threads, extra)
        self.info = {"load": {"first_s": first[1], "warm_s": _median([warm1, warm2]),
                              "warm_runs_s": [warm1, warm2]},
                     "dtype": self.llm.dtype.value, "kwargs": {**_thread_kwargs(threads), **extra}}

    def run(self, text: str, ids: list[int], n: int):
        assert self.llm.encode_prompt(text) == ids, "yirage's prompt ids changed"
        r = self.llm.generate(text, max_new_tokens=n)
        assert r.prompt_tokens == len(ids)
        return r.prefill_s, r.decode_tokens_per_s, list(r.token_ids), r.text

    def close(self) -> None:
        _close(self.llm)


class LlamaCppSide:
    """llama.cpp through llama-cpp-python on the GGUF file: the prompt token ids are evaluated
    as given (no tokenization), then greedy tokens one per step; generation stops at
    ``eos_ids`` like yirage's. ImportError without llama-cpp-python."""

    def __init__(self, gguf_path: str, threads: int, eos_ids=frozenset()):
        import llama_cpp

        def make():
            t0 = time.perf_counter()
            llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=MAX_SEQ, n_threads=threads,
                                  n_threads_batch=threads, n_batch=MAX_SEQ, verbose=False)
            return llm, time.perf_counter() - t0

        llm, first_s = make()
        llm.close()
        llm, warm1 = make()
        llm.close()
        self.llm, warm2 = make()
        self.eos_ids = set(eos_ids)
        self.info = {"version": llama_cpp.__version__, "threads": threads, "n_ctx": MAX_SEQ,
                     "n_batch": self.llm.n_batch, "n_ubatch": self.llm.context_params.n_ubatch,
                     "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                     "load": {"first_s": first_s, "warm_s": _median([warm1, warm2]),
                              "warm_runs_s": [warm1, warm2]}}

    def run(self, text: str, ids: list[int], n: int):
        llm = self.llm
        llm.reset()  # n_tokens = 0: no prefix reuse from the previous run
        gen = llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
        t0 = time.perf_counter()
        toks: list[int] = []
        t_first = None
        for tok in gen:  # each next() evaluates the previous token and samples one (greedy)
            if t_first is None:
                t_first = time.perf_counter()
            if tok in self.eos_ids:
                break
            toks.append(int(tok))
            if len(toks) >= n:
                break
        end = time.perf_counter()
        gen.close()
        tps = (len(toks) - 1) / (end - t_first) if len(toks) > 1 else 0.0
        return t_first - t0, tps, toks, llm.detokenize(toks).decode("utf-8", "replace")

    def close(self) -> None:
        self.llm.close()


def measure(sides: dict, prompts: dict[str, tuple[str, list[int]]], tokens: int, runs: int,
            busy: bool = False) -> dict[str, tuple[dict, dict]]:
    """Every side on every prompt, ``runs`` times, the sides taking turns run by run (so that
    other load on a shared machine spreads over all of them); with ``busy``, one core is kept
    busy meanwhile. Returns {side: (summary, {prompt: greedy token ids of the first run})}."""
    first_text, first_ids = next(iter(prompts.values()))
    for side in sides.values():
        side.run(first_text, first_ids, 4)  # warm-up: first-call work outside the timings
    raw = {s: {p: [] for p in prompts} for s in sides}
    with BusyCore() if busy else contextlib.nullcontext():
        for pname, (text, ids) in prompts.items():
            for _ in range(runs):
                for sname, side in sides.items():
                    raw[sname][pname].append(side.run(text, ids, tokens))
    out = {}
    for sname, side in sides.items():
        summary, toks = dict(side.info), {}
        for pname, rs in raw[sname].items():
            summary[pname] = _summary(len(prompts[pname][1]), [r[0] for r in rs], [r[1] for r in rs],
                                      [len(r[2]) for r in rs], rs[0][3])
            summary[pname]["deterministic"] = all(r[2] == rs[0][2] for r in rs)
            toks[pname] = rs[0][2]
        out[sname] = (summary, toks)
    return out


def measure_busy(sides: dict, idle_side, prompts: dict[str, tuple[str, list[int]]], tokens: int,
                 runs: int) -> tuple[dict, dict[str, tuple[dict, dict]]]:
    """The busy scenario, run by run: ``idle_side`` (yirage with one worker) on the idle
    machine, then one core kept busy by another process (started for the run, given a
    32-token generation per side to settle) while every side of ``sides`` runs. Pairing the
    two in time keeps the machine's drift (a shared host) out of their ratio. Returns
    (idle summary, {side: (summary, {prompt: greedy token ids of the first run})})."""
    first_text, first_ids = next(iter(prompts.values()))
    for side in (idle_side, *sides.values()):
        side.run(first_text, first_ids, 4)
    idle_raw = {p: [] for p in prompts}
    raw = {s: {p: [] for p in prompts} for s in sides}
    for pname, (text, ids) in prompts.items():
        for _ in range(runs):
            idle_raw[pname].append(idle_side.run(text, ids, tokens))
            with BusyCore():
                for side in sides.values():
                    side.run(text, ids, 32)
                for sname, side in sides.items():
                    raw[sname][pname].append(side.run(text, ids, tokens))

    def summary(side, by_prompt):
        out, toks = dict(side.info), {}
        for pname, rs in by_prompt.items():
            out[pname] = _summary(len(prompts[pname][1]), [r[0] for r in rs], [r[1] for r in rs],
                                  [len(r[2]) for r in rs], rs[0][3])
            toks[pname] = rs[0][2]
        return out, toks

    return summary(idle_side, idle_raw)[0], {s: summary(side, raw[s]) for s, side in sides.items()}


def bench_llamacpp(gguf_path: str, prompt_ids: dict[str, list[int]], new_tokens: int, threads: int,
                   runs: int = 3, eos_ids=frozenset(), busy: bool = False) -> tuple[dict, dict]:
    """llama.cpp alone on the same GGUF and prompt token ids: load time (the Llama
    constructor), prefill (prompt eval plus the first greedy token) and decode per prompt.
    Returns the summary and {prompt: greedy token ids}; the summary is {"skipped": why}
    without llama-cpp-python."""
    try:
        side = LlamaCppSide(gguf_path, threads, eos_ids)
    except ImportError:
        return {"skipped": LLAMACPP_MISSING}, {}
    try:
        return measure({"llamacpp": side}, {k: ("", v) for k, v in prompt_ids.items()}, new_tokens, runs,
                       busy)["llamacpp"]
    finally:
        side.close()


LLAMACPP_MISSING = "llama-cpp-python not installed: make bench"


# ---- transformers ---------------------------------------------------------------------------
def bench_transformers(model: str, prompts: dict[str, list[int]], tokens: int, runs: int,
                       device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    from transformers import AutoModelForCausalLM

    loaded = load_model(model, progress=False)
    tok = loaded.tokenizer
    t0 = time.perf_counter()
    if loaded.format == "gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(loaded.path.parent), gguf_file=loaded.path.name,
                                                  dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=dtype)
    hf = hf.to(device).eval()
    out = {"dtype": str(dtype).removeprefix("torch."), "load": {"first_s": time.perf_counter() - t0}}
    tokens_out = {}
    kw = dict(do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        for name, ids_list in prompts.items():
            ids = torch.tensor([ids_list], device=device)
            hf.generate(ids, max_new_tokens=4, **kw)
            ttfts, tps, counts = [], [], []
            for _ in range(runs):
                t0 = time.perf_counter()
                hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
                ttft = time.perf_counter() - t0
                t0 = time.perf_counter()
                gen = hf.generate(ids, max_new_tokens=tokens, **kw)
                total = time.perf_counter() - t0
                n = gen.shape[1] - ids.shape[1]
                ttfts.append(ttft)
                tps.append((n - 1) / (total - ttft) if n > 1 else 0.0)
                counts.append(n)
            new = [t for t in gen[0, ids.shape[1]:].tolist() if t != tok.eos_token_id]
            out[name] = _summary(len(ids_list), ttfts, tps, counts,
                                 tok.decode(new, skip_special_tokens=True))
            tokens_out[name] = new
    return out, tokens_out


# ---- the run --------------------------------------------------------------------------------
def _ratios(y: dict, l: dict, names) -> dict:
    r = {}
    for name in names:
        if name in y and name in l:
            r[f"decode_{name}"] = y[name]["decode_tokens_per_s"] / l[name]["decode_tokens_per_s"]
            r[f"prefill_{name}"] = y[name]["prefill_tokens_per_s"] / l[name]["prefill_tokens_per_s"]
    r["load_warm (yirage s / llama.cpp s, lower is better)"] = y["load"]["warm_s"] / l["load"]["warm_s"]
    r["load_first (yirage s / llama.cpp s, lower is better)"] = y["load"]["first_s"] / l["load"]["first_s"]
    return r


def _targets(y: dict, ratios: dict | None) -> dict:
    """GitHub issue 7's targets on 2 cores (idle scenario)."""
    t = {"load_warm_s<=0.5": y["load"]["warm_s"] <= 0.5}
    if ratios:
        for key, goal in (("decode_short", 1.4), ("decode_long", 1.3), ("prefill_short", 1.0),
                          ("prefill_long", 1.0)):
            if key in ratios:
                t[f"{key}>={goal}x"] = ratios[key] >= goal
    return t


def build(args, prompt_names: list[str], gguf_path: str, default_only: bool = False):
    """The first yirage load, the prompts (yirage's ids), then every side: one YirageSide per
    config (only the first, yirage's default engine, with ``default_only``) and (unless
    skipped) a LlamaCppSide. Returns (prompts, sides, llama.cpp skip reason)."""
    configs = yirage_configs()
    if default_only:
        configs = dict([next(iter(configs.items()))])
    first_name, first_extra = next(iter(configs.items()))
    first = _make_llm(args.model, args.threads, first_extra)
    encode = first[0].encode_prompt
    prompts = {"short": (PROMPT, encode(PROMPT))}
    if "long" in prompt_names:
        text = long_prompt(encode)
        prompts["long"] = (text, encode(text))
    prompts = {k: v for k, v in prompts.items() if k in prompt_names}
    eos = set(first[0].eos_token_ids)
    sides = {name: YirageSide(args.model, args.threads, extra, first if name == first_name else None)
             for name, extra in configs.items()}
    skipped = "--no-llamacpp" if args.no_llamacpp else None
    if skipped is None:
        try:
            sides["llamacpp"] = LlamaCppSide(gguf_path, args.threads, eos)
        except ImportError:
            skipped = LLAMACPP_MISSING
    return prompts, sides, skipped


def busy_report(args, prompt_names: list[str], gguf_path: str, report: dict) -> None:
    """The busy scenario (issue 7's target: yirage with --threads threads and one core busy
    decodes at least as fast as yirage with one thread on the idle machine), measured in
    pairs by ``measure_busy``; prints the report. yirage runs its default engine only."""
    prompts, sides, skipped = build(args, prompt_names, gguf_path, default_only=True)
    name = next(iter(sides))
    idle_side = YirageSide(args.model, 1, yirage_configs()[name])   # one worker, idle machine
    report["prompts"] = {k: {"tokens": len(v[1])} for k, v in prompts.items()}
    report["busy_core"] = max(os.sched_getaffinity(0))
    try:
        idle, results = measure_busy(sides, idle_side, prompts, args.tokens, args.runs)
    finally:
        for side in (idle_side, *sides.values()):
            side.close()
    report["loadavg_after"] = os.getloadavg()[0]
    report["yirage_1thread_idle"] = {name: idle}
    report[f"yirage_{args.threads}threads_one_core_busy"] = {name: results[name][0]}
    report[f"llamacpp_{args.threads}threads_one_core_busy"] = (results["llamacpp"][0] if "llamacpp" in results
                                                                else {"skipped": skipped})
    cmp = {}
    for pname in prompts:
        busy_runs = results[name][0][pname]["runs"]["decode_tokens_per_s"]
        idle_runs = idle[pname]["runs"]["decode_tokens_per_s"]
        pairs = [b / a for a, b in zip(idle_runs, busy_runs) if a > 0]
        cmp[f"{name} {pname}"] = {"median_of_pairs": _median(pairs), "pairs": pairs}
    report["decode_busy_over_1thread_idle (target >= 1.0)"] = cmp
    print(json.dumps(report, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct",
                    help="a short name (yirage models), .gguf file or Hugging Face directory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--transformers-runs", type=int, default=1,
                    help="runs of the (slow) transformers reference (default 1)")
    ap.add_argument("--prompts", default=None,
                    help="comma-separated subset of short,long (default: both; busy scenario: short)")
    ap.add_argument("--scenario", choices=("idle", "busy"), default="idle")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers (slow)")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompt_names = (args.prompts or ("short" if args.scenario == "busy" else "short,long")).split(",")
    gguf = load_model(args.model, progress=False)
    if gguf.format != "gguf":
        args.no_llamacpp = True
    report = {"model": args.model, "gguf": str(gguf.path), "scenario": args.scenario, "threads": args.threads,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "max_new_tokens": args.tokens,
              "runs": args.runs, "transformers_runs": args.transformers_runs, "machine": platform.machine(),
              "cpus": len(os.sched_getaffinity(0)), "cpu": yr.get_backend_info("cpu").device_name,
              "loadavg_before": os.getloadavg()[0], "llm_params": sorted(_llm_params() - {"self"})}

    if args.scenario == "busy":
        busy_report(args, prompt_names, str(gguf.path), report)
        return

    prompts, sides, llama_skipped = build(args, prompt_names, str(gguf.path))
    report["prompts"] = {k: {"tokens": len(v[1])} for k, v in prompts.items()}
    try:
        results = measure(sides, prompts, args.tokens, args.runs)
    finally:
        for side in sides.values():
            side.close()
    ys = {k: v[0] for k, v in results.items() if k != "llamacpp"}
    ref_ids = next(v[1] for k, v in results.items() if k != "llamacpp")  # yirage's greedy tokens
    if "llamacpp" in results:
        l, lids = results["llamacpp"]
        for name in prompts:
            l[name]["vs_yirage_greedy_tokens"] = _compare(lids[name], ref_ids[name])
    else:
        l = {"skipped": llama_skipped}
    report["loadavg_after"] = os.getloadavg()[0]

    report["yirage"] = ys
    report["llamacpp"] = l
    if "skipped" not in l:
        report["ratios_yirage_over_llamacpp"] = {cfg: _ratios(y, l, prompts) for cfg, y in ys.items()}
    if args.no_transformers:
        report["transformers_eager"] = {"skipped": "--no-transformers"}
    else:
        t, tids = bench_transformers(args.model, {k: v[1] for k, v in prompts.items()}, args.tokens,
                                     args.transformers_runs)
        for name in prompts:
            t[name]["vs_yirage_greedy_tokens"] = _compare(tids[name], ref_ids[name])
        report["transformers_eager"] = t
        report["ratios_yirage_over_transformers"] = {
            cfg: {f"decode_{n}": y[n]["decode_tokens_per_s"] / t[n]["decode_tokens_per_s"] for n in prompts}
            | {f"prefill_{n}": y[n]["prefill_tokens_per_s"] / t[n]["prefill_tokens_per_s"] for n in prompts}
            for cfg, y in ys.items()}
    report["targets"] = {cfg: _targets(y, report.get("ratios_yirage_over_llamacpp", {}).get(cfg))
                         for cfg, y in ys.items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
