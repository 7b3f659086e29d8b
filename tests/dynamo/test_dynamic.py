"""Dynamic shapes through ``torch.compile(backend="yirage")``: symbolic graphs run their
partitions in yirage, compiled per input signature, and a new length costs no C++ build."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import yirage as yr
from yirage.dynamo.compiler import YirageBackend
from yirage.runtime import toolchain

TOL = dict(rtol=1e-4, atol=1e-4)


class Attention(nn.Module):
    """LayerNorm, one attention head with softmax over the keys (row width = sequence length)."""

    def __init__(self, d=32):
        super().__init__()
        self.ln, self.q, self.k, self.v = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.ln(x)
        s = self.q(h) @ self.k(h).transpose(-1, -2) * 0.25
        return F.gelu(torch.softmax(s, dim=-1) @ self.v(h)) + x


def _parts(be):
    return [p for r in be.reports for p in r.partitions]


def test_automatic_dynamic_bert_over_lengths():
    """A small BERT under no_grad over 6 sequence lengths with torch's default dynamic=None:
    one static compile, one dynamic recompile, then no dynamo compile and no C++ build for
    the remaining lengths; eager-equal at every length."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=64)
    model = transformers.BertModel(config).eval()
    be = YirageBackend()
    compiled = torch.compile(model, backend=be)
    builds = []
    with torch.no_grad():
        for length in (6, 9, 11, 14, 19, 23):
            ids = torch.randint(0, 100, (2, length))
            mask = torch.ones(2, length, dtype=torch.int64)
            mask[1, length - 2:] = 0
            out = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
            torch.testing.assert_close(out, ref, **TOL)
            builds.append(toolchain.builds())
    assert len(be.reports) == 2                      # static first shape, then one symbolic graph
    assert builds[2:] == [builds[1]] * 4             # new lengths reuse the C++ already built
    dynamic = be.reports[-1].partitions
    assert dynamic and all(p.runs_in == "yirage" and p.symbolic for p in dynamic)
    assert sum(p.num_compute_ops for p in dynamic) >= 20
    assert max(p.variants for p in dynamic) == 5


def test_dynamic_true_softmax_over_sequence():
    """dynamic=True: one graph for every length; the softmax over the keys (its row width is
    the length) is built once."""
    model, be = Attention().eval(), YirageBackend()
    compiled = torch.compile(model, backend=be, dynamic=True)
    with torch.no_grad():
        for i, length in enumerate((5, 8, 13, 21)):
            x = torch.randn(2, length, 32)
            torch.testing.assert_close(compiled(x), model(x), **TOL)
            if i == 0:
                after_first = toolchain.builds()
    assert toolchain.builds() == after_first
    assert len(be.reports) == 1
    parts = _parts(be)
    assert parts and all(p.runs_in == "yirage" and p.symbolic and p.variants == 4 for p in parts)
    assert any("_softmax" in op for p in parts for op in p.ops)


def test_mark_dynamic():
    """torch._dynamo.mark_dynamic on the batch dim: one compile, yirage partitions, eager-equal."""
    model, be = Attention().eval(), YirageBackend()
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        for batch in (2, 3, 7):
            x = torch.randn(batch, 6, 32)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert len(be.reports) == 1
    assert all(p.runs_in == "yirage" and p.symbolic for p in _parts(be))


def test_yr_compile_is_dynamic_after_a_second_shape():
    """yr.compile keeps torch's dynamic=None: a second shape recompiles once, symbolically."""
    model = Attention().eval()
    compiled = yr.compile(model)
    with torch.no_grad():
        for length in (4, 6, 9, 10):
            x = torch.randn(1, length, 32)
            torch.testing.assert_close(compiled(x), model(x), **TOL)
    report = yr.explain(model, torch.randn(1, 5, 32))
    assert report.yirage_partitions
