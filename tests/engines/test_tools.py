"""Tool calling (engines/tools.py): the call formats parsed out of replies (whole and streamed in
any pieces), the checks of tools and tool_choice, and generation with tools on SmolLM2 through a
Hermes-style template: a forced call always validates against the tool's JSON Schema
(jsonschema, independent of the grammar), and the prompt is the template's rendering."""
import json
import pathlib
import re

import pytest

import yirage as yr
from yirage.engines.tools import HERMES, LLAMA3_JSON, MISTRAL, ToolCalling, check_tool_choice, check_tools, tool_format

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DATA = pathlib.Path(__file__).parents[1] / "serve" / "data"   # shared with tests/serve/test_serve_tools.py
TEMPLATE = (DATA / "chatml_tools.jinja").read_text()
_TOOLS = json.loads((DATA / "tools.json").read_text())
WEATHER, ADD = _TOOLS["get_weather"], _TOOLS["add"]
TOOLS = check_tools([WEATHER, ADD])


def calling(fmt, choice="auto"):
    return ToolCalling(TOOLS, choice, True, fmt)


def summary(parsed):
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


REPLIES = [  # (format, reply text as decoded, content, calls)
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', None, [("add", {"a": 1, "b": 2})]),
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo", "unit": "C"}), ("add", {"a": 3, "b": 4})]),
    (HERMES, 'a < b, and <tool_call is not a tag', 'a < b, and <tool_call is not a tag', []),
    (HERMES, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', []),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1,', '<tool_call>\n{"name": "add", "arguments": {"a": 1,', []),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 5}}', None, [("add", {"a": 1, "b": 5})]),
    (LLAMA3_JSON, '{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                  '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "F"}}', None,
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome", "unit": "F"})]),
    (LLAMA3_JSON, 'It is {"name": "add"} maybe', 'It is {"name": "add"} maybe', []),
    (LLAMA3_JSON, '{"not": "a call"}', '{"not": "a call"}', []),
    (MISTRAL, '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 5, "b": 6}}]', None,
     [("add", {"a": 1, "b": 2}), ("add", {"a": 5, "b": 6})]),
    (MISTRAL, '[1, 2, 3] is a list', '[1, 2, 3] is a list', []),
    (MISTRAL, 'No call here.', 'No call here.', []),
]


@pytest.mark.parametrize("fmt,text,content,calls", REPLIES)
def test_calls_are_parsed_out_of_replies(fmt, text, content, calls):
    assert summary(calling(fmt).parse(text)) == (content, calls)
    assert calling(fmt, "none").parse(text) == (text, [])


def test_one_call_only_without_parallel_tool_calls():
    one = ToolCalling(TOOLS, "auto", False, HERMES)
    assert summary(one.parse(REPLIES[1][1])) == ("Let me check.", [("get_weather", {"city": "Oslo", "unit": "C"})])


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(REPLIES), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_a_streamed_reply_in_any_pieces_gives_the_same_content_and_calls(case, cuts):
    fmt, text, content, calls = case
    stream = calling(fmt).stream()
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    parts = [p for a, b in zip(bounds, bounds[1:]) for p in stream.feed(text[a:b])] + stream.finish()
    got_text = "".join(p for p in parts if isinstance(p, str))
    got_calls = [(p.name, json.loads(p.arguments)) for p in parts if not isinstance(p, str)]
    assert got_calls == calls
    assert (got_text.strip() or None if calls else got_text) == content


def test_template_formats_are_recognised():
    assert tool_format(TEMPLATE) is HERMES
    assert tool_format('{{ "[TOOL_CALLS]" }}{{ tool_calls | tojson }}') is MISTRAL
    assert tool_format('{{ "[TOOL_CALLS]" + name + "[ARGS]" }}') is None   # Mistral's newer form: not parsed
    assert tool_format('{{ "<|python_tag|>" }}') is LLAMA3_JSON
    assert tool_format("{{ messages }}") is None


@pytest.mark.parametrize("tools,message", [
    ([], "non-empty list"), ([{"type": "code"}], "tools[0] must be"),
    ([{"type": "function", "function": {"name": "a b"}}], "1-64 letters"),
    ([WEATHER, WEATHER], "'get_weather' is given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "parameters must be a JSON Schema"),
    ([{"type": "function", "function": {"name": "f", "bogus": 1}}], "unknown field(s) bogus"),
])
def test_bad_tools_are_one_clear_error(tools, message):
    with pytest.raises(yr.GenerationError, match=re.escape(message)):
        check_tools(tools)


def test_tool_choice_values():
    names = ["get_weather", "add"]
    assert check_tool_choice(None, names) == "auto" and check_tool_choice("required", names) == "required"
    assert check_tool_choice({"type": "function", "function": {"name": "add"}}, names) == "add"
    for bad, message in [("always", "must be one of"), ({"type": "function", "function": {"name": "x"}}, "not in tools"),
                         ({"function": "add"}, "must be 'none'")]:
        with pytest.raises(yr.GenerationError, match=message):
            check_tool_choice(bad, names)


@pytest.mark.slow
def test_a_forced_call_validates_against_the_schema_greedy_or_sampled(smollm):
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in [WEATHER, ADD]}
    runs = [dict(tool_choice="required"), dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
            *[dict(tool_choice="required", temperature=1.0, seed=s) for s in range(3)]]
    for kw in runs:
        r = smollm.generate(messages, max_new_tokens=96, tools=[WEATHER, ADD], chat_template=TEMPLATE, **kw)
        assert r.finish_reason == "tool_calls" and r.tool_calls and r.text == "", (kw, r)
        for call in r.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        if isinstance(kw["tool_choice"], dict):
            assert [c.name for c in r.tool_calls] == ["get_weather"]
    # the prompt is the template's rendering of the tools and the messages
    ids = smollm.prompt_ids(messages, True, TOOLS, TEMPLATE)
    text = smollm.tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=TEMPLATE, tokenize=False,
                                                add_generation_prompt=True)
    assert ids == smollm.tokenizer.encode(text, add_special_tokens=False) and '"name": "get_weather"' in text
    # auto: whatever the model says, parsed; none: all text
    auto = smollm.generate(messages, max_new_tokens=24, tools=[WEATHER], chat_template=TEMPLATE)
    plain = smollm.generate(smollm.prompt_ids(messages, True, check_tools([WEATHER]), TEMPLATE), max_new_tokens=24)
    assert summary(calling(HERMES).parse(plain.text)) == (auto.text or None if auto.tool_calls else auto.text,
                                                          [(c.name, json.loads(c.arguments)) for c in auto.tool_calls])


@pytest.mark.slow
def test_a_template_without_a_tool_format_is_refused_naming_the_model(smollm):
    with pytest.raises(yr.GenerationError, match="the chat template of smollm2-135m-instruct has no tool format"):
        smollm.generate("hi", tools=[WEATHER])
    with pytest.raises(yr.GenerationError, match="tool_choice 'required' needs tools"):
        smollm.generate("hi", tool_choice="required")
    with pytest.raises(yr.GenerationError, match="cannot be combined"):
        smollm.generate("hi", tools=[WEATHER], tool_choice="required", chat_template=TEMPLATE,
                        response_format={"type": "json_object"})
