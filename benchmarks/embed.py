"""Embedding throughput: yirage float32 and int8 vs sentence-transformers (and ONNX Runtime if importable).

Prints one JSON object: sentences/s of each side on the same 512 sentences (a fixed,
deterministic mix of short and medium English sentences, 5 to about 60 tokens), the same
thread count (``torch.set_num_threads`` and OMP_NUM_THREADS), the same batch size. Each side
runs once to warm up (which also compiles yirage's plans), then ``--rounds`` timed runs with
the sides taking turns (yirage float32, int8, sentence-transformers, ONNX Runtime, again ...),
so that a burst of load from another process hits every side alike; each side's figure is its
fastest run (all times are in the JSON). Also: the largest difference of yirage float32's
vectors from sentence-transformers', and the cosine of yirage int8's vectors to float32's
(min and mean).

    python benchmarks/embed.py [-m all-minilm-l6-v2] [--threads 2] [--batch-size 32] [--n 512] [--rounds 5]

ONNX Runtime runs the same model exported with ``torch.onnx.export`` (mean pooling and the
Normalize module in numpy; ``pip install onnxruntime onnx``, or ``make bench``);
it is skipped (null in the JSON) when onnxruntime is not importable or the export fails.
The machine may be shared with other jobs: figures are noisy; compare within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _threads  # noqa: E402,F401  (sets OMP_NUM_THREADS from --threads before torch loads)

import numpy as np  # noqa: E402
import torch  # noqa: E402

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


def _time_rounds(sides: dict, texts, rounds: int) -> tuple[dict[str, list[float]], dict[str, np.ndarray]]:
    """Seconds of each timed run per side (sides take turns, after one warm-up run each, which
    compiles yirage's plans and fills caches) and each side's vectors."""
    outs = {name: fn(texts) for name, fn in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            t = time.perf_counter()
            fn(texts)
            times[name].append(time.perf_counter() - t)
    return times, outs


def _onnx_side(path: str, texts: list[str], threads: int, batch_size: int, normalize: bool):
    try:
        import onnxruntime as ort
    except ImportError:
        return None, "onnxruntime is not importable"
    import tempfile

    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    try:
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
    except Exception as e:  # an exporter that cannot handle this model: report, do not fail the run
        return None, f"export failed: {type(e).__name__}: {e}"
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(f, opts, providers=["CPUExecutionProvider"])

    def run(batch_texts):
        order = sorted(range(len(batch_texts)), key=lambda i: -len(batch_texts[i]))
        out = np.empty((len(batch_texts), model.config.hidden_size), dtype=np.float32)
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            enc = tok([batch_texts[i] for i in idx], padding=True, truncation=True, max_length=256,
                      return_tensors="np")
            h = sess.run(None, {"input_ids": enc["input_ids"].astype(np.int64),
                                "attention_mask": enc["attention_mask"].astype(np.int64)})[0]
            m = enc["attention_mask"][..., None].astype(np.float32)
            out[idx] = (h * m).sum(1) / np.clip(m.sum(1), 1e-9, None)
        if normalize:   # the model's Normalize module, as sentence-transformers applies it
            out /= np.clip(np.linalg.norm(out, axis=1, keepdims=True), 1e-12, None)
        return out
    return run, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="all-minilm-l6-v2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5, help="timed runs per side (the fastest counts)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import yirage as yr
    from sentence_transformers import SentenceTransformer

    texts = sentences(args.n)
    m = yr.EmbeddingModel(args.model, backend="cpu")
    path = str(m.spec.directory)
    st = SentenceTransformer(path, device="cpu")
    result = {"model": args.model, "sentences": len(texts), "threads": args.threads, "batch_size": args.batch_size,
              "cpu": platform.processor() or platform.machine(),
              "mean_tokens": float(np.mean([len(x) for x in m.tokenizer(texts)["input_ids"]]))}

    q8 = yr.EmbeddingModel(args.model, backend="cpu", quantization="int8")
    sides = {"yirage_float32": lambda x: m.encode(x, batch_size=args.batch_size),
             "yirage_int8": lambda x: q8.encode(x, batch_size=args.batch_size),
             "sentence_transformers": lambda x: st.encode(x, batch_size=args.batch_size, convert_to_numpy=True)}
    onnx, why = _onnx_side(path, texts, args.threads, args.batch_size, m.spec.normalize)
    if onnx is not None:
        sides["onnxruntime"] = onnx
    times, outs = _time_rounds(sides, texts, args.rounds)
    for name, ts in times.items():
        result[name] = {"seconds": min(ts), "sentences_per_s": len(texts) / min(ts), "all_seconds": ts}
    result["yirage_float32"]["plans"] = len(m._plans)
    result["yirage_int8"]["plans"] = len(q8._plans)
    v_yr, v_q8, v_st = outs["yirage_float32"], outs["yirage_int8"], outs["sentence_transformers"]
    cos = (v_yr * v_q8).sum(1) / (np.linalg.norm(v_yr, axis=1) * np.linalg.norm(v_q8, axis=1))
    result["yirage_int8"].update(cosine_to_float32_min=float(cos.min()), cosine_to_float32_mean=float(cos.mean()))
    if onnx is None:
        result["onnxruntime"] = None
        result["onnxruntime_skipped"] = why
    t_st = result["sentence_transformers"]["seconds"]
    result["speedup_yirage_float32_vs_sentence_transformers"] = t_st / result["yirage_float32"]["seconds"]
    result["speedup_yirage_int8_vs_sentence_transformers"] = t_st / result["yirage_int8"]["seconds"]
    result["max_abs_diff_vs_sentence_transformers"] = float(np.abs(v_yr - v_st).max())
    if onnx is not None:
        t_ort = result["onnxruntime"]["seconds"]
        result["onnxruntime"]["max_abs_diff_vs_sentence_transformers"] = float(np.abs(outs["onnxruntime"] - v_st).max())
        result["speedup_yirage_float32_vs_onnxruntime"] = t_ort / result["yirage_float32"]["seconds"]
        result["speedup_yirage_int8_vs_onnxruntime"] = t_ort / result["yirage_int8"]["seconds"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
