"""Embedding throughput: yirage float32, bfloat16 and int8 vs sentence-transformers (and ONNX Runtime if importable).

Prints one JSON object: sentences/s of each side on the same 512 sentences (a fixed,
deterministic mix of short and medium English sentences, 5 to about 60 tokens), the same
thread count (OMP_NUM_THREADS and ``torch.set_num_threads`` in each side's process; ONNX
Runtime's ``intra_op_num_threads``), the same batch size. Every side runs in its own process
(``benchmarks/_sides.py``): a side that crashes, hangs (``--timeout``) or fails is reported
as such under its name and the other sides' figures still print. Each side loads its model
and encodes the sentences once to warm up (which also compiles yirage's plans), then the
sides take ``--rounds`` turns, one timed encode of all the sentences each per round, in an
order rotated from round to round, so that a burst of load from another process hits every
side alike. ``seconds`` is a side's median (every round's time is in ``all_seconds``,
its fastest in ``best_seconds``); ``speedup_A_vs_B`` is the median over the rounds of B's
time / A's time in the same round (``yirage.runtime.timing.Comparison``). Also: the largest
difference of yirage float32's vectors from sentence-transformers' (and ONNX Runtime's), and
the cosine of every other yirage side's vectors to yirage float32's (min and mean).

    python benchmarks/embed.py [-m all-minilm-l6-v2] [--threads 2] [--batch-size 32] [--n 512] [--rounds 5]
                               [--timeout 600] [--cold]

A process's first encode (``warmup_s``: its plans built, its kernels chosen) is reported too,
as ``speedup_<side>_first_encode_vs_sentence_transformers_warm``; with ``--cold`` yirage's sides
start from an empty cache that holds only what ``make setup`` leaves there (a user's very first
process).

ONNX Runtime runs the same model exported with ``torch.onnx.export`` (mean pooling and the
Normalize module in numpy; ``pip install onnxruntime onnx``, or ``make bench``); it is
reported as skipped when onnxruntime is not installed, as failed when the export fails.
``machine`` is ``yirage.runtime.machine.machine_record()``.
The machine may be shared with other jobs: figures are noisy; compare within one run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _threads  # noqa: E402,F401  (sets OMP_NUM_THREADS from --threads before torch loads)
from _plot import add_plot_option, figure, save  # noqa: E402
from _sides import Sides, SideSpec, comparison  # noqa: E402

import numpy as np  # noqa: E402

#: The sides, in turn order: name -> (side class of this module, its keyword arguments). A
#: yirage variant is one line: its ``yr.EmbeddingModel`` keyword arguments (every yirage_*
#: side gets the speedups and its cosine to yirage_float32 in the JSON).
SIDES: dict[str, tuple[str, dict]] = {
    "yirage_float32": ("YirageSide", {}),
    "yirage_int8": ("YirageSide", {"quantization": "int8"}),
    "yirage_bfloat16": ("YirageSide", {"dtype": "bfloat16"}),
    "sentence_transformers": ("SentenceTransformersSide", {}),
    "onnxruntime": ("OnnxRuntimeSide", {}),
}
#: a side that needs a package which may be missing: the side is skipped without it
REQUIRES = {"sentence_transformers": "sentence_transformers", "onnxruntime": "onnxruntime"}
BASELINE, REFERENCE = "sentence_transformers", "yirage_float32"

_SUBJECTS = ["The committee", "A small dog", "Our new compiler", "The weather in Paris", "My neighbour's cat",
             "This quarterly report", "The train to Berlin", "An old lighthouse", "The research team",
             "A cup of green tea", "The city council", "Every embedding model"]
_VERBS = ["announced", "ignored", "measured", "described", "improved", "delayed", "explained", "questioned"]
_OBJECTS = ["the results of the experiment", "a plan for the coming winter", "the price of electricity",
            "how the network handles long sentences", "the history of the old harbour",
            "several unexpected problems with the schedule", "the weekly meeting",
            "a faster way to compute sentence embeddings on ordinary CPUs"]
_TAILS = ["", " yesterday.", " after a long discussion with everyone involved.", " in great detail.",
          " because nobody else wanted to, and then they went home early to rest before the next day.",
          " while the rain kept falling on the quiet streets of the town."]


def sentences(n: int) -> list[str]:
    """``n`` deterministic English sentences of varied length."""
    out = []
    for i in range(n):
        s = f"{_SUBJECTS[i % 12]} {_VERBS[(i * 7) % 8]} {_OBJECTS[(i * 5) % 8]}{_TAILS[(i * 11) % 6]}"
        out.append(s if s.endswith(".") else s + ".")
    return out


class _EncodeSide:
    """A side in its worker: the subclass sets ``self.encode(texts) -> float32 [n, dim]`` and
    ``self.info``; the ``n`` sentences are encoded once to warm up; ``sample()`` times one
    encode of all of them (seconds) and returns the vectors."""

    def __init__(self, n: int):
        self.texts = sentences(n)
        t0 = time.perf_counter()
        self.encode(self.texts)
        self.info["warmup_s"] = time.perf_counter() - t0

    def sample(self) -> tuple[dict, np.ndarray]:
        t0 = time.perf_counter()
        v = self.encode(self.texts)
        return {"seconds": time.perf_counter() - t0}, np.asarray(v, dtype=np.float32)


class YirageSide(_EncodeSide):
    """``yr.EmbeddingModel(model, backend="cpu", **kwargs)``; info: load seconds, kwargs, the
    sentences' mean token count, compiled plans after the warm-up."""

    def __init__(self, model: str, n: int, batch_size: int, **kwargs):
        import yirage as yr

        t0 = time.perf_counter()
        m = yr.EmbeddingModel(model, backend="cpu", **kwargs)
        self.info = {"load_s": time.perf_counter() - t0, "kwargs": kwargs,
                     "mean_tokens": float(np.mean([len(x) for x in m.tokenizer(sentences(n))["input_ids"]]))}
        self.encode = lambda x: m.encode(x, batch_size=batch_size)
        super().__init__(n)
        self.info["plans"] = len(m._plans)


