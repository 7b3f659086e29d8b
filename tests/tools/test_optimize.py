"""``yirage optimize``, ``yr.auto_configure_backend()`` and ``yr.BackendOptimizer()`` (tools/optimize.py):
measurements go to a machine profile, --apply makes it the one the backends read, the
recommendation reads it back, a saved configuration loads on this machine."""
import json

import numpy as np
import pytest
import torch

import yirage as yr
from yirage.backends.cpu import precision as cpu_precision, providers as cpu_providers
from yirage.errors import YirageError
from yirage.tools import optimize as opt
from yirage.tuning import profile as tuning


@pytest.fixture
def small(monkeypatch, tmp_path):
    """Two small workloads (float32 and bfloat16 weights) instead of the registry's, no thread
    sweep, steady figures (the suite's load must not stop the profile from being written), and
    a profile of its own (other tests' first-use measurements may cover the same shapes)."""
    monkeypatch.setenv(tuning.PROFILE_DIR_ENV, str(tmp_path / "tuning"))
    gguf = pytest.importorskip("gguf")
    w = np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32)
    blocks = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)).reshape(40, -1)
    monkeypatch.setattr(opt, "workload_cases", lambda: [
        opt.Workload("small float", 48, 32, ("float32", "bfloat16", "int8"), rows=(16, 64), group=0),
        opt.Workload("small int8 groups", 40, 64, ("int8",), rows=(16,), group=32),
        opt.Workload("small q4_1", 40, 64, ("q4_1", "q4_1/bfloat16"), rows=(16,), weight=blocks)])
    monkeypatch.setattr(opt, "_embedding_threads", lambda budget: None)
    monkeypatch.setattr(tuning, "unsteady_reason", lambda c: None)
    monkeypatch.setattr(tuning, "busy_reason", lambda *a: None)   # record() saves unless the machine is busy


def test_optimize_writes_a_profile_and_apply_makes_it_the_one_used(small):
    result = opt.optimize("cpu", budget_s=2.0)
    rows = result["cases"]
    assert len(rows) == 2 * 3 + 1 + 2
    for r in rows:
        quantized = r["dtype"].startswith("q4_1")
        case = cpu_providers.Case(r["op"], r["dtype"], r["M"], r["N"], r["K"],
                                  32 if r["K"] == 64 and not quantized else 0, not quantized)
        assert r["key"] == case.key()
        cands = set(cpu_providers.candidates(case))
        assert cands == ({"yirage", "mkl"} if r["dtype"] == "q4_1" else {"onednn"} if quantized else cands)
        # bfloat16 compute of a quantized weight: its one provider is timed too
        assert set(r["median_s"]) == (cands if len(cands) > 1 or quantized else set())
        if r["median_s"]:
            assert r["choice"] == min(r["median_s"], key=r["median_s"].get)
    written = json.loads(open(result["profile"]).read())
    assert result["profile"].endswith(".optimize.json") and result["applied"] is None
    assert {r["key"] for r in rows if r["median_s"]} == set(written["entries"])
    for r in rows:   # the table marks what the profile marks: a close race is saved and applied
        if r["median_s"]:
            assert r["close"] == written["entries"][r["key"]].get("close") and r["noisy"] is None
    assert written["machine"] == tuning.machine_identity()
    assert not set(written["entries"]) & set(tuning.reload_profile().entries)   # not applied yet
    applied = opt.optimize("cpu", budget_s=2.0, apply=True)
    active = tuning.reload_profile()
    for r in applied["cases"]:
        if r["median_s"]:
            assert active.entries[r["key"]]["choice"] == r["choice"]
            assert active.entries[r["key"]]["source"] == "yirage optimize"
    conf = yr.auto_configure_backend()
    assert conf["source"] == "profile" and conf["profile"] == applied["applied"]
    assert {r["key"]: r["choice"] for r in applied["cases"] if r["median_s"]}.items() <= conf["kernel_choices"].items()
    assert conf["backend"] == "cpu" and conf["threads"] >= 1 and conf["tune"] == "on"
    assert set(conf["dtypes"]) == {"embedding", "llm", "llm_prefill", "kernel_graph"}


def test_optimize_errors(yirage_cli):
    with pytest.raises(YirageError, match="positive number"):
        opt.optimize("cpu", budget_s=0)
    code, out, err = yirage_cli("optimize", "--budget", "-1")
    assert code == 1 and err.startswith("yirage: error:") and "positive number" in err and len(err.splitlines()) == 1
    code, out, err = yirage_cli("optimize", "--backend", "no-such")
    assert code == 1 and "unknown" in err and len(err.splitlines()) == 1


