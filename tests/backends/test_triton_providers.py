"""Kernel choice on the Triton backends (backends/triton/providers.py): yirage's Triton kernel or
torch's op (cuBLAS, cuDNN, torch's SDPA on a GPU) for linear, matmul, conv2d and sdpa.

Without a GPU these run on 'triton-interpret' with its measuring switched on for the test (the
interpreter itself never measures: it exists to test the Triton kernels): each provider,
pinned, computes what torch eager does; the first use measures both with the backend's sync
after every sample and records the choice under a key naming the device; YIRAGE_TUNE=off and
ops without a vendor candidate keep yirage's kernel."""
import pytest
import torch
import torch.nn.functional as F

import yirage as yr
from yirage.backends.triton import TritonInterpreterBackend, providers as triton_providers
from yirage.tuning import profile as tuning

pytestmark = pytest.mark.skipif(not yr.get_backend_info("triton-interpret").available,
                                reason="Triton's interpreter is not available")


def _linear(layout, bias, M=5):
    g = yr.new_kernel_graph("triton-interpret")
    N, K = 24, 40
    x = g.new_input((M, K))
    w = g.new_input((K, N) if layout == "kn" else (N, K))
    ins = [torch.randn(M, K), torch.randn((K, N) if layout == "kn" else (N, K)) / K ** 0.5]
    wt = ins[1] if layout == "kn" else ins[1].t()
    want = ins[0] @ wt
    if bias:
        b = g.new_input((N,))
        ins.append(torch.randn(N))
        want = want + ins[2]
        y = g.linear(x, w, b, weight_layout=layout)
    else:
        y = g.linear(x, w, weight_layout=layout)
    g.mark_output(y)
    return g, ins, want


def _matmul():
    g = yr.new_kernel_graph("triton-interpret")
    a, b = g.new_input((3, 7, 16)), g.new_input((3, 16, 12))
    g.mark_output(g.matmul(a, b))
    ins = [torch.randn(3, 7, 16), torch.randn(3, 16, 12)]
    return g, ins, ins[0] @ ins[1]


def _sdpa():
    g = yr.new_kernel_graph("triton-interpret")
    q, k, v = g.new_input((2, 4, 9, 16)), g.new_input((2, 2, 9, 16)), g.new_input((2, 2, 9, 16))
    g.mark_output(g.sdpa(q, k, v, causal=True))
    ins = [torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)]
    return g, ins, F.scaled_dot_product_attention(*ins, is_causal=True, enable_gqa=True)


def _conv():
    """conv -> BatchNorm -> + (strided 1x1 conv -> BatchNorm) -> ReLU, pooled (conformance's
    block: fused into conv2d ops with epilogues)."""
    from yirage.tools import conformance
    return conformance._conv_block(1, 6, 11, 10, 8, 3, 2, 1, "conv", "relu", yr.float32)


def _layout():
    """A permute (BERT's head split) and a cat with a pad after it: strided copies."""
    g = yr.new_kernel_graph("triton-interpret")
    x, y = g.new_input((2, 5, 3, 4)), g.new_input((2, 3, 5, 2))
    p = g.permute(x, (0, 2, 1, 3))
    g.mark_output(g.pad(g.cat([p, y], dim=3), [(0, 0), (0, 0), (0, 0), (1, 2)], 0.5))
    ins = [torch.randn(2, 5, 3, 4), torch.randn(2, 3, 5, 2)]
    return g, ins, F.pad(torch.cat([ins[0].permute(0, 2, 1, 3), ins[1]], dim=3), (1, 2), value=0.5)


def _sdpa_mask_causal():
    g = yr.new_kernel_graph("triton-interpret")
    q, k, v, m = (g.new_input(s) for s in ((2, 4, 9, 16), (2, 2, 11, 16), (2, 2, 11, 16), (2, 1, 1, 11)))
    g.mark_output(g.sdpa(q, k, v, m, causal=True))
    ins = [torch.randn(2, 4, 9, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 1, 1, 11)]
    want = F.scaled_dot_product_attention(*ins[:3], attn_mask=ins[3], is_causal=True, enable_gqa=True)
    return g, ins, want


CASES = {"linear-nk-bias": lambda: _linear("nk", True), "linear-nk": lambda: _linear("nk", False),
         "linear-kn-bias": lambda: _linear("kn", True), "matmul-batched": _matmul, "sdpa-causal-gqa": _sdpa,
         "sdpa-mask-causal": _sdpa_mask_causal, "layout-permute-cat-pad": _layout,
         "conv-block": _conv}


@pytest.fixture
def measuring(monkeypatch):
    """The interpreter backend choosing as a GPU backend does."""
    monkeypatch.setattr(TritonInterpreterBackend, "measures_vendor", True)


PINNED = [(c, p) for c in CASES for p in ("yirage", "torch")] + [("linear-nk-bias", "torch-mm"),
                                                                   ("linear-kn-bias", "torch-mm")]


