"""Decode and prefill speed and load time of yirage vs llama.cpp and Hugging Face transformers.

Prints one JSON object. All sides run the same model file (the GGUF behind --model), the
same prompt token ids (yirage's ``encode_prompt``: the chat template applied), the same
thread count and greedy decoding; each side generates --tokens new tokens (fewer if the
model emits EOS first: the counts are in the output); the median of --runs runs is reported
(--transformers-runs for transformers, the slow reference).

    python benchmarks/decode.py [-m smollm2-135m-instruct | gemma3-270m] [--threads=2] [--tokens 128]
                                [--runs 3] [--transformers-runs 1] [--no-transformers]
                                [--no-llamacpp] [--scenario idle|busy] [--prompts short,long]
                                [--timeout 600]

Two prompts: ``short`` (a one-line chat prompt, about 42 tokens) and ``long`` (a fixed,
deterministic set of notes in the chat template, about 790 tokens; the exact count is in
the output).

Measures, per side and prompt:
  - prefill_s: seconds from the start of the prompt to the first new token (time to first
    token: the prompt's forward pass plus the first greedy pick); prefill_tokens_per_s =
    prompt_tokens / prefill_s;
  - decode_tokens_per_s: tokens/s over the decode steps after the first new token;
  - load: the constructor's seconds (``yr.LLM(...)`` / ``llama_cpp.Llama(...)``): ``first_s``
    the first one of that side in its process (the first load after ``import yirage``),
    ``warm_s`` the median of the next two (disk and compile caches warm).

Every side (each yirage config, llama.cpp, transformers) runs in its own process
(``benchmarks/_sides.py``) with the same OMP_NUM_THREADS and torch thread count: a side that
crashes (llama.cpp's AMX kernels segfault on some Intel CPUs), hangs (``--timeout`` seconds
per generation) or fails is reported as such under its name, and the other sides' figures
still print. The sides are timed in interleaved rounds, one generation of every side per
round in an order rotated from round to round, so that other load on a shared machine hits
every side alike (transformers takes part in the first --transformers-runs rounds). The
ratios are medians of the ratios within each round (``yirage.runtime.timing.Comparison``).
The first yirage side tokenizes the prompts; the other sides get its token ids.

llama.cpp comes from llama-cpp-python (the optional ``bench`` extra: ``make bench`` installs it,
built for this CPU without its AMX kernels; it compiles llama.cpp for about 10 minutes).
Without it the llama.cpp sides are skipped. It runs twice: ``llamacpp`` with llama-cpp-python's
default (flash attention off) and ``llamacpp_flash_attn`` with flash attention on, the default of
llama.cpp's own tools (``-fa auto``); ``ratios_yirage_over_llamacpp_best`` takes each figure
against whichever of the two was faster there, and the targets use it.

``--scenario busy``: a separate process spins on one core (the last one this process may use)
while yirage (its default engine) and llama.cpp decode with --threads threads; run by run,
yirage with one worker on the idle machine runs just before, and the ratio of each such pair
is reported (their median is issue 7's busy-core figure).

If ``yr.LLM`` takes a ``persistent`` keyword, yirage is measured with persistent=True and
persistent=False (and, if it takes ``prefill_dtype``, persistent=True with bfloat16 prefill GEMMs;
if it takes ``decode_dtype``, persistent=True with int8 decode activations, llama.cpp's decode
numerics; if it takes ``kv_cache_dtype``, persistent=True with a float16 KV cache, llama.cpp's
default cache type, alone and with int8 decode activations: the greedy tokens of each may differ
from float32's); if it takes a thread-count keyword (num_threads, threads, num_workers), it
gets --threads. ``machine`` is ``yirage.runtime.machine.machine_record()``.
The machine may be shared with other jobs: figures are noisy; compare within one run.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _threads  # noqa: E402,F401  (sets OMP_NUM_THREADS from --threads before torch loads)
from _plot import add_plot_option, figure, save  # noqa: E402
from _sides import Sides, SideSpec, comparison  # noqa: E402

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


def _summary(prompt_tokens: int, prefills: list[float], decodes: list[float], counts: list[int],
             text: str) -> dict:
    p = statistics.median(prefills)
    return {"prompt_tokens": prompt_tokens, "prefill_s": p, "prefill_tokens_per_s": prompt_tokens / p,
            "decode_tokens_per_s": statistics.median(decodes), "new_tokens": counts,
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


# ---- the sides, each built in its own worker process ------------------------------------------
# A side: ``info`` (load times, settings) and ``sample(prompt, tokens)`` -> (figures, outputs)
# for one greedy generation of at most ``tokens`` new tokens after prompt ``prompt``.
def _sample(prefill_s: float, tps: float, ids: list[int], text: str) -> tuple[dict, dict]:
    return ({"prefill_s": prefill_s, "decode_tokens_per_s": tps, "new_tokens": len(ids),
             "decode_s_per_token": 1.0 / tps if tps > 0 else math.inf}, {"tokens": ids, "text": text})


def _llm_params() -> set[str]:
    import yirage as yr

    return set(inspect.signature(yr.LLM).parameters)


def yirage_configs() -> dict[str, dict]:
    """The yr.LLM keyword sets to measure: both persistent modes if LLM takes ``persistent``, and
    the persistent one with bfloat16 prefill GEMMs if it takes ``prefill_dtype``, with int8
    decode activations if it takes ``decode_dtype``, with a float16 KV cache if it takes
    ``kv_cache_dtype``, and with both of the last two (llama.cpp's numerics)."""
    params = _llm_params()
    if "persistent" not in params:
        return {"default": {}}
    configs = {"persistent=True": {"persistent": True}, "persistent=False": {"persistent": False}}
    if "prefill_dtype" in params:
        configs["persistent=True prefill_dtype=bfloat16"] = {"persistent": True, "prefill_dtype": "bfloat16"}
    if "decode_dtype" in params:   # llama.cpp's decode numerics (int8 activations)
        configs["persistent=True decode_dtype=int8"] = {"persistent": True, "decode_dtype": "int8"}
    if "kv_cache_dtype" in params:   # llama.cpp's default cache type (float16 keys and values)
        configs["persistent=True kv_cache_dtype=float16"] = {"persistent": True, "kv_cache_dtype": "float16"}
        if "decode_dtype" in params:   # both: llama.cpp's numerics
            configs["persistent=True decode_dtype=int8 kv_cache_dtype=float16"] = {
                "persistent": True, "decode_dtype": "int8", "kv_cache_dtype": "float16"}
    return configs


def _thread_kwargs(threads: int) -> dict:
    params = _llm_params()
    for name in ("num_threads", "threads", "num_workers", "n_threads"):
        if name in params:
            return {name: threads}
    return {}


def _make_llm(model: str, threads: int, extra: dict):
    import yirage as yr

    t0 = time.perf_counter()
    llm = yr.LLM(model, backend="cpu", max_seq_length=MAX_SEQ, **_thread_kwargs(threads), **extra)
    return llm, time.perf_counter() - t0


def _close(llm) -> None:
    close = getattr(llm, "close", None)
    if callable(close):
        close()
    del llm
    gc.collect()


def make_prompts(encode, names: list[str]) -> dict[str, tuple[str, list[int]]]:
    """{prompt name: (text, token ids)} of ``names`` (short, long), ``encode`` giving the ids."""
    prompts = {"short": (PROMPT, encode(PROMPT))}
    if "long" in names:
        text = long_prompt(encode)
        prompts["long"] = (text, encode(text))
    return {k: v for k, v in prompts.items() if k in names}


class YirageSide:
    """yr.LLM(model, **extra) on the CPU: a first load (this process's first), then two timed
    warm ones (the second is kept). ``prompts`` None: this side tokenizes ``prompt_names`` and
    puts them (and the EOS ids) in its info for the other sides; otherwise it checks that it
    encodes every prompt text to the same ids."""

    def __init__(self, model: str, threads: int, extra: dict, prompts: dict | None = None,
                 prompt_names: tuple[str, ...] = ("short", "long")):
        first = _make_llm(model, threads, extra)
        _close(first[0])
        llm, warm1 = _make_llm(model, threads, extra)
        _close(llm)
        self.llm, warm2 = _make_llm(model, threads, extra)
        self.info = {"load": {"first_s": first[1], "warm_s": statistics.median([warm1, warm2]),
                              "warm_runs_s": [warm1, warm2]},
                     "dtype": self.llm.dtype.value, "kwargs": {**_thread_kwargs(threads), **extra}}
        if prompts is None:
            prompts = make_prompts(self.llm.encode_prompt, list(prompt_names))
            self.info.update(prompts=prompts, eos_token_ids=sorted(self.llm.eos_token_ids))
        for name, (text, ids) in prompts.items():
            if self.llm.encode_prompt(text) != list(ids):
                raise AssertionError(f"{extra}: yirage's ids of prompt {name!r} differ from the first side's")
        self.prompts = prompts
        self.sample(next(iter(prompts)), 4)  # warm-up: first-call work outside the timings

    def sample(self, prompt: str, tokens: int):
        text, ids = self.prompts[prompt]
        r = self.llm.generate(text, max_new_tokens=tokens)
        assert r.prompt_tokens == len(ids)
        return _sample(r.prefill_s, r.decode_tokens_per_s, list(r.token_ids), r.text)

    def close(self) -> None:
        _close(self.llm)


class LlamaCppSide:
    """llama.cpp through llama-cpp-python on the GGUF file: the prompt token ids are evaluated
    as given (no tokenization), then greedy tokens one per step; generation stops at
    ``eos_ids`` like yirage's. Load: a first, then two timed warm ones (the second is kept)."""

    def __init__(self, gguf_path: str, threads: int, prompts: dict[str, list[int]], eos_ids=(),
                 flash_attn: bool = False):
        import llama_cpp

        def make():
            t0 = time.perf_counter()
            llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=MAX_SEQ, n_threads=threads,
                                  n_threads_batch=threads, n_batch=MAX_SEQ, verbose=False, flash_attn=flash_attn)
            return llm, time.perf_counter() - t0

        llm, first_s = make()
        llm.close()
        llm, warm1 = make()
        llm.close()
        self.llm, warm2 = make()
        self.eos_ids = set(eos_ids)
        self.prompts = prompts
        self.info = {"version": llama_cpp.__version__, "threads": threads, "n_ctx": MAX_SEQ, "flash_attn": flash_attn,
                     "n_batch": self.llm.n_batch, "n_ubatch": self.llm.context_params.n_ubatch,
                     "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                     "load": {"first_s": first_s, "warm_s": statistics.median([warm1, warm2]),
                              "warm_runs_s": [warm1, warm2]}}
        self.sample(next(iter(prompts)), 4)  # warm-up

    def sample(self, prompt: str, tokens: int):
        llm = self.llm
        llm.reset()  # n_tokens = 0: no prefix reuse from the previous run
        gen = llm.generate(self.prompts[prompt], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                           reset=True)
        t0 = time.perf_counter()
        toks: list[int] = []
        t_first = None
        for tok in gen:  # each next() evaluates the previous token and samples one (greedy)
            if t_first is None:
                t_first = time.perf_counter()
            if tok in self.eos_ids:
                break
            toks.append(int(tok))
            if len(toks) >= tokens:
                break
        end = time.perf_counter()
        gen.close()
        tps = (len(toks) - 1) / (end - t_first) if len(toks) > 1 else 0.0
        return _sample(t_first - t0, tps, toks, llm.detokenize(toks).decode("utf-8", "replace"))

    def close(self) -> None:
        self.llm.close()


