"""The set-up's warm-up (``python -m yirage.tools.warmup``): after it, the default embedding model's
first encode in a process compiles nothing and measures no kernel choice, whatever the sentence
lengths (every rows bucket was met); a model that is not installed is skipped with one line."""
from __future__ import annotations

import pytest
import torch

import yirage as yr
from yirage.engines.embed import bucket_tokens
from yirage.runtime import toolchain
from yirage.tools import warmup
from yirage.tuning import profile as tuning


def test_the_embedding_batches_cover_every_rows_bucket():
    batches = warmup.embedding_batches()
    packed = [bucket_tokens(sum(len(s) for s in b)) for b in batches]
    assert packed == list(warmup.EMBEDDING_ROWS)
    assert {tuning.m_bucket(n) for n in packed} == {1 << p for p in range(4, 12)}
    assert all(len(b) <= 32 for b in batches)


def test_after_the_warm_up_a_first_encode_compiles_and_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.PROFILE_DIR_ENV, str(tmp_path))   # a machine with no profile yet
    monkeypatch.setattr(tuning, "busy_reason", lambda *a: None)   # saved however busy the test machine is
    tuning.reload_profile()
    try:
        lines = []
        warmup.warm_embedding(None, lines.append)
        assert len(lines) == 1 and "plans" in lines[0]
        tuning.reload_profile()                                   # what the next process reads
        spent, built = tuning.first_use_spent()["measured"], toolchain.builds()
        m = yr.EmbeddingModel(backend="cpu")
        words = "the quick brown fox jumps over the lazy dog near the river bank".split()
        texts = [" ".join(words[: 1 + i % len(words)]) * (1 + i % 5) for i in range(300)]
        got = m.encode(texts)
        assert tuning.first_use_spent()["measured"] == spent and toolchain.builds() == built
        assert got.shape == (300, m.get_sentence_embedding_dimension()) and torch.isfinite(torch.as_tensor(got)).all()
    finally:
        monkeypatch.undo()
        tuning.reload_profile()


def test_a_missing_model_is_skipped_with_one_line(capsys):
    assert warmup.main(["--embedding", "no-such-model", "--no-llm"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("skipped embedding (")
