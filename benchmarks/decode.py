"""Decode speed of yirage vs Hugging Face transformers (eager) on the same model and prompt.

Prints one JSON object. Both sides run in this process with the same torch thread count,
the same chat prompt and greedy decoding; each side generates exactly --tokens new tokens
(or fewer if the model emits EOS first: the counts are in the output), and the median of
--runs runs is reported.

    python benchmarks/decode.py [--model smollm2-135m-instruct] [--threads=2] [--tokens 64]

Time to first token (ttft_s) is prefill plus the first sampled token; decode tokens/s
counts the tokens after the first one.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

# OpenMP reads this when the runtime loads, so set it before torch and the kernels load.
_threads = next((a.split("=")[1] for a in sys.argv if a.startswith("--threads=")), None)
os.environ.setdefault("OMP_NUM_THREADS", _threads or "2")

import torch  # noqa: E402

import yirage as yr  # noqa: E402
from yirage.models.loading import load_model  # noqa: E402

PROMPT = "Write a detailed story about a robot who learns to paint."


def bench_yirage(model: str, tokens: int, runs: int, backend: str = "cpu", dtype=None) -> dict:
    llm = yr.LLM(model, backend=backend, max_seq_length=1024, dtype=dtype)
    llm.generate(PROMPT, max_new_tokens=4)  # warm-up: builds and loads kernels
    results = [llm.generate(PROMPT, max_new_tokens=tokens) for _ in range(runs)]
    return {"decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in results),
            "ttft_s": statistics.median(r.prefill_s for r in results),
            "new_tokens": [len(r.token_ids) for r in results],
            "prompt_tokens": results[0].prompt_tokens, "dtype": llm.dtype.value, "text": results[0].text[:80]}


def bench_transformers(model: str, tokens: int, runs: int, device: str = "cpu",
                       dtype: torch.dtype = torch.float32) -> dict:
    from transformers import AutoModelForCausalLM

    loaded = load_model(model, progress=False)
    tok = loaded.tokenizer
    if loaded.format == "gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(loaded.path.parent), gguf_file=loaded.path.name,
                                                  dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=dtype)
    hf = hf.to(device).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"].to(device)
    kw = dict(do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, **kw)
        ttfts, tps, counts = [], [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=tokens, **kw)
            total = time.perf_counter() - t0
            n = out.shape[1] - ids.shape[1]
            ttfts.append(ttft)
            tps.append((n - 1) / (total - ttft))
            counts.append(n)
    return {"decode_tokens_per_s": statistics.median(tps), "ttft_s": statistics.median(ttfts),
            "new_tokens": counts, "prompt_tokens": ids.shape[1], "dtype": str(dtype).removeprefix("torch."),
            "text": tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)[:80]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    y = bench_yirage(args.model, args.tokens, args.runs)
    t = bench_transformers(args.model, args.tokens, args.runs)
    print(json.dumps({
        "model": args.model, "threads": args.threads, "max_new_tokens": args.tokens, "runs": args.runs,
        "machine": platform.machine(), "cpu": yr.get_backend_info("cpu").device_name,
        "yirage": y, "transformers_eager": t,
        "decode_speedup": y["decode_tokens_per_s"] / t["decode_tokens_per_s"],
        "ttft_speedup": t["ttft_s"] / y["ttft_s"],
    }, indent=2))


if __name__ == "__main__":
    main()
