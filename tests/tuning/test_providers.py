"""Kernel providers of the CPU's linear layers (backends/cpu/providers.py) and their choice by
measurement (tuning/profile.py): every provider computes the op as the reference interpreter
does, with and without a fused row epilogue; the first use measures and records; the profile,
then a matching template, answer later uses; YIRAGE_TUNE=off gives the fixed defaults."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import yirage as yr
from yirage.backends.cpu import embed as cpu_embed, providers as cpu_providers
from yirage.errors import YirageError
from yirage.tuning import profile as tuning


def _graph(M, N, K, wdtype, epilogue, int8_group=None):
    """linear (or linear_w8a8) [M, K] -> [M, N] with a bias, then (epilogue) residual + LayerNorm
    and GELU, as the encoder's layers are; returns (graph, inputs) with the weight at index 1."""
    g = yr.new_kernel_graph(backend="cpu")
    X = g.new_input((M, K))
    if int8_group is None:
        W, B = g.new_input((N, K), dtype=wdtype), g.new_input((N,))
        y = g.linear(X, W, B)
        w = (torch.randn(N, K) / K ** 0.5).to(getattr(torch, wdtype))
        ins = [torch.randn(M, K), w, torch.randn(N)]
    else:
        W, S, B = g.new_input((K, N), dtype="int8"), g.new_input((N,)), g.new_input((N,))
        y = g.linear_w8a8(X, W, S, B, group_size=int8_group)
        ins = [torch.randn(M, K), torch.randint(-127, 128, (K, N), dtype=torch.int8), torch.rand(N) / 100,
               torch.randn(N)]
    if epilogue:
        R, LW, LB = g.new_input((M, N)), g.new_input((N,)), g.new_input((N,))
        y = g.gelu(g.layer_norm(g.add(y, R), (N,), LW, LB, 1e-5))
        ins += [torch.randn(M, N), torch.rand(N) + 0.5, torch.randn(N)]
    g.mark_output(y)
    return g, ins


CASES = [("float32", None, name) for name in ("yirage", "mkl", "onednn")] + \
        [("bfloat16", None, name) for name in ("yirage", "onednn", "onednn-packed")] + \
        [("int8", 0, "yirage"), ("int8", 0, "onednn"), ("int8", 32, "yirage")]


@pytest.mark.parametrize("epilogue", [False, True])
@pytest.mark.parametrize("dtype,group,provider", CASES)
@pytest.mark.parametrize("M,N,K", [(1, 40, 64), (203, 96, 64), (37, 1000, 96)])
def test_every_provider_computes_the_reference(dtype, group, provider, epilogue, M, N, K, monkeypatch, provider_runs):
    """Each provider, pinned (YIRAGE_TUNE=off with it as the default), against the reference
    interpreter; with the epilogue, a vendor GEMM runs in row blocks (N=1000: blocks of 64 rows)."""
    provider_runs(provider, dtype)
    monkeypatch.setenv("YIRAGE_TUNE", "off")
    monkeypatch.setitem(cpu_providers.DEFAULTS, dtype, provider)
    g, ins = _graph(M, N, K, "float32" if dtype == "int8" else dtype, epilogue, group)
    cpu_embed.mark_constant(ins[1])
    plan = g.compile().plan(ins)
    gemm = [t for t in plan.thunks if hasattr(t, "provider")]
    assert [t.provider for t in gemm] == [f"{provider} (default (YIRAGE_TUNE=off))"]
    assert len(plan.thunks) == 1   # with the epilogue: the row program ran inside the GEMM's thunk
    out = plan.run()[0]
    ref = g.interpret(ins)[0]
    # bfloat16: the GEMM's sum is rounded to bfloat16; a different summation order may round
    # the other way (one bfloat16 ulp, 2^-8 relative) before LayerNorm/GELU
    tol = {"float32": 1e-4, "bfloat16": 3e-2, "int8": 1e-3}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_packing_providers_need_a_constant_weight():
    x, w = torch.randn(8, 16), torch.randn(12, 16)
    case = cpu_providers.case_of("linear", [x, w], torch.empty(8, 12))
    assert set(cpu_providers.candidates(case)) == {"mkl"}
    cpu_embed.mark_constant(w)
    case = cpu_providers.case_of("linear", [x, w], torch.empty(8, 12))
    assert set(cpu_providers.candidates(case)) == {"yirage", "mkl", "onednn"}
    wb = w.bfloat16()
    assert set(cpu_providers.candidates(cpu_providers.case_of("linear", [x, wb], torch.empty(8, 12)))) == {"onednn"}
    cpu_embed.mark_constant(wb)
    packed = {"onednn-packed"} if _onednn_reorders_bfloat16() else set()   # as the CPU (and YIRAGE_ISA) allow
    assert set(cpu_providers.candidates(cpu_providers.case_of("linear", [x, wb], torch.empty(8, 12)))) == {
        "yirage", "onednn"} | packed
    case = cpu_providers.case_of("linear", [x, w], torch.empty(8, 12), compute_dtype="bfloat16")
    assert set(cpu_providers.candidates(case)) == {"yirage", "onednn", "yirage-f32"} | packed


def _onednn_reorders_bfloat16() -> bool:
    """Does oneDNN itself reorder a bfloat16 weight here (the step onednn-packed needs)?"""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.randn(8, 16).bfloat16(), 4)
    except RuntimeError:
        return False
    return True


def test_a_provider_is_a_candidate_exactly_where_the_cpu_runs_it():
    """onednn-packed (bfloat16) is offered exactly where oneDNN reorders a bfloat16 weight on this
    CPU (with YIRAGE_ISA=avx2 oneDNN is capped to AVX2 and refuses, as on an AMD Zen 3); where it
    is left out, ``unavailable`` says why."""
    wb = torch.randn(12, 16).bfloat16()
    cpu_embed.mark_constant(wb)
    case = cpu_providers.case_of("linear", [torch.randn(8, 16), wb], torch.empty(8, 12))
    runs = _onednn_reorders_bfloat16()
    assert ("onednn-packed" in cpu_providers.candidates(case)) == runs
    why = cpu_providers.unavailable(case).get("onednn-packed")
    assert (why is None) == runs
    if not runs:
        assert "bfloat16" in why


