"""Frozen weights (``options["freeze"]``, the default): parameters and buffers a graph does not
mutate are declared constant to the backend, which may keep them prepacked for the kernel it
chose; writes to a weight stay visible. References: the same modules in torch eager."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import yirage as yr
from yirage.backends.cpu import embed as cpu_embed, providers as cpu_providers

TOL = dict(rtol=1e-4, atol=1e-4)


class MLP(nn.Module):
    def __init__(self, d=48, h=96):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Conv1DMLP(nn.Module):
    """GPT-2's Conv1D: weights stored [in, out], ``addmm(bias, x, w)`` (a [K, N] linear)."""

    def __init__(self, d=48, h=80):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(d, h) / d ** 0.5), nn.Parameter(torch.randn(h))
        self.w2 = nn.Parameter(torch.randn(h, d) / h ** 0.5)

    def forward(self, x):
        h = torch.addmm(self.b1, x.view(-1, x.shape[-1]), self.w1)
        return torch.mm(torch.tanh(h), self.w2).view(*x.shape[:-1], -1)


class Accumulates(nn.Module):
    """A 2-D buffer the forward pass writes (a mutated graph input: never frozen)."""

    def __init__(self, d=32):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("state", torch.eye(d))

    def forward(self, x):
        y = F.linear(self.fc(x), self.state).relu()
        self.state.add_(0.25)
        return y


def _pin(monkeypatch, provider: str) -> None:
    """Every float32 linear on ``provider`` (no measuring)."""
    monkeypatch.setenv("YIRAGE_TUNE", "off")
    monkeypatch.setitem(cpu_providers.DEFAULTS, "float32", provider)


@pytest.mark.parametrize("provider", ["yirage", "onednn"])
def test_frozen_weights_run_on_a_packing_provider_and_match_eager(provider, monkeypatch):
    _pin(monkeypatch, provider)
    torch.manual_seed(0)
    m = MLP().eval()
    x = torch.randn(3, 20, 48)
    with torch.no_grad():
        ref = m(x)
        out = torch.compile(m, backend="yirage")(x)
    torch.testing.assert_close(out, ref, **TOL)
    assert cpu_embed.is_constant(m.fc1.weight) and cpu_embed.is_constant(m.fc2.weight)
    case = cpu_providers.case_of("linear", [x.view(-1, 48), m.fc1.weight], torch.empty(60, 96))
    kind = cpu_providers.candidates(case)[provider].kind(case)
    assert cpu_embed.has_packed(m.fc1.weight, kind), "the chosen provider keeps the weight packed"


@pytest.mark.parametrize("provider", ["yirage", "onednn"])
def test_a_weight_written_after_compiling_is_seen(provider, monkeypatch):
    _pin(monkeypatch, provider)
    torch.manual_seed(1)
    m = MLP().eval()
    x = torch.randn(4, 48)
    c = torch.compile(m, backend="yirage")
    with torch.no_grad():
        c(x)
        m.fc1.weight.mul_(-0.5)          # in place: its packed copy is stale now
        m.fc2.bias.add_(1.0)
        torch.testing.assert_close(c(x), m(x), **TOL)


@pytest.mark.parametrize("provider", ["yirage", "onednn", "mkl"])
def test_kn_weights_on_every_provider_match_eager_and_see_writes(provider, monkeypatch):
    _pin(monkeypatch, provider)
    torch.manual_seed(4)
    m = Conv1DMLP().eval()
    x = torch.randn(2, 17, 48)
    c = torch.compile(m, backend="yirage")
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x), **TOL)
        m.w1.mul_(0.5)
        torch.testing.assert_close(c(x), m(x), **TOL)
    report = yr.explain(m, x)
    assert len(report.yirage_partitions) == 1 and not report.torch_ops


def test_freeze_false_declares_nothing(monkeypatch):
    _pin(monkeypatch, "yirage")
    torch.manual_seed(2)
    m = MLP().eval()
    x = torch.randn(5, 48)
    with torch.no_grad():
        out = torch.compile(m, backend="yirage", options={"freeze": False})(x)
        torch.testing.assert_close(out, m(x), **TOL)
    assert not cpu_embed.is_constant(m.fc1.weight)
    with pytest.raises(yr.TorchCompileError, match="freeze"):
        yr.compile(m, options={"freeze": "yes"})


def test_a_buffer_the_graph_writes_is_not_frozen():
    torch.manual_seed(3)
    m, ref_m = Accumulates().eval(), Accumulates().eval()
    ref_m.load_state_dict(m.state_dict())
    c = torch.compile(m, backend="yirage")
    x = torch.randn(6, 32)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(c(x), ref_m(x), **TOL)
    torch.testing.assert_close(m.state, ref_m.state)
    assert cpu_embed.is_constant(m.fc.weight) and not cpu_embed.is_constant(m.state)


def test_concurrent_callers_get_their_own_answers():
    """Activations are staged in a partition's own buffers (one plan, bound once); a caller that
    finds them busy runs on a plan of its own. 4 threads x 20 calls against eager."""
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(5)
    m = MLP().eval()
    c = torch.compile(m, backend="yirage")
    xs = [torch.randn(7, 48) for _ in range(4)]
    with torch.no_grad():
        refs = [m(x) for x in xs]
        c(xs[0])   # compiled here, once

        def calls(i):
            with torch.no_grad():
                return [c(xs[i]) for _ in range(20)]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(calls, range(4)))
    for ref, outs in zip(refs, results):
        for out in outs:
            torch.testing.assert_close(out, ref, **TOL)


def _bf16_reference(m: MLP, x: torch.Tensor) -> torch.Tensor:
    """What ``dtype='bfloat16'`` computes: each linear's x and weight rounded to bfloat16, the
    float32 sums rounded to bfloat16, then the float32 bias; GELU in float32."""
    def lin(layer, t):
        return F.linear(t.to(torch.bfloat16), layer.weight.to(torch.bfloat16)).float() + layer.bias
    return lin(m.fc2, F.gelu(lin(m.fc1, x)))


@pytest.mark.parametrize("provider", ["yirage", "onednn-packed", "onednn", "yirage-f32"])
def test_dtype_bfloat16_computes_the_gemms_in_bfloat16(provider, monkeypatch, provider_runs):
    provider_runs(provider, "float32/bfloat16")
    monkeypatch.setenv("YIRAGE_TUNE", "off")
    monkeypatch.setitem(cpu_providers.DEFAULTS, "float32/bfloat16", provider)
    torch.manual_seed(6)
    m = MLP(64, 128).eval()
    x = torch.randn(9, 64)
    with torch.no_grad():
        out = torch.compile(m, backend="yirage", options={"dtype": "bfloat16"})(x)
        want, exact = _bf16_reference(m, x), m(x)
    # one bfloat16 ulp of a sum (2^-8 relative) may differ in another summation order
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
    assert (out - want).abs().max() < 0.25 * (exact - want).abs().max(), "not the bfloat16 computation"