def test_optimize_command_prints_the_table_and_json(small, yirage_cli):
    code, out, err = yirage_cli("optimize", "--budget", "2", "--apply")
    assert code == 0, err
    assert "small float" in out and "profile written" in out and "applied:" in out
    code, out, err = yirage_cli("optimize", "--budget", "2", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["machine"]["cpu"] == yr.get_backend_info("cpu").device_name and len(doc["cases"]) == 9


def test_auto_configure_without_measurements_uses_a_template_or_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.PROFILE_DIR_ENV, str(tmp_path))
    tuning.reload_profile()
    monkeypatch.setattr(tuning, "templates", lambda: ())
    tuning.matching_template.cache_clear()
    try:
        conf = yr.auto_configure_backend()
        assert conf["source"] == "defaults" and conf["profile"] is None and conf["kernel_choices"] == {}
        assert conf["dtypes"]["embedding"] == "float32"
        ident = tuning.machine_identity()
        tpl = {"match": {"cpu": ident["cpu"]}, "measured_on": "here",
               "entries": {"linear|float32|m512|n1536|k384|t2": {"choice": "mkl", "median_s": {"mkl": 1.0}},
                           "linear|bfloat16|m512|n1536|k384|t2": {"choice": "onednn", "median_s": {"onednn": 0.5}},
                           "linear|q4_1|m256|n576|k576|t2": {"choice": "yirage", "median_s": {"yirage": 1.0, "mkl": 2.0}},
                           "linear|q4_1/bfloat16|m256|n576|k576|t2": {"choice": "onednn", "median_s": {"onednn": 0.9}}},
               "extra": {"threads": {"embedding": 1}}}
        monkeypatch.setattr(tuning, "templates", lambda: (("this-machine", tpl),))
        tuning.matching_template.cache_clear()
        # a CPU with a bfloat16 dot product (AVX512-BF16), whatever this one has
        monkeypatch.setattr(cpu_precision, "native_precision_flag", lambda d: "avx512_bf16")
        conf = yr.auto_configure_backend()
        assert conf["source"] == "template this-machine" and conf["threads"] == 1
        assert conf["dtypes"]["embedding"] == "bfloat16"     # bfloat16 measured at half float32's time
        assert conf["dtypes"]["llm_prefill"] == "float32"    # 0.9x float32's time: not worth bfloat16's error
        tpl["entries"]["linear|q4_1/bfloat16|m256|n576|k576|t2"]["median_s"]["onednn"] = 0.7
        assert yr.auto_configure_backend()["dtypes"]["llm_prefill"] == "bfloat16"
        # a CPU that only emulates bfloat16 (an AMD Zen 3): never recommended, however it measured
        monkeypatch.setattr(cpu_precision, "native_precision_flag", lambda d: None)
        assert set(yr.auto_configure_backend()["dtypes"].values()) == {"float32"}
    finally:
        tuning.matching_template.cache_clear()
        monkeypatch.undo()
        tuning.reload_profile()


def test_backend_optimizer_config_round_trip(tmp_path, capsys):
    bo = yr.BackendOptimizer()
    bo.print_system_info()
    assert yr.get_backend_info("cpu").device_name in capsys.readouterr().out
    key = "linear|float32|m16|n8|k8|t1"
    prof = tuning.active_profile()
    prof.entries[key] = {"choice": "mkl", "median_s": {"mkl": 1e-6, "yirage": 2e-6}}
    path = bo.save_config(tmp_path / "yirage.json", backend="cpu")
    doc = json.loads(path.read_text())
    assert doc["backend"] == "cpu" and doc["entries"][key]["choice"] == "mkl"
    del prof.entries[key]
    try:
        assert bo.load_config(path)["backend"] == "cpu"
        assert yr.get_backend().value == "cpu" and tuning.active_profile().entries[key]["choice"] == "mkl"
        doc["machine"] = dict(doc["machine"], cpu="another CPU")
        del tuning.active_profile().entries[key]
        (tmp_path / "other.json").write_text(json.dumps(doc))
        bo.load_config(tmp_path / "other.json")             # measured elsewhere: its choices are not taken
        assert key not in tuning.active_profile().entries
        (tmp_path / "bad.json").write_text("[1, 2]")
        with pytest.raises(YirageError, match="not a yirage configuration"):
            bo.load_config(tmp_path / "bad.json")
        with pytest.raises(YirageError, match="cannot read"):
            bo.load_config(tmp_path / "missing.json")
    finally:
        import yirage.backends as b
        b._explicit_backend = None