class TransformersSide:
    """Hugging Face transformers (eager) on the same model file (GGUF dequantized by
    transformers), in ``dtype`` on ``device``: time to first token from a one-token
    ``generate``, decode tokens/s from a full one; EOS tokens dropped from the ids."""

    def __init__(self, model: str, prompts: dict[str, list[int]], device: str = "cpu", dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM

        from yirage.models.loading import load_model

        loaded = load_model(model, progress=False)
        self.tok = loaded.tokenizer
        t0 = time.perf_counter()
        if loaded.format == "gguf":
            hf = AutoModelForCausalLM.from_pretrained(str(loaded.path.parent), gguf_file=loaded.path.name,
                                                      dtype=getattr(torch, dtype))
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=getattr(torch, dtype))
        self.hf = hf.to(device).eval()
        self.info = {"dtype": dtype, "load": {"first_s": time.perf_counter() - t0}}
        self.ids = {name: torch.tensor([ids], device=device) for name, ids in prompts.items()}
        self.kw = dict(do_sample=False, pad_token_id=self.tok.eos_token_id)
        with torch.inference_mode():
            for ids in self.ids.values():
                self.hf.generate(ids, max_new_tokens=4, **self.kw)  # warm-up

    def sample(self, prompt: str, tokens: int):
        import torch

        ids = self.ids[prompt]
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **self.kw)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            gen = self.hf.generate(ids, max_new_tokens=tokens, **self.kw)
            total = time.perf_counter() - t0
        n = gen.shape[1] - ids.shape[1]
        new = [t for t in gen[0, ids.shape[1]:].tolist() if t != self.tok.eos_token_id]
        figures, out = _sample(ttft, (n - 1) / (total - ttft) if n > 1 else 0.0, new,
                               self.tok.decode(new, skip_special_tokens=True))
        figures["new_tokens"] = n
        return figures, out


