"""``yr.benchmark_backends`` and ``yirage benchmark``: the cases' structure, the correctness check
against torch eager (a deliberately wrong kernel is caught and not timed), skipped and failed
cases, argument errors (one line from the CLI), the JSON and PNG files, and the message when
matplotlib is missing. Tiny shapes and one round per case; no speed is asserted."""
import json
import subprocess
import sys

import pytest

import yirage as yr
import yirage.cli as cli
from yirage.backends.cpu import CPUBackend
from yirage.errors import BackendUnavailableError, BenchmarkError
from yirage.tools import benchmark as bm

TINY = dict(batch_sizes=[2], seq_lengths=[8], hidden_sizes=[64])
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny():
    """Every op on every available backend (but triton-interpret) at a tiny shape, one round."""
    return yr.benchmark_backends(iterations=1, **TINY)


def test_every_case_is_checked_then_timed(tiny):
    assert set(tiny["machine"]) >= {"cpu", "isa", "cores", "threads", "torch", "mkl", "onednn", "yirage"}
    assert "triton-interpret" not in tiny["arguments"]["backends"]  # only when named
    assert tiny["arguments"]["backends"] == [b.value for b in yr.get_available_backends() if b.value != "triton-interpret"]
    cpu = [c for c in tiny["cases"] if c["backend"] == "cpu"]
    assert [c["op"] for c in cpu] == list(bm.OPS)
    shapes = {c["op"]: c["dims"] for c in cpu}
    assert shapes["matmul"] == {"M": 16, "K": 64, "N": 64} and shapes["quantized_gemv"] == {"M": 1, "K": 64, "N": 256}
    assert shapes["attention"] == {"B": 2, "S": 8, "heads": 1, "head_dim": 64}
    for c in cpu:
        assert c["status"] == "ok", c
        assert c["yirage_s"] > 0 and c["torch_s"] > 0 and c["speedup"] > 0 and c["rounds"] == 1
        # float32: torch's own output is the reference, and yirage's is within the tolerance
        assert c["torch_max_abs_error"] == 0 and 0 <= c["max_abs_error"] <= c["tolerance"]
        assert c["torch_side"]
    assert tiny["summary"]["cpu"]["ok"] == len(cpu)
    json.dumps(tiny)  # JSON-ready as it is


def test_a_wrong_kernel_is_reported_wrong_and_not_timed(monkeypatch):
    """Every CPU library op (GEMM, GEMV, attention) made to add 0.01 to its output: those cases
    fail the check against torch eager; the fused row kernel (softmax) still passes."""
    right = CPUBackend.bind_library_op

    def wrong(self, node, graph, args, out, status=None):
        run = right(self, node, graph, args, out, status)

        def thunk():
            run()
            out.add_(0.01)
        return thunk
    monkeypatch.setattr(CPUBackend, "bind_library_op", wrong)
    r = yr.benchmark_backends(backends="cpu", iterations=1, ops=["matmul", "softmax", "quantized_gemv"], **TINY)
    by_op = {c["op"]: c for c in r["cases"]}
    for op in ("matmul", "quantized_gemv"):
        c = by_op[op]
        assert c["status"] == "wrong" and "tolerance" in c["reason"], c
        assert c["max_abs_error"] == pytest.approx(0.01, rel=1e-3) and "yirage_s" not in c and "speedup" not in c
    assert by_op["softmax"]["status"] == "ok"
    assert r["summary"]["cpu"]["wrong"] == 2 and r["summary"]["cpu"]["ok"] == 1


def test_cases_yirage_cannot_run_are_skipped_with_the_reason():
    r = yr.benchmark_backends(backends="cpu", iterations=1, dtype="bfloat16", ops=["attention", "layer_norm"], **TINY)
    att, ln = r["cases"]
    assert att["status"] == "skipped" and "no attention_varlen kernel for (bfloat16" in att["reason"]
    assert ln["status"] == "ok" and ln["max_abs_error"] <= ln["tolerance"]
    r = yr.benchmark_backends(backends="cpu", iterations=1, hidden_sizes=[96], ops=["attention", "matmul"],
                              max_gflop=1e-5, batch_sizes=[1], seq_lengths=[4])  # 7.4e-5 GFLOP
    att, mm = r["cases"]
    assert att["status"] == "skipped" and "not a multiple of 64" in att["reason"]
    assert mm["status"] == "skipped" and "above the cap" in mm["reason"]


def test_a_case_that_fails_is_an_error_and_the_run_goes_on(monkeypatch):
    from yirage.errors import ToolchainError

    def no_compiler(self, kernels):
        if kernels:
            raise ToolchainError("no C++ compiler (simulated)")
        return []
    monkeypatch.setattr(CPUBackend, "compile", no_compiler)
    r = yr.benchmark_backends(backends="cpu", iterations=1, ops=["softmax", "matmul"], **TINY)
    sm, mm = r["cases"]
    assert sm["status"] == "error" and "ToolchainError: no C++ compiler" in sm["reason"]
    assert mm["status"] == "ok"


