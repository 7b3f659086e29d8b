"""Replays every fuzzing regression saved by `make fuzz` (tests/fuzz/regressions/*.json).

Each file holds a mutation recipe that once crashed, hung or raised a non-yirage exception; it
must now end in a yirage exception or load and run. Passes trivially when nothing is saved.
"""
from __future__ import annotations

import pytest

from fuzz import campaign, runner


@pytest.mark.slow
def test_saved_regressions_fail_cleanly():
    saved = campaign.load_regressions()
    if not saved:
        return  # nothing saved yet
    results, digest = campaign.replay_results([rec for _, rec in saved])
    lines = []
    for (path, rec), res in zip(saved, results):
        if res.outcome in runner.FAILING:
            note = f" (saved against seeds {rec.get('seeds')}, replayed on {digest})" if rec.get("seeds") != digest else ""
            lines.append(f"{path.name}: {res.describe()}{note}")
    assert not lines, f"{len(lines)} of {len(saved)} saved regressions still fail:\n" + "\n".join(lines)
