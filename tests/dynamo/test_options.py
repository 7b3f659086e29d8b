"""Options, fallbacks, verify and gradients of the torch.compile front end.

Failures are provoked by replacing one entry of the lowering table (monkeypatch), so the
tests do not depend on which ops happen to be missing today.
"""
import importlib
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import yirage as yr
from yirage.dynamo import lowering
from yirage.dynamo.compiler import YirageBackend
from yirage.dynamo.options import VALID_KEYS, parse_options
from yirage.errors import GraphError, TorchCompileError, YirageFallbackWarning

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]


class MLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _run(model, x, **opts):
    be = YirageBackend(**opts)
    out = torch.compile(model, backend=be)(x)
    return out, be


def _broken_gelu(monkeypatch, emit):
    old = lowering.LOWERINGS[aten.gelu.default]
    monkeypatch.setitem(lowering.LOWERINGS, aten.gelu.default, lowering.Lowering(old.check, emit))


def test_entry_point_in_pyproject_resolves_to_the_backend():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["torch_dynamo_backends"]["yirage"]
    module, attr = target.split(":")
    fn = getattr(importlib.import_module(module), attr)
    assert fn is yr.dynamo.backend and callable(fn)


def test_register_makes_the_name_known():
    from torch._dynamo.backends import registry
    yr.dynamo.register()
    assert registry.lookup_backend("yirage") is not None
    assert "yirage" in torch._dynamo.list_backends(exclude_tags=())


@pytest.mark.parametrize("import_first", [False, True])
def test_backend_name_works_in_a_fresh_process(import_first):
    """``torch.compile(m, backend="yirage")`` in a new interpreter, with no yirage import (the
    installed entry point) and with ``import yirage`` after torch._dynamo (which must not
    register the name a second time: torch would refuse the entry point as a duplicate)."""
    import subprocess
    import sys
    code = ("import torch, torch._dynamo\n" + ("import yirage\n" if import_first else "") +
            "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())\nx = torch.randn(2, 8)\n"
            "with torch.no_grad():\n    y = torch.compile(m, backend='yirage')(x)\n"
            "    assert (y - m(x)).abs().max() < 1e-5\n"
            "import sys\nassert 'yirage.dynamo' in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("mode, options, message", [
    (None, {"min_blok_size": 3}, r"unknown option\(s\) 'min_blok_size'; valid options: backend, dtype, "
                                 r"min_block_size, torch_executed_ops, fallback, verify, cache_dir, time_budget_s, "
                                 r"freeze"),
    ("fast", None, r"unknown mode 'fast'; valid modes: None .*'max-autotune'"),
    (None, {"fallback": "ignore"}, r"'fallback': must be one of \('eager', 'raise'\), got 'ignore'"),
    (None, {"min_block_size": 0}, r"'min_block_size': must be an integer >= 1"),
    (None, {"verify": "yes"}, r"'verify': must be a bool"),
    (None, {"time_budget_s": -1}, r"'time_budget_s': must be a positive number"),
    (None, {"torch_executed_ops": "aten.gelu"}, r"'torch_executed_ops': must be a collection"),
    (None, {"dtype": "float16"}, r"'dtype': must be None or one of \('bfloat16',\)"),
    (None, {"freeze": 1}, r"'freeze': must be a bool"),
    (None, [1], r"options must be a dict"),
])
def test_bad_options_name_the_valid_ones(mode, options, message):
    with pytest.raises(TorchCompileError, match=message):
        yr.compile(MLP(), mode=mode, options=options)


def test_parse_options_defaults():
    o = parse_options("default", {"torch_executed_ops": [aten.gelu.default, "torch.ops.aten.relu"]})
    assert o.mode is None and o.fallback == "eager" and o.min_block_size == 2 and not o.verify and o.freeze
    assert o.torch_executed_ops == {"aten.gelu.default", "aten.relu"}
    assert set(VALID_KEYS) == {"backend", "dtype", "min_block_size", "torch_executed_ops", "fallback",
                               "verify", "cache_dir", "time_budget_s", "freeze"}


def test_fallback_eager_warns_once_and_matches(monkeypatch):
    def emit(e, node):
        raise GraphError("gelu: deliberately broken")
    _broken_gelu(monkeypatch, emit)
    model, x = MLP().eval(), torch.randn(3, 16)
    with torch.no_grad(), pytest.warns(YirageFallbackWarning) as record:
        out, be = _run(model, x)
        out2 = torch.compile(model, backend=be)(x)
    fallbacks = [w for w in record if issubclass(w.category, YirageFallbackWarning)]
    assert len(fallbacks) == 1
    assert "aten.gelu.default" in str(fallbacks[0].message) and "deliberately broken" in str(fallbacks[0].message)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
        torch.testing.assert_close(out2, model(x))
    (part,) = be.reports[0].partitions
    assert part.runs_in == "torch" and "deliberately broken" in part.reason


def test_fallback_raise_is_an_error(monkeypatch):
    def emit(e, node):
        raise GraphError("gelu: deliberately broken")
    _broken_gelu(monkeypatch, emit)
    with torch.no_grad(), pytest.raises(Exception, match="deliberately broken.*fallback='raise'"):
        _run(MLP().eval(), torch.randn(3, 16), options={"fallback": "raise"})