def test_first_use_measures_records_and_drops_the_losers_copies(monkeypatch):
    """The first bind of a shape class times every candidate on it and stores the fastest in this
    machine's profile (file and memory); packed copies made only for the measurement are dropped;
    a later bind of the class reads the profile and measures nothing."""
    monkeypatch.setattr(tuning, "busy_reason", lambda *a: None)   # however busy the machine is
    g, ins = _graph(64, 52, 36, "float32", False)     # a shape class no other test measures
    w = ins[1]
    cpu_embed.mark_constant(w)
    key = cpu_providers.case_of("linear", ins[:3], torch.empty(64, 52)).key()
    assert key == f"linear|float32|m64|n52|k36|t{torch.get_num_threads()}"
    assert key not in tuning.active_profile().entries
    plan = g.compile().plan(ins)
    entry = tuning.active_profile().entries[key]
    assert set(entry["median_s"]) == {"yirage", "mkl", "onednn"} and entry["source"] == "first use"
    assert entry["choice"] == min(entry["median_s"], key=entry["median_s"].get)
    assert plan.thunks[0].provider == f"{entry['choice']} (measured)"
    on_disk = json.loads(tuning.profile_path().read_text())
    assert on_disk["entries"][key]["choice"] == entry["choice"]
    assert on_disk["machine"]["cpu"] == yr.get_backend_info("cpu").device_name
    kinds = {"yirage": "f32", "onednn": "onednn/64"}
    for name, kind in kinds.items():
        assert cpu_embed.has_packed(w, kind) == (name == entry["choice"])

    def no_measuring(*a, **k):
        raise AssertionError("measured again")
    monkeypatch.setattr(tuning, "measure", no_measuring)
    g2, ins2 = _graph(100, 52, 36, "float32", False)     # another M in the same bucket (64..127)
    cpu_embed.mark_constant(ins2[1])
    plan2 = g2.compile().plan(ins2)
    assert plan2.thunks[0].provider == f"{entry['choice']} (profile)"
    torch.testing.assert_close(plan2.run()[0], g2.interpret(ins2)[0], rtol=1e-4, atol=1e-4)


def test_a_matching_template_answers_until_the_machine_has_its_own(monkeypatch):
    x, w = torch.randn(8, 16), torch.randn(24, 16)
    cpu_embed.mark_constant(w)
    case = cpu_providers.case_of("linear", [x, w], torch.empty(8, 24))
    ident = tuning.machine_identity()
    tpl = {"measured_on": "test", "match": {"cpu": ident["cpu"], "isa_all": ident["isa"][:2]},
           "entries": {case.key(): {"choice": "onednn", "median_s": {p.name: 1e-6 for p in cpu_providers.PROVIDERS}}}}
    other = {"measured_on": "another CPU", "match": {"cpu": "Some Other CPU"},
             "entries": {case.key(): {"choice": "mkl"}}}
    monkeypatch.setattr(tuning, "templates", lambda: (("aaa-other", other), ("bbb-this", tpl)))
    tuning.matching_template.cache_clear()
    try:
        monkeypatch.setattr(tuning, "measure", lambda *a, **k: pytest.fail("measured despite the template"))
        provider, choice = cpu_providers.choose(case, [x, w])
        assert (provider.name, choice.source) == ("onednn", "template bbb-this")
        tuning.active_profile().entries[case.key()] = {"choice": "mkl", "median_s": {}}   # its own profile wins
        assert cpu_providers.choose(case, [x, w])[1].source == "profile"
    finally:
        tuning.matching_template.cache_clear()


def test_a_provider_added_since_the_measurement_is_measured(monkeypatch):
    """A profile entry whose timings lack one of today's candidates is measured again (the new
    provider gets its chance); one without timings (a choice made by hand) is kept."""
    key = "testop|float32|m1|n1|k1|t1"
    cands = {"old": lambda: (lambda: None), "new": lambda: (lambda: None)}
    tuning.active_profile().entries[key] = {"choice": "old", "median_s": {"old": 1e-6}}
    measured = []

    def fake_measure(thunks, budget_s, **kw):
        measured.append(sorted(thunks))
        return None
    monkeypatch.setattr(tuning, "measure", fake_measure)
    monkeypatch.setattr(tuning, "record", lambda k, comparison, source: tuning.Choice("new", source))
    assert tuning.choose(key, cands, "old").provider == "new" and measured == [["new", "old"]]
    tuning.active_profile().entries[key] = {"choice": "old", "median_s": {}}
    assert tuning.choose(key, cands, "old").source == "profile" and len(measured) == 1


def test_tune_off_and_bad_values(monkeypatch):
    x, w = torch.randn(8, 16), torch.randn(24, 16)
    cpu_embed.mark_constant(w)
    case = cpu_providers.case_of("linear", [x, w], torch.empty(8, 24))
    monkeypatch.setattr(tuning, "measure", lambda *a, **k: pytest.fail("measured with YIRAGE_TUNE=off"))
    monkeypatch.setenv("YIRAGE_TUNE", "off")
    assert cpu_providers.choose(case, [x, w])[0].name == cpu_providers.DEFAULTS["float32"]
    monkeypatch.setenv("YIRAGE_TUNE", "sometimes")
    with pytest.raises(YirageError, match="YIRAGE_TUNE='sometimes'"):
        cpu_providers.choose(case, [x, w])


def test_a_busy_machines_measurement_serves_the_process_but_is_not_saved(monkeypatch):
    """A first-use measurement on a busy machine (load above the cores) decides for this
    process only; the next process measures again."""
    monkeypatch.setattr(tuning, "busy_reason", lambda *a: "load average 9.0 on 2 cores")
    x, w = torch.randn(4, 16), torch.randn(72, 16)
    cpu_embed.mark_constant(w)
    case = cpu_providers.case_of("linear", [x, w], torch.empty(4, 72))
    assert cpu_providers.choose(case, [x, w])[1].source == "measured"
    entry = tuning.active_profile().entries[case.key()]
    assert entry["noisy"] == "load average 9.0 on 2 cores"
    assert cpu_providers.choose(case, [x, w])[1].source == "profile"            # this process: decided
    path = tuning.profile_path()
    assert not path.exists() or case.key() not in json.loads(path.read_text())["entries"]


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat")
def test_another_processs_load_makes_a_measurement_busy(tmp_path):
    """A process spinning on a core while candidates are timed makes the figures noisy (not
    saved); the measurement's own threads never do (on 2 cores they made the load average read
    as busy, so no first-use choice was ever saved)."""
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 30\nwhile time.time() < t: pass"])
    try:
        time.sleep(0.3)
        c = tuning.measure({"a": lambda: sum(range(2000))}, budget_s=0.5)
    finally:
        spin.kill()
        spin.wait()
    assert c.others_cores is not None and c.others_cores >= 0.6, c.others_cores
    assert "other processes kept" in tuning.busy_reason(c)


