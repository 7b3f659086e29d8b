"""The autotuning wrapper of the Triton kernels (kernels/triton/_common.py ``autotune``): on a
GPU, a launch's configs are compiled together (``precompile``) before the first is timed, and
not again for the next; the interpreter keeps one config and compiles nothing ahead. The
compiles themselves need a GPU's Triton driver: here a stand-in kernel records its warm-ups."""
import pytest
import torch
import triton
import triton.language as tl

from yirage.kernels.triton import _common

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((16, 1), (32, 2), (64, 4))]


@triton.jit
def _fill(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, 1.0, mask=offs < n)


@pytest.fixture
def tuned(monkeypatch):
    """(autotuner of ``_fill``, the calls of ``precompile`` and of the benchmark)."""
    if not _common._AUTOTUNE_DO_BENCH:
        pytest.skip("this Triton's autotuner takes no benchmark function")
    calls = {"precompile": [], "bench": 0}

    def precompile(jit_fn, configs, named_args, kw):
        calls["precompile"].append((jit_fn, [c.kwargs["BLOCK"] for c in configs], dict(named_args), dict(kw)))
        return len(configs)

    def do_bench(fn, warmup, rep, quantiles=None):
        calls["bench"] += 1
        assert (warmup, rep) == (_common.BENCH_WARMUP_MS, _common.BENCH_MS)
        return [1.0, 1.0, 1.0]
    monkeypatch.setattr(_common, "precompile", precompile)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    return _common.autotune(configs=CONFIGS, key=["n"])(_fill), calls


def test_configs_compile_together_before_the_first_timing(tuned, monkeypatch):
    tuner, calls = tuned
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    x = torch.empty(40)
    kept = tuner.early_config_prune(tuner.configs, {"x_ptr": x, "n": 40}, grid=(3,), warmup=False)
    assert [c.kwargs["BLOCK"] for c in kept] == [16, 32, 64]
    assert calls["precompile"] == []   # pruning alone compiles nothing (a disk-cached timing needs none)
    for _ in kept:
        tuner._do_bench(lambda: None, quantiles=(0.5, 0.2, 0.8))
    assert calls["bench"] == 3
    assert len(calls["precompile"]) == 1
    jit_fn, blocks, named, kw = calls["precompile"][0]
    assert jit_fn is tuner.fn and blocks == [16, 32, 64]
    assert named["x_ptr"] is x and named["n"] == 40 and kw["grid"] == (3,)


def test_the_interpreter_keeps_one_config_and_compiles_nothing_ahead(tuned, monkeypatch):
    tuner, calls = tuned
    monkeypatch.setattr(_common, "interpreting", lambda: True)
    kept = tuner.early_config_prune(tuner.configs, {"x_ptr": torch.empty(4), "n": 4}, grid=(1,), warmup=False)
    assert [c.kwargs["BLOCK"] for c in kept] == [16]
    tuner._do_bench(lambda: None, quantiles=(0.5,))
    assert calls["precompile"] == []


def test_precompile_warms_each_config_under_async_compile_and_survives_a_failure():
    pytest.importorskip("triton.runtime._async_compile")
    from triton.runtime import _async_compile

    seen = []

    class Kernel:   # stands in for a JITFunction: warmup(*args, grid, **kwargs)
        def warmup(self, *args, grid, **kwargs):
            seen.append((args, grid, kwargs["BLOCK"], kwargs["num_warps"], kwargs["HAS_BIAS"],
                         _async_compile.active_mode.get() is not None))
            if kwargs["BLOCK"] == 32:
                raise RuntimeError("out of shared memory")   # left to the autotuner, which times it as inf
    x = torch.empty(8)
    n = _common.precompile(Kernel(), CONFIGS, {"x_ptr": x, "n": 8}, {"grid": (2,), "warmup": False, "HAS_BIAS": True})
    assert n == 3
    assert [(s[2], s[3]) for s in seen] == [(16, 1), (32, 2), (64, 4)]   # past the failure, nothing raised
    assert all(s[0] == (x, 8) and s[1] == (1,) and s[4] is True and s[5] for s in seen)
    assert _async_compile.active_mode.get() is None
