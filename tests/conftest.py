"""Shared fixtures: the default model loaded once, and transformers' copy of it.

Without a GPU, Triton kernels run under Triton's CPU interpreter: TRITON_INTERPRET=1 is set
here, before any test module imports triton (the flag is read when a kernel is decorated).
XDG_CONFIG_HOME points at an empty temporary directory, so that no test reads the user config
file of whoever runs the suite (``yirage set``).
"""
import contextlib
import os
import signal
import sys
import tempfile

# Under pytest-xdist (-n N) the cores are split between the workers before any OpenMP runtime
# starts: each worker loads the CPU kernel library (``_kernel_library``), which measures its
# prefetch level with OpenMP on every core, and 16 workers x 16 threads on a 16-core GPU machine
# spun past pytest-timeout's 90 s in every worker's setup (2026-11-27). xdist sets the count in
# the worker's environment before conftest is imported.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import torch  # noqa: E402

if not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="yirage-test-config-")

import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

import yirage as yr  # noqa: E402


def pytest_runtest_logreport(report):
    """With YIRAGE_FAILURE_LOG set, each failure's traceback is appended to that file as it
    happens, so a run cut short by a time limit (a lent GPU machine's: benchmarks/gpu_checks.sh)
    still keeps what went wrong."""
    path = os.environ.get("YIRAGE_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(autouse=True, scope="session")
def _own_machine_profile(tmp_path_factory):
    """Kernel-provider measurements taken while the suite runs (first use, yirage.tuning) go to
    a profile of the session's own, never to the user's."""
    from yirage.tuning import profile

    before = os.environ.get(profile.PROFILE_DIR_ENV)
    os.environ[profile.PROFILE_DIR_ENV] = str(tmp_path_factory.mktemp("tuning"))   # subprocesses too
    yield
    if before is None:
        os.environ.pop(profile.PROFILE_DIR_ENV, None)
    else:
        os.environ[profile.PROFILE_DIR_ENV] = before


@pytest.fixture(autouse=True, scope="session")
def _kernel_library(_own_machine_profile):
    """The CPU kernel library loaded once up front: loading it measures the machine's prefetch
    level (``cpu.native.prefetch_level``, a ``tuning.choose``), which must not happen inside a
    test that pins ``tuning.choose`` to one op's provider. A machine without a C++ compiler
    leaves it to the tests that need it (they report the ToolchainError)."""
    from yirage.backends.cpu.native import library
    from yirage.errors import ToolchainError

    try:
        library()
    except ToolchainError:
        pass


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same torch seed, so random inputs repeat run to run."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _cpu_unless_parametrized(request, monkeypatch):
    """A test that does not take the ``backend`` fixture is a CPU test: on a GPU machine 'auto'
    would pick the GPU and its CPU tensors would be refused (rightly). The ``backend``-
    parametrized tests are the ones that run on every backend present."""
    if "backend" not in request.fixturenames and not os.environ.get("YIRAGE_BACKEND"):
        monkeypatch.setenv("YIRAGE_BACKEND", "cpu")


@pytest.fixture(params=[b.value for b in yr.get_available_backends()])
def backend(request):
    """Every backend this machine can run: the CPU, the GPU backends present, and
    'triton-interpret' (the GPU kernels under Triton's CPU interpreter; enabled above when
    no GPU is present), and 'webgpu' where wgpu finds an adapter (Mesa's lavapipe without a
    GPU). The shared backend suite (tests/backends/test_ops.py) uses it. webgpu runs in the
    modules that say ``WEBGPU = True``; elsewhere it skips, saying so (issue 44: the engines,
    torch.compile and threadblock graphs have not been brought to it yet)."""
    if request.param == "webgpu" and not getattr(request.module, "WEBGPU", False):
        pytest.skip("webgpu: this module does not run on the webgpu backend yet")
    return request.param


def _cpu_flags() -> set[str]:
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_LIB_VARIANT_FLAGS = {"avx2": ["-march=native", "-mno-avx512f", "-mno-avxvnni"],
                      "avxvnni": ["-march=native", "-mno-avx512f"], "avx512": ["-march=native", "-mno-avx512bf16"],
                      "scalar": ["-march=x86-64"]}
#: the builds without OpenMP (-fopenmp-simd alone, as a compiler without it gets): their
#: parallel loops run on yirage's own thread pool (kernels/cpu/yr_threads.h)
_LIB_VARIANTS_WITHOUT_OPENMP = {"scalar"}
_LIB_VARIANTS: dict = {}


@pytest.fixture(params=["native", "avx2", "scalar", "aarch64"])
def lib(request):
    """The C++ kernel library (kernels/cpu/library.cpp and its headers) as each build the CPU
    backend may select: native (AVX-512 here), AVX2 (-mno-avx512f -mno-avxvnni), the portable
    scalar path (-march=x86-64), built without OpenMP so that its parallel loops run on yirage's
    own thread pool (kernels/cpu/yr_threads.h), and aarch64 (ARMv8.2 with dotprod, NEON paths;
    cross-built and run under qemu-user: tests/cross), so that every ``#if`` branch and both
    thread runtimes are tested; each built once per session. ``lib_vnni`` adds the AVX2 +
    AVX-VNNI build (the int8 GEMM's ymm vpdpbusd path)."""
    return _lib_variant(request.param)


def _variant_unavailable(name: str) -> str | None:
    """Why this machine cannot run the library build ``name``, or None."""
    import platform

    if name != "native" and platform.machine().lower() not in ("x86_64", "amd64"):
        return "ISA variants are only built on x86-64"
    if name != "native" and os.environ.get("YIRAGE_ISA", "native") not in ("", "native"):
        return "under YIRAGE_ISA's cap the library is the capped build (the 'native' case); the other x86 builds run uncapped"
    if name in ("avx2", "avxvnni") and not {"avx2", "fma", "f16c"} <= _cpu_flags():
        return "CPU lacks AVX2/FMA/F16C"
    if name == "avxvnni" and "avx_vnni" not in _cpu_flags():
        return "CPU lacks AVX-VNNI"
    if name == "avx512" and not {"avx512f", "avx512bw", "f16c"} <= _cpu_flags():
        return "CPU lacks AVX-512F/BW"
    return None


def _lib_variant(name: str):
    """The library build ``name`` (native, avx2, avxvnni, avx512, scalar: the last without
    OpenMP, on yirage's thread pool); skips where the CPU cannot run it. The first ISA variant
    asked for builds every variant this machine runs, two compilers at a time (4 builds of
    14-28 s each on 2 cores, one after another before)."""
    from concurrent.futures import ThreadPoolExecutor

    from yirage.backends.cpu.native import bind_signatures, library
    from yirage.config import scoped_environ
    from yirage.runtime.toolchain import cxx_flags, load_kernel_library, openmp_flags

    if name.startswith("aarch64"):
        return _cross_variant(name)
    reason = _variant_unavailable(name)
    if reason:
        pytest.skip(reason)
    if name == "native" and name not in _LIB_VARIANTS:
        _LIB_VARIANTS[name] = library()
    if name not in _LIB_VARIANTS:
        todo = [v for v in _LIB_VARIANT_FLAGS if v not in _LIB_VARIANTS and not _variant_unavailable(v)]

        def build(v):
            if v not in _LIB_VARIANTS_WITHOUT_OPENMP:
                flags = [f for f in cxx_flags() if not f.startswith("-march")] + _LIB_VARIANT_FLAGS[v]
                return bind_signatures(load_kernel_library("library", tuple(flags)))
            omp = set(openmp_flags())
            flags = [f for f in cxx_flags() if not f.startswith("-march") and f not in omp]
            # the pool reads OMP_NUM_THREADS as the library loads: 2 threads at least, so that
            # the kernels run on a real team also where xdist gives a worker one core's share
            share = os.environ.get("OMP_NUM_THREADS", "").split(",")[0]
            flags += [*_LIB_VARIANT_FLAGS[v], "-fopenmp-simd"]
            with scoped_environ({"OMP_NUM_THREADS": str(max(2, int(share) if share.isdigit() else os.cpu_count() or 1))}):
                return bind_signatures(load_kernel_library("library", tuple(flags)))

        with ThreadPoolExecutor(max_workers=2) as pool:
            _LIB_VARIANTS.update(zip(todo, pool.map(build, todo)))
    return _LIB_VARIANTS[name]


#: the aarch64 builds of the library (tests/cross.TARGETS)
_CROSS_VARIANTS = {"aarch64": "armv8.2-a+dotprod", "aarch64-v8.0": "armv8-a"}


def _cross_variant(name: str):
    """The library cross-built for an Arm target, called under qemu-user; skips where the cross
    compiler or qemu is missing."""
    import cross
    from yirage.backends.cpu.native import SIGNATURES

    why = cross.unavailable()
    if why:
        pytest.skip(why)
    if name not in _LIB_VARIANTS:
        _LIB_VARIANTS[name] = cross.CrossLibrary("library", _CROSS_VARIANTS[name], SIGNATURES)
    return _LIB_VARIANTS[name]


@pytest.fixture(params=["native", "avx2", "avxvnni", "scalar", "aarch64", "aarch64-v8.0"])
def lib_vnni(request):
    """``lib``'s builds plus AVX2 with AVX-VNNI (-mno-avx512f), and ARMv8.0 without the dot
    product (smull/sadalp in place of sdot): for the int8 GEMM tests."""
    return _lib_variant(request.param)


@pytest.fixture(params=["native", "avx512", "avx2", "scalar"])
def lib_bf16(request):
    """``lib``'s builds plus AVX-512 without AVX512-BF16 (-mno-avx512bf16): for the bfloat16
    GEMM tests (vdpbf16ps natively here, FMAs on the bf16 halves, scalar)."""
    return _lib_variant(request.param)


def skip_unless_provider_runs(provider: str, dtype: str) -> None:
    """Skip the calling test, with the reason, where the linear provider ``provider`` of weight
    dtype ``dtype`` ('float32', 'bfloat16', 'float32/bfloat16', 'int8') cannot run on this machine
    (its ``Needs``, under ``YIRAGE_ISA``'s cap): a test never fails on a CPU without a feature."""
    from yirage.backends.cpu import providers as cpu_providers

    case = cpu_providers.Case("linear_w8a8" if dtype == "int8" else "linear", dtype, 8, 8, 8, constant=True)
    why = cpu_providers.unavailable(case).get(provider)
    if why is not None:
        pytest.skip(f"{provider} ({dtype}) cannot run here: {why}")


@pytest.fixture
def provider_runs():
    """``provider_runs(provider, dtype)``: ``skip_unless_provider_runs`` for test modules."""
    return skip_unless_provider_runs


@pytest.fixture(scope="session")
def smollm():
    """yr.LLM on the default model (CPU), loaded once per test session."""
    import yirage as yr
    return yr.LLM("smollm2-135m-instruct", backend="cpu", max_seq_length=512)


@contextlib.contextmanager
def gguf_parsed_once():
    """While transformers loads a GGUF reference (``gguf_file=``): gguf-py's ``GGUFReader``
    memoized per file (path, size, mtime). transformers parses the whole file for the config,
    again for the weights and again for the tokenizer; for a 262K-token vocabulary each parse
    takes ~19 s of Python. The reader is read-only, so sharing it changes nothing but time."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        st = os.stat(path)
        key = (os.fspath(path), mode, st.st_size, st.st_mtime_ns)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


@pytest.fixture(scope="session")
def gguf_once():
    """``gguf_parsed_once`` for test modules: ``with gguf_once(): AutoModel...(gguf_file=...)``."""
    return gguf_parsed_once


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' reference: the same GGUF loaded by transformers, dequantized to float32."""
    from transformers import AutoModelForCausalLM
    from yirage.models.registry import resolve_model

    path = resolve_model("smollm2-135m-instruct").path
    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Factory: a word-level tokenizer 'w0'..'w{n-1}' (no network) to save beside tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def make(vocab_size: int):
        vocab = {f"w{i}": i for i in range(vocab_size)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1", bos_token="w2")
    return make


@pytest.fixture(scope="session")
def save_tiny_model(tiny_tokenizer):
    """Factory ``(kind, directory, chat_template=None) -> transformers model``: a tiny random
    Llama (untied, llama3 RoPE scaling) or Qwen2 (biases, tied) saved to ``directory`` as
    safetensors with a word-level tokenizer 'w0'..'w299' (optionally with a chat template);
    the returned model is the reference."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    def make(kind: str, directory, chat_template=None):
        torch.manual_seed(0)
        common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5, eos_token_id=1, bos_token_id=2)
        if kind == "llama":
            cfg = LlamaConfig(**common, tie_word_embeddings=False,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                              rope_theta=500000.0)
        else:
            cfg = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
        hf = AutoModelForCausalLM.from_config(cfg).eval()
        hf.save_pretrained(directory)
        tok = tiny_tokenizer(300)
        tok.chat_template = chat_template
        tok.save_pretrained(directory)
        return hf
    return make


@pytest.fixture
def matches_transformers():
    """``check(llm, hf)``: a 7-token prefill and 3 greedy decode steps of the ``yr.LLM`` equal
    the transformers model ``hf``'s full-sequence logits (atol/rtol 1e-4), and each step's
    argmax output is the argmax of its logits."""
    def check(llm, hf, ids=(5, 17, 299, 42, 8, 100, 3), steps: int = 3):
        seq = list(ids)
        logits, _ = llm.steps.run(list(ids), 0)
        got = [logits[0].to("cpu", copy=True)]
        for _ in range(steps):
            nxt = int(got[-1].argmax())
            seq.append(nxt)
            logits, argmax = llm.steps.run([nxt], len(seq) - 1)
            assert int(argmax[0]) == int(logits[0].argmax())
            got.append(logits[0].to("cpu", copy=True))
        with torch.inference_mode():
            ref = hf(torch.tensor([seq])).logits[0]
        for i, g in enumerate(got):
            torch.testing.assert_close(g, ref[len(ids) - 1 + i], atol=1e-4, rtol=1e-4)
    return check


# ---- the yirage command line run in this process (tools and serve tests) -----------------
@pytest.fixture
def run_cli():
    """``run_cli(*args) -> click.testing.Result``: the ``yirage`` command group run in this
    process, so that monkeypatches apply. The CLI's error exit resets the SIGINT handler; it is
    put back afterwards."""
    from yirage.cli import cli

    handler = signal.getsignal(signal.SIGINT)
    runner = CliRunner()
    yield lambda *args: runner.invoke(cli, list(args))
    signal.signal(signal.SIGINT, handler)


def _one_line_error(result, *fragments) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, (result.exit_code, result.stderr)
    assert lines[0].startswith("yirage: error: ")
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def one_line_error():
    """``one_line_error(result, *fragments) -> str``: asserts that a ``run_cli`` result exited 1
    with one line ``yirage: error: ...`` on stderr holding every fragment; returns the line."""
    return _one_line_error


@pytest.fixture
def yirage_cli(monkeypatch, capsys):
    """Run ``yirage ARGS`` in this process through ``cli.main`` (the entry point: its one-line
    errors and exit statuses); returns (status, stdout, stderr). Its signal handling is
    switched off, so that the test process keeps its own SIGINT handler."""
    from yirage import cli

    def _exit(code):
        raise SystemExit(code)
    monkeypatch.setattr(cli, "_exit", _exit)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["yirage", *args])
        with pytest.raises(SystemExit) as e:
            cli.main()
        out = capsys.readouterr()
        return e.value.code, out.out, out.err
    return run