def test_a_high_load_average_from_our_own_threads_is_not_busy(monkeypatch, tmp_path):
    """With the measurement's own share of the machine known, the load average is not consulted:
    a choice measured while only this process worked is saved however high the load average."""
    monkeypatch.setattr(tuning.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    quiet = tuning.timing.Comparison([{"a": 1.0, "b": 2.0}] * 3, {"a": 1, "b": 1}, others_cores=0.1)
    assert tuning.busy_reason(quiet) is None
    assert tuning.busy_reason() == f"load average 9.0 on {tuning.usable_cpu_count()} cores"   # no figure: the load
    prof = tuning.Profile(tmp_path / "p.json")
    tuning.record("k", quiet, "first use", prof)
    assert "noisy" not in prof.entries["k"] and json.loads((tmp_path / "p.json").read_text())["entries"]["k"]


def test_a_close_race_is_saved_as_such_and_not_measured_again(monkeypatch):
    """A winner faster than the runner-up in fewer than 2/3 of the rounds won within noise:
    the choice is saved, marked ``close``, and a later process reads it instead of measuring
    (and packing every candidate's weights) again."""
    monkeypatch.setattr(tuning, "busy_reason", lambda *a: None)
    clear = tuning.timing.Comparison([{"a": 1.0, "b": 2.0}, {"a": 3.0, "b": 2.1}, {"a": 1.0, "b": 1.9}],
                                     {"a": 1, "b": 1})
    assert tuning.close_race(clear) is None             # a won 2 of 3 rounds (one spike of its own)
    close = tuning.timing.Comparison([{"a": 1.0, "b": 1.1}, {"a": 1.2, "b": 1.1}, {"a": 1.0, "b": 0.9},
                                      {"a": 1.0, "b": 1.2}], {"a": 1, "b": 1})
    assert tuning.close_race(close) == "a was faster than b in 2 of 4 rounds"
    assert tuning.unsteady_reason(close) == "a was faster than b in 2 of 4 rounds"
    monkeypatch.setattr(tuning, "measure", lambda thunks, budget_s, **kw: close)
    key = "linear|float32|m4|n8|k8|t1"   # a class of this test's own
    calls = []

    def factory(name):
        def make():
            calls.append(name)
            return lambda: None
        return make
    choice = tuning.choose(key, {"a": factory("a"), "b": factory("b")}, "a")
    assert choice.provider == "a" and choice.source == "measured"
    on_disk = json.loads(tuning.profile_path().read_text())["entries"][key]
    assert on_disk["choice"] == "a" and on_disk["close"] == "a was faster than b in 2 of 4 rounds"
    assert "noisy" not in on_disk
    tuning.reload_profile()   # as a later process does
    calls.clear()
    assert tuning.choose(key, {"a": factory("a"), "b": factory("b")}, "a").source == "profile"
    assert calls == []        # nothing bound, nothing measured


def test_first_use_spent_counts_each_measured_class_and_its_preparation(monkeypatch):
    """``first_use_spent`` adds up what first-use choices cost: a measured class counts once with
    its candidates' preparation (a GPU kernel's compile happens there) and timing; a class read
    from the profile costs nothing."""
    import time

    monkeypatch.setattr(tuning, "busy_reason", lambda *a: None)
    monkeypatch.setattr(tuning, "_SPENT", {"measured": 0, "seconds": 0.0})
    key = "linear|float32|m4|n12|k8|t1"   # a class of this test's own

    def factory():
        time.sleep(0.05)   # a slow preparation: packing, or a JIT compile
        return lambda: None
    tuning.choose(key, {"a": factory, "b": factory}, "a")
    spent = tuning.first_use_spent()
    assert spent["measured"] == 1 and spent["seconds"] >= 0.1
    assert tuning.choose(key, {"a": factory, "b": factory}, "a").source == "profile"
    assert tuning.first_use_spent() == spent


def test_a_damaged_profile_is_measured_again(monkeypatch):
    monkeypatch.setattr(tuning, "busy_reason", lambda *a: None)
    path = tuning.profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    tuning.reload_profile()
    assert tuning.active_profile().entries == {}
    x, w = torch.randn(4, 16), torch.randn(40, 16)
    cpu_embed.mark_constant(w)
    case = cpu_providers.case_of("linear", [x, w], torch.empty(4, 40))
    assert cpu_providers.choose(case, [x, w])[1].source == "measured"
    assert case.key() in json.loads(path.read_text())["entries"]     # rewritten whole


def _quantized(N: int, K: int, fmt: str) -> torch.Tensor:
    """A random [N, K] weight quantized to ``fmt`` by gguf-py (the independent encoder)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    if fmt.endswith("r16"):   # a plain format's blocks, rows in groups of 16 (ir.ops.to_row_groups)
        from yirage.dtypes import DType
        from yirage.ir.ops import to_row_groups
        return to_row_groups(_quantized(N, K, fmt[:-3]), DType(fmt[:-3]))
    w = (np.random.default_rng(0).standard_normal((N, K)) / K ** 0.5).astype(np.float32)
    blocks = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, fmt.upper()))
    return torch.from_numpy(np.ascontiguousarray(blocks)).reshape(N, -1)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_0", "q5_1", "q4_1r16", "q8_0r16"])
@pytest.mark.parametrize("compute,provider", [(None, "yirage"), (None, "mkl"), ("bfloat16", "onednn")])
@pytest.mark.parametrize("M", [1, 40])
def test_quantized_weight_providers_compute_the_reference(fmt, compute, provider, M, monkeypatch):
    """The quantized prefill GEMM's providers, pinned, against the reference interpreter (the
    weights decoded by ir.ops.dequantize); a scratch smaller than the weight makes the vendor
    providers dequantize it in three row blocks (the row-group layouts: five blocks of 16 rows)."""
    N, K = (80 if fmt.endswith("r16") else 72), 256
    case = cpu_providers.Case("linear", f"{fmt}/bfloat16" if compute else fmt, M, N, K)
    if provider not in cpu_providers.candidates(case):
        assert provider == "mkl" and M < cpu_providers.VENDOR_QUANT_MIN_M   # a GEMV's rows
        return
    monkeypatch.setenv("YIRAGE_TUNE", "off")
    monkeypatch.setitem(cpu_providers.DEFAULTS, case.dtype, provider)
    monkeypatch.setattr(cpu_providers, "DEQUANT_SCRATCH_BYTES", 4 * K * 25)
    g = yr.new_kernel_graph(backend="cpu")
    X, W, B = g.new_input((M, K)), g.new_input((N, K), dtype=fmt), g.new_input((N,))
    g.mark_output(g.linear(X, W, B, compute_dtype=compute))
    ins = [torch.randn(M, K), _quantized(N, K, fmt), torch.randn(N)]
    plan = g.compile().plan(ins)
    assert [t.provider for t in plan.thunks if hasattr(t, "provider")] == [f"{provider} (default (YIRAGE_TUNE=off))"]
    out, ref = plan.run()[0], g.interpret(ins)[0]
    if compute:   # bfloat16 sums: one bfloat16 ulp where a different summation order rounds the other way
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_needs_float32_x_and_a_float32_or_quantized_weight():
    g = yr.new_kernel_graph(backend="cpu")
    X, W = g.new_input((4, 64)), g.new_input((8, 64))
    g.linear(X, W, compute_dtype="bfloat16")   # a float32 weight: torch.compile's dtype option
    with pytest.raises(yr.errors.GraphError, match="compute_dtype='bfloat16': only 'bfloat16', with float32 x"):
        g.linear(X, g.new_input((8, 64), dtype="bfloat16"), compute_dtype="bfloat16")
    with pytest.raises(yr.errors.GraphError, match="compute_dtype='bfloat16'"):
        g.linear(g.new_input((4, 64), dtype="bfloat16"), g.new_input((8, 64), dtype="bfloat16"),
                 compute_dtype="bfloat16")
    with pytest.raises(yr.errors.GraphError, match="compute_dtype='float16'"):
        g.linear(X, g.new_input((8, 64), dtype="q8_0"), compute_dtype="float16")


def test_templates_tell_cpu_generations_apart():
    """A virtual machine calls Zen 4 and Zen 5 both "AMD EPYC": the x86 family/model decides."""
    ident = {"cpu": "AMD EPYC", "cpu_generation": "25/17", "isa": ["avx512f", "avx512_bf16"], "torch": "2.13.0"}
    assert tuning._matches({"cpu": "AMD EPYC", "cpu_generation": "25/17"}, ident)
    assert not tuning._matches({"cpu": "AMD EPYC", "cpu_generation": "26/"}, ident)
    assert tuning._matches({"cpu": "AMD EPYC", "cpu_generation": "26/"}, {**ident, "cpu_generation": "26/2"})
    assert not tuning._matches({"cpu_generation": "26/"}, {**ident, "cpu_generation": None})
    names = {name: doc["match"] for name, doc in tuning.templates()}
    assert names["amd-epyc-zen5-avx512-2cores"]["cpu_generation"] == "26/"
    assert names["amd-epyc-zen4-avx512-2cores"]["cpu_generation"] == "25/17"


_SDPA_SPECS = {"mask": (2, 4, 4, 9, 9, (2, 1, 1, 9), False, None), "causal": (1, 2, 2, 7, 7, None, True, 0.5),
               "gqa-causal-mask-d32": (1, 2, 1, 40, 40, (1, 1, 40, 40), True, None, 32),
               "mask-per-head-d64": (2, 3, 3, 17, 23, (1, 3, 17, 23), False, None, 64)}
_SDPA_CASES = [(p, s) for p in ("flash", "gemm", "yirage") for s in _SDPA_SPECS
               if not (p == "gemm" and _SDPA_SPECS[s][1] != _SDPA_SPECS[s][2])]


@pytest.mark.parametrize("provider,spec", _SDPA_CASES, ids=[f"{p}-{s}" for p, s in _SDPA_CASES])
def test_sdpa_providers_compute_attention(provider, spec, monkeypatch):
    """Every provider of ``sdpa`` (torch's fused kernel, two batched GEMMs around a softmax,
    yirage's kernel: its register-blocked path for head dims of 32 and 64, the any-width one
    for 16; queries split into chunks at 40) against attention written out (conformance's
    builder)."""
    spec = _SDPA_SPECS[spec]
    from yirage.tools import conformance

    monkeypatch.setattr(tuning, "choose", lambda key, cands, default, **kw: tuning.Choice(provider, "pinned"))
    g, inputs, want = conformance._sdpa(*spec)
    out = g.compile("cpu")(inputs)
    torch.testing.assert_close(out[0], want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("provider", ["flash", "gemm", "yirage"])
def test_sdpa_providers_give_zero_for_a_fully_masked_row(provider, monkeypatch):
    """A query row whose keys are all masked (-inf) attends to nothing: 0, as torch's fused kernel
    (and its decomposition's safe softmax) gives, not NaN."""
    monkeypatch.setattr(tuning, "choose", lambda key, cands, default, **kw: tuning.Choice(provider, "pinned"))
    g = yr.new_kernel_graph(backend="cpu")
    q, k, v, m = (g.new_input((1, 2, 3, 8)), g.new_input((1, 2, 4, 8)), g.new_input((1, 2, 4, 8)),
                  g.new_input((1, 1, 3, 4)))
    g.mark_output(g.sdpa(q, k, v, m))
    xs = [torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.zeros(1, 1, 3, 4)]
    xs[3][0, 0, 1] = float("-inf")
    out = g.compile("cpu")(xs)[0]
    want = torch.nn.functional.scaled_dot_product_attention(*xs[:3], attn_mask=xs[3])
    assert not out.isnan().any() and (out[:, :, 1] == 0).all()
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


_BLOCKS = {"identity-relu": (2, 8, 9, 7, 8, 3, 1, 1, "identity", "relu"),
           "conv-shortcut": (1, 6, 11, 10, 8, 3, 2, 1, "conv", "relu"),
           "depthwise-relu6": (2, 12, 8, 9, 12, 3, 1, 12, None, "relu6"),
           "1x1-silu": (1, 5, 6, 7, 9, 1, 1, 1, None, "silu"),
           "1x1-identity-relu": (2, 8, 5, 6, 8, 1, 1, 1, "identity", "relu"),
           "1x1-large-relu6": (2, 24, 23, 21, 40, 1, 1, 1, None, "relu6"),   # 966 rows: many GEMM row blocks
           "depthwise-5x5-s2": (1, 70, 9, 8, 70, 5, 2, 70, None, "silu"),   # 70 channels: a partial block of 64
           "depthwise-identity-relu": (2, 12, 8, 9, 12, 3, 1, 12, "identity", "relu"),
           "5x5-s2-silu": (1, 5, 13, 11, 33, 5, 2, 1, None, "silu"),   # 33 outputs: a partial panel of 32
           "3x3-large-relu6": (2, 24, 23, 21, 40, 3, 1, 1, None, "relu6")}   # 966 pixels: many row blocks
_CONV_CASES = [(p, b) for p in ("aten", "aten-nchw", "onednn-packed") for b in _BLOCKS] + [
    ("yirage-gemm", "1x1-silu"), ("yirage-gemm", "1x1-identity-relu"), ("yirage-gemm", "1x1-large-relu6"),
    ("onednn-copy", "depthwise-relu6"), ("yirage-depthwise", "depthwise-relu6"), ("yirage-depthwise", "depthwise-5x5-s2"),
    ("yirage-depthwise", "depthwise-identity-relu"),
    ("onednn-copy", "1x1-silu"), ("yirage-igemm/48x768", "identity-relu"), ("yirage-igemm/192x384", "conv-shortcut"),
    ("yirage-igemm/96x768", "5x5-s2-silu"), ("yirage-igemm/48x768", "3x3-large-relu6")]


@pytest.mark.parametrize("provider,block", _CONV_CASES, ids=[f"{p}-{b}" for p, b in _CONV_CASES])
def test_conv2d_providers_compute_the_block(provider, block, monkeypatch):
    """Every conv2d provider, pinned, on residual blocks whose weights are declared constant (as
    torch.compile's frozen parameters are): torch's convolution with in-place epilogue ops (in
    NHWC, or through NCHW copies), oneDNN on the weight with BatchNorm folded in and reordered
    once, and (1x1) yirage's packed GEMM on the folded weight, against torch.nn.functional in
    float32 (conformance's builder)."""
    block = _BLOCKS[block]
    from yirage.tools import conformance

    chosen = []

    def pin(key, cands, default, **kw):
        assert provider in cands, f"{provider} is not a candidate of {key}: {list(cands)}"
        chosen.append(key)
        return tuning.Choice(provider, "pinned")
    monkeypatch.setattr(tuning, "choose", pin)
    g, inputs, want = conformance._conv_block(*block, yr.float32)
    for t in inputs[1:]:
        cpu_embed.mark_constant(t)
    out = g.compile("cpu")(inputs)
    assert chosen and all(k.startswith("conv2d|float32/nhwc") for k in chosen)
    if provider == "yirage-gemm":
        assert all("/1x1/" in k for k in chosen)
    if provider.startswith("yirage-igemm"):
        assert any("/1x1/" not in k for k in chosen)
    for i, w in want.items():
        torch.testing.assert_close(out[i], w, rtol=1e-4, atol=1e-4)


def test_conv2d_onednn_sees_writes_to_folded_batch_norm_statistics(monkeypatch):
    """The folded, reordered weight is remade when the weight or a BatchNorm statistic is
    written after the first call (their versions change), so the output follows eager."""
    from yirage.tools import conformance

    monkeypatch.setattr(tuning, "choose", lambda key, cands, default, **kw: tuning.Choice("onednn-packed", "pinned"))
    g, inputs, _ = conformance._conv_block(2, 8, 9, 7, 8, 3, 1, 1, "identity", "relu", yr.float32)
    for t in inputs[1:]:
        cpu_embed.mark_constant(t)
    g.compile("cpu")(inputs)
    x, w, mean, var, gw, gb = inputs
    with torch.no_grad():
        var.mul_(4.0)
        gb.add_(1.0)
    want = torch.relu(torch.nn.functional.batch_norm(torch.nn.functional.conv2d(x, w, None, 1, 1), mean, var, gw, gb,
                                                     training=False, eps=1e-3) + x)
    torch.testing.assert_close(g.compile("cpu")(inputs)[0], want, rtol=1e-4, atol=1e-4)


def test_conv2d_measurement_keeps_its_sample_buffers_alive(monkeypatch, tmp_path):
    """The first-use measurement of a 1x1 convolution with a residual: every provider runs on
    sample tensors that stay alive while it is timed (the GEMM's row epilogue reads the
    residual through a raw pointer; this one, 33 MB, is above glibc's largest mmap threshold,
    so freeing it early unmapped it and the epilogue crashed: ResNet-50 at batch 8 did). Then
    the chosen provider computes the block."""
    from yirage.tools import conformance

    monkeypatch.setenv(tuning.PROFILE_DIR_ENV, str(tmp_path))
    tuning.reload_profile()
    monkeypatch.setattr(tuning, "matching_template", lambda: None)
    g, inputs, want = conformance._conv_block(1, 128, 256, 256, 128, 1, 1, 1, "identity", "relu", yr.float32)
    for t in inputs[1:]:
        cpu_embed.mark_constant(t)
    out = g.compile("cpu")(inputs)
    torch.testing.assert_close(out[0], want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("provider", ["onednn-packed", "yirage-gemm"])
def test_a_conv_weight_shared_under_two_batch_norms_is_packed_once_for_each(provider, monkeypatch):
    """One weight, two convolutions with different BatchNorms folded in: each keeps its own
    packed form (keyed by the tensors folded into it), so calls after the first repack
    nothing, and both outputs match torch.nn.functional."""
    import torch.nn.functional as F

    monkeypatch.setattr(tuning, "choose", lambda key, cands, default, **kw: tuning.Choice(provider, "pinned"))
    g = yr.new_kernel_graph(backend="cpu")
    x, w = g.new_input((1, 8, 6, 6)), g.new_input((8, 8, 1, 1))
    bn1, bn2 = [g.new_input((8,)) for _ in range(4)], [g.new_input((8,)) for _ in range(4)]
    g.mark_output(g.relu(g.batch_norm(g.conv2d(x, w), *bn1)))
    g.mark_output(g.relu(g.batch_norm(g.conv2d(x, w), *bn2)))
    stats = [[torch.randn(8), torch.rand(8) + 0.5, torch.randn(8), torch.randn(8)] for _ in range(2)]
    inputs = [torch.randn(1, 8, 6, 6), torch.randn(8, 8, 1, 1), *stats[0], *stats[1]]
    for t in inputs[1:]:
        cpu_embed.mark_constant(t)
    cg = g.compile("cpu")
    cg(inputs)
    packed = {k: v[1] for k, v in cpu_embed._packed.items() if k[0] == id(inputs[1])}
    out = cg(inputs)
    assert len(packed) == 2 and all(cpu_embed._packed[k][1] is v for k, v in packed.items())
    for o, s in zip(out, stats):
        want = F.batch_norm(F.conv2d(inputs[0], inputs[1]), *s, training=False).relu()
        torch.testing.assert_close(o, want, rtol=1e-4, atol=1e-4)


def _igemm_case(res: bool):
    """A float32 NHWC convolution with an uneven window, stride, padding and dilation, its
    weight and bias constant, and the torch.nn.functional reference (+ residual, then ReLU)."""
    import torch.nn.functional as F
    from yirage.ir.conv import ConvInputs

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, 13, 10, generator=g).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(37, 7, 3, 5, generator=g) / 6, torch.randn(37, generator=g)
    attrs = {"stride": [2, 1], "padding": [1, 2], "dilation": [2, 1], "groups": 1, "activation": "relu"}
    want = F.conv2d(x, w, b, (2, 1), (1, 2), (2, 1))
    r = torch.randn(want.shape, generator=g).contiguous(memory_format=torch.channels_last) if res else None
    want = (want if r is None else want + r).relu()
    for t in (w, b):
        cpu_embed.mark_constant(t)
    y = torch.full(want.shape, float("nan")).contiguous(memory_format=torch.channels_last)
    return ConvInputs(x, w, b, residual=r), x, y, r, attrs, want


@pytest.mark.parametrize("mc,kc", [(1, 1), (5, 7), (48, 768), (4096, 4096)])
@pytest.mark.parametrize("res", [False, True], ids=["plain", "residual"])
def test_conv2d_implicit_gemm_tiles_compute_the_convolution(mc, kc, res):
    """yirage's implicit-GEMM convolution in any tile (pixels per gathered block, k-block), on a
    3x5 window with stride (2, 1), padding (1, 2) and dilation (2, 1), 37 output channels (a
    partial panel), against torch.nn.functional."""
    from yirage.backends.cpu import conv as cpu_conv

    c, x, y, r, attrs, want = _igemm_case(res)
    cpu_conv._conv_igemm(c, x, y, r, attrs, mc=mc, kc=kc)()
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_conv2d_implicit_gemm_refuses_a_geometry_that_does_not_fit():
    """The native kernel checks the geometry it is handed (an output size the window does not
    give, a tile out of range): a clear error, and the output untouched."""
    from yirage.backends.cpu import conv as cpu_conv

    c, x, y, r, attrs, _ = _igemm_case(False)
    run = cpu_conv._conv_igemm(c, x, y, r, attrs)
    # Ho, mc, kc, C (then x_len is too short)
    _assert_refused(run, run.epilogue_args[1], {5: 99, 15: 0, 16: 5000, 3: 8}, y, "implicit GEMM")


def _assert_refused(run, geo: torch.Tensor, bad: dict[int, int], out: torch.Tensor, match: str) -> None:
    """Each bad value put in the kernel's geometry array in turn: a YirageError naming the op,
    and ``out`` (NaN-filled) left untouched; the geometry is restored after each."""
    for index, value in bad.items():
        saved = int(geo[index])
        geo[index] = value
        with pytest.raises(YirageError, match=match):
            run()
        geo[index] = saved
        assert out.isnan().all()


@pytest.mark.parametrize("layout,bias", [("nk", True), ("kn", False)])
def test_linear_stack_packed_gemm_writes_each_plane_and_sees_weight_writes(layout, bias):
    """The stacked packed GEMM (one GEMM over k weights packed together, each output in its own
    plane) against F.linear per weight; a weight written after the first call is repacked."""
    import torch.nn.functional as F

    M, N, K = 13, 64, 40
    x = torch.randn(M, K)
    ws = [torch.randn(N, K) for _ in range(3)]
    stored = [w.t().contiguous() if layout == "kn" else w for w in ws]
    bs = [torch.randn(N) for _ in range(3)] if bias else None
    out = torch.full((3, M, N), float("nan"))
    run = cpu_embed.bind_linear_stack_f32(x, stored, bs, out, layout)
    for step in range(2):
        run()
        for i, w in enumerate(ws):
            torch.testing.assert_close(out[i], F.linear(x, w, bs[i] if bs else None), rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            stored[1].mul_(-2.0)
            ws[1].mul_(-2.0)


def test_linear_stack_kernel_refuses_planes_that_split_a_panel():
    """Out features per plane must be a multiple of the 32-column panel: a clear error, no write."""
    x, ws = torch.randn(4, 8), [torch.randn(48, 8) for _ in range(2)]
    out = torch.full((2, 4, 48), float("nan"))
    with pytest.raises(YirageError, match="linear_stack"):
        cpu_embed.bind_linear_stack_f32(x, ws, None, out)()
    assert out.isnan().all()


def test_prefetch_level_is_measured_and_either_level_computes_the_same_gemv(monkeypatch, tmp_path):
    """The machine's prefetch level (L1 or L2) is a measured choice recorded in its profile; the
    q4_1 GEMV gives torch's result on the dequantized weight at both levels (the level is only
    a hint), and the library is left at the chosen one."""
    import gguf
    import torch.nn.functional as F
    from yirage.backends.cpu import native

    monkeypatch.setenv(tuning.PROFILE_DIR_ENV, str(tmp_path))
    tuning.reload_profile()
    monkeypatch.setattr(tuning, "matching_template", lambda: None)
    monkeypatch.setattr(native, "PREFETCH_SWEEP_BYTES", 8 << 20)   # a quick sweep: what is recorded matters here
    lib = native.library()
    level = native.prefetch_level(lib)
    (key, entry), = [(k, e) for k, e in tuning.active_profile().entries.items() if k.startswith("gemv_prefetch|")]
    assert set(entry["median_s"]) == set(native.PREFETCH_LEVELS)
    assert level == native.PREFETCH_LEVELS[entry["choice"]]
    w = torch.randn(96, 256).numpy()
    blocks = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1))
    ref = F.linear(x := torch.randn(1, 256), torch.from_numpy(gguf.quants.dequantize(blocks.numpy(),
                                                                                     gguf.GGMLQuantizationType.Q4_1)))
    try:
        for lv in (1, 0):
            y = torch.full((1, 96), float("nan"))
            lib.yr_set_prefetch_level(lv)
            lib.yr_linear_q4_1(x.data_ptr(), blocks.data_ptr(), None, y.data_ptr(), 1, 96, 256)
            torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    finally:
        lib.yr_set_prefetch_level(level)