def bench_transformers(model: str, prompts: dict[str, list[int]], tokens: int, runs: int,
                       device: str = "cpu", dtype: str = "float32") -> tuple[dict, dict]:
    """TransformersSide in this process, ``runs`` generations per prompt: (summary with each
    prompt's ``_summary``, {prompt: greedy token ids of the first run})."""
    side = TransformersSide(model, prompts, device, dtype)
    rounds = {p: [{"t": side.sample(p, tokens)} for _ in range(runs)] for p in prompts}
    out, toks = dict(side.info), {}
    for p, rs in rounds.items():
        out[p], toks[p] = summarize(rs, "t", len(prompts[p]))
    return out, toks


# ---- the parent: statistics and the report ------------------------------------------------
def summarize(rounds: list[dict], side: str, prompt_tokens: int) -> tuple[dict, list[int]] | tuple[None, None]:
    """``side``'s figures over the rounds it answered in (``_summary`` plus whether its greedy
    tokens were the same every run) and its first run's tokens; (None, None) if none."""
    rs = [r[side] for r in rounds if side in r]
    if not rs:
        return None, None
    figs, outs = [f for f, _ in rs], [o for _, o in rs]
    summary = _summary(prompt_tokens, [f["prefill_s"] for f in figs], [f["decode_tokens_per_s"] for f in figs],
                       [f["new_tokens"] for f in figs], outs[0]["text"])
    summary["deterministic"] = all(o["tokens"] == outs[0]["tokens"] for o in outs)
    return summary, outs[0]["tokens"]