def test_verify_passes_on_a_correct_model():
    model, x = MLP().eval(), torch.randn(3, 16)
    with torch.no_grad():
        out, be = _run(model, x, options={"verify": True})
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    assert be.reports[0].partitions[0].runs_in == "yirage"


def test_verify_catches_a_wrong_lowering(monkeypatch):
    _broken_gelu(monkeypatch, lambda e, node: e.g.relu(e[node.args[0]]))   # wrong on purpose
    with torch.no_grad(), pytest.raises(TorchCompileError, match="verify: output 0 .* differs from eager"):
        _run(MLP().eval(), torch.randn(3, 16), options={"verify": True})


def test_a_graph_needing_gradients_runs_eager_with_one_warning():
    model, x = MLP(), torch.randn(3, 16)
    with pytest.warns(YirageFallbackWarning, match="needs gradients.*torch.no_grad") as record:
        out, be = _run(model, x)
    assert sum(issubclass(w.category, YirageFallbackWarning) for w in record) == 1
    torch.testing.assert_close(out, model(x))
    out.sum().backward()                                  # eager: gradients still flow
    assert model.fc1.weight.grad is not None
    assert be.reports[0].reason and not be.reports[0].partitions


def test_a_graph_needing_gradients_with_fallback_raise():
    with pytest.raises(Exception, match="needs gradients"):
        _run(MLP(), torch.randn(3, 16), options={"fallback": "raise"})


def test_torch_executed_ops_and_min_block_size():
    model, x = MLP().eval(), torch.randn(3, 16)
    report = yr.explain(model, x, options={"torch_executed_ops": ["aten.gelu"]})
    reasons = {t.op: t.reason for t in report.torch_ops}
    assert reasons["aten.gelu.default"] == "listed in torch_executed_ops"
    # the two linears, alone on each side of gelu, are partitions of 1 compute op
    assert not report.yirage_partitions and "min_block_size=2" in reasons["aten.linear.default"]
    torch._dynamo.reset()
    report = yr.explain(model, x, options={"torch_executed_ops": ["aten.gelu"], "min_block_size": 1})
    assert len(report.yirage_partitions) == 2
    with torch.no_grad():
        torch.testing.assert_close(report.outputs, model(x), rtol=1e-4, atol=1e-4)


def test_cache_dir_receives_the_kernels(tmp_path):
    """A kernel this process has not loaded yet (a clamp bound no other test uses) is built
    into ``cache_dir``."""
    def model(x):
        return torch.clamp(x * 3.0, -0.123457, 0.7654321) + 1.0
    x = torch.randn(3, 16)
    report = yr.explain(model, x, options={"cache_dir": str(tmp_path)})
    assert report.yirage_partitions
    assert any(tmp_path.rglob("*")), "no kernel was written to cache_dir"


def test_max_autotune_superoptimizes_each_partition():
    model, x = MLP().eval(), torch.randn(4, 16)
    report = yr.explain(model, x, mode="max-autotune", options={"time_budget_s": 1})
    (part,) = report.yirage_partitions
    assert part.compiled_as.startswith("superoptimize: ")
    with torch.no_grad():
        torch.testing.assert_close(report.outputs, model(x), rtol=1e-4, atol=1e-4)


def test_default_and_reduce_overhead_use_the_fixed_fusion():
    model, x = MLP().eval(), torch.randn(4, 16)
    for mode in (None, "reduce-overhead"):
        torch._dynamo.reset()
        report = yr.explain(model, x, mode=mode)
        (part,) = report.yirage_partitions
        assert part.compiled_as.startswith("fixed fusion: ")
        assert "as fixed fusion" in str(report)


def test_more_compiles_of_one_forward_than_dynamos_recompile_limit():
    """Every ``yr.compile`` and ``yr.explain`` brings its own backend, which dynamo's
    BACKEND_MATCH guard tells apart: compiled on one code object (every instance of a class,
    every transformers model behind its shared ``forward`` wrapper), the ninth call used to hit
    ``torch._dynamo.config.recompile_limit`` (8) and run eager, with only a log line to say so
    (explain reported 0 graphs). Each call now has recompiles of its own (torch.compile's
    ``isolate_recompiles``)."""
    x = torch.randn(3, 16)
    limit = torch._dynamo.config.recompile_limit
    for i in range(limit + 2):
        report = yr.explain(MLP().eval(), x)
        assert len(report.yirage_partitions) == 1, (i, str(report))
    for i in range(limit + 2):
        model = MLP().eval()
        model.register_forward_hook(lambda *a: None)   # no precompile: the torch.compile path
        compiled = yr.compile(model)
        with torch.no_grad():
            out, ref = compiled(x), model(x)
        assert compiled.precompile_status.startswith("declined: the model has forward hooks")
        assert len(compiled._yirage_backend.reports) == 1, i   # compiled by yirage, not run eager
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_explain_says_why_when_dynamo_gave_no_graph():
    from yirage.dynamo.explain import NO_GRAPH

    @torch._dynamo.disable
    def eager_only(x):
        return F.gelu(x) * 2
    def model(x):   # all of it behind a call dynamo must not trace
        return eager_only(x)
    x = torch.randn(3, 4)
    report = yr.explain(model, x)
    assert not report.graphs and NO_GRAPH in str(report)
    torch.testing.assert_close(report.outputs, F.gelu(x) * 2)