def test_parallel_linears_merge_by_measurement(monkeypatch, tmp_path):
    """The CPU's answer for a group of parallel linears is a measured choice between the
    separate linears and the stacked GEMM, recorded in the machine's profile under its shape class."""
    from yirage.backends.cpu import library as cpu_library
    from yirage.transforms.parallel import LinearGroup

    monkeypatch.setenv(tuning.PROFILE_DIR_ENV, str(tmp_path))
    tuning.reload_profile()
    monkeypatch.setattr(tuning, "matching_template", lambda: None)
    case = LinearGroup(M=16, N=64, K=64, parts=3, dtype="float32", layout="nk", bias=True)
    merged = cpu_library.merge_linears(case)
    entries = tuning.active_profile().entries   # saved to disk only when the figures were steady
    (key, entry), = [(k, e) for k, e in entries.items() if k.startswith("linear_stack|float32/nk/x3/bias|m16")]
    assert set(entry["median_s"]) == {"separate", "stacked"} and merged == (entry["choice"] == "stacked")
    assert not cpu_library.merge_linears(LinearGroup(16, 40, 64, 3, "float32", "nk", True))   # planes split panels
    assert not cpu_library.merge_linears(LinearGroup(16, 64, 64, 3, "bfloat16", "nk", True))
    assert not cpu_library.merge_linears(LinearGroup(16, 4096, 4096, 3, "float32", "nk", True))   # 192 MiB