@pytest.mark.parametrize("case,provider", PINNED)
def test_each_provider_computes_what_torch_eager_does(case, provider, measuring, monkeypatch):
    chosen = []

    def pin(key, cands, default, **kw):
        biased_linear = case.startswith("linear") and case.endswith("bias")
        assert set(cands) == {"yirage", "torch"} | ({"torch-mm"} if biased_linear else set())
        assert default == "yirage" and callable(kw.get("sync"))
        chosen.append(key)
        return tuning.Choice(provider, "pinned")
    monkeypatch.setattr(tuning, "choose", pin)
    g, ins, want = CASES[case]()
    plan = g.compile("triton-interpret").plan(ins)
    op = {"conv": "conv2d"}.get(case.split("-")[0], case.split("-")[0])
    assert chosen and all(k.startswith(f"{op}|cpu/float32") and k.endswith("|t0") for k in chosen)
    if op == "layout":
        assert {k.split("|")[1] for k in chosen} == {"cpu/float32/permute/0213", "cpu/float32/cat", "cpu/float32/pad"}
    picked = [t.provider for t in plan.thunks if hasattr(t, "provider")]
    assert picked and set(picked) == {f"{provider} (pinned)"}
    out = plan.run()
    pairs = [(out[i], w) for i, w in want.items()] if isinstance(want, dict) else [(out[0], want)]
    for o, w in pairs:
        torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-4)


def test_first_use_measures_both_with_the_device_sync_and_records_the_choice(measuring, monkeypatch):
    monkeypatch.setattr(tuning, "busy_reason", lambda *a: None)
    syncs = []
    monkeypatch.setattr(TritonInterpreterBackend, "synchronize", lambda self: syncs.append(1))
    g, ins, want = _linear("nk", True)
    plan = g.compile("triton-interpret").plan(ins)
    key = "linear|cpu/float32/bias|m4|n24|k40|t0"
    entry = tuning.active_profile().entries[key]
    assert set(entry["median_s"]) == {"yirage", "torch", "torch-mm"} and entry["source"] == "first use"
    assert entry["choice"] == min(entry["median_s"], key=entry["median_s"].get)
    assert len(syncs) >= 9   # after every sample: 3+ rounds of 3 candidates
    assert plan.thunks[0].provider == f"{entry['choice']} (measured)"
    torch.testing.assert_close(plan.run()[0], want, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(tuning, "measure", lambda *a, **k: pytest.fail("measured again"))
    g2, ins2, _ = _linear("nk", True, M=7)   # M 7: the same bucket of rows (4..7)
    plan2 = g2.compile("triton-interpret").plan(ins2)
    assert plan2.thunks[0].provider == f"{entry['choice']} (profile)"


def test_the_interpreter_and_tune_off_keep_the_triton_kernel(monkeypatch):
    monkeypatch.setattr(tuning, "choose", lambda *a, **k: pytest.fail("the interpreter measured"))
    g, ins, want = _linear("nk", True)
    plan = g.compile("triton-interpret").plan(ins)
    assert not any(hasattr(t, "provider") for t in plan.thunks)   # Triton's kernel, bound directly
    torch.testing.assert_close(plan.run()[0], want, rtol=1e-4, atol=1e-4)
    monkeypatch.undo()
    monkeypatch.setattr(TritonInterpreterBackend, "measures_vendor", True)
    monkeypatch.setenv("YIRAGE_TUNE", "off")
    plan = g.compile("triton-interpret").plan(ins)
    assert plan.thunks[0].provider == "yirage (default (YIRAGE_TUNE=off))"


def test_only_float_weights_of_the_activations_dtype_have_a_torch_candidate():
    g = yr.new_kernel_graph("triton-interpret")
    x = g.new_input((2, 64))
    w = g.new_input((8, 64), dtype="q8_0")
    g.mark_output(g.linear(x, w))
    node = next(n for n in g.ops if n.op == "linear")
    assert not triton_providers.vendor_applies(node, g)
    g2, _, _ = _linear("nk", False)
    assert triton_providers.vendor_applies(next(n for n in g2.ops if n.op == "linear"), g2)
    with pytest.raises(KeyError, match="yirage, torch\\)"):
        triton_providers.bind_provider("mkl", node, g, [], None, None, None)


@pytest.mark.parametrize("provider", ["yirage", "torch"])
def test_a_written_batch_norm_statistic_or_weight_is_seen_by_the_next_call(provider, measuring, monkeypatch):
    """BatchNormFold computes the folded BatchNorm once, and again after a write to a statistic
    or the convolution's weight (version counter): a frozen model's parameters written in place
    stay visible, for the Triton kernel's scale and shift as for cuDNN's folded weight."""
    monkeypatch.setattr(tuning, "choose", lambda key, cands, default, **kw: tuning.Choice(provider, "pinned"))
    g = yr.new_kernel_graph("triton-interpret")
    x, w = g.new_input((1, 4, 6, 5)), g.new_input((6, 4, 3, 3))
    stats = [g.new_input((6,)) for _ in range(4)]
    g.mark_output(g.relu(g.batch_norm(g.conv2d(x, w, None, 1, 1), *stats, eps=1e-5)))
    ins = [torch.randn(1, 4, 6, 5), torch.randn(6, 4, 3, 3) / 3, torch.randn(6), torch.rand(6) + 0.5,
           torch.randn(6), torch.randn(6)]

    def want():
        y = F.conv2d(ins[0], ins[1], None, 1, 1)
        return F.batch_norm(y, ins[2], ins[3], ins[4], ins[5], training=False, eps=1e-5).relu()
    plan = g.compile("triton-interpret").plan(ins)
    assert [t.provider for t in plan.thunks if hasattr(t, "provider")] == [f"{provider} (pinned)"]
    torch.testing.assert_close(plan.run()[0], want(), rtol=1e-4, atol=1e-4)
    ins[3].mul_(4.0)   # running_var
    torch.testing.assert_close(plan.run()[0], want(), rtol=1e-4, atol=1e-4)
    ins[1].neg_()      # the convolution's weight
    torch.testing.assert_close(plan.run()[0], want(), rtol=1e-4, atol=1e-4)
