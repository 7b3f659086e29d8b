"""Fusion pass: the schedule it builds keeps the reference numbers and fuses what it should."""
import torch

import yirage as yr
from yirage.codegen.eager import EagerKernel
from yirage.transforms.fusion import FusedKernel, LibraryStep, schedule


def llama_block_graph(T=5, H=64, I=96):
    g = yr.new_kernel_graph()
    h, o = g.new_input((T, H)), g.new_input((T, H))
    wn, wg, wu = g.new_input((H,)), g.new_input((I, H)), g.new_input((I, H))
    h2 = g.add(h, o)
    n = g.mul(g.rms_norm(h2, (H,)), wn)
    m = g.mul(g.silu(g.linear(n, wg)), g.linear(n, wu))
    g.mark_output(h2)
    g.mark_output(m)
    return g


def test_residual_norm_and_swiglu_fuse_into_two_kernels():
    g = llama_block_graph()
    steps = schedule(g)
    kinds = [type(s).__name__ if isinstance(s, FusedKernel) else s.node.op for s in steps]
    assert kinds == ["FusedKernel", "linear", "linear", "FusedKernel"]
    first = steps[0]
    assert len(first.ops) == 3 and len(first.outputs) == 2  # h2 (graph output) and n (read by linear)


def test_every_fused_kernel_matches_reference_in_eager_and_cpp():
    g = llama_block_graph()
    inputs = [torch.randn(5, 64), torch.randn(5, 64), torch.randn(64), torch.randn(96, 64), torch.randn(96, 64)]
    ref = g.interpret(inputs)
    out = g(inputs=inputs)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the same schedule evaluated with torch eager kernels (the non-C++ rendering)
    cg = g.compile("cpu")
    env = dict(zip(g.inputs, inputs))
    for step in cg.steps:
        if isinstance(step, LibraryStep):
            from yirage.ir.ops import OPS
            env[step.node.output] = OPS[step.node.op].reference([env[i] for i in step.node.inputs], step.node.attrs)
            continue
        outs = [torch.empty(g.tensors[tid].shape) for _, tid, _ in step.outputs]
        EagerKernel(step).bind([env[i.tid] for i in step.inputs] + outs, step.R)()
        env.update({tid: t for (_, tid, _), t in zip(step.outputs, outs)})
    for o, b in zip(g.outputs, ref):
        torch.testing.assert_close(env[o], b, atol=1e-5, rtol=1e-5)


def test_row_scalar_chain_and_multiple_phases():
    g = yr.new_kernel_graph()
    x = g.new_input((6, 130))
    s = g.sqrt(g.reduction(g.square(x), 1))      # rs values
    y = g.div(x, s)                                # back to vec
    z = g.softmax(g.exp(g.neg(y)), -1)             # three more phases
    g.mark_output(z)
    g.mark_output(s)
    assert sum(isinstance(st, FusedKernel) for st in schedule(g)) == 1
    data = torch.randn(6, 130)
    out = g(inputs=[data])
    torch.testing.assert_close(out[0], torch.softmax(torch.exp(-data / data.norm(dim=1, keepdim=True)), -1))
    torch.testing.assert_close(out[1], data.norm(dim=1, keepdim=True))


def test_library_op_splits_kernels_and_shape_change_starts_new_one():
    g = yr.new_kernel_graph()
    x, w = g.new_input((4, 8)), g.new_input((8, 16))
    a = g.relu(x)
    b = g.exp(g.matmul(a, w))
    c = g.add(g.reduction(b, 1), g.new_input((4, 1)))
    g.mark_output(c)
    steps = schedule(g)
    assert [isinstance(s, FusedKernel) for s in steps] == [True, False, True]
    xs, ws, cs = torch.randn(4, 8), torch.randn(8, 16), torch.randn(4, 1)
    torch.testing.assert_close(g(inputs=[xs, ws, cs])[0], torch.exp(xs.relu() @ ws).sum(1, keepdim=True) + cs,
                               atol=1e-4, rtol=1e-4)


def test_op_table_declares_in_place_writes():
    from yirage.ir.ops import OPS
    assert OPS["attention"].mutates == (3, 4)  # the KV caches
    assert OPS["attention_rows"].mutates == (3, 4)  # the slotted KV caches of continuous batching
    assert all(not d.mutates for name, d in OPS.items() if name not in ("attention", "attention_rows"))


def test_kernel_reading_the_kv_cache_does_not_sink_past_attention():
    """exp(k_cache) joins a later add; attention writes k_cache in between. Sinking the
    kernel after attention would read the updated cache; the schedule must keep it first."""
    S, Hkv, Dh = 8, 1, 4
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((1, Hkv, Dh)), g.new_input((1, Hkv, Dh)), g.new_input((1, Hkv, Dh))
    kc, vc, pos = g.new_input((S, Hkv, Dh)), g.new_input((S, Hkv, Dh)), g.new_input((1,), yr.int64)
    other = g.new_input((S, Hkv * Dh))
    before = g.exp(g.reshape(kc, (S, Hkv * Dh)))
    a = g.attention(q, k, v, kc, vc, pos)
    g.mark_output(g.add(before, other))
    g.mark_output(a)
    kinds = [type(s).__name__ if isinstance(s, FusedKernel) else s.node.op for s in schedule(g)]
    assert kinds.index("attention") > kinds.index("FusedKernel")
    inputs = [torch.randn(1, Hkv, Dh), torch.randn(1, Hkv, Dh), torch.randn(1, Hkv, Dh),
              torch.zeros(S, Hkv, Dh), torch.zeros(S, Hkv, Dh), torch.tensor([3]), torch.randn(S, Hkv * Dh)]
    ref = g.interpret([x.clone() for x in inputs])
    out = g(inputs=inputs)
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[0], 1 + inputs[6])  # exp of the cache before the write (zeros)


def test_kernel_still_sinks_past_gemms_that_write_nothing():
    g = llama_block_graph()
    assert sum(isinstance(s, FusedKernel) for s in schedule(g)) == 2
