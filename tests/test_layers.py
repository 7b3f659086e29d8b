"""The import layers of ARCHITECTURE.md, enforced with import-linter (config in pyproject.toml).

cli > engines > models > kernel (front end) > backends > runtime > kernels > codegen >
transforms > ir > {dtypes, config} > errors: a module may import only from layers below its
own, lazy imports inside functions included, so no package-level cycle can form. Inside the CPU
backend the same holds for its modules: backend > library > {conv, precision} > providers >
embed > native.
"""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports() -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    return subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                          capture_output=True, text=True)


def test_imports_follow_the_layers():
    proc = _lint_imports()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout


def test_a_backward_import_is_caught(tmp_path):
    """The check is live: an ir module that imports a backend lazily breaks the contract."""
    probe = ROOT / "src" / "yirage" / "ir" / "_layer_probe.py"
    probe.write_text("def f():\n    from ..backends import get_backend\n    return get_backend\n")
    try:
        proc = _lint_imports()
    finally:
        probe.unlink()
    assert proc.returncode != 0
    assert "yirage.ir is not allowed to import yirage.backends" in proc.stdout
