"""No body gets a 5xx from ``yirage serve``: hypothesis posts generated bodies (JSON values of
every shape, near-misses of real requests, raw bytes) to every endpoint; each answer is a 2xx or
an OpenAI-style 4xx, and afterwards the server still answers a normal request correctly."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import yirage as yr  # noqa: E402
from yirage.serve import ServeOptions, create_app  # noqa: E402

from test_serve import EMB_NAME, LLM_NAME, running  # noqa: E402  (tests/serve is on sys.path)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
# near-misses of real requests: the real field names with values of any shape; few new tokens
fields = st.fixed_dictionaries(
    {"model": st.sampled_from([LLM_NAME, EMB_NAME, "gpt-4o"]) | json_values},
    optional={"messages": json_values | st.lists(st.fixed_dictionaries({"role": st.sampled_from(
                  ["user", "system", "assistant", "tool", "x"]) | json_values, "content": json_values}), max_size=3),
              "prompt": json_values | st.text(max_size=30) | st.lists(st.integers(-5, 60000), max_size=8),
              "input": json_values | st.lists(st.text(max_size=10), max_size=3),
              "max_tokens": st.integers(-3, 4) | json_values, "temperature": json_values, "top_p": json_values,
              "stop": json_values, "n": st.integers(-1, 3) | json_values, "stream": st.booleans() | json_values,
              "response_format": json_values, "seed": json_values, "logprobs": st.integers(-1, 21) | json_values,
              "top_logprobs": st.integers(-1, 21) | json_values, "echo": st.booleans() | json_values,
              "logit_bias": json_values, "tools": json_values,
              "encoding_format": st.sampled_from(["float", "base64", "x"]) | json_values})
bodies = (fields.map(lambda d: json.dumps(d).encode())
          | json_values.map(lambda v: json.dumps(v).encode())
          | st.binary(max_size=64))


@pytest.fixture(scope="module")
def base(smollm):
    embedder = yr.EmbeddingModel(EMB_NAME, backend="cpu")
    app = create_app(ServeOptions(LLM_NAME, EMB_NAME, max_queue=16, timeout_s=60, parallel=4),
                     llm=smollm, embedder=embedder)
    with running(app) as url:
        yield url


@pytest.mark.slow
@pytest.mark.parametrize("path", ENDPOINTS)
def test_generated_bodies_never_get_a_5xx(base, path):
    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(body=bodies)
    def post(body):
        r = httpx.post(f"{base}{path}", content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code < 500, (body[:200], r.status_code, r.text[:300])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["code"] == r.status_code and err["message"]
    post()
    # the server still answers a normal request, with the engine's own answer
    if path == "/v1/embeddings":
        r = httpx.post(f"{base}{path}", json={"model": EMB_NAME, "input": "still here"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
    else:
        r = httpx.post(f"{base}/v1/completions", json={"model": LLM_NAME, "prompt": "The sky is", "max_tokens": 4,
                                                       "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