class SentenceTransformersSide(_EncodeSide):
    """``SentenceTransformer(path, device="cpu").encode``: the reference."""

    def __init__(self, path: str, n: int, batch_size: int):
        import sentence_transformers

        t0 = time.perf_counter()
        st = sentence_transformers.SentenceTransformer(path, device="cpu")
        self.info = {"load_s": time.perf_counter() - t0, "version": sentence_transformers.__version__}
        self.encode = lambda x: st.encode(x, batch_size=batch_size, convert_to_numpy=True)
        super().__init__(n)


class OnnxRuntimeSide(_EncodeSide):
    """The transformers model exported with ``torch.onnx.export`` (opset 17, dynamic batch and
    sequence), run by an ONNX Runtime CPU session of ``threads`` intra-op threads, sentences
    sorted by length into batches; mean pooling and the Normalize module in numpy."""

    def __init__(self, path: str, n: int, batch_size: int, threads: int):
        import onnxruntime as ort

        t0 = time.perf_counter()
        self.tok, self.hidden, f = _export_onnx(path)
        self.export_dir = os.path.dirname(f)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        self.sess = ort.InferenceSession(f, opts, providers=["CPUExecutionProvider"])
        self.batch_size = batch_size
        from yirage.models.bert import read_sentence_transformer
        self.normalize = read_sentence_transformer(path).normalize
        self.info = {"load_s": time.perf_counter() - t0, "version": ort.__version__}
        super().__init__(n)

    def encode(self, texts: list[str]) -> np.ndarray:
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = np.empty((len(texts), self.hidden), dtype=np.float32)
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            enc = self.tok([texts[i] for i in idx], padding=True, truncation=True, max_length=256,
                           return_tensors="np")
            h = self.sess.run(None, {"input_ids": enc["input_ids"].astype(np.int64),
                                     "attention_mask": enc["attention_mask"].astype(np.int64)})[0]
            m = enc["attention_mask"][..., None].astype(np.float32)
            out[idx] = (h * m).sum(1) / np.clip(m.sum(1), 1e-9, None)
        if self.normalize:   # the model's Normalize module, as sentence-transformers applies it
            out /= np.clip(np.linalg.norm(out, axis=1, keepdims=True), 1e-12, None)
        return out

    def close(self) -> None:
        """Delete the exported model's temporary directory."""
        import shutil

        shutil.rmtree(self.export_dir, ignore_errors=True)


def _export_onnx(path: str):
    """(tokenizer, hidden size, path of the exported model.onnx) of the transformers model at ``path``."""
    import tempfile

    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()

    class Encoder(torch.nn.Module):  # keyword arguments: BertModel's positional order changes
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    f = os.path.join(tempfile.mkdtemp(), "model.onnx")
    dummy = tok(["a b c"], return_tensors="pt")
    torch.onnx.export(Encoder(model), (dummy["input_ids"], dummy["attention_mask"]), f,
                      input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                      dynamic_axes={"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"},
                                    "last_hidden_state": {0: "b", 1: "s"}}, opset_version=17, dynamo=False)
    return tok, model.config.hidden_size, f


