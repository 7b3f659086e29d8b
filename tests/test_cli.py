"""The yirage command line: info, generate (text and --json), and one-line errors."""
import json
import subprocess
import sys

import pytest


def yirage(*args, env=None):
    import os
    return subprocess.run([sys.executable, "-m", "yirage.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def assert_one_line_error(proc, *fragments):
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_info_lists_every_backend_and_the_default():
    p = yirage("info", env={"YIRAGE_BACKEND": "cpu"})
    assert p.returncode == 0, p.stderr
    for name in ("cpu", "cuda", "rocm", "xpu", "mps"):
        assert name in p.stdout
    assert "default backend: cpu (from env)" in p.stdout


@pytest.mark.slow
def test_generate_json():
    p = yirage("generate", "--max-new-tokens", "8", "--json", "What is the capital of France?")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) >= {"text", "token_ids", "finish_reason", "prefill_s", "decode_tokens_per_s"}
    assert "Paris" in out["text"] and out["finish_reason"] in ("stop", "length")


@pytest.mark.slow
def test_generate_streams_text():
    p = yirage("generate", "--max-new-tokens", "8", "--system", "You are terse.", "Name a color.")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()


@pytest.mark.parametrize("args,fragments", [
    (["-m", "no-such-model", "hi"], ["no-such-model"]),
    (["-m", "/nonexistent/model.gguf", "hi"], ["no such file"]),
    (["--backend", "tpu", "hi"], ["tpu", "Available backends: cpu"]),
    (["--backend", "cuda", "hi"], ["cuda", "unavailable"]),
    (["--max-new-tokens", "0", "hi"], ["max_new_tokens"]),
    (["--max-new-tokens", "abc", "hi"], ["abc"]),
])
def test_bad_input_is_one_line(args, fragments):
    assert_one_line_error(yirage("generate", *args), *fragments)


def test_corrupt_gguf_is_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    assert_one_line_error(yirage("generate", "-m", str(bad), "hi"), "broken.gguf")


@pytest.mark.slow
def test_prompt_longer_than_max_seq_length_is_one_line():
    assert_one_line_error(yirage("generate", "--max-seq-length", "16", "word " * 40), "max_seq_length")


def test_bad_env_backend_is_one_line():
    assert_one_line_error(yirage("generate", "hi", env={"YIRAGE_BACKEND": "quantum"}), "quantum")
