"""The shipped conformance suite (yirage/tools/conformance.py, ``yirage test``): it covers every op
of the op table, it fails when a kernel computes wrong values or raises (a library op binder and
the fused C++ kernels broken on purpose), and the CLI prints one line per case, a summary and
exits 1 on any failure. That every case passes on each backend is tests/backends/test_ops.py's
job (it runs the same CASES)."""
import json
import math

import pytest
import torch

import yirage as yr
from yirage.backends.cpu import backend as cpu_backend, library as cpu_library
from yirage.ir.ops import OPS
from yirage.tools import conformance
from yirage.tools.conformance import CASES, NOT_APPLICABLE, compare, run_case, run_conformance


def test_case_ids_are_unique_and_name_an_op():
    ids = [c.id for c in CASES]
    assert len(set(ids)) == len(ids)
    assert all(c.op in OPS or c.op.startswith("fused: ") for c in CASES)


def test_every_op_has_a_case_or_a_reason():
    assert conformance.coverage_failures() == []
    assert set(OPS) <= conformance.covered_ops() | set(NOT_APPLICABLE)
    for op, reason in NOT_APPLICABLE.items():
        assert op in OPS and reason.strip() and op not in conformance.covered_ops()


def test_a_new_op_without_a_case_fails_the_suite(monkeypatch, run_cli):
    monkeypatch.setitem(OPS, "new_op", OPS["exp"])
    (missing,) = conformance.coverage_failures()
    assert (missing.op, missing.status) == ("new_op", "FAIL")
    assert "no conformance case runs op 'new_op'" in missing.message
    result = run_cli("test", "cpu")  # the whole suite: every case passes, the coverage line fails
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("FAIL  -") and "new_op/coverage" in lines[0]
    assert sum(line.startswith("PASS  cpu") for line in lines) == len(CASES)
    assert "1 op(s) without a conformance case" in lines[-1]


def _argmax_plus_one(monkeypatch):
    """The CPU's argmax kernel, then every index + 1: wrong on every row."""
    supported, bind = cpu_library.OPS["argmax"]

    def broken(node, graph, args, out, status):
        run = bind(node, graph, args, out, status)
        return lambda: (run(), out.add_(1))
    monkeypatch.setitem(cpu_library.OPS, "argmax", (supported, broken))


def test_a_broken_library_kernel_fails(monkeypatch, run_cli, one_line_error):
    _argmax_plus_one(monkeypatch)
    results = run_conformance("cpu", select="argmax")
    assert len(results) == 2 and all(r.status == "FAIL" for r in results)
    assert all("elements off" in r.message and r.max_error == 1 for r in results), results
    assert all(r.status == "PASS" for r in run_conformance("cpu", select="matmul/"))  # the others still pass

    result = run_cli("test", "cpu", "-k", "argmax")
    assert [line.split()[0] for line in result.stdout.splitlines()[:2]] == ["FAIL", "FAIL"]
    assert "cpu: 0 passed, 2 failed, 0 errors" in result.stdout
    one_line_error(result, "2 of 2 conformance results failed")


class _OffByOne:
    """A compiled fused kernel whose first output element comes out 1 too large."""

    def __init__(self, kernel):
        self.kernel = kernel

    def bind(self, tensors, rows):
        run, out = self.kernel.bind(tensors, rows), tensors[-1]
        return lambda: (run(), out.view(-1)[:1].add_(1))


def test_a_broken_fused_kernel_fails(monkeypatch):
    compile_cpp = cpu_backend.compile_cpp
    monkeypatch.setattr(cpu_backend, "compile_cpp", lambda kernels: [_OffByOne(k) for k in compile_cpp(kernels)])
    for case_id in ("fused: elementwise chain/9x65", "softmax/7x7", "layer_norm/7x33 affine"):
        (case,) = [c for c in CASES if c.id == case_id]
        r = run_case(case, "cpu")
        assert r.status == "FAIL" and r.max_error >= 0.5, (case_id, r)
        assert r.message.startswith("output ") and "1 of " in r.message


def test_a_kernel_that_raises_is_an_error_result(monkeypatch, run_cli, one_line_error):
    def raising(node, graph, args, out, status):
        raise RuntimeError("no kernel today\nsecond line")
    monkeypatch.setitem(cpu_library.OPS, "matmul", (cpu_library.OPS["matmul"][0], raising))
    (case,) = [c for c in CASES if c.id == "matmul/7x33 @ 33x5"]
    r = run_case(case, "cpu")
    assert (r.status, r.message, r.max_error) == ("ERROR", "RuntimeError: no kernel today second line", None)
    result = run_cli("test", "cpu", "-k", "matmul/7x33", "--json")
    data = json.loads(result.stdout)
    assert data["summary"] == {"cpu": {"passed": 0, "failed": 0, "errors": 1, "fallback": 0}}
    assert data["passed"] is False and data["results"][0]["status"] == "ERROR" and data["machine"]["cores"] >= 1
    one_line_error(result, "1 of 1 conformance results failed")


def test_compare_counts_nan_and_inf():
    want = torch.tensor([1.0, math.inf, math.nan, -2.0])
    assert compare(want.clone(), want, 0.0, 0.0) == (0.0, None)
    got = torch.tensor([1.0, math.inf, 7.0, -2.0 + 1e-6])
    err, problem = compare(got, want, 1e-5, 0.0)
    assert err == math.inf and problem.startswith("1 of 4 elements off") and "(2,)" in problem
    err, problem = compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 3e-5]), 1e-5, 1e-5)
    assert problem is not None and err == pytest.approx(3e-5, rel=1e-2)  # float32 2 + 3e-5; > 1e-5 + 1e-5 * 2
    assert compare(torch.zeros(2), torch.zeros(2, 1), 1, 1)[1].startswith("shape (2,)")
    assert compare(torch.zeros(2), torch.zeros(2, dtype=torch.float64), 1, 1)[1] is not None


def test_run_case_leaves_the_callers_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    assert run_case(CASES[0], "cpu").status == "PASS"
    assert torch.equal(torch.rand(3), expected)


def test_cli_lines_summary_and_backends(run_cli, monkeypatch):
    monkeypatch.setenv("YIRAGE_BACKEND", "cpu")
    result = run_cli("test", "-k", "argmax/5x7")  # the default backend
    assert result.exit_code == 0, result.output
    first, summary = result.stdout.splitlines()
    assert first.split()[:3] == ["PASS", "cpu", "argmax/5x7"] and "max error 0.00e+00" in first
    assert summary == "cpu: 1 passed, 0 failed, 0 errors"
    result = run_cli("test", "all", "-k", "argmax/5x7", "--json")
    backends = [r["backend"] for r in json.loads(result.stdout)["results"]]
    assert backends == [b.value for b in yr.get_available_backends()]


def test_cli_errors_are_one_line(run_cli, monkeypatch, one_line_error):
    one_line_error(run_cli("test", "tpu"), "'tpu' is unknown", "Available backends")
    one_line_error(run_cli("test", "cpu", "-k", "no-such-case"), "no conformance case matches -k 'no-such-case'")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    one_line_error(run_cli("test", "triton-interpret"), "TRITON_INTERPRET=1 is not set",
                   "run: TRITON_INTERPRET=1 yirage test triton-interpret")
