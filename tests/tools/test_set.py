"""The default backend in the user config file: ``yirage set NAME | --unset``, its reading
(yirage/config.py) and its place in the precedence set_backend > YIRAGE_BACKEND > config file >
auto (yirage/backends/__init__.py), ``yirage info`` naming the source, and the errors of a
malformed file or a bad name. Every test points XDG_CONFIG_HOME at its own directory."""
import json
import os

import pytest

import yirage as yr
import yirage.backends as backends
from yirage.config import read_user_config, update_user_config, user_config_path
from yirage.errors import BackendUnavailableError, ConfigError


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    """The config file's path under a fresh XDG_CONFIG_HOME; no YIRAGE_BACKEND (tests/conftest.py
    sets it to cpu), no set_backend() choice."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("YIRAGE_BACKEND", raising=False)
    monkeypatch.setattr(backends, "_explicit_backend", None)
    return tmp_path / "yirage" / "config.json"


def _auto_and_other():
    """('auto''s choice here, another available backend), skipping where only one is available."""
    auto = backends.resolve_backend("auto")
    others = [b for b in yr.get_available_backends() if b != auto]
    if not others:
        pytest.skip("needs two available backends (tests/conftest.py enables triton-interpret without a GPU)")
    return auto, others[0]


def test_config_path_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert user_config_path() == tmp_path / "yirage" / "config.json"
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/dir")  # the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_config_path() == tmp_path / "home" / ".config" / "yirage" / "config.json"


def test_set_show_unset(config_file, run_cli):
    result = run_cli("set")
    assert result.exit_code == 0 and f"no backend set in {config_file}" in result.stdout
    assert not config_file.exists()

    result = run_cli("set", "CPU")
    assert result.exit_code == 0 and result.stdout == f"default backend: cpu (written to {config_file})\n"
    assert json.loads(config_file.read_text()) == {"backend": "cpu"}
    assert os.listdir(config_file.parent) == ["config.json"]  # the temporary file was renamed over it
    result = run_cli("set")
    assert f"backend in {config_file}: cpu" in result.stdout and "default backend: cpu (from config)" in result.stdout

    result = run_cli("set", "--unset")
    assert result.exit_code == 0 and f"removed backend 'cpu' from {config_file}" in result.stdout
    assert json.loads(config_file.read_text()) == {}
    result = run_cli("set", "--unset")
    assert result.exit_code == 0 and "nothing to remove" in result.stdout


def test_other_keys_are_kept(config_file, run_cli):
    config_file.parent.mkdir(parents=True)
    config_file.write_text('{"profile": "/p.json", "backend": "cpu"}')
    assert run_cli("set", "auto").exit_code == 0
    assert json.loads(config_file.read_text()) == {"profile": "/p.json", "backend": "auto"}
    assert run_cli("set", "--unset").exit_code == 0
    assert json.loads(config_file.read_text()) == {"profile": "/p.json"}


def test_precedence(config_file, monkeypatch):
    auto, other = _auto_and_other()
    assert (backends.get_backend(), backends.get_backend_source()) == (auto, "auto")
    update_user_config(backend=other.value)
    assert (backends.get_backend(), backends.get_backend_source()) == (other, "config")
    monkeypatch.setenv("YIRAGE_BACKEND", auto.value)
    assert (backends.get_backend(), backends.get_backend_source()) == (auto, "env")
    backends.set_backend(other)
    assert (backends.get_backend(), backends.get_backend_source()) == (other, "set_backend")
    monkeypatch.setattr(backends, "_explicit_backend", None)
    monkeypatch.delenv("YIRAGE_BACKEND")
    update_user_config(backend="auto")
    assert (backends.get_backend(), backends.get_backend_source()) == (auto, "config")


def test_info_names_the_config_file(config_file, run_cli):
    _, other = _auto_and_other()
    assert run_cli("set", other.value).exit_code == 0
    result = run_cli("info")
    assert result.exit_code == 0, result.output
    assert f"default backend: {other.value} (from config file {config_file})" in result.stdout


def test_env_override_is_noted(config_file, run_cli, monkeypatch):
    monkeypatch.setenv("YIRAGE_BACKEND", "cpu")
    result = run_cli("set", "auto")
    assert result.exit_code == 0 and "note: YIRAGE_BACKEND='cpu' is set and overrides it here" in result.stderr


@pytest.mark.parametrize("content,fragment", [
    (b"{backend: cpu}", "is not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    (b'["cpu"]', "must hold a JSON object"),
    (b"\xff\xfe", "is not UTF-8 text"),
    (b'{"backend": 3}', "sets backend to 3, not a backend name"),
    (b'{"backend": ""}', "sets backend to '', not a backend name"),
])
def test_malformed_file_is_one_clear_error(config_file, run_cli, one_line_error, content, fragment):
    config_file.parent.mkdir(parents=True)
    config_file.write_bytes(content)
    with pytest.raises(ConfigError, match="yirage set --unset") as error:
        backends.get_backend()
    assert str(config_file) in str(error.value) and fragment in str(error.value)
    one_line_error(run_cli("info"), str(config_file), fragment, "run 'yirage set --unset' to reset it")
    one_line_error(run_cli("test", "-k", "argmax/5x7"), str(config_file))  # the default backend is resolved
    assert run_cli("set", "--unset").exit_code == 0  # repairs it
    assert backends.get_backend() == backends.resolve_backend("auto")


def test_unset_sets_a_malformed_file_aside(config_file, run_cli):
    config_file.parent.mkdir(parents=True)
    config_file.write_text("not json")
    result = run_cli("set", "cpu")
    assert result.exit_code == 0 and json.loads(config_file.read_text()) == {"backend": "cpu"}
    assert (config_file.parent / "config.json.bad").read_text() == "not json"


def test_unreadable_or_unwritable_config(config_file, run_cli, one_line_error):
    config_file.mkdir(parents=True)  # a directory where the file should be
    with pytest.raises(ConfigError, match="cannot read the config file"):
        read_user_config()
    one_line_error(run_cli("set", "cpu"), "cannot read the config file", str(config_file))
    config_file.rmdir()
    config_file.parent.rmdir()
    config_file.parent.write_text("")  # a file where the directory should be
    one_line_error(run_cli("set", "cpu"), f"cannot write the config file {config_file}")
    assert backends.get_backend() == backends.resolve_backend("auto")  # nothing to read: auto


def test_set_refuses_unknown_and_unavailable_backends(config_file, run_cli, one_line_error):
    one_line_error(run_cli("set", "tpu"), "'tpu' is unknown (known backends: cpu, cuda", "auto")
    missing = [b for b in yr.Backend if not yr.is_backend_available(b)]
    if missing:
        one_line_error(run_cli("set", missing[0].value), f"'{missing[0].value}' is unavailable: ")
    one_line_error(run_cli("set", "cpu", "--unset"), "give a backend name or --unset, not both")
    assert not config_file.exists()


def test_config_naming_an_unavailable_backend(config_file, run_cli, one_line_error):
    config_file.parent.mkdir(parents=True)
    missing = [b.value for b in yr.Backend if not yr.is_backend_available(b)]
    for name in ["tpu"] + missing[:1]:
        config_file.write_text(json.dumps({"backend": name}))
        with pytest.raises(BackendUnavailableError, match=f"the config file {config_file} sets backend '{name}'"):
            backends.get_backend()
        one_line_error(run_cli("info"), str(config_file), "yirage set --unset")