# ---- the parent: start the sides, take the rounds, compare ----------------------------------
def side_spec(name: str, args, path: str) -> SideSpec:
    """The worker spec of side ``name`` of SIDES for these arguments."""
    cls, kwargs = SIDES[name]
    common = {"n": args.n, "batch_size": args.batch_size}
    if cls == "YirageSide":
        kwargs = {"model": args.model, **common, **kwargs}
    elif cls == "OnnxRuntimeSide":
        kwargs = {"path": path, **common, "threads": args.threads, **kwargs}
    else:
        kwargs = {"path": path, **common, **kwargs}
    return SideSpec(f"embed:{cls}", kwargs, threads=args.threads)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def report(sides: Sides, rounds: list[dict], n: int) -> dict:
    """Each side's entry (figures or failure) and the cross-side figures of the sides that ran."""
    out: dict = {}
    vectors = {}
    for name in SIDES:
        ts = [r[name][0]["seconds"] for r in rounds if name in r]
        if name in sides.failures or not ts:
            out[name] = sides.report(name)
            continue
        med = float(np.median(ts))
        out[name] = sides.report(name, {"seconds": med, "sentences_per_s": n / med, "best_seconds": min(ts),
                                        "all_seconds": ts})
        vectors[name] = next(r[name][1] for r in rounds if name in r)
    for name in (k for k in vectors if k.startswith("yirage_")):
        for peer in (BASELINE, "onnxruntime"):
            cmp = comparison(rounds, "seconds", [name, peer]) if peer in vectors else None
            if cmp is not None:
                out[f"speedup_{name}_vs_{peer}"] = cmp.ratio(peer, name)
        if name != REFERENCE and REFERENCE in vectors:
            cos = _cosines(vectors[REFERENCE], vectors[name])
            out[name].update(cosine_to_float32_min=float(cos.min()), cosine_to_float32_mean=float(cos.mean()))
    if BASELINE in vectors:   # a process's first encode (its plans built, kernels chosen) against the reference warm
        for name in (k for k in vectors if k.startswith("yirage_")):
            first = sides.info.get(name, {}).get("warmup_s")
            if first:
                out[f"speedup_{name}_first_encode_vs_{BASELINE}_warm"] = out[BASELINE]["seconds"] / first
        if REFERENCE in vectors:
            out["max_abs_diff_vs_sentence_transformers"] = float(np.abs(vectors[REFERENCE] - vectors[BASELINE]).max())
        if "onnxruntime" in vectors:
            out["onnxruntime"]["max_abs_diff_vs_sentence_transformers"] = float(
                np.abs(vectors["onnxruntime"] - vectors[BASELINE]).max())
    return out


def cold_cache(threads: int) -> str:
    """Point YIRAGE_CACHE_DIR (for the sides' processes too) at a new, empty directory and run the
    set-up's cache steps there (``make setup``'s ``python -m yirage.runtime.toolchain`` and ``python
    -m yirage.tools.warmup``), with no other machine profile: what a user's very first process
    finds. Returns the directory."""
    import subprocess
    import tempfile

    cache = tempfile.mkdtemp(prefix="yirage-cold-cache-")
    os.environ["YIRAGE_CACHE_DIR"] = cache
    os.environ.pop("YIRAGE_PROFILE_DIR", None)
    for step in SETUP_STEPS:
        subprocess.run([sys.executable, "-m", *step], check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return cache


#: the cache steps of ``make setup`` (after its installs), as ``python -m`` arguments
SETUP_STEPS = (("yirage.runtime.toolchain",), ("yirage.tools.warmup",))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="all-minilm-l6-v2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5, help="timed encodes per side, one per round")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a side may take per encode")
    ap.add_argument("--cold", action="store_true",
                    help="yirage's sides start from an empty cache that holds only what make setup leaves "
                         "(a user's very first process)")
    add_plot_option(ap)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.cold:
        cold_cache(args.threads)

    from yirage.models.registry import resolve_embedding_model
    from yirage.runtime.machine import machine_record

    path = str(resolve_embedding_model(args.model))
    result = {"model": args.model, "sentences": args.n, "threads": args.threads, "batch_size": args.batch_size,
              "rounds": args.rounds, "machine": machine_record(args.threads)}
    with Sides(timeout_s=args.timeout) as sides:
        for name in SIDES:
            module = REQUIRES.get(name)
            if module and importlib.util.find_spec(module) is None:
                sides.skip(name, f"{module} is not installed (pip install {module}, or make bench)")
            else:
                sides.start(name, side_spec(name, args, path))
        rounds = sides.rounds(args.rounds, {})
    if REFERENCE in sides.info:
        result["mean_tokens"] = sides.info[REFERENCE]["mean_tokens"]
    result.update(report(sides, rounds, args.n))
    print(json.dumps(result, indent=2))
    if args.plot:
        save(plot_figure(result), args.plot)


#: a side's name in a figure
LABELS = {"yirage_float32": "float32", "yirage_bfloat16": "bfloat16", "yirage_int8": "int8",
          BASELINE: "sentence-transformers", "onnxruntime": "ONNX Runtime"}


def plot_figure(result: dict) -> dict | None:
    """The figure (``benchmarks/_plot.py``): sentences/s of each yirage side over each peer's
    (the median of the paired ratios of the rounds), and a new process's first encode over
    sentence-transformers' warm rate."""
    bars = [{"group": LABELS[name], "series": f"vs {LABELS[peer]}", "ratio": result[key]}
            for name in SIDES if name.startswith("yirage_") for peer in (BASELINE, "onnxruntime")
            if (key := f"speedup_{name}_vs_{peer}") in result]
    bars += [{"group": LABELS[name], "series": f"first encode of a new process vs {LABELS[BASELINE]} warm",
              "ratio": result[key]}
             for name in SIDES if (key := f"speedup_{name}_first_encode_vs_{BASELINE}_warm") in result]
    return figure("embed", f"{result['model']}: yirage sentences/s over each peer's ({result['sentences']} "
                           f"sentences, batch {result['batch_size']})", result["machine"], bars,
                  ylabel="yirage sentences/s / the peer's (x; higher: yirage faster)") if bars else None


if __name__ == "__main__":
    main()
