"""Models through ``torch.compile(backend="yirage")`` / ``yr.compile`` against torch eager.

Every test also checks that yirage partitions actually ran (``yr.explain`` counts, or the
partitions of the backend's reports), so none can pass by an all-eager fallback.
"""
import importlib.metadata

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import yirage as yr
from yirage.dynamo.compiler import YirageBackend

TOL = dict(rtol=1e-4, atol=1e-4)


class MLP(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """LayerNorm -> Linear -> softmax over the last dim."""

    def __init__(self, d=32, n=48):
        super().__init__()
        self.ln, self.proj = nn.LayerNorm(d), nn.Linear(d, n)

    def forward(self, x):
        return torch.softmax(self.proj(self.ln(x)), dim=-1)


class Split(nn.Module):
    """Two lowerable blocks with an op yirage does not lower (cumprod) between them."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = F.silu(self.a(x)) * 0.5
        h = torch.cumprod(h, dim=-1)
        return torch.relu(self.b(h)) + 1.0


def _compiled_run(model, *inputs, **opts):
    be = YirageBackend(**opts)
    with torch.no_grad():
        out = torch.compile(model, backend=be)(*inputs)
        ref = model(*inputs)
    return out, ref, be


def _yirage_partitions(be):
    return [p for r in be.reports for p in r.partitions if p.runs_in == "yirage"]


@pytest.mark.parametrize("model, shape", [(MLP(), (4, 32)), (MLP(), (2, 5, 32)), (Block(), (3, 7, 32))])
def test_model_matches_eager(model, shape):
    x = torch.randn(shape)
    out, ref, be = _compiled_run(model.eval(), x)
    torch.testing.assert_close(out, ref, **TOL)
    parts = _yirage_partitions(be)
    assert len(parts) == 1 and not any(t for r in be.reports for t in r.torch_ops)
    assert parts[0].num_compute_ops >= 3


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("make_model", [MLP, Block])
def test_half_precision_models_match_eager(make_model, dtype, tol):
    model, x = make_model().eval().to(dtype), torch.randn(3, 5, 32, dtype=dtype)
    out, ref, be = _compiled_run(model, x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    parts = _yirage_partitions(be)
    assert len(parts) == 1 and not any(t for r in be.reports for t in r.torch_ops)
    assert parts[0].num_compute_ops >= 3


def test_unsupported_op_splits_into_two_partitions():
    model, x = Split().eval(), torch.randn(2, 3, 32)
    report = yr.explain(model, x)
    with torch.no_grad():
        torch.testing.assert_close(report.outputs, model(x), **TOL)
    assert len(report.yirage_partitions) == 2
    (cumprod,) = report.torch_ops
    assert cumprod.op == "aten.cumprod.default" and "no lowering" in cumprod.reason
    text = str(report)
    assert "2 partition(s) on yirage" in text and "cumprod" in text and "no lowering" in text
    assert report.to_dict()["graphs"][0]["torch_ops"][0]["op"] == "aten.cumprod.default"


def test_registered_name_and_yr_compile():
    """``backend="yirage"`` by name (the installed entry point, else ``register()``) and
    ``yr.compile``; both match eager and run yirage partitions."""
    names = importlib.metadata.entry_points(group="torch_dynamo_backends").names
    if "yirage" not in names:
        yr.dynamo.register()
    model, x = MLP().eval(), torch.randn(4, 32)
    with torch.no_grad():
        ref = model(x)
        by_name = torch.compile(model, backend="yirage")(x)
        torch._dynamo.reset()
        by_yr = yr.compile(model)(x)
    torch.testing.assert_close(by_name, ref, **TOL)
    torch.testing.assert_close(by_yr, ref, **TOL)
    assert len(yr.explain(model, x).yirage_partitions) == 1


def test_options_through_torch_compile():
    """torch.compile passes ``options`` to a named backend: a bad one is our error, by name."""
    yr.dynamo.register()
    with pytest.raises(Exception, match="unknown option.*'nope'.*valid options: backend, dtype"):
        with torch.no_grad():
            torch.compile(MLP(), backend="yirage", options={"nope": 1})(torch.randn(2, 32))


def test_bert_matches_eager():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=32)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[1, 9:] = 0
    be = YirageBackend()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = torch.compile(model, backend=be)(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, ref, **TOL)
    parts = _yirage_partitions(be)
    assert parts and sum(p.num_compute_ops for p in parts) >= 20
    assert not any(p.runs_in == "torch" for r in be.reports for p in r.partitions)


def test_new_shapes():
    """Static compiles (dynamic=False) compile each shape; dynamic=True compiles one symbolic
    graph whose partitions run in yirage for every shape (tests/dynamo/test_dynamic.py has more)."""
    model = MLP().eval()
    be = YirageBackend()
    static = torch.compile(model, backend=be, dynamic=False)
    with torch.no_grad():
        for rows in (2, 3, 4):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(static(x), model(x), **TOL)
    assert [len(r.partitions) for r in be.reports] == [1, 1, 1]
    torch._dynamo.reset()
    be = YirageBackend()
    dyn = torch.compile(model, backend=be, dynamic=True)
    with torch.no_grad():
        for rows in (5, 6):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(dyn(x), model(x), **TOL)
    (report,) = be.reports
    (part,) = report.partitions
    assert part.runs_in == "yirage" and part.symbolic and part.variants == 2


class Inception(nn.Module):
    """A stem convolution, then an Inception-style module: three 1x1 branches of one input
    (conv -> BatchNorm -> ReLU each, different widths), one of them followed by a 3x3, a max-pool
    branch, all concatenated along the channels."""

    def __init__(self, c=24):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)

        def branch(o):
            return nn.Sequential(nn.Conv2d(c, o, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU())
        self.b1, self.b2, self.b3 = branch(16), branch(48), branch(8)
        self.b2b = nn.Conv2d(48, 32, 3, padding=1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        return torch.cat([self.b1(x), self.b2b(self.b2(x)), self.b3(x), F.max_pool2d(x, 3, 1, 1)], dim=1)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "measured"])
def test_inception_branches_match_eager(monkeypatch, merge):
    """An Inception module's 1x1 branches through torch.compile: with the CPU's merge forced on
    they run as one ``conv2d_stack`` GEMM (counted); with it measured, whichever is chosen;
    both equal eager. The BatchNorms are calibrated so that they matter."""
    from yirage.backends.cpu import conv as cpu_conv
    from yirage.backends.cpu import CPUBackend
    model = Inception()
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 3, 9, 11))
    model.eval()
    calls = []
    if merge:
        monkeypatch.setattr(CPUBackend, "merge_convs", lambda self, case: True)
        real = cpu_conv._conv_stack_gemm
        monkeypatch.setattr(cpu_conv, "_conv_stack_gemm", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(2, 3, 9, 11)
    out, ref, be = _compiled_run(model, x)
    torch.testing.assert_close(out, ref, **TOL)
    assert _yirage_partitions(be) and not any(t for r in be.reports for t in r.torch_ops)
    assert calls == ([1] if merge else [])
