"""benchmarks/webgpu.py runs end to end on the adapter at hand (lavapipe here) and reports every
side from one run with the adapter; its figures are checked for shape, not speed."""
import json
import os
import subprocess
import sys

import pytest

import yirage as yr

if not yr.is_backend_available("webgpu"):
    pytest.skip("webgpu unavailable", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_webgpu_benchmark_reports_every_side_and_the_adapter(tmp_path):
    out = tmp_path / "webgpu.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "webgpu.py"), "--graphs", "lora",
                           "--gemm", "512", "--rounds", "2", "--min-time", "0.2", "--skip-decode", "-o", str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "YIRAGE_BACKEND": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["adapter"]["device"] and report["software_adapter"] == (report["adapter"]["adapter_type"] == "CPU")
    lora = report["graphs"]["lora"]
    assert lora["max_abs_err"] < 1e-4 and set(lora["us"]) >= {"yirage_webgpu", "yirage_cpu"}
    assert report["gemm"]["max_abs_err"] < 1e-3 and report["gemm"]["gflops"]["yirage_webgpu"] > 0
    assert report["machine"]["cores"] >= 1
