"""The benchmarks' figures (benchmarks/_plot.py): a figure drawn from a small JSON is a non-empty
PNG whose title names the machine and the date; the figure JSON redraws with ``python
benchmarks/_plot.py``; every benchmark script with peers takes ``--plot PATH.png`` (parsed only,
nothing run) and turns a report of its own shape into bars; the figures under docs/img/benchmarks
have their PNG beside their JSON. (Nothing here runs a benchmark.)"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the figures need matplotlib (the test and bench extras)")

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import _plot  # noqa: E402

#: the benchmark scripts whose JSON compares yirage with peers: each takes --plot
SCRIPTS = ("decode", "embed", "serve", "torch_compile", "kernels_cpu", "superoptimize", "scale", "webgpu", "gpu",
           "providers", "parallel_convs")

MACHINE = {"cpu": "AMD EPYC", "cpu_generation": "26/2", "isa": ["avx2", "fma", "avx512f", "avx512bw", "avx512_bf16",
                                                                 "avx512_vnni"],
           "isa_cap": "native", "amx": False, "cores": 2, "threads": 2}


def tiny_figure() -> dict:
    return _plot.figure("decode", "a tiny figure", MACHINE,
                        [{"group": "decode, 42-token prompt", "series": "float32 vs llama.cpp", "ratio": 1.68},
                         {"group": "decode, 42-token prompt", "series": "float32 vs transformers", "ratio": 10.7},
                         {"group": "prefill, 42-token prompt", "series": "float32 vs llama.cpp", "ratio": 0.8},
                         {"group": "prefill, 42-token prompt", "series": "float32 vs transformers", "ratio": None}],
                        command="python benchmarks/decode.py", date="2026-11-28")


def load(name: str):
    """benchmarks/<name>.py as a module of its own name (bench_<name>); OMP_NUM_THREADS, which
    ``import _threads`` sets, is restored."""
    before = os.environ.get("OMP_NUM_THREADS")
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before
    return module


def test_a_figure_from_a_small_json_is_a_png_titled_with_the_machine(tmp_path):
    fig = tiny_figure()
    assert [b["ratio"] for b in fig["bars"]] == [1.68, 10.7, 0.8]   # a failed side (no ratio) is dropped
    path = tmp_path / "decode.png"
    _plot.save(fig, str(path))
    assert path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "decode.json").read_text()) == fig
    title = _plot.render(fig).axes[0].get_title()
    assert "AMD EPYC (x86 family 26 model 2)" in title and "AVX-512 (BF16, VNNI)" in title
    assert "2 threads" in title and "2026-11-28" in title and "redrawn" not in title
    redrawn = _plot.render({**fig, "source": "redrawn from README.md"}).axes[0].get_title()
    assert "redrawn from the recorded run" in redrawn
    assert _plot.render(fig).axes[0].get_yscale() == "log"   # 0.8 to 10.7: more than 8x apart


def test_isa_summary():
    assert _plot.isa_summary({"isa": ["avx2", "fma"], "isa_cap": "x86-64-v3"}) == "AVX2, capped to x86-64-v3"
    assert _plot.isa_summary({"isa": ["avx512f", "avx512bw", "amx_tile"], "amx": True}) == "AVX-512 (AMX)"
    assert _plot.isa_summary({"isa": ["asimd", "asimddp"]}) == "NEON (dotprod)"
    assert _plot.isa_summary({"isa": []}) == "scalar"


def test_the_figure_json_redraws_from_the_command_line(tmp_path):
    src = tmp_path / "fig.json"
    src.write_text(json.dumps(tiny_figure()))
    r = subprocess.run([sys.executable, str(BENCHMARKS / "_plot.py"), str(src)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "fig.png").stat().st_size > 1000


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_benchmark_script_takes_plot(name):
    if name in ("serve", "scale"):
        pytest.importorskip("httpx", reason="benchmarks/serve.py needs httpx")
    args = load(name).parser().parse_args(["--plot", "out.png"])
    assert args.plot == "out.png"


def _ok(**figures):
    return {"status": "ok", **figures}


#: a report of each script's shape, as small as its plot_figure reads, and the bars it must give
REPORTS = {
    "decode": ({"scenario": "idle", "model": "m", "max_new_tokens": 8, "machine": MACHINE,
                "prompts": {"short": {"tokens": 42}, "long": {"tokens": 785}},
                "ratios_yirage_over_llamacpp_best": {"persistent=True": {"decode_short": 2.0, "prefill_short": 2.5,
                                                                         "decode_long": 2.2},
                                                     "persistent=True decode_dtype=int8": {"decode_short": 2.9}},
                "ratios_yirage_over_transformers": {"persistent=True": {"decode_short": 10.0},
                                                    "persistent=False": {"decode_short": 9.0}}}, 5),
    "embed": ({"model": "all-minilm-l6-v2", "sentences": 64, "batch_size": 32, "machine": MACHINE,
               "speedup_yirage_float32_vs_sentence_transformers": 2.3, "speedup_yirage_int8_vs_onnxruntime": 2.6}, 2),
    "serve": ({"model": "m", "slots": 16, "output_tokens": 128, "machine": MACHINE,
               "yirage_vs_llama_server": [{"concurrency": 1, "prompt_tokens": 128, "output_tokens_per_s": 1.02},
                                          {"concurrency": 16, "prompt_tokens": 128, "output_tokens_per_s": 1.79}]}, 2),
    "torch_compile": ({"machine": MACHINE, "device": "cpu", "dtype": "float32", "rounds": 3,
                       "models": {"bert b1": {"yirage_speedup_vs_eager": 1.8, "yirage_speedup_vs_inductor": 1.6},
                                  "resnet50 b8": {"yirage_speedup_vs_eager": 1.4}}}, 3),
    "kernels_cpu": ({"machine": MACHINE,
                     "decode_M1_hot": [{"M": 1, "N": 576, "K": 576, "speedup_q4_1_vs_torch": 3.5,
                                        "speedup_q8_0_vs_torch": 3.0}],
                     "gemm": [{"M": 32, "N": 384, "K": 384, "ratio_vs_onednn_bf16_gemm": 0.5}]}, 3),
    "superoptimize": ({"machine": MACHINE, "small": True,
                       "graphs": {"gqa": {"speedup_superopt_vs_compile": 1.2, "speedup_superopt_vs_fixed": 1.3},
                                  "lora": {"speedup_fixed_vs_compile": 1.0}}}, 2),
    "scale": ({"machine": MACHINE, "embed": {"sentences": 20000, "ray_vs_in_process": 0.77,
                                            "in_process_vs_st_multi_process": 2.6},
               "serve": {"ray_2x1_vs_ray_1x2": 1.005, "plain_vs_llama-server": None}}, 3),
    "webgpu": ({"machine": MACHINE, "small": True, "adapter": {"device": "llvmpipe", "backend_type": "Vulkan"},
                "graphs": {"gqa": {"webgpu_vs_cpu": 0.2}}, "gemm": {"n": 256, "webgpu_vs_cpu": 0.1},
                "decode": {"webgpu_vs_cpu": 0.05, "webgpu_vs_torch_gpu": 0.5}}, 4),
    "providers": ({"machine": MACHINE, "rounds": 9,
                   "rows": [{"key": "linear f32 M128 K384 N1536", "chosen_over_fastest": 1.02},
                            {"key": "linear f32 M1 K384 N384", "chosen_over_fastest": 1.0}]}, 2),
    "parallel_convs": ({"machine": MACHINE, "results": [{"group": "resnet-50", "batch": 1, "speedup": 1.3},
                                                        {"group": "resnet-50", "batch": 8, "speedup": 0.9}]}, 2),
    "gpu": ({"machine": MACHINE, "device": "NVIDIA H100", "backend": "cuda", "dtype": "float16",
             "graphs": {"gqa": {"speedup_vs_eager": 2.0, "speedup_vs_compile": 1.5,
                                "cudagraph_speedup_vs_compile": 3.4}},
             "llm": {"decode_speedup": 12.0}}, 4),
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_draws_its_report(name, tmp_path):
    if name in ("serve", "scale"):
        pytest.importorskip("httpx", reason="benchmarks/serve.py needs httpx")
    report, n_bars = REPORTS[name]
    fig = load(name).plot_figure(report)
    assert len(fig["bars"]) == n_bars and all(b["ratio"] > 0 for b in fig["bars"])
    assert fig["machine"] == MACHINE
    _plot.draw(fig, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_a_run_with_no_peer_draws_nothing(tmp_path, capsys):
    assert load("embed").plot_figure({"model": "m", "sentences": 1, "batch_size": 1, "machine": MACHINE}) is None
    _plot.save(None, str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists() and "nothing to draw" in capsys.readouterr().err


def test_the_docs_figures_have_their_data_beside_them():
    folder = ROOT / "docs" / "img" / "benchmarks"
    pngs = sorted(folder.glob("*.png"))
    if not pngs:
        pytest.skip("no figures under docs/img/benchmarks")
    for png in pngs:
        data = png.with_suffix(".json")
        assert data.exists(), f"{png.name} has no {data.name} to redraw it from"
        fig = json.loads(data.read_text())
        assert {"job", "title", "machine", "date", "command", "source", "bars"} <= set(fig), data.name
        assert png.stat().st_size < 150_000, f"{png.name}: {png.stat().st_size} bytes"


def test_plot_paths_are_checked_before_a_run(tmp_path, capsys):
    ap = load("webgpu").parser()
    for bad in (str(tmp_path / "figure.txt"), str(tmp_path / "missing" / "figure.png")):
        with pytest.raises(SystemExit):
            ap.parse_args(["--plot", bad])
    report = str(tmp_path / "run.json")
    args = ap.parse_args(["--plot", str(tmp_path / "run.png"), "-o", report])
    with pytest.raises(SystemExit):   # the figure's data would overwrite -o's report
        _plot.check_plot(ap, args)
    assert "-o's report" in capsys.readouterr().err
    _plot.check_plot(ap, ap.parse_args(["--plot", str(tmp_path / "run.png"), "-o", str(tmp_path / "other.json")]))
