"""Fixtures of the tools' tests: the ``yirage`` command line run in this process."""
import sys

import pytest

from yirage import cli


@pytest.fixture
def yirage_cli(monkeypatch, capsys):
    """Run ``yirage ARGS`` in this process through ``cli.main`` (the entry point: its one-line
    errors and exit statuses); returns (status, stdout, stderr). Its signal handling is
    switched off, so that the test process keeps its own SIGINT handler."""
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
