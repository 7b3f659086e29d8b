"""Fixtures of the tool tests: the ``yirage`` command line run in this process."""
from __future__ import annotations

import signal
import sys

import pytest
from click.testing import CliRunner


@pytest.fixture
def run_cli():
    """``run_cli(*args) -> click.testing.Result``: the ``yirage`` command group run in this
    process, so that monkeypatches apply. The CLI's error exit resets the SIGINT handler; it is
    put back afterwards."""
    from yirage.cli import cli

    handler = signal.getsignal(signal.SIGINT)
    runner = CliRunner()
    yield lambda *args: runner.invoke(cli, list(args))
    signal.signal(signal.SIGINT, handler)


def _one_line_error(result, *fragments) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, (result.exit_code, result.stderr)
    assert lines[0].startswith("yirage: error: ")
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def one_line_error():
    """``one_line_error(result, *fragments) -> str``: asserts that a ``run_cli`` result exited 1
    with one line ``yirage: error: ...`` on stderr holding every fragment; returns the line."""
    return _one_line_error


@pytest.fixture
def yirage_cli(monkeypatch, capsys):
    """Run ``yirage ARGS`` in this process through ``cli.main`` (the entry point: its one-line
    errors and exit statuses); returns (status, stdout, stderr). Its signal handling is
    switched off, so that the test process keeps its own SIGINT handler."""
    from yirage import cli

    def _exit(code):
        raise SystemExit(code)
    monkeypatch.setattr(cli, "_exit", _exit)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["yirage", *args])
        with pytest.raises(SystemExit) as e:
            cli.main()
        out = capsys.readouterr()
        return e.value.code, out.out, out.err
    return run