def test_parts_gemm_writes_each_part_and_refuses_sizes_that_do_not_fit():
    """The merged GEMM of parallel 1x1 convolutions (parts of different widths, each padded to
    whole panels in the pack, each written to its own rows) against F.linear per part; an
    output too short for the parts, a width of 0 or more than 64 parts: a clear error, no write."""
    import torch.nn.functional as F

    M, K, widths = 11, 24, [33, 7, 64]
    x = torch.randn(M, K)
    ws, bs = [torch.randn(w, K) for w in widths], [torch.randn(w) for w in widths]
    P = torch.cat([cpu_embed.pack_f32(w).view(-1) for w in ws])
    bias = torch.cat([torch.cat([b, torch.zeros(-w % 32)]) for b, w in zip(bs, widths)])
    out = torch.full((M * sum(widths),), float("nan"))
    cpu_embed.bind_gemm_f32_parts(x, out, widths, lambda: (P, bias))()
    off = 0
    for w, b, n in zip(ws, bs, widths):
        torch.testing.assert_close(out[off:off + M * n].view(M, n), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
        off += M * n
    for bad_out, bad_widths in [(torch.full((M * sum(widths) - 1,), float("nan")), widths),
                                (torch.full((M * 64,), float("nan")), [32, 0, 32]),
                                (torch.full((M * 65,), float("nan")), [1] * 65)]:
        with pytest.raises(YirageError, match="conv2d_stack"):
            cpu_embed.bind_gemm_f32_parts(x, bad_out, bad_widths, lambda: (P, bias))()
        assert bad_out.isnan().all()


def test_parallel_convs_merge_by_measurement(monkeypatch, tmp_path):
    """The CPU's answer for a group of parallel 1x1 convolutions is a measured choice between
    the convolutions apart and the one GEMM, recorded under its shape class; groups the GEMM
    does not take (3x3, NCHW, bfloat16) are never merged."""
    from yirage.backends.cpu import conv as cpu_conv
    from yirage.transforms.parallel import ConvGroup

    monkeypatch.setenv(tuning.PROFILE_DIR_ENV, str(tmp_path))
    tuning.reload_profile()
    monkeypatch.setattr(tuning, "matching_template", lambda: None)
    part = {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1, "layout": "nhwc", "bias": False,
            "bn": {"eps": 1e-5, "affine": True}, "activation": "relu"}
    case = ConvGroup((1, 6, 5, 16), "float32", ((32, 16, 1, 1), (8, 16, 1, 1)), (part, dict(part, activation=None)))
    merged = cpu_conv.merge_convs(case)
    entries = tuning.active_profile().entries
    (key, entry), = [(k, e) for k, e in entries.items() if k.startswith("conv2d_stack|float32/nhwc/1x1/w32+8/")]
    assert "bn+relu;bn+id" in key
    assert set(entry["median_s"]) == {"separate", "stacked"} and merged == (entry["choice"] == "stacked")
    assert not cpu_conv.merge_convs(ConvGroup((1, 6, 5, 16), "float32", ((32, 16, 3, 3),) * 2, (part, part)))
    nchw = dict(part, layout="nchw")
    assert not cpu_conv.merge_convs(ConvGroup((1, 16, 6, 5), "float32", case.weights, (nchw, nchw)))
    assert not cpu_conv.merge_convs(ConvGroup((1, 6, 5, 16), "bfloat16", case.weights, case.parts))


def test_sdpa_kernel_refuses_a_geometry_that_does_not_fit():
    """yirage's attention kernel checks what it is handed (query heads not a multiple of the
    key heads, a mask shorter than its strides reach): a clear error, the output untouched."""
    from yirage.backends.cpu import library as cpu_library

    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    mask, out = torch.zeros(1, 4, 5, 6), torch.full((1, 4, 5, 16), float("nan"))
    run = cpu_library._sdpa_yirage(q, k, v, mask, out, False, None)
    _assert_refused(run, run.keep[0], {2: 3, 8: 999, 3: 0}, out, "sdpa")   # Hkv, the mask's head stride, Tq
    run()
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                     enable_gqa=True),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B,H,causal,gqa,head_dim", [(2, 4, False, False, 32), (2, 4, True, True, 32),
                                                     (2, 4, True, False, 24), (1, 2, True, False, 64)])
