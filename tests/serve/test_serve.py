"""``yirage serve`` over real HTTP, called the way users call it: the ``openai`` client (and
httpx for malformed requests). Every answer is checked against the engines called directly
(``yr.LLM.generate``, ``yr.EmbeddingModel.encode``)."""
import concurrent.futures
import contextlib
import json
import socket
import threading
import time

import numpy as np
import pytest
import torch

import yirage as yr

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from yirage.serve import ServeOptions, create_app  # noqa: E402

from serve_process import wait_healthy  # noqa: E402  (tests/serve_process.py)

LLM_NAME, EMB_NAME = "smollm2-135m-instruct", "all-minilm-l6-v2"


@contextlib.contextmanager
def running(app):
    """Serve ``app`` on a free local port in a thread; yields the base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def embedder():
    return yr.EmbeddingModel(EMB_NAME, backend="cpu")


@pytest.fixture(scope="module", params=[4, 1], ids=["batching", "one-at-a-time"])
def url(request, smollm, embedder):
    """The server with continuous batching of 4 sequences, then with one sequence at a time."""
    app = create_app(ServeOptions(LLM_NAME, EMB_NAME, max_queue=16, timeout_s=120, parallel=request.param),
                     llm=smollm, embedder=embedder)
    with running(app) as base:
        APPS[base] = app
        yield base


#: base URL -> the app served there (to look at its engine)
APPS = {}


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is 12 times 7?"}]


@pytest.mark.slow
def test_models_and_health(client, url):
    assert {m.id for m in client.models.list().data} == {LLM_NAME, EMB_NAME}
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.slow
def test_chat_completion_equals_the_engine(client, smollm):
    r = client.chat.completions.create(model=LLM_NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    ref = smollm.generate(MESSAGES, max_new_tokens=12, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(smollm.encode_prompt(MESSAGES))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 12 "}, {"type": "text", "text": "times 7?"}]}]
    same = client.chat.completions.create(model=LLM_NAME, messages=[MESSAGES[0], *parts], max_completion_tokens=12,
                                          temperature=0)
    assert same.choices[0].message.content == ref.text
    seeded = [client.chat.completions.create(model=LLM_NAME, messages=MESSAGES, max_tokens=8, temperature=0.9,
                                             seed=5, n=2) for _ in range(2)]
    assert [c.message.content for c in seeded[0].choices] == [c.message.content for c in seeded[1].choices]
    assert len(seeded[0].choices) == 2
    # a stop string: the reply ends before it, as the engine's does
    cut = ref.text[len(ref.text) // 2:][:3]
    assert cut.strip()
    stopped = client.chat.completions.create(model=LLM_NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                             stop=[cut])
    want = smollm.generate(MESSAGES, max_new_tokens=12, temperature=0, stop=[cut])
    assert stopped.choices[0].message.content == want.text and cut not in want.text
    assert stopped.choices[0].finish_reason == want.finish_reason == "stop"


@pytest.mark.slow
def test_streamed_chat_gives_the_same_text_then_usage(client):
    full = client.chat.completions.create(model=LLM_NAME, messages=MESSAGES, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=LLM_NAME, messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # n choices that end in the same step: each streamed choice has its whole text
    kw = dict(model=LLM_NAME, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=5, n=2)
    texts = ["", ""]
    for c in client.chat.completions.create(**kw, stream=True):
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in client.chat.completions.create(**kw).choices]


@pytest.mark.slow
def test_completions_with_token_ids_and_ignore_eos(client, smollm):
    ids = smollm.encode_prompt("Count to 3.")
    r = client.completions.create(model=LLM_NAME, prompt=ids, max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    ref = smollm.generate(ids, max_new_tokens=40, ignore_eos=True)
    assert r.choices[0].text == ref.text
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=LLM_NAME, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True))
    assert text == smollm.generate("The capital of France is", max_new_tokens=8, chat=False).text


@pytest.mark.slow
def test_embeddings_float_base64_and_token_ids(client, embedder):
    texts = ["The cat sat on the mat.", "Un chat est assis.", "Compilers fuse kernels."]
    ref = embedder.encode(texts)
    b64 = client.embeddings.create(model=EMB_NAME, input=texts)   # the client asks for base64
    assert [d.index for d in b64.data] == [0, 1, 2]
    np.testing.assert_array_equal(np.array([d.embedding for d in b64.data], dtype=np.float32), ref)
    flt = client.embeddings.create(model=EMB_NAME, input=texts[0], encoding_format="float")
    np.testing.assert_array_equal(np.array(flt.data[0].embedding, dtype=np.float32), embedder.encode(texts[:1])[0])
    ids = embedder.tokenize(texts[:2])
    by_ids = client.embeddings.create(model=EMB_NAME, input=ids, encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in by_ids.data]), ref[:2], rtol=1e-5, atol=1e-6)
    assert by_ids.usage.prompt_tokens == sum(len(x) for x in ids)


@pytest.mark.slow
def test_concurrent_requests_get_their_own_answers(client, smollm):
    prompts = [f"Name {k} fruits." for k in range(2, 10)]
    alone = [smollm.generate(p, max_new_tokens=10, temperature=0).text for p in prompts]

    def ask(p):
        return client.chat.completions.create(model=LLM_NAME, messages=[{"role": "user", "content": p}],
                                              max_tokens=10, temperature=0).choices[0].message.content
    engine = APPS[str(client.base_url).rstrip("/").removesuffix("/v1")].state.yirage.engine
    steps_before = getattr(getattr(engine, "engine", None), "steps", 0)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, prompts)) == alone
    if hasattr(engine, "engine"):   # continuous batching: the 8 requests shared steps
        assert engine.engine.steps - steps_before < 8 * 10 / 2


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colours"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                         "colours": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}}
ANN = [{"role": "user", "content": "Describe a person named Ann, 31, who likes blue and green, as JSON."}]


def check_json(text: str, schema: dict | None):
    """``text`` parsed as JSON and validated against ``schema`` (jsonschema when installed,
    else PERSON's keys and types); raises otherwise."""
    value = json.loads(text)
    assert isinstance(value, dict)
    if schema is not None:
        try:
            import jsonschema
        except ImportError:
            assert set(value) == set(schema["required"]) and isinstance(value["age"], int)
        else:
            jsonschema.validate(value, schema)
    return value


@pytest.mark.slow
def test_response_format_json_object_and_json_schema(client, smollm):
    pytest.importorskip("llguidance")
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=LLM_NAME, messages=ANN, max_tokens=80, temperature=0,
                                       response_format=schema_format)
    assert r.choices[0].finish_reason == "stop"
    person = check_json(r.choices[0].message.content, PERSON)
    assert person["name"] == "Ann" and person["age"] == 31
    ref = smollm.generate(ANN, max_new_tokens=80, response_format=schema_format)   # the engine alone
    assert r.choices[0].message.content == ref.text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=LLM_NAME, messages=ANN, max_tokens=80, temperature=0, response_format=schema_format, stream=True))
    assert streamed == ref.text
    sampled = client.chat.completions.create(model=LLM_NAME, messages=ANN, max_tokens=80, temperature=1.0, seed=3,
                                             n=2, response_format=schema_format)
    for choice in sampled.choices:
        check_json(choice.message.content, PERSON)
    obj = client.chat.completions.create(model=LLM_NAME, max_tokens=60, temperature=0,
                                         messages=[{"role": "user", "content": "Give three fruits and their colours."}],
                                         response_format={"type": "json_object"})
    check_json(obj.choices[0].message.content, None)