def test_duration_mode_takes_at_least_three_rounds():
    r = yr.benchmark_backends(0.01, backends="cpu", ops=["softmax"], **TINY)
    assert r["cases"][0]["rounds"] >= 3 and r["arguments"]["duration_seconds"] == 0.01


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(duration_seconds=1, iterations=2), "not both"),
    (dict(iterations=0), "iterations must be a positive integer"),
    (dict(duration_seconds=-1), "duration must be a positive number"),
    (dict(ops=["matmul", "conv"]), "unknown op 'conv'"),
    (dict(batch_sizes=[1, 0]), "positive integers, got 0"),
    (dict(hidden_sizes=[64.0]), "positive integers, got 64.0"),
    (dict(seq_lengths=[]), "at least one size"),
    (dict(dtype="int8"), "unknown dtype 'int8'"),
    (dict(quant_type="q4_k"), "unknown quantization type 'q4_k'"),
    (dict(max_gflop=0), "max_gflop must be a positive number"),
])
def test_bad_arguments_raise_one_clear_error(kwargs, fragment):
    with pytest.raises(BenchmarkError, match=fragment):
        yr.benchmark_backends(**{"backends": "cpu", **kwargs})


def test_bad_backends_and_dtypes_the_backend_cannot_hold(monkeypatch):
    with pytest.raises(BackendUnavailableError, match="tpu"):
        yr.benchmark_backends(backends="cpu,tpu", iterations=1)
    monkeypatch.setattr(bm, "_dtype_problem", lambda b, d: f"backend {b.value} cannot hold {d} tensors (simulated)")
    with pytest.raises(BenchmarkError, match="cpu cannot hold float16 tensors"):
        yr.benchmark_backends(backends="cpu", dtype="float16", iterations=1)


def test_plot_is_a_png(tiny, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "speedups.png"
    assert bm.plot_speedups(tiny, str(path)) == str(path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(BenchmarkError, match="cannot write the plot"):
        bm.plot_speedups(tiny, str(tmp_path / "speedups.nosuchformat"))


# ---- the command line ------------------------------------------------------------------------
@pytest.fixture
def yirage_main(yirage_cli):
    """``yirage benchmark ARGS`` in this process (tests/tools/conftest.py)."""
    return lambda *args: yirage_cli("benchmark", *args)


def _invoke(args):
    return cli.cli.main(["benchmark", *args], prog_name="yirage", standalone_mode=False)


def test_list_options_take_the_values_that_follow(monkeypatch, tiny, capsys):
    seen = {}

    def fake(duration, backends, **kw):
        seen.update(kw, duration=duration, backends=backends)
        return tiny
    monkeypatch.setattr(bm, "benchmark_backends", fake)
    _invoke(["--batch-sizes", "1", "4", "--seq-lengths", "8,16", "--hidden-sizes", "64", "--ops", "matmul",
             "softmax", "--backend", "cpu", "--iterations", "3"])
    assert (seen["batch_sizes"], seen["seq_lengths"], seen["hidden_sizes"]) == ([1, 4], [8, 16], [64])
    assert (seen["ops"], seen["backends"], seen["iterations"], seen["duration"]) == (["matmul", "softmax"], ["cpu"], 3, None)
    _invoke([])
    assert (seen["batch_sizes"], seen["seq_lengths"], seen["hidden_sizes"]) == ([1], [128], [768])
    assert (seen["ops"], seen["backends"], seen["iterations"], seen["duration"]) == (None, ["all"], None, None)
    assert "matmul" in capsys.readouterr().out  # the table
    _invoke(["--json"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(tiny))


@pytest.mark.parametrize("args,fragment", [
    (["--iterations", "2", "--duration", "1"], "not both"),
    (["--batch-sizes", "1", "-4"], "positive integers, got -4"),
    (["--hidden-sizes", "64", "x"], "'x' is not an integer"),
    (["--ops", "matmul", "conv"], "unknown op 'conv'"),
    (["--backend", "tpu"], "backend 'tpu' is unknown"),
    (["--dtype", "int8"], "'int8' is not one of"),
    (["-o", "/nonexistent-dir/r.json"], "does not exist or is not writable"),
])
def test_cli_bad_arguments_are_one_line(yirage_main, args, fragment):
    status, out, err = yirage_main(*args)
    lines = err.strip().splitlines()
    assert status == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("yirage: error: ") and fragment in lines[0], lines[0]


def test_cli_writes_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    p = subprocess.run([sys.executable, "-m", "yirage.cli", "benchmark", "--backend", "cpu", "--ops", "softmax", "rms_norm", "--batch-sizes", "1", "--seq-lengths",
               "4", "--hidden-sizes", "64", "--iterations", "1", "-o", str(out), "--plot", str(png)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert set(data) >= {"machine", "arguments", "cases", "summary"}
    assert [(c["op"], c["status"]) for c in data["cases"]] == [("softmax", "ok"), ("rms_norm", "ok")]
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "rms_norm" in p.stdout and "[cpu softmax M=4 N=64 float32:" in p.stderr


def test_cli_without_matplotlib_keeps_the_json(monkeypatch, tmp_path, yirage_main):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "r.json"
    status, _, err = yirage_main("--backend", "cpu", "--ops", "softmax", "--seq-lengths", "4", "--hidden-sizes", "64",
                                 "--iterations", "1", "-o", str(out), "--plot", str(tmp_path / "r.png"))
    assert status == 1
    lines = err.strip().splitlines()  # the case's progress line, then the error
    assert len(lines) == 2 and lines[1] == (f"yirage: error: plotting needs matplotlib, which is not installed: pip "
                                            f"install 'yirage[plot]' (the results are in {out})")
    assert json.loads(out.read_text())["cases"][0]["status"] == "ok"
    assert not (tmp_path / "r.png").exists()
