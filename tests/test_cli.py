"""The yirage command line: info, generate (text and --json), one-line errors and exit statuses
(1 error, 130 interrupted, 141 broken pipe)."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest


def yirage(*args, env=None):
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


@pytest.mark.slow
@pytest.mark.parametrize("option,value,bad_dtype", [("--decode-dtype", "int8", "bfloat16"),
                                                    ("--kv-cache-dtype", "float16", "float16")])
def test_generate_llamacpp_numerics_options(option, value, bad_dtype):
    """--decode-dtype int8 (int8 decode activations) and --kv-cache-dtype float16 (a float16 KV
    cache), llama.cpp's numerics, still answer the question; with non-float32 activations each is
    one clear error."""
    p = yirage("generate", "--max-new-tokens", "8", "--json", option, value, "What is the capital of France?")
    assert p.returncode == 0, p.stderr
    assert "Paris" in json.loads(p.stdout)["text"]
    name = option[2:].replace("-", "_")
    assert_one_line_error(yirage("generate", option, value, "--dtype", bad_dtype, "hi"),
                          f"{name}='{value}'", "float32 activations")


@pytest.mark.parametrize("args,fragments", [
    (["-m", "no-such-model", "hi"], ["no-such-model"]),
    (["-m", "/nonexistent/model.gguf", "hi"], ["no such file"]),
    (["--backend", "tpu", "hi"], ["tpu", "Available backends:", "cpu"]),
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


# ---- issue 6: every user-caused failure is one line, with a documented exit status ----------

EXIT_ERROR, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 1, 130, 141
CLI = [sys.executable, "-m", "yirage.cli"]


def assert_one_error_line(proc, code, *fragments):
    """Exactly one error line on stderr, ``yirage: error: ...``, exit status ``code``, no
    traceback. Blank lines (rich's progress bar leaves one when stderr is no terminal) and
    log warnings (a kernel cache being rebuilt) are not error lines."""
    stderr = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode("utf-8", "replace")
    lines = [line for line in stderr.splitlines() if line.strip() and "[yirage WARNING]" not in line]
    assert proc.returncode == code, (proc.returncode, stderr)
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    assert lines[0].startswith("yirage: error: "), lines[0]
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.mark.parametrize("args,fragments", [
    (["--temperature", "nan"], ["temperature must be a finite number >= 0", "nan"]),
    (["--temperature", "inf"], ["temperature must be a finite number >= 0", "inf"]),
    (["--seed", "99999999999999999999999"], ["seed must be an integer in 0..2**64-1", "99999999999999999999999"]),
    (["--seed", "-1"], ["seed must be an integer in 0..2**64-1"]),
    (["--top-k", "0"], ["top_k must be a positive integer"]),
    (["--top-p", "nan"], ["top_p must be a number in (0, 1]"]),
    (["--max-seq-length", "0"], ["max_seq_length must be a positive integer"]),
    (["--system", "x", "--no-chat"], ["--system needs the model's chat template"]),
])
def test_bad_generation_arguments_are_one_line(args, fragments):
    assert_one_error_line(yirage("generate", *args, "hi"), EXIT_ERROR, *fragments)


@pytest.mark.parametrize("args,what", [([b"\xff\xfe"], "PROMPT"), ([b"--system", b"a\xffb", b"hi"], "--system")])
def test_non_utf8_argument_is_one_line(args, what):
    """Decision: undecodable bytes are an error (the model would get a different prompt than
    the one typed), not replaced; PYTHONUTF8=1 makes argv decoding the same everywhere."""
    proc = subprocess.run([*CLI, "generate", *args], capture_output=True, timeout=600,
                          env={**os.environ, "PYTHONUTF8": "1"})
    assert_one_error_line(proc, EXIT_ERROR, f"{what} is not valid utf-8 text", "0xff", "pass UTF-8 text")


def test_closed_stdout_is_one_line():
    """`yirage generate hi >&-`: found before any work, exit 1."""
    quoted = " ".join(shlex.quote(a) for a in CLI)
    for cmd in ("generate hi", "info"):
        proc = subprocess.run(["bash", "-c", f"{quoted} {cmd} >&-"], capture_output=True, text=True, timeout=600)
        assert_one_error_line(proc, EXIT_ERROR, "standard output is closed")


def test_full_stdout_is_one_line():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        proc = subprocess.run([*CLI, "info"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=600)
    assert_one_error_line(proc, EXIT_ERROR, "cannot write to standard output", "No space left")


def run_into_broken_pipe(*args):
    """Run the CLI with stdout a pipe whose reader has already gone away."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([*CLI, *args], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=600)
    finally:
        os.close(write_end)


def test_broken_pipe_is_quiet_141():
    """Decision: a reader that goes away (`| head -c1`) ends yirage quietly with 128 + SIGPIPE."""
    proc = run_into_broken_pipe("info")
    assert proc.returncode == EXIT_BROKEN_PIPE and not proc.stderr.strip(), proc.stderr


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, save_tiny_model):
    """Factory: a tiny random Llama directory (tests/conftest.py ``save_tiny_model``) with the
    given chat template; returns its path."""
    def make(chat_template=None):
        directory = tmp_path_factory.mktemp("tiny")
        save_tiny_model("llama", directory, chat_template)
        return str(directory)
    return make