BAD = [  # (body, status, words in the message)
    ('{"model": "smollm2-135m-instruct", "messages": [', 400, "not valid JSON"),
    ({"model": LLM_NAME, "messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens"),
    ({"model": LLM_NAME, "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": LLM_NAME, "messages": []}, 400, "messages"),
    ({"model": LLM_NAME, "messages": MESSAGES, "temperature": 3}, 400, "temperature"),
    ({"model": LLM_NAME, "messages": MESSAGES, "bogus": 1}, 400, "unknown field"),
    ({"model": LLM_NAME, "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, 400, "Invalid type: bogus"),
    ({"model": LLM_NAME, "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/missing"}}}}, 400, "does not exist"),
    ({"model": LLM_NAME, "messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400, "needs a 'json_schema'"),
    ({"model": LLM_NAME, "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}}, 400, "response_format.json_schema.name"),
    ({"model": LLM_NAME, "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": "not a schema"}}}, 400, "response_format.json_schema.schema"),
    ({"model": LLM_NAME, "messages": MESSAGES, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ({"model": LLM_NAME, "messages": MESSAGES, "top_logprobs": 2}, 400, "'top_logprobs' needs 'logprobs': true"),
    ({"model": LLM_NAME, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": LLM_NAME, "messages": MESSAGES, "logprobs": 3}, 400, "logprobs"),
    ({"model": LLM_NAME, "messages": MESSAGES, "logit_bias": {"5": 300}}, 400, "must be a number in [-100, 100]"),
    ({"model": LLM_NAME, "messages": MESSAGES, "logit_bias": {"999999": 1}}, 400, "not a token id in [0, 49152)"),
    ({"model": LLM_NAME, "messages": MESSAGES, "logit_bias": {"a": 1}}, 400, "'a' is not a token id"),
    ({"model": LLM_NAME, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages"),
    ({"model": "gpt-4o", "messages": MESSAGES}, 404, "not served here"),
    ({"model": LLM_NAME, "messages": [{"role": "user", "content": "x " * 5000}]}, 400, "max_seq_length"),
    ([1, 2], 400, "JSON object"),
    # more new tokens than the context (512) holds: refused, not silently cut
    ({"model": LLM_NAME, "messages": MESSAGES, "max_tokens": 10 ** 9}, 400, "more than the context of 512"),
    ({"model": LLM_NAME, "messages": MESSAGES, "max_completion_tokens": 600}, 400, "'max_completion_tokens' 600"),
    # wrong types are refused, never coerced
    ({"model": LLM_NAME, "messages": MESSAGES, "max_tokens": "3"}, 400, "max_tokens"),
    ({"model": LLM_NAME, "messages": MESSAGES, "max_tokens": True}, 400, "max_tokens"),
    ({"model": LLM_NAME, "messages": MESSAGES, "n": "2"}, 400, "n: Input should be a valid integer"),
]


@pytest.mark.slow
@pytest.mark.parametrize("body,status,words", BAD)
def test_bad_requests_get_one_clear_4xx(url, body, status, words):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{url}/v1/chat/completions", headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["code"] == status


@pytest.mark.slow
def test_logit_bias_as_the_openai_client_sends_it(client, smollm):
    """logit_bias (token id strings to biases) gives the engine's own answer with that bias, in
    chat and completions, streamed or not; -100 bans the token the model would pick."""
    ref = smollm.generate(MESSAGES, max_new_tokens=8)
    banned = ref.token_ids[0]
    want = smollm.generate(MESSAGES, max_new_tokens=8, logit_bias={banned: -100})
    got = client.chat.completions.create(model=LLM_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                         logit_bias={str(banned): -100})
    assert got.choices[0].message.content == want.text and want.token_ids[0] != banned
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=LLM_NAME, messages=MESSAGES, max_tokens=8, temperature=0, logit_bias={str(banned): -100}, stream=True))
    assert streamed == want.text
    plain = smollm.generate("The sky is", max_new_tokens=5, chat=False, logit_bias={"13": 4.5})
    text = client.completions.create(model=LLM_NAME, prompt="The sky is", max_tokens=5, temperature=0,
                                     logit_bias={"13": 4.5})
    assert text.choices[0].text == plain.text


@pytest.mark.slow
def test_chat_logprobs_as_openai_returns_them(client, smollm):
    """logprobs/top_logprobs: each generated token's text, logprob, UTF-8 bytes and alternatives,
    the engine's own values (which its tests hold to transformers'), streamed or not."""
    ref = smollm.generate(MESSAGES, max_new_tokens=8, logprobs=3)
    got = client.chat.completions.create(model=LLM_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)
    tokens = [smollm.tokenizer.decode([x.token_id]) for x in ref.logprobs]
    assert [c.token for c in content] == tokens and "".join(tokens) == got.choices[0].message.content
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    for c, x in zip(content, ref.logprobs):
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([v for _, v in x.top], abs=1e-5)
        assert [t.token for t in c.top_logprobs] == [smollm.tokenizer.decode([i]) for i, _ in x.top]
    plain = client.chat.completions.create(model=LLM_NAME, messages=MESSAGES, max_tokens=4, temperature=0,
                                           logprobs=True)
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)
    none = client.chat.completions.create(model=LLM_NAME, messages=MESSAGES, max_tokens=4, temperature=0)
    assert none.choices[0].logprobs is None
    streamed = [c for c in client.chat.completions.create(model=LLM_NAME, messages=MESSAGES, max_tokens=8,
                                                          temperature=0, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs is not None]
    items = [x for c in streamed for x in c.choices[0].logprobs.content]
    assert [x.token for x in items] == [c.token for c in content]
    assert [x.logprob for x in items] == pytest.approx([c.logprob for c in content], abs=1e-5)


@pytest.mark.slow
def test_completion_logprobs_with_echo_score_the_prompt(client, smollm):
    """/v1/completions with logprobs k and echo: the prompt's text then the completion's, and the
    legacy logprobs (tokens, token_logprobs with the first prompt token's null, top_logprobs,
    text_offset) of every prompt and generated token: the engine's prompt_logprobs and generate
    values. max_tokens 1 with echo is how evaluation harnesses score a text."""
    prompt = "The capital of France is Paris"
    ids = smollm.prompt_ids(prompt, False)
    scored = smollm.prompt_logprobs(ids, 2)
    ref = smollm.generate(prompt, max_new_tokens=3, chat=False, logprobs=2)
    got = client.completions.create(model=LLM_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                    echo=True)
    ch = got.choices[0]
    assert ch.text == prompt + ref.text
    lp = ch.logprobs
    every = ids + ref.token_ids
    assert lp.tokens == [smollm.tokenizer.decode([t]) for t in every]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [x.logprob for x in scored[1:]] + [x.logprob for x in ref.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(every))]
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert list(lp.top_logprobs[-1].values()) == pytest.approx([v for _, v in ref.logprobs[-1].top], abs=1e-5)
    # without echo: only the generated tokens; streamed: the same, piece by piece
    alone = client.completions.create(model=LLM_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=0)
    assert alone.choices[0].text == ref.text
    assert alone.choices[0].logprobs.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)
    chunks = list(client.completions.create(model=LLM_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ch.text
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    offsets = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset and values[0] is None
    assert values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    # echo without logprobs: the prompt's text only
    echoed = client.completions.create(model=LLM_NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + ref.text and echoed.choices[0].logprobs is None


ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@pytest.mark.slow
def test_bodies_no_endpoint_can_hold_get_one_4xx(url):
    """JSON nested 5,000 levels deep (Python's JSON decoder gives up at about 1,000: it was a 500),
    invalid UTF-8, and a lone UTF-16 surrogate in a string (valid JSON, not text: the tokenizer
    raised, a 500 on /v1/embeddings) get one OpenAI-style 400 on every endpoint."""
    deep_object = b'{"a":' * 5000 + b"1" + b"}" * 5000
    cases = [(deep_object, "nests deeper than 128 levels"), (b"[" * 5000 + b"]" * 5000, "nests deeper than 128 levels"),
             (b'{"model": "' + b"[" * 200 + b'"}', None),
             (json.dumps({"model": LLM_NAME, "input": [[["x"]] * 3] * 200}).encode(), None),
             (b'{"model": "\xff\xfe", "prompt": "a"}', "not valid JSON")]
    for path in ENDPOINTS:
        field = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/embeddings": "input"}[path]
        value = [{"role": "user", "content": "a \ud800 b"}] if field == "messages" else "a \ud800 b"
        surrogate = json.dumps({"model": EMB_NAME if field == "input" else LLM_NAME, field: value, "max_tokens": 2}
                               if field != "input" else {"model": EMB_NAME, "input": value})
        for body, words in [*cases, (surrogate.encode(), "lone UTF-16 surrogate")]:
            r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
            assert 400 <= r.status_code < 500, (path, body[:60], r.status_code, r.text[:200])
            err = r.json()["error"]
            assert err["code"] == r.status_code and (words is None or words in err["message"]), (path, err)


def test_a_body_over_the_limit_gets_413_before_it_is_read(smollm, embedder):
    app = create_app(ServeOptions(LLM_NAME, EMB_NAME, max_body_bytes=1000), llm=smollm, embedder=embedder)
    with running(app) as base:
        big = json.dumps({"model": EMB_NAME, "input": "word " * 400})
        r = httpx.post(f"{base}/v1/embeddings", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "more than --max-body-bytes 1000" in r.json()["error"]["message"]

        def chunks():   # no Content-Length: the limit holds while the body streams in
            yield big[:600].encode()
            yield big[600:].encode()
        r = httpx.post(f"{base}/v1/embeddings", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        ok = httpx.post(f"{base}/v1/embeddings", json={"model": EMB_NAME, "input": "a short one"})
        assert ok.status_code == 200


@pytest.mark.slow
def test_bad_completion_and_embedding_requests(url):
    cases = [("/v1/completions", {"model": LLM_NAME, "prompt": [10 ** 9]}, 400, "out of range"),
             ("/v1/completions", {"model": LLM_NAME, "prompt": ["a", "b"]}, 400, "one prompt per request"),
             ("/v1/completions", {"model": LLM_NAME, "prompt": "x", "max_tokens": 10 ** 30}, 400, "ask for at most"),
             ("/v1/completions", {"model": LLM_NAME, "prompt": "x", "ignore_eos": "no"}, 400, "ignore_eos"),
             ("/v1/completions", {"model": LLM_NAME, "prompt": [True]}, 400, "prompt"),
             ("/v1/completions", {"model": LLM_NAME, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
             ("/v1/completions", {"model": LLM_NAME, "prompt": "x", "logprobs": True}, 400, "logprobs"),
             ("/v1/embeddings", {"model": EMB_NAME, "input": []}, 400, "empty"),
             ("/v1/embeddings", {"model": EMB_NAME, "input": [[1, 2, 10 ** 9]]}, 400, "token ids are integers"),
             ("/v1/embeddings", {"model": LLM_NAME, "input": "x"}, 404, "not served here"),
             ("/v1/nothing", {}, 404, "no route")]
    for path, body, status, words in cases:
        r = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert r.status_code == status and words in r.json()["error"]["message"], (path, body, r.text)


@pytest.mark.slow
def test_metrics_count_what_was_served(client, url):
    client.chat.completions.create(model=LLM_NAME, messages=MESSAGES, max_tokens=4, temperature=0)
    text = httpx.get(f"{url}/metrics").text
    for name in ("yirage_requests_running", "yirage_requests_waiting", "yirage_generation_tokens_total",
                 "yirage_time_to_first_token_seconds_bucket", "yirage_inter_token_latency_seconds_bucket",
                 "yirage_kv_cache_usage_ratio", "yirage_request_errors_total"):
        assert name in text
    tokens = next(float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("yirage_generation_tokens_total"))
    assert tokens >= 4


@pytest.mark.slow
def test_api_key_loading_and_queue_limit(smollm):
    release = threading.Event()

    def load(options):
        release.wait(30)
        return smollm, None
    app = create_app(ServeOptions(LLM_NAME, api_key="sekret", max_queue=1, parallel=1), load=load)
    with running(app) as base:
        assert httpx.get(f"{base}/health").status_code == 503
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": LLM_NAME, "messages": MESSAGES},
                       headers={"authorization": "Bearer sekret"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        release.set()
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        missing = httpx.get(f"{base}/v1/models")   # no Authorization header at all
        assert missing.status_code == 401 and missing.json()["error"]["code"] == 401
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret", max_retries=0)
        long = dict(model=LLM_NAME, prompt="Once upon a time", max_tokens=300, temperature=0,
                    extra_body={"ignore_eos": True})
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(good.completions.create, **long)
            _wait_for_metric(base, "yirage_requests_running", 1)   # the first runs,
            second = pool.submit(good.completions.create, **long)
            _wait_for_metric(base, "yirage_requests_waiting", 1)   # the second waits
            with pytest.raises(openai.APIStatusError, match="--max-queue") as refused:
                good.completions.create(**long)
            assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
            assert first.result().usage.completion_tokens == 300
            assert second.result().usage.completion_tokens == 300


def _wait_for_metric(base: str, name: str, value: float, timeout_s: float = 60) -> None:
    """Return once ``GET /metrics`` reports the gauge ``name`` at ``value``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        if any(line.split()[-1] == repr(float(value)) for line in text.splitlines() if line.startswith(name + " ")):
            return
        assert time.monotonic() < deadline, f"{name} never reached {value} within {timeout_s} s"
        time.sleep(0.02)


def test_serve_cli_errors(yirage_cli):
    code, out, err = yirage_cli("serve", "--parallel", "0")
    assert code == 1 and "--parallel must be a positive integer" in err and len(err.splitlines()) == 1
    code, out, err = yirage_cli("serve", "-m", "none")
    assert code == 1 and "nothing to serve" in err
    code, out, err = yirage_cli("serve", "--api-key", "a", "--api-key-file", "b")
    assert code == 1 and "not both" in err
    code, out, err = yirage_cli("serve", "--parallel", "4", "--max-batch-tokens", "3")
    assert code == 1 and "--max-batch-tokens must be in [--parallel, --ctx-size] = [4, 4096]" in err
    assert len(err.splitlines()) == 1
    code, out, err = yirage_cli("serve", "--parallel", "1", "--max-batch-tokens", "64")
    assert code == 1 and "give --parallel 2 or more" in err


def test_the_default_step_budget_is_128_rows_or_one_per_slot(smollm):
    from yirage.serve.engine import default_batch_tokens
    app = create_app(ServeOptions(LLM_NAME, parallel=4), llm=smollm)
    with running(app):
        assert app.state.yirage.engine.engine.max_batch_tokens == 128
    assert default_batch_tokens(200) == 200   # every slot's decode row fits one step


def test_a_small_step_budget_gives_the_same_answers(smollm):
    """--max-batch-tokens 6 with 4 slots: each step holds the decoding rows plus at most 2-6
    prompt tokens, so the prompts fill in chunks over many steps; every answer still equals
    the model's alone."""
    prompts = [f"List {k} colours, one per line." for k in range(2, 6)]
    alone = [smollm.generate(p, max_new_tokens=8, temperature=0).text for p in prompts]
    app = create_app(ServeOptions(LLM_NAME, max_queue=8, timeout_s=120, parallel=4, max_batch_tokens=6), llm=smollm)
    with running(app) as base:
        engine = app.state.yirage.engine.engine
        assert engine.max_batch_tokens == 6
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

        def ask(p):
            return client.chat.completions.create(model=LLM_NAME, messages=[{"role": "user", "content": p}],
                                                  max_tokens=8, temperature=0).choices[0].message.content
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, prompts)) == alone


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"kv_cache_dtype": "float16"},
                                     {"kv_cache_dtype": "float16", "decode_dtype": "int8"}])
def test_llamacpp_numerics_servers_answer_as_their_model_alone(options):
    """ServeOptions(kv_cache_dtype='float16') (``--kv-cache-dtype float16``) loads the LLM with a
    float16 KV cache, the batching slots included; with decode_dtype='int8' (``--decode-dtype
    int8``) too, the batching steps' projections on row-group weights take int8 x (where the CPU
    keeps them so). Concurrent greedy chats get what that model's engine gives each prompt alone:
    its single-sequence generation with float32 activations, its batch of one with int8."""
    from yirage.backends.cpu.library import row_groups_native
    from yirage.serve import load_models
    prompts = ["Name three fruits.", "What is 2 + 2?", "Say hello in French."]
    app = create_app(ServeOptions(LLM_NAME, max_queue=8, timeout_s=120, parallel=4, **options), load=load_models)
    with running(app) as base:
        deadline = time.monotonic() + 120
        while not app.state.yirage.ready:
            assert time.monotonic() < deadline and app.state.yirage.load_error is None, app.state.yirage.load_error
            time.sleep(0.1)
        llm = app.state.yirage.llm
        assert llm.model.k_cache[0].dtype == torch.float16
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

        def ask(p):
            return client.chat.completions.create(model=LLM_NAME, messages=[{"role": "user", "content": p}],
                                                  max_tokens=10, temperature=0).choices[0].message.content
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            together = list(pool.map(ask, prompts))
        engine = app.state.yirage.engine.engine
        assert engine.cache.k[0].dtype == torch.float16
    if "decode_dtype" in options:
        g, _ = llm.model.build_batch_graph(4, 2, engine.cache)
        int8 = [op.attrs.get("compute_dtype") == "int8" for op in g.ops if op.op == "linear"]
        assert all(int8) if row_groups_native() else not any(int8)
        assert together == [llm.generate([p], max_new_tokens=10)[0].text for p in prompts]
    else:
        assert together == [llm.generate(p, max_new_tokens=10).text for p in prompts]


@pytest.mark.slow
def test_a_repeated_prompt_reuses_its_cached_prefix(client, url):
    """With continuous batching, a request whose prompt a slot already holds prefills only its
    last token: ``usage.prompt_tokens_details.cached_tokens`` says so, the answer is the same,
    and /metrics counts the tokens. One sequence at a time (the persistent kernel) reuses none."""
    first, second = (client.chat.completions.create(model=LLM_NAME, messages=MESSAGES, max_tokens=6, temperature=0)
                     for _ in range(2))
    assert second.choices[0].message.content == first.choices[0].message.content
    batching = APPS[url].state.yirage.options.parallel > 1
    cached = second.usage.prompt_tokens_details.cached_tokens
    text = httpx.get(f"{url}/metrics").text
    counted = next(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("yirage_prompt_tokens_cached_total"))
    if batching:
        assert cached == second.usage.prompt_tokens - 1 and counted >= cached
    else:
        assert cached == 0 and counted == 0


@pytest.mark.slow
def test_the_cli_serves_on_localhost_and_drains_on_sigterm(smollm):
    """``yirage serve`` as users start it (its own process, default host): it answers on
    127.0.0.1; on SIGTERM it stops listening at once, finishes the stream in flight (every
    token, then ``data: [DONE]``) and exits without a traceback."""
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "yirage.cli", "serve", "--port", str(port), "--parallel", "2",
                             "--ctx-size", "512"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base)
        prompt, n = "The history of the city begins", 96
        body = {"model": LLM_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:   # the first token is out: the request is in flight
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while True:   # it stops listening: new connections are refused (however slow the machine)
                try:
                    httpx.get(f"{base}/health", timeout=5)
                except httpx.ConnectError:
                    break
                assert time.monotonic() < deadline, "still listening 60 s after SIGTERM"
                time.sleep(0.05)
            events += [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
        assert text == smollm.generate(prompt, max_new_tokens=n, ignore_eos=True, chat=False).text
        # uvicorn re-raises the signal once it has shut down, so the status says SIGTERM ended it
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        err = proc.stderr.read()
        assert f"http://127.0.0.1:{port}/v1" in err and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