def side_entry(sides: Sides, rounds: dict[str, list[dict]], prompts: dict | None, side: str):
    """(``side``'s JSON entry, {prompt: its greedy tokens}): its info and per-prompt summaries
    if it answered on every prompt and never failed; else (its failure report, or "not run";
    None)."""
    per = {p: summarize(rs, side, len(prompts[p][1])) for p, rs in rounds.items()}
    if side in sides.failures or not per or not all(v[0] for v in per.values()):
        return (sides.report(side) if side in sides.failures else {"status": "not run"}), None
    return sides.report(side, {p: v[0] for p, v in per.items()}), {p: v[1] for p, v in per.items()}


def paired_ratios(rounds: dict[str, list[dict]], side: str, peer: str) -> dict:
    """Per prompt, ``side``'s decode and prefill speed over ``peer``'s: the median of the
    ratios within the rounds both answered in (absent where they share no round)."""
    r = {}
    for prompt, rs in rounds.items():
        for metric, key in (("decode_s_per_token", "decode"), ("prefill_s", "prefill")):
            cmp = comparison(rs, metric, [side, peer])
            if cmp is not None:
                r[f"{key}_{prompt}"] = cmp.ratio(peer, side)
    return r


def _load_ratios(y: dict, l: dict) -> dict:
    return {"load_warm (yirage s / llama.cpp s, lower is better)": y["load"]["warm_s"] / l["load"]["warm_s"],
            "load_first (yirage s / llama.cpp s, lower is better)": y["load"]["first_s"] / l["load"]["first_s"]}