def test_broken_pipe_during_generation_is_quiet_141(tiny_model):
    proc = run_into_broken_pipe("generate", "-m", tiny_model(), "--backend", "cpu", "--max-new-tokens", "8", "w5 w6")
    assert proc.returncode == EXIT_BROKEN_PIPE, proc.stderr
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("template,fragment", [
    ("{{ raise_exception('this template takes no user messages') }}", "this template takes no user messages"),
    ("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}", "No filter named 'nosuchfilter'"),
])
def test_failing_chat_template_is_one_line(tiny_model, template, fragment):
    """(More template failures: tests/engines/test_arguments.py.)"""
    proc = yirage("generate", "-m", tiny_model(template), "--backend", "cpu", "--max-new-tokens", "4", "w5 w6")
    assert_one_error_line(proc, EXIT_ERROR, "the model's chat template failed", fragment, "--no-chat")


def test_no_chat_skips_a_failing_chat_template(tiny_model):
    model = tiny_model("{{ raise_exception('this template takes no user messages') }}")
    proc = yirage("generate", "-m", model, "--backend", "cpu", "--max-new-tokens", "4", "--no-chat", "w5 w6")
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr


def _sigint_when(proc, ready, timeout=300):
    """Send SIGINT to ``proc`` once ``ready()`` holds; False if it ended first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    return True


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc to see the model being loaded")
def test_ctrl_c_during_start_up_is_130():
    """SIGINT while the default model loads (its GGUF is mapped): exit 130, one line."""
    from yirage.models.registry import resolve_model

    gguf = str(resolve_model("smollm2-135m-instruct").path.resolve())
    proc = subprocess.Popen([*CLI, "generate", "--max-new-tokens", "64", "hi"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def loading():
        try:
            with open(f"/proc/{proc.pid}/maps") as maps:
                return gguf in maps.read()
        except OSError:
            return False
    sent = _sigint_when(proc, loading)
    out, err = proc.communicate(timeout=600)
    assert sent, err
    assert_one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
                          EXIT_INTERRUPTED, "interrupted")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc to see what the process has loaded")
@pytest.mark.parametrize("library", ["libtorch_cpu", "tokenizers"])
def test_ctrl_c_while_python_imports_is_130(library):
    """SIGINT while the CLI starts, once it is loading torch (then transformers' tokenizers):
    `import yirage` loads nothing heavy, so the CLI's own handler is in place and answers with
    one line. The signal goes when the library is mapped, however slow the machine (a fixed
    0.3 s could fall in the interpreter's own start-up on a loaded one)."""
    proc = subprocess.Popen([*CLI, "generate", "--max-new-tokens", "4", "hi"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def mapped():
        try:
            with open(f"/proc/{proc.pid}/maps") as maps:
                return library in maps.read()
        except OSError:
            return False
    assert _sigint_when(proc, mapped), "the process ended before it loaded " + library
    out, err = proc.communicate(timeout=600)
    assert_one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
                          EXIT_INTERRUPTED, "interrupted")


@pytest.mark.slow
def test_ctrl_c_during_generation_is_130():
    """SIGINT after the first streamed piece: exit 130, one line, the partial line ended."""
    proc = subprocess.Popen([*CLI, "generate", "--max-new-tokens", "400", "--temperature", "0.8", "--seed", "1",
                             "Count from 1 to 500, one number per line."],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.read(1)
    assert first, proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    assert_one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
                          EXIT_INTERRUPTED, "interrupted")