def test_sdpa_kernel_reads_and_writes_head_strided_views(B, H, causal, gqa, head_dim):
    """yirage's attention kernel on [B, S, H, D] buffers read as [B, H, S, D] (q, k, v, out:
    what the executor hands it instead of permute copies) against torch's; causal queries in
    chunks that start past 0 (few heads: the tasks split the queries) and row blocks that skip
    the keys after them; a stride reaching past its buffer is refused, out untouched."""
    from yirage.backends.cpu import library as cpu_library

    S, T, D = 37, 41, head_dim
    Hk = 2 if gqa else H
    q = torch.randn(B, S, H, D).transpose(1, 2)
    k, v = (torch.randn(B, T, Hk, D).transpose(1, 2) for _ in range(2))
    out_buf = torch.full((B, S, H, D), float("nan"))
    out = out_buf.transpose(1, 2)
    assert not any(t.is_contiguous() for t in (q, k, v, out))
    run = cpu_library._sdpa_yirage(q, k, v, None, out, causal, None)
    _assert_refused(run, run.keep[0], {12: S * H * D, 21: 10 ** 6, 14: -1}, out_buf, "sdpa")   # q_st, o_st, k_sh
    run()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_strided_kernels_refuse_a_geometry_whose_reach_overflows():
    """Sizes and strides each in range whose products sum past 2^63 (a wrapped sum would pass
    the length check): the RoPE and attention kernels refuse them, out untouched."""
    from yirage.backends.cpu import library as cpu_library
    from yirage.ir.graph import KernelGraph

    x, cos = torch.randn(2, 3, 4, 8), torch.randn(1, 1, 4, 8)
    out = torch.full_like(x, float("nan"))
    run = cpu_library._rotary_emb(None, KernelGraph(), [x, cos, cos.clone()], out, None)   # reads only its tensors
    geo, big = run.keep[0], 2 ** 31 - 2
    geo[:3] = big
    geo[4:7] = big                        # x's strides: (big - 1) * big three times
    with pytest.raises(YirageError, match="rotary_emb"):
        run()
    assert out.isnan().all()

    q = torch.randn(2, 2, 3, 16)
    out = torch.full_like(q, float("nan"))
    run = cpu_library._sdpa_yirage(q, q.clone(), q.clone(), None, out, False, None)
    geo = run.keep[0]
    geo[0], geo[1], geo[2], geo[3] = big, big, big, big   # B, Hq, Hkv, Tq
    geo[10:13] = big                                       # q's strides
    with pytest.raises(YirageError, match="sdpa"):
        run()
    assert out.isnan().all()


