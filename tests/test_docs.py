"""The documentation site builds: ``mkdocs build --strict`` over docs/ and mkdocs.yml.

Strict mode turns every warning into a failure: a broken link or anchor, a page missing from
the nav, a ``::: yirage.module`` reference that does not resolve, a docstring that
mkdocstrings cannot parse. The build runs in a subprocess from the repository root into a
temporary directory (never site/), and a failure shows mkdocs' own output.

This test must never write into the source tree. It skips only when mkdocs (or its
plugins) is not installed: ``pip install -e '.[docs]'`` (make test's set-up does).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NEEDED = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _missing() -> list[str]:
    missing = []
    for name in NEEDED:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except ModuleNotFoundError:
            missing.append(name)
    return missing


def build(config: Path, site_dir: Path) -> subprocess.CompletedProcess:
    """``python -m mkdocs build --strict`` of ``config`` into ``site_dir``; the process result."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def mkdocs_installed():
    missing = _missing()
    if missing:
        pytest.skip(f"mkdocs is not installed ({', '.join(missing)} missing): pip install -e '.[docs]' "
                    "(make test's set-up installs it)")


def test_docs_build_strict(mkdocs_installed, tmp_path):
    result = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, (f"mkdocs build --strict failed (exit {result.returncode}):\n"
                                    f"{result.stdout}\n{result.stderr}")
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "llm" / "index.html").is_file()


def test_broken_link_fails_the_build(mkdocs_installed, tmp_path):
    """The build can fail: a copy of the docs with one link to a page that does not exist."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    page = docs / "getting-started.md"
    page.write_text(page.read_text() + "\n[a page that does not exist](no-such-page.md)\n")
    config = tmp_path / "mkdocs.yml"
    text = (ROOT / "mkdocs.yml").read_text()
    config.write_text(text.replace("docs_dir: docs", f"docs_dir: {docs}")
                      .replace("paths: [src]", f"paths: [{ROOT / 'src'}]"))
    result = build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stdout + result.stderr
