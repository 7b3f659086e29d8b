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


# ---- layout aliases: permutes next to ops that take strided views (runtime/executor.py) ----
def _attention_graph(causal: bool, outputs_permutes: bool = False):
    """x [B, S, H*D] -> q, k, v heads by view + permute -> sdpa -> permute back -> a row op,
    with other buffers allocated between the permutes and the attention."""
    B, S, H, D = 2, 9, 3, 16
    g = yr.new_kernel_graph()
    x, *ws = g.new_input((B, S, H * D)), *(g.new_input((H * D, H * D)) for _ in range(3))
    heads = [g.permute(g.reshape(g.linear(x, w), (B, S, H, D)), (0, 2, 1, 3)) for w in ws]
    y = g.silu(g.mul(x, x))                                     # buffers between: reuse would show
    o = g.permute(g.reshape(g.sdpa(*heads, causal=causal), (B, H, S, D)), (0, 2, 1, 3))
    if outputs_permutes:   # the query heads and the attention's permuted output
        g.mark_output(heads[0])
        g.mark_output(o)
    g.mark_output(g.add(g.reshape(o, (B, S, H * D)), y))
    return g, [torch.randn(B, S, H * D), *(torch.randn(H * D, H * D) * 0.2 for _ in range(3))]


@pytest.mark.parametrize("causal", [False, True])
def test_permutes_around_attention_are_views_not_copies(causal, backend):
    """On backends whose attention takes strided heads (``strided_io``: cpu, triton) the head
    permutes before the attention become views and the one after it is the attention's own
    output buffer: no copy runs for them, and the result matches the graph's interpreter."""
    g, inputs = _attention_graph(causal)
    impl = get_backend_impl(backend)
    dev_inputs = [x.to(impl.torch_device) for x in inputs]
    plan = g.compile(backend).plan(dev_inputs)
    permutes = {n.output for n in g.ops if n.op == "permute"}
    assert len(plan._viewed) == 3 and set(plan._viewed) | plan._absorbed == permutes
    assert not any("_layout" in getattr(t, "__qualname__", "") for t in plan.thunks)
    for _ in range(2):   # the plan run again reads its views afresh
        torch.testing.assert_close(plan.run()[0].cpu(), g.interpret(inputs)[0], atol=1e-4, rtol=1e-4)
        inputs[0].mul_(-0.5)
        dev_inputs[0].copy_(inputs[0])


def test_layout_aliases_leave_graph_outputs_and_other_backends_alone():
    """A permute that is a graph output is never a view (the caller gets a contiguous tensor):
    the query heads stay a copy, while the attention still writes its permuted output buffer
    directly. A backend without ``strided_io`` (the contract's default) copies every permute."""
    g, inputs = _attention_graph(True, outputs_permutes=True)
    cpu = get_backend_impl("cpu")
    viewed, written = executor.layout_aliases(schedule_of(g), g, cpu)
    q_heads, o = g.outputs[:2]
    assert len(viewed) == 2 and q_heads not in viewed and [dst for dst, _, _ in written.values()] == [o]
    out = g.compile("cpu")(inputs)
    for got, want in zip(out, g.interpret(inputs)):
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert executor.layout_aliases(schedule_of(g), g, TorchOpsBackend()) == ({}, {})


def schedule_of(g):
    from yirage.transforms.fusion import schedule
    return schedule(g)


@pytest.mark.parametrize("backend_kind", ["contract", "cpu"])
def test_a_buffer_read_through_several_views_at_its_last_use_is_freed_once(backend_kind):
    """One step reading two views of one buffer at its last use (attention's k and v as
    ``slice_rows`` of one stacked projection) frees that buffer once: freed twice, the plan's
    pool handed it to two later tensors alive at the same time (Segformer's encoder read a wrong
    residual, max error 4). The result matches the graph's interpreter, and the pool holds each
    buffer once."""
    g = yr.new_kernel_graph()
    x, w1, w2 = g.new_input((4, 8)), g.new_input((8, 8)), g.new_input((8, 8))
    s = g.linear_stack(x, [w1, w2])                              # [2, 4, 8]: two planes, one buffer
    kv = g.add(g.slice_rows(s, 0, 1), g.slice_rows(s, 1, 2))    # the buffer's last use: both views
    a = g.exp(g.mul(kv, kv))                                     # [1, 4, 8]: alive to the end
    b = g.relu(g.linear(g.reshape(a, (4, 8)), w1))               # [4, 8], the size of one plane
    c = g.linear_stack(b, [w2, w1])                              # [2, 4, 8]: the stack's size again
    d = g.linear_stack(g.reshape(a, (4, 8)), [w1, w2])           # alive beside c
    g.mark_output(g.add(g.add(c, d), g.reshape(a, (1, 4, 8))))
    inputs = [torch.randn(4, 8), torch.randn(8, 8) * 0.3, torch.randn(8, 8) * 0.3]
    impl = TorchOpsBackend() if backend_kind == "contract" else get_backend_impl("cpu")
    cg = CompiledGraph(g, impl)
    plan = cg.plan(inputs)
    for _ in range(2):
        torch.testing.assert_close(plan.run()[0], g.interpret(inputs)[0], atol=1e-4, rtol=1e-4)
    pooled = [b.data_ptr() for bufs in plan._pool.values() for b in bufs]
    assert len(pooled) == len(set(pooled)), "a buffer was pooled twice"
