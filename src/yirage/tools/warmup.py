"""The set-up's last step: run the default models once at every shape class a user's first calls
hit, so that their fused kernels are compiled into the kernel cache and their kernel choices
measured into this machine's profile before the user's first process needs them.

    python -m yirage.tools.warmup [--embedding MODEL | --no-embedding] [--llm MODEL | --no-llm]

``make setup`` runs it after building the hand-written kernel libraries. Without it a user's very
first ``EmbeddingModel.encode`` compiled its fused kernels and measured the providers of every
(GEMM, rows bucket) class it met while the user waited: 512 sentences of all-MiniLM-L6-v2 took
3.0 s there against 1.3 s in the next process (2 threads, AMD EPYC Zen 5 at YIRAGE_ISA=avx2,
2026-11-28). Why warm at set-up rather than measure in the background or fall back to torch while
a kernel compiles: a provider measured in the background would race the user's own work for the
same cores (and so measure that work, not the kernels), and a torch fallback would make the first
calls' numerics and speed differ from the later ones'. The set-up runs once per machine, and
every later process reads the profile.

The embedding model is warmed by batches of token ids whose packed lengths fall in every rows
bucket from 16 to 2048 (``tuning.m_bucket``: powers of two) at the default batch size of 32; the
LLM by prompts of 16 to 1024 tokens (every prefill rows bucket up to 1024) and a few decode steps.
Models that are not installed are skipped with a line saying so. This module measures nothing
itself (first-use kernel choice does, through the engines) and never writes outside the caches.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Sequence

from ..errors import YirageError

#: packed token counts of the embedding warm-up batches: one per rows bucket 16 .. 2048
EMBEDDING_ROWS = tuple(1 << p for p in range(4, 12))
#: prompt lengths of the LLM warm-up: one per prefill rows bucket 16 .. 1024
PROMPT_TOKENS = tuple(1 << p for p in range(4, 11))


def embedding_batches(rows: Sequence[int] = EMBEDDING_ROWS, batch: int = 32, vocab: int = 1000,
                      first_id: int = 1000) -> list[list[list[int]]]:
    """Batches of token id lists (ids ``first_id`` .. ``first_id + vocab``), one per entry of
    ``rows``: min(batch, n // 16) lists of n // that-many tokens each, so that the batch packs
    to n tokens (a whole rows bucket), as a batch of 32 real sentences of 16 to 64 tokens does."""
    out = []
    for n in rows:
        b = max(1, min(batch, n // 16))
        length = n // b
        out.append([[first_id + (i * 7 + j * 13) % vocab for j in range(length)] for i in range(b)])
    return out


def warm_embedding(name: str | None, say: Callable[[str], None]) -> float:
    """Encode ``embedding_batches`` with ``yr.EmbeddingModel(name)`` (the default model when
    None) on the CPU; returns the seconds it took. Raises YirageError if it cannot load."""
    from ..engines.embed import EmbeddingModel
    from ..models.registry import DEFAULT_EMBEDDING_MODEL

    t0 = time.perf_counter()
    model = EmbeddingModel(name or DEFAULT_EMBEDDING_MODEL, backend="cpu")
    limit = model.max_seq_length
    for ids in embedding_batches():
        model.encode_ids([seq[:limit] for seq in ids], batch_size=len(ids))
    seconds = time.perf_counter() - t0
    say(f"embedding model {name or DEFAULT_EMBEDDING_MODEL}: {len(model.plan_shapes)} plans in {seconds:.1f} s")
    return seconds


def warm_llm(name: str | None, say: Callable[[str], None]) -> float:
    """Prefill prompts of ``PROMPT_TOKENS`` tokens and decode a few tokens with ``yr.LLM(name)``
    (the default model when None) on the CPU; returns the seconds it took. Raises YirageError if
    it cannot load."""
    from ..engines.generate import LLM
    from ..models.registry import DEFAULT_MODEL

    t0 = time.perf_counter()
    llm = LLM(name or DEFAULT_MODEL, backend="cpu", max_seq_length=max(PROMPT_TOKENS) + 8)
    vocab = llm.config.vocab_size
    for n in PROMPT_TOKENS:
        llm.generate([(1000 + 17 * i) % vocab for i in range(n)], max_new_tokens=4, ignore_eos=True, chat=False)
    seconds = time.perf_counter() - t0
    say(f"LLM {name or DEFAULT_MODEL}: prompts of {PROMPT_TOKENS[0]} to {PROMPT_TOKENS[-1]} tokens in {seconds:.1f} s")
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m yirage.tools.warmup``: warm the default embedding model and LLM (or the named
    ones); a model that is not installed is skipped with a line. Exit status 0, or 1 with one
    line for any other error."""
    ap = argparse.ArgumentParser(prog="python -m yirage.tools.warmup",
                                 description="Compile and measure the default models' kernels on this machine now.")
    ap.add_argument("--embedding", default=None, help="the embedding model (default: the registry's)")
    ap.add_argument("--no-embedding", action="store_true")
    ap.add_argument("--llm", default=None, help="the LLM (default: the registry's)")
    ap.add_argument("--no-llm", action="store_true")
    args = ap.parse_args(argv)
    steps = [] if args.no_embedding else [(warm_embedding, args.embedding)]
    steps += [] if args.no_llm else [(warm_llm, args.llm)]
    for step, name in steps:
        try:
            step(name, print)
        except YirageError as e:   # not installed, or not loadable here: the set-up goes on
            print(f"skipped {step.__name__.removeprefix('warm_')} ({e})")
        except Exception as e:  # noqa: BLE001 - a set-up step: one line, never a traceback
            print(f"yirage: warm-up failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
