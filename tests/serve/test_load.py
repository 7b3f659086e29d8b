"""The load test of ``yirage serve`` (issue 20), small enough for CI: 60 concurrent requests
(streamed or not, chat and text, greedy and seeded) of which about a fifth are abandoned by
their clients mid-way, against both engines. Every answer must equal the same request run
alone on ``yr.LLM.generate``; no 5xx; abandoned requests stop and free their slots; later
requests still succeed; resident memory stays flat. ``loadgen.py`` holds the load and the
checks (``make load-test`` runs it with 200 requests)."""
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import loadgen  # noqa: E402  (tests/serve is on sys.path: pytest's rootdir-less import mode)

from yirage.serve import ServeOptions, create_app  # noqa: E402

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def cases_and_refs(smollm):
    cases = loadgen.make_cases()
    return cases, loadgen.references(smollm, cases)


@pytest.mark.slow
@pytest.mark.parametrize("parallel,requests", [(4, 60), (1, 24)], ids=["batching", "one-at-a-time"])
def test_load_with_abandoned_requests(smollm, cases_and_refs, parallel, requests):
    cases, refs = cases_and_refs
    app = create_app(ServeOptions(MODEL, max_queue=128, timeout_s=120, parallel=parallel), llm=smollm)
    with loadgen.serve_in_thread(app) as url:
        warm = loadgen.run_load(url, MODEL, cases, refs, requests=12, concurrency=8, seed=1)
        assert warm.failures == []
        report = loadgen.run_load(url, MODEL, cases, refs, requests=requests, concurrency=8,
                                  cancel_fraction=0.25, bad_fraction=0.05, seed=0)
        engine = app.state.yirage.engine
        if parallel > 1:   # nothing left behind in the engine's tables
            assert engine.engine.running == [] and engine.engine.waiting == 0
            assert engine._jobs == {} and engine._owner == {} and engine._last == {}
    assert report.failures == [], "\n".join(report.failures)
    assert report.abandoned >= 3 and report.answered >= requests // 2 and report.statuses == {}
    assert report.rss_mb_after - warm.rss_mb_after < 48, (warm.rss_mb_after, report.rss_mb_after)
