"""The compile cache across processes (yirage/dynamo/cache.py): a second interpreter with the
same ``YIRAGE_CACHE_DIR`` loads every partition variant instead of lowering it, and a damaged
entry is detected, logged at DEBUG and rebuilt."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from yirage.dynamo import cache
from yirage.runtime import toolchain

SCRIPT = textwrap.dedent("""
    import json, logging, sys, time
    import torch, torch.nn as nn, torch.nn.functional as F
    import yirage as yr
    from yirage.dynamo import cache

    class Block(nn.Module):
        def __init__(self, d=32):
            super().__init__()
            self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 64), nn.Linear(64, d)
        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(self.ln(x)))) + x

    logging.basicConfig(stream=sys.stderr)
    logging.getLogger("yirage").setLevel(logging.DEBUG)
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 5, 32)
    t = time.perf_counter()
    report = yr.explain(model, x)
    with torch.no_grad():
        err = (report.outputs - model(x)).abs().max().item()
    print(json.dumps({"hits": report.cache_hits, "misses": report.cache_misses, "stats": cache.stats(),
                      "partitions": len(report.yirage_partitions), "err": err,
                      "seconds": time.perf_counter() - t}))
""")


def _run(cache_dir: Path) -> tuple[dict, str]:
    if not (cache_dir / "cpp").exists():   # the built C++ libraries are shared: only the compile cache is new
        (cache_dir / "cpp").symlink_to(toolchain.cache_folder("cpp"), target_is_directory=True)
    env = dict(os.environ, YIRAGE_CACHE_DIR=str(cache_dir), YIRAGE_BACKEND="cpu")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_second_process_hits_and_a_damaged_entry_is_rebuilt(tmp_path, monkeypatch):
    first, _ = _run(tmp_path)
    assert first["partitions"] >= 1 and first["err"] < 1e-4
    assert first["hits"] == 0 and first["misses"] >= 1 and first["stats"]["stores"] == first["misses"]

    second, _ = _run(tmp_path)
    assert second["hits"] == first["misses"] and second["misses"] == 0 and second["err"] < 1e-4
    assert second["stats"]["corrupt"] == 0

    entries = sorted((tmp_path / "dynamo").glob("*.json"))
    assert len(entries) == first["misses"]
    doc = json.loads(entries[0].read_text())
    doc["payload"] = doc["payload"].replace("float32", "float16", 1)   # checksum no longer matches
    entries[0].write_text(json.dumps(doc))
    third, log = _run(tmp_path)
    assert third["stats"]["corrupt"] == 1 and third["misses"] == 1 and third["err"] < 1e-4
    assert "is damaged" in log and "rebuilding it" in log
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path))   # the rebuilt entry was stored again
    assert cache.load(entries[0].stem)[1] == "hit"


def test_truncated_entry_is_a_rebuild_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path))
    entry = cache.Entry('{"version": 1}', [[[2.0], "float32"]], False)
    cache.store("k" * 64, entry)
    path = cache.entry_path("k" * 64)
    loaded, status = cache.load("k" * 64)
    assert status == "hit" and loaded.constant_tensors()[0].dtype == torch.float32
    path.write_text(path.read_text()[:40])
    before = cache.stats()["corrupt"]
    assert cache.load("k" * 64) == (None, "corrupt")
    assert cache.stats()["corrupt"] == before + 1