def _targets(y: dict, ratios: dict | None) -> dict:
    """GitHub issue 7's targets on 2 cores (idle scenario)."""
    t = {"load_warm_s<=0.5": y["load"]["warm_s"] <= 0.5}
    if ratios:
        for key, goal in (("decode_short", 1.4), ("decode_long", 1.3), ("prefill_short", 1.0),
                          ("prefill_long", 1.0)):
            if key in ratios:
                t[f"{key}>={goal}x"] = ratios[key] >= goal
    return t


#: llama.cpp's sides: llama-cpp-python's default (flash attention off) and with flash attention,
#: the default of llama.cpp's own tools (llama-cli, llama-server: -fa auto)
LLAMACPP_SIDES = {"llamacpp": False, "llamacpp_flash_attn": True}


def start_sides(sides: Sides, args, gguf_path: str, configs: dict[str, dict], with_transformers: bool,
                llamacpp_sides: tuple[str, ...] = tuple(LLAMACPP_SIDES)):
    """Start the yirage configs (the first one tokenizes the prompts), llama.cpp (``llamacpp_sides``
    of ``LLAMACPP_SIDES``) and transformers; returns the prompts {name: (text, ids)}, or None if
    no yirage side started (then nothing else can run: the prompts are yirage's)."""
    prompts, eos = None, []
    for name, extra in configs.items():
        kw = {"model": args.model, "threads": args.threads, "extra": extra}
        kw.update({"prompts": prompts} if prompts else {"prompt_names": tuple(args.prompt_names)})
        if sides.start(name, SideSpec("decode:YirageSide", kw, threads=args.threads)) and prompts is None:
            info = sides.info[name]
            prompts = {k: tuple(v) for k, v in info.pop("prompts").items()}
            eos = info.pop("eos_token_ids")
    if prompts is None:
        return None
    ids = {k: list(v[1]) for k, v in prompts.items()}
    for name in llamacpp_sides:
        if args.no_llamacpp:
            sides.skip(name, "--no-llamacpp" if args.gguf_format == "gguf" else "the model is not a GGUF file")
        elif importlib.util.find_spec("llama_cpp") is None:
            sides.skip(name, LLAMACPP_MISSING)
        else:
            sides.start(name, SideSpec("decode:LlamaCppSide", {"gguf_path": gguf_path, "threads": args.threads,
                                                                "prompts": ids, "eos_ids": eos,
                                                                "flash_attn": LLAMACPP_SIDES[name]},
                                       threads=args.threads))
    if not with_transformers:
        sides.skip("transformers", "--no-transformers")
    else:
        sides.start("transformers", SideSpec("decode:TransformersSide", {"model": args.model, "prompts": ids},
                                             threads=args.threads))
    return prompts


LLAMACPP_MISSING = "llama-cpp-python not installed: make bench"


