"""Fixtures of the tool tests (``yirage test``, ``yirage set``): the CLI run in this process."""
from __future__ import annotations

import signal

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