@pytest.mark.parametrize("head_dim", [32, 24])   # the register-blocked path and the any-width one
def test_sdpa_kernel_masked_rows_over_vectors_and_tail(head_dim):
    """yirage's attention kernel finds a masked row's largest score in vectors of keys and a
    scalar tail (37 keys: two vectors of 16 and 5 more): a row with every key masked gives 0,
    rows whose only open key sits in a vector or in the tail attend to it alone; against torch."""
    from yirage.backends.cpu import library as cpu_library

    q, k, v = torch.randn(1, 2, 6, head_dim), torch.randn(1, 2, 37, head_dim), torch.randn(1, 2, 37, head_dim)
    mask = torch.randn(1, 1, 6, 37)
    mask[0, 0, 1] = float("-inf")                               # every key masked
    mask[0, 0, 2], mask[0, 0, 2, 20] = float("-inf"), 0.0       # only key 20 (a vector)
    mask[0, 0, 3], mask[0, 0, 3, 35] = float("-inf"), 0.0       # only key 35 (the tail)
    out = torch.full((1, 2, 6, head_dim), float("nan"))
    cpu_library._sdpa_yirage(q, k, v, mask, out, False, None)()
    assert (out[:, :, 1] == 0).all()
    torch.testing.assert_close(out[:, :, 2], v[:, :, 20], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:, :, 3], v[:, :, 35], rtol=1e-6, atol=1e-6)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    keep = [0, 2, 3, 4, 5]
    torch.testing.assert_close(out[:, :, keep], ref[:, :, keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("provider", ["yirage", "onednn-packed", "onednn", "yirage-f32"])
@pytest.mark.parametrize("M,N,K", [(1, 40, 64), (203, 1000, 96)])
def test_bfloat16_compute_providers_compute_the_reference(provider, M, N, K, monkeypatch, provider_runs):
    """A float32 weight with bfloat16 compute (torch.compile's dtype option), each provider
    pinned, with a residual + LayerNorm + GELU epilogue (N=1000: the vendor-style providers run
    in row blocks, each block's x and sums rounded in the thread's scratch), against the
    reference interpreter: one bfloat16 ulp of a sum may round the other way."""
    provider_runs(provider, "float32/bfloat16")
    monkeypatch.setenv("YIRAGE_TUNE", "off")
    monkeypatch.setitem(cpu_providers.DEFAULTS, "float32/bfloat16", provider)
    g = yr.new_kernel_graph(backend="cpu")
    X, W, B, R = g.new_input((M, K)), g.new_input((N, K)), g.new_input((N,)), g.new_input((M, N))
    LW, LB = g.new_input((N,)), g.new_input((N,))
    g.mark_output(g.gelu(g.layer_norm(g.add(g.linear(X, W, B, compute_dtype="bfloat16"), R), (N,), LW, LB, 1e-5)))
    ins = [torch.randn(M, K), torch.randn(N, K) / K ** 0.5, torch.randn(N), torch.randn(M, N), torch.rand(N) + 0.5,
           torch.randn(N)]
    cpu_embed.mark_constant(ins[1])
    plan = g.compile().plan(ins)
    assert [t.provider for t in plan.thunks if hasattr(t, "provider")] == [f"{provider} (default (YIRAGE_TUNE=off))"]
    torch.testing.assert_close(plan.run()[0], g.interpret(ins)[0], rtol=3e-2, atol=3e-2)
