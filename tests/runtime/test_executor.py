"""The executor talks to a backend only through the contract (backends/base.py)."""
import logging
import threading

import pytest
import torch

import yirage as yr
from yirage.backends import Backend, get_backend_impl
from yirage.backends.base import BackendImpl, BackendInfo, MemoryInfo
from yirage.errors import GraphError
from yirage.runtime import executor
from yirage.runtime.executor import CompiledGraph


class TorchOpsBackend(BackendImpl):
    """The smallest contract implementation: no code generator, no library kernels."""

    name = Backend.CPU
    device_type = "cpu"

    def __init__(self):
        self.compiled, self.asked = [], []

    def unavailable_reason(self):
        return None

    def _device_info(self):
        return BackendInfo(self.name, True, device_name="test")

    def _device_memory_info(self):
        return MemoryInfo(1, None, None)

    def supports(self, node, graph):
        self.asked.append(node.op)
        return False

    def compile(self, kernels):
        self.compiled.extend(kernels)
        return super().compile(kernels)


def _graph():
    g = yr.new_kernel_graph()
    x, w, ids, table = g.new_input((5, 16)), g.new_input((8, 16)), g.new_input((5,), yr.int32), g.new_input((9, 8))
    h = g.mul(g.silu(g.linear(g.rms_norm(x, (16,)), w)), g.embedding(ids, table))
    g.mark_output(g.softmax(h, -1))
    g.mark_output(g.argmax(h, -1))
    return g


def _inputs():
    return [torch.randn(5, 16), torch.randn(8, 16), torch.tensor([0, 8, 3, 3, 1], dtype=torch.int32),
            torch.randn(9, 8)]


def test_any_contract_implementation_runs_a_graph():
    g, impl = _graph(), TorchOpsBackend()
    inputs = _inputs()
    out = CompiledGraph(g, impl)(inputs)
    ref = g.interpret(inputs)
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], ref[1])
    assert impl.compiled and set(impl.asked) == {"linear", "embedding", "argmax"}


def test_unsupported_op_runs_its_reference_logged_once(caplog, monkeypatch):
    """int32 ids have no CPU embedding kernel: the torch reference runs, logged once."""
    monkeypatch.setattr(executor, "_logged_fallbacks", set())
    g, inputs = _graph(), _inputs()
    cpu = get_backend_impl("cpu")
    assert not cpu.supports(next(n for n in g.ops if n.op == "embedding"), g)
    with caplog.at_level(logging.DEBUG, logger="yirage"):
        out = g(inputs=inputs, backend="cpu")
        g2 = _graph()
        g2(inputs=inputs, backend="cpu")
    msgs = [r.getMessage() for r in caplog.records if "torch reference" in r.getMessage()]
    assert msgs == ["backend cpu has no kernel for this embedding: running its torch reference on cpu"]
    torch.testing.assert_close(out[0], g.interpret(inputs)[0], atol=1e-5, rtol=1e-5)


def test_cpu_supports_its_library_kernels():
    g = yr.new_kernel_graph()
    x, wq, ids = g.new_input((1, 64)), g.new_input((4, 64), yr.q4_1), g.new_input((1,), yr.int64)
    g.mark_output(g.linear(x, wq))
    g.mark_output(g.embedding(ids, wq))
    cpu = get_backend_impl("cpu")
    assert all(cpu.supports(n, g) for n in g.ops)


# ---- CompiledGraph.__call__ reuses the last call's plan (runtime/executor.py) ----
def _silu_matmul_graph():
    g = yr.new_kernel_graph()
    X, W = g.new_input(dims=(4, 16)), g.new_input(dims=(16, 8))
    g.mark_output(g.silu(g.matmul(X, W)))
    return g


def test_a_repeated_call_returns_new_tensors_that_later_calls_leave_alone():
    g = _silu_matmul_graph()
    cg = g.compile("cpu")
    x, w = torch.randn(4, 16), torch.randn(16, 8)
    first = cg([x, w])[0]
    want_first = g.interpret([x, w])[0]
    x.mul_(-2.0)                      # same tensors, new values: the reused plan reads them
    second = cg([x, w])[0]
    torch.testing.assert_close(second, g.interpret([x, w])[0])
    torch.testing.assert_close(first, want_first)     # the first result was not overwritten
    assert first.data_ptr() != second.data_ptr()
    third = cg([torch.ones(4, 16), w])[0]            # other inputs: another plan
    torch.testing.assert_close(third, g.interpret([torch.ones(4, 16), w])[0])


def test_concurrent_calls_on_the_same_inputs_get_their_own_plans():
    g = _silu_matmul_graph()
    cg = g.compile("cpu")
    x, w = torch.randn(4, 16), torch.randn(16, 8)
    want = g.interpret([x, w])[0]
    errors = []

    def work():
        for _ in range(200):
            out = cg([x, w])[0]
            if not torch.allclose(out, want, atol=1e-5, rtol=1e-5):
                errors.append(out)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_repeated_calls_capture_the_plan_on_a_backend_that_captures(monkeypatch):
    """On a backend with ``captures`` (CUDA graphs), the CAPTURE_AFTER-th call with the same
    inputs captures the plan once and later calls replay it; new values in the same input
    tensors are read by the replay; a failing capture leaves the plan launching as before.
    (The CPU backend stands in here, its capture replaced by a recording one.)"""
    from yirage.runtime import executor

    g = _silu_matmul_graph()
    cg = g.compile("cpu")
    captured = []

    def capture(run):
        captured.append(run)
        return run
    monkeypatch.setattr(cg.impl, "captures", True, raising=False)
    monkeypatch.setattr(cg.impl, "capture", capture)
    x, w = torch.randn(4, 16), torch.randn(16, 8)
    for i in range(executor.CAPTURE_AFTER + 2):
        x.normal_()
        torch.testing.assert_close(cg([x, w])[0], g.interpret([x, w])[0])
        assert len(captured) == (1 if i + 1 >= executor.CAPTURE_AFTER else 0)

    def failing(run):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(cg.impl, "capture", failing)
    y = torch.randn(4, 16)
    for _ in range(executor.CAPTURE_AFTER + 1):
        torch.testing.assert_close(cg([y, w])[0], g.interpret([y, w])[0])


def test_a_call_with_the_same_tensors_rebinds_when_their_storage_changed():
    """The quick path for the very tensors of the last call: their new values are read, a
    tensor moved to other storage (``set_``) or replaced by another object rebinds the plan,
    and a wrong shape still gets the input check's error."""
    g = yr.new_kernel_graph(backend="cpu")
    a, b = g.new_input((4, 8)), g.new_input((4, 8))
    g.mark_output(g.add(g.relu(a), b))
    cg = g.compile("cpu")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(2):
        torch.testing.assert_close(cg([x, y])[0], x.relu() + y)
    x.mul_(-1)                       # new values, same storage
    torch.testing.assert_close(cg([x, y])[0], x.relu() + y)
    x.set_(torch.randn(4, 8))        # same object, other storage
    torch.testing.assert_close(cg([x, y])[0], x.relu() + y)
    y2 = torch.randn(4, 8)           # another object
    torch.testing.assert_close(cg([x, y2])[0], x.relu() + y2)
    with pytest.raises(GraphError, match="input 1"):
        cg([x, torch.randn(4, 9)])