def idle_report(args, gguf_path: str, report: dict) -> None:
    """Every side on every prompt, ``--runs`` interleaved rounds per prompt; fills ``report``."""
    configs = yirage_configs()
    with Sides(timeout_s=args.timeout) as sides:
        prompts = start_sides(sides, args, gguf_path, configs, not args.no_transformers)
        rounds = {}
        for pname in prompts or {}:
            rounds[pname] = sides.rounds(args.runs, {"prompt": pname, "tokens": args.tokens},
                                         limit={"transformers": args.transformers_runs})
    report["prompts"] = {k: {"tokens": len(v[1])} for k, v in (prompts or {}).items()}
    report["loadavg_after"] = os.getloadavg()[0]
    figures, tokens = {}, {}
    for side in [*configs, *LLAMACPP_SIDES, "transformers"]:
        figures[side], toks = side_entry(sides, rounds, prompts, side)
        if toks is not None:
            tokens[side] = toks
    ys = {c: figures[c] for c in configs}
    ref = next((tokens[c] for c in configs if c in tokens), None)  # yirage's greedy tokens
    for peer in (*LLAMACPP_SIDES, "transformers"):
        if peer in tokens and ref is not None:
            for p in prompts:
                figures[peer][p]["vs_yirage_greedy_tokens"] = _compare(tokens[peer][p], ref[p])
    report["yirage"] = ys
    for peer in LLAMACPP_SIDES:
        report[peer] = figures[peer]
    report["transformers_eager"] = figures["transformers"]
    ok = [c for c in configs if c in tokens]
    for peer in LLAMACPP_SIDES:
        if peer in tokens:
            report[f"ratios_yirage_over_{peer}"] = {
                c: paired_ratios(rounds, c, peer) | _load_ratios(ys[c], figures[peer]) for c in ok}
    both = [report.get(f"ratios_yirage_over_{peer}") for peer in LLAMACPP_SIDES]
    if all(both):   # each figure against whichever llama.cpp config was faster there (the smaller ratio)
        report["ratios_yirage_over_llamacpp_best"] = {
            c: {k: min(r[c][k] for r in both) for k in both[0][c] if k.startswith(("decode", "prefill"))}
            for c in ok}
    if "transformers" in tokens:
        report["ratios_yirage_over_transformers"] = {c: paired_ratios(rounds, c, "transformers") for c in ok}
    best = report.get("ratios_yirage_over_llamacpp_best") or report.get("ratios_yirage_over_llamacpp", {})
    report["targets"] = {c: _targets(ys[c], best.get(c)) for c in ok}


def busy_report(args, gguf_path: str, report: dict) -> None:
    """The busy scenario (issue 7's target: yirage with --threads threads and one core busy
    decodes at least as fast as yirage with one thread on the idle machine), run by run: yirage
    with one worker on the idle machine, then one core kept busy by another process (started for
    the run, given a 32-token generation per side to settle) while yirage's default engine and
    llama.cpp run. Pairing the two in time keeps the machine's drift (a shared host) out of their
    ratio. Fills ``report``."""
    name, extra = next(iter(yirage_configs().items()))
    idle = "yirage_1thread_idle"
    with Sides(timeout_s=args.timeout) as sides:
        prompts = start_sides(sides, args, gguf_path, {name: extra}, with_transformers=False,
                              llamacpp_sides=("llamacpp",))
        if prompts is not None:
            sides.start(idle, SideSpec("decode:YirageSide", {"model": args.model, "threads": 1, "extra": extra,
                                                             "prompts": prompts}, threads=1))
        rounds = {}
        for pname in prompts or {}:
            rounds[pname] = []
            for _ in range(args.runs):
                got = {idle: sides.sample(idle, {"prompt": pname, "tokens": args.tokens})}
                with BusyCore():
                    for s in (name, "llamacpp"):
                        sides.sample(s, {"prompt": pname, "tokens": 32})
                    got |= {s: sides.sample(s, {"prompt": pname, "tokens": args.tokens}) for s in (name, "llamacpp")}
                rounds[pname].append({k: v for k, v in got.items() if v is not None})
    report["prompts"] = {k: {"tokens": len(v[1])} for k, v in (prompts or {}).items()}
    report["busy_core"] = max(os.sched_getaffinity(0))
    report["loadavg_after"] = os.getloadavg()[0]

    report["yirage_1thread_idle"] = {name: side_entry(sides, rounds, prompts, idle)[0]}
    report[f"yirage_{args.threads}threads_one_core_busy"] = {name: side_entry(sides, rounds, prompts, name)[0]}
    report[f"llamacpp_{args.threads}threads_one_core_busy"] = side_entry(sides, rounds, prompts, "llamacpp")[0]
    cmp = {}
    for pname, rs in rounds.items():
        c = comparison(rs, "decode_s_per_token", [idle, name])
        if c is not None:   # idle s/token over busy s/token: busy tokens/s over idle tokens/s
            cmp[f"{name} {pname}"] = {"median_of_pairs": c.ratio(idle, name), "pairs": c.ratios(idle, name)}
    report["decode_busy_over_1thread_idle (target >= 1.0)"] = cmp


def parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a side may take per generation")
    add_plot_option(ap)
    return ap


def main() -> None:
    args = parser().parse_args()
    args.prompt_names = (args.prompts or ("short" if args.scenario == "busy" else "short,long")).split(",")

    from yirage.models.loading import load_model
    from yirage.runtime.machine import machine_record

    gguf = load_model(args.model, progress=False)
    args.gguf_format = gguf.format
    if gguf.format != "gguf":
        args.no_llamacpp = True
    report = {"model": args.model, "gguf": str(gguf.path), "scenario": args.scenario, "threads": args.threads,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "max_new_tokens": args.tokens,
              "runs": args.runs, "transformers_runs": args.transformers_runs,
              "machine": machine_record(args.threads), "loadavg_before": os.getloadavg()[0],
              "llm_params": sorted(_llm_params() - {"self"})}
    (busy_report if args.scenario == "busy" else idle_report)(args, str(gguf.path), report)
    print(json.dumps(report, indent=2))
    if args.plot:
        save(plot_figure(report), args.plot)


#: the short names of yirage's configurations in a figure
CONFIG_LABELS = {"persistent=True": "float32", "persistent=False": "float32, launch per op",
                 "persistent=True prefill_dtype=bfloat16": "bf16 prefill", "persistent=True decode_dtype=int8": "int8 decode",
                 "persistent=True kv_cache_dtype=float16": "fp16 KV cache",
                 "persistent=True decode_dtype=int8 kv_cache_dtype=float16": "int8 decode + fp16 KV", "default": "default"}


def plot_figure(report: dict) -> dict | None:
    """The figure of an idle run (``benchmarks/_plot.py``): decode and prefill, per prompt, of each
    yirage configuration over llama.cpp (the faster of its two configurations at each figure when
    both ran), and of the first configuration over transformers. None for the busy scenario."""
    if report.get("scenario") != "idle":
        return None
    tokens = {p: v["tokens"] for p, v in report.get("prompts", {}).items()}
    best = report.get("ratios_yirage_over_llamacpp_best")
    llama = ("llama.cpp (best of flash attention on/off)", best) if best else \
        ("llama.cpp", report.get("ratios_yirage_over_llamacpp"))
    bars = []
    for peer, ratios in (llama, ("transformers", report.get("ratios_yirage_over_transformers"))):
        for i, (config, r) in enumerate((ratios or {}).items()):
            if peer == "transformers" and i > 0:
                break
            for key, value in r.items():
                kind, _, prompt = key.partition("_")
                if kind in ("decode", "prefill") and prompt in tokens:
                    bars.append({"group": f"{kind}, {tokens[prompt]}-token prompt",
                                 "series": f"{CONFIG_LABELS.get(config, config)} vs {peer}", "ratio": value})
    return figure("decode", f"{report['model']}: yirage decode and prefill tokens/s over each peer's, "
                            f"{report['max_new_tokens']} new tokens", report["machine"], bars,
                  ylabel="yirage tokens/s / the peer's (x; higher: yirage faster)") if bars else None


if __name__ == "__main__":
    main()
