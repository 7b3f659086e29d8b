"""Tool calling through ``yirage serve``, called with the ``openai`` client: SmolLM2 served with
a Hermes-style template (``--chat-template-file``; its own has no tool format). A forced call
(``tool_choice`` 'required' or named) validates against the tool's schema (jsonschema); the
streamed ``delta.tool_calls`` add up to the same call; a two-turn exchange (call, result, answer)
answers what the engine answers for the same messages; bad tool requests get one 400."""
import json
import pathlib

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from yirage.serve import ServeOptions, create_app  # noqa: E402

from test_serve import LLM_NAME, running  # noqa: E402  (tests/serve is on sys.path)

TEMPLATE_FILE = pathlib.Path(__file__).parent / "data" / "chatml_tools.jinja"
TEMPLATE = TEMPLATE_FILE.read_text()
_TOOLS = json.loads((pathlib.Path(__file__).parent / "data" / "tools.json").read_text())   # shared with tests/engines
WEATHER, ADD = _TOOLS["get_weather"], _TOOLS["add"]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]


@pytest.fixture(scope="module", params=[4, 1], ids=["batching", "one-at-a-time"])
def base(request, smollm):
    app = create_app(ServeOptions(LLM_NAME, parallel=request.param, timeout_s=120, chat_template=TEMPLATE), llm=smollm)
    with running(app) as url:
        yield url


@pytest.fixture
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert names is None or call.function.name in names


@pytest.mark.slow
def test_a_required_call_is_well_formed_streamed_or_not(client, smollm):
    r = client.chat.completions.create(model=LLM_NAME, messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
                                       max_tokens=96, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)
    ref = smollm.generate(ASK, max_new_tokens=96, tools=[WEATHER, ADD], tool_choice="required", chat_template=TEMPLATE)
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [(c.name, c.arguments) for c in ref.tool_calls]
    chunks = list(client.chat.completions.create(model=LLM_NAME, messages=ASK, tools=[WEATHER, ADD],
                                                 tool_choice="required", max_tokens=96, temperature=0, stream=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] = (d.function.name if d.function and d.function.name else entry["name"])
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
    assert [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert all(calls[k]["id"] for k in calls)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    # sampled: the grammar still gives a call that validates, and a named choice calls that one
    for seed in range(3):
        s = client.chat.completions.create(model=LLM_NAME, messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
                                           max_tokens=96, temperature=1.0, seed=seed)
        check_calls(s.choices[0].message.tool_calls)
    named = client.chat.completions.create(model=LLM_NAME, messages=ASK, tools=[WEATHER, ADD], max_tokens=96,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    check_calls(named.choices[0].message.tool_calls, names={"add"})
    assert len(named.choices[0].message.tool_calls) == 1


@pytest.mark.slow
def test_two_turns_call_then_result_then_answer(client, smollm):
    first = client.chat.completions.create(model=LLM_NAME, messages=ASK, tools=[WEATHER],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=96, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "clear"})}]
    second = client.chat.completions.create(model=LLM_NAME, messages=messages, tools=[WEATHER], max_tokens=24,
                                            temperature=0)
    ref = smollm.generate(messages, max_new_tokens=24, tools=[WEATHER], chat_template=TEMPLATE)
    assert second.choices[0].message.content == (ref.text or None if ref.tool_calls else ref.text)
    rendered = smollm.tokenizer.apply_chat_template(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.loads(call.function.arguments)}}]}, messages[-1]],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER["function"].items()}}],
        chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>" in rendered and call.function.arguments in rendered
    assert second.usage.prompt_tokens == len(smollm.tokenizer.encode(rendered, add_special_tokens=False))


BAD = [  # (body fields, words in the message)
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice must be one of"),
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "1-64 letters"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "only an assistant message has tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "add", "arguments": "{not json"}}]}, {"role": "tool", "tool_call_id": "1", "content": "3"}]},
     "arguments is not JSON"),
    ({"tools": "get_weather"}, "tools"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fields,words", BAD)
def test_bad_tool_requests_get_one_400(base, fields, words):
    body = {"model": LLM_NAME, "messages": ASK, "max_tokens": 4, **fields}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


@pytest.mark.slow
def test_a_model_whose_template_has_no_tool_format_gets_a_400_naming_it(smollm):
    with running(create_app(ServeOptions(LLM_NAME, parallel=2), llm=smollm)) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": LLM_NAME, "messages": ASK, "tools": [WEATHER]},
                       timeout=30)
        assert r.status_code == 400, r.text
        assert "the chat template of smollm2-135m-instruct has no tool format" in r.json()["error"]["message"]
        assert "--chat-template-file" in r.json()["error"]["message"]
        # tool_choice 'none' with no tools is a plain request
        ok = httpx.post(f"{url}/v1/chat/completions", json={"model": LLM_NAME, "messages": ASK, "max_tokens": 2,
                                                             "tool_choice": "none"}, timeout=30)
        assert ok.status_code == 200


def test_chat_template_file_errors(yirage_cli, tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    for args, words in [(["--chat-template-file", str(tmp_path / "missing.jinja")], "cannot read --chat-template-file"),
                        (["--chat-template-file", str(bad)], "is not a jinja2 template"),
                        (["-m", "none", "--embedding-model", "all-minilm-l6-v2", "--chat-template-file",
                          str(TEMPLATE_FILE)], "give an LLM")]:
        code, out, err = yirage_cli("serve", *args)
        assert code == 1 and words in err and len(err.splitlines()) == 1, err
