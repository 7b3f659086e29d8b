"""Tool calling as OpenAI's API defines it (``tools``, ``tool_choice``, ``parallel_tool_calls``),
through the model's own chat template.

- **The prompt.** The tools (function definitions with JSON-Schema ``parameters``) are rendered by
  the chat template (``tools=``, as transformers' ``apply_chat_template`` passes them). Earlier
  assistant turns with ``tool_calls`` and ``role: "tool"`` results go to the template as
  transformers documents them (``arguments`` a dict). A template that does not render the tools
  has no tool format: ``compile_tools`` refuses it with one error naming the model (a template
  given by the user, ``chat_template=``, may add one: ``yirage serve --chat-template-file``).
- **The format** of the model's calls is read off its template (``tool_format``):
  ``hermes`` (Qwen 2.5/3, SmolLM3, Hermes; ``<tool_call>{"name", "arguments"}</tool_call>``),
  ``llama3_json`` (Llama 3.1-3.3: a bare ``{"name", "parameters"}`` object, after
  ``<|python_tag|>`` or not) and ``mistral`` (``[TOOL_CALLS][{"name", "arguments"}, ...]``).
- **The calls** are parsed out of the generated text (``ToolCalling.parse``, or piece by piece for
  streaming with ``ToolCalling.stream``). Text that looks like a call but is not valid JSON naming
  one of the tools stays in the content, as vLLM's parsers leave it.
- **Forced calls.** With ``tool_choice`` ``"required"`` or one named function, decoding is
  constrained by an llguidance grammar (``engines/structured.py``'s engine): the format's markers
  around a JSON object whose ``name`` is one of the allowed tools and whose arguments validate
  against that tool's ``parameters``, so the call is well formed whatever the model's quality.

This module must never build graphs or touch kernels.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import GenerationError
from .structured import ResponseFormat, checked_grammar

#: OpenAI's rule for a function's name
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``id`` (made here, for the ``tool`` message that answers it),
    the function's ``name`` and its ``arguments`` as JSON text (OpenAI's form)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes its calls: ``name``; ``start``/``end`` the markers around each call
    (``end`` None: a single JSON value after ``start``); ``args_key`` the key of the arguments;
    ``json_list`` True when the calls are one JSON list (Mistral)."""

    name: str
    start: str | None
    end: str | None
    args_key: str
    json_list: bool = False


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", "<|python_tag|>", None, "parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", None, "arguments", json_list=True)


def tool_format(template: str) -> ToolFormat | None:
    """The call format a chat template (jinja2 text) teaches its model, or None when it shows
    none yirage knows: ``<tool_call>`` (hermes), ``[TOOL_CALLS]`` without ``[ARGS]`` (mistral's
    JSON list; its newer ``name[ARGS]{...}`` form is not one), or Llama 3's ``<|python_tag|>`` /
    ``"parameters"`` JSON."""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return None if "[ARGS]" in template else MISTRAL
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return LLAMA3_JSON
    return None


def check_tools(tools: Any) -> list[dict]:
    """``tools`` (OpenAI's list of ``{"type": "function", "function": {"name", "description",
    "parameters", "strict"}}``) checked and normalised: each function's ``parameters`` a dict
    (``{"type": "object", "properties": {}}`` when absent). GenerationError with one message for
    anything else: not a list, a type other than 'function', a bad or repeated name, parameters
    that are not a JSON object, unknown fields."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise GenerationError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"),
                                                                                               Mapping):
            raise GenerationError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., "
                                  "'parameters': {...}}}")
        if set(tool) - {"type", "function"}:
            raise GenerationError(f"{where} has unknown field(s) {', '.join(sorted(set(tool) - {'type', 'function'}))}")
        fn = tool["function"]
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise GenerationError(f"{where}.function has unknown field(s) {', '.join(sorted(unknown))}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise GenerationError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in names:
            raise GenerationError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise GenerationError(f"{where}.function.parameters must be a JSON Schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise GenerationError(f"{where}.function.description must be a string")
        entry = {"name": name, "parameters": dict(params)}
        if fn.get("description") is not None:
            entry["description"] = fn["description"]
        out.append({"type": "function", "function": entry})
    return out


def check_tool_choice(tool_choice: Any, names: list[str]) -> str:
    """``tool_choice`` as 'none', 'auto', 'required' or the one function's name; None is 'auto'.
    GenerationError for anything else, or a function not among ``names``."""
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise GenerationError(f"tool_choice must be one of {', '.join(_CHOICES)} or {{'type': 'function', "
                                  f"'function': {{'name': ...}}}}, got {tool_choice!r}")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not isinstance(fn, Mapping) or tool_choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise GenerationError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                              "{'name': ...}}")
    if fn["name"] not in names:
        raise GenerationError(f"tool_choice names function {fn['name']!r}, which is not in tools "
                              f"({', '.join(names)})")
    return fn["name"]


def messages_for_template(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates take them: an assistant turn's ``tool_calls`` with
    ``function.arguments`` parsed from its JSON text into a dict (transformers' documented form,
    which Qwen's, Llama's and Mistral's templates print with ``tojson``), and its null content
    as "" (Qwen 3's template reads it). GenerationError for arguments that are not a JSON
    object."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        rendered = []
        for j, call in enumerate(calls):
            fn = dict(call.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError as e:
                    raise GenerationError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}") from None
            if not isinstance(args, Mapping):
                raise GenerationError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
            fn["arguments"] = dict(args)
            rendered.append({**call, "function": fn})
        out.append({**message, "content": message.get("content") or "", "tool_calls": rendered})
    return out


def _call_id(fmt: ToolFormat) -> str:
    if fmt is MISTRAL:   # Mistral's templates accept 9 letters and digits only
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCalling:
    """A request's tools, compiled for one model (``compile_tools``).

    Attributes: ``tools`` (normalised), ``choice`` ('none', 'auto', 'required' or a function's
    name), ``parallel`` (more than one call allowed: with ``parallel_tool_calls`` false or a
    named function, the calls after the first are dropped, as vLLM drops them), ``format``
    (``ToolFormat``),
    ``response_format`` (the grammar forcing a call, a ``ResponseFormat`` for
    ``LLM.generate``'s ``response_format``; None unless the choice forces one).
    """

    tools: list[dict]
    choice: str
    parallel: bool
    format: ToolFormat
    response_format: ResponseFormat | None = None

    @property
    def names(self) -> list[str]:
        """The tools' function names."""
        return [t["function"]["name"] for t in self.tools]

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole generated ``text``: content is the text outside the calls
        (None when nothing is left), calls those that parse. With tool_choice 'none' the text is
        all content."""
        if self.choice == "none":
            return text, []
        stream = self.stream()
        parts = [*stream.feed(text), *stream.finish()]
        content = "".join(p for p in parts if isinstance(p, str)).strip()
        calls = [p for p in parts if isinstance(p, ToolCall)]
        return (content or None) if calls else text, calls

    def stream(self) -> "ToolCallStream":
        """A parser for a streamed generation: ``feed`` the text pieces as they come."""
        return ToolCallStream(self)

    def _call(self, obj: Any) -> ToolCall | None:
        """A ToolCall from a parsed JSON value, or None if it is not a call of one of the tools."""
        if not isinstance(obj, Mapping) or obj.get("name") not in self.names:
            return None
        args = obj.get(self.format.args_key, obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, Mapping):
            return None
        return ToolCall(_call_id(self.format), obj["name"], json.dumps(args, ensure_ascii=False))

    def _calls_in(self, body: str) -> list[ToolCall] | None:
        """The calls in one block's text (a JSON object, or a list of them), or None."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
        values = value if isinstance(value, list) else [value]
        calls = [self._call(v) for v in values]
        return calls if calls and all(c is not None for c in calls) else None


class ToolCallStream:
    """Splits a generation, piece by piece, into content and tool calls. ``feed(piece)`` and
    ``finish()`` return what can be sent: strings (content) and ``ToolCall``s. Text that could be
    the start of a call is held back until it is known: for hermes, a possible ``<tool_call>``
    prefix, then the block up to ``</tool_call>``; for the single-value formats (Llama 3's JSON,
    Mistral's list), a reply that begins (after spaces) with the marker, ``{`` or ``[``, to the end."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self.fmt = calling.format
        self.calls = 0   # calls let out so far
        self.buffer = ""
        self.inside = False   # within a call (hermes: after <tool_call>; others: the whole reply)
        self.decided = False   # single-value formats: whether the reply is a call is known

    def feed(self, piece: str) -> list:
        self.buffer += piece
        return self._drain(final=False)

    def finish(self) -> list:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list:
        if self.calling.choice == "none":
            out, self.buffer = ([self.buffer] if self.buffer else []), ""
            return out
        parts = self._drain_blocks(final) if self.fmt.end is not None else self._drain_value(final)
        out = []
        for part in parts:
            if isinstance(part, ToolCall):
                self.calls += 1
                if self.calls > 1 and not self.calling.parallel:
                    continue   # one call only: the rest are dropped
            out.append(part)
        return _merge(out)

    def _drain_blocks(self, final: bool) -> list:
        start, end = self.fmt.start, self.fmt.end
        out = []
        while self.buffer:
            if not self.inside:
                at = self.buffer.find(start)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, start)
                    if len(self.buffer) > keep:
                        out.append(self.buffer[:len(self.buffer) - keep])
                        self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                if at:
                    out.append(self.buffer[:at])
                self.buffer = self.buffer[at + len(start):]
                self.inside = True
            at = self.buffer.find(end)
            if at < 0:
                if final:   # a call the model never closed: a call if its JSON is whole
                    calls = self.calling._calls_in(self.buffer.strip())
                    out.extend(calls if calls else [start + self.buffer])
                    self.buffer, self.inside = "", False
                break
            body = self.buffer[:at]
            calls = self.calling._calls_in(body.strip())
            out.extend(calls if calls else [start + body + end])
            self.buffer, self.inside = self.buffer[at + len(end):], False
        return out

    def _drain_value(self, final: bool) -> list:
        if not self.decided:
            head = self.buffer.lstrip()
            if not head and not final:
                return []
            opening = ("[",) if self.fmt.json_list else ("{",)
            if head.startswith(self.fmt.start) or head.startswith(opening):
                self.inside = True
            elif not final and _partial_suffix(head, self.fmt.start) == len(head):
                return []   # could still become the marker
            self.decided = True
        if not self.inside:
            out, self.buffer = ([self.buffer] if self.buffer else []), ""
            return out
        if not final:
            return []
        body = self.buffer.strip()
        if body.startswith(self.fmt.start):
            body = body[len(self.fmt.start):].strip()
        calls = self.calling._calls_in(body) if not self.fmt.json_list or body.startswith("[") else None
        if calls is None and not self.fmt.json_list:   # Llama 3.1 may separate calls with ';'
            pieces = [p for p in body.split(";") if p.strip()]
            found = [self.calling._calls_in(p.strip()) for p in pieces]
            calls = [c for f in found for c in f] if pieces and all(found) else None
        out = calls if calls else [self.buffer]
        self.buffer = ""
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (0 if none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _merge(parts: list) -> list:
    out: list = []
    for p in parts:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif not (isinstance(p, str) and not p):
            out.append(p)
    return out


def _template_text(llm, chat_template: str | None) -> str:
    if chat_template is not None:
        return chat_template
    template = llm.tokenizer.chat_template
    if isinstance(template, Mapping):
        template = template.get("tool_use") or template.get("default") or ""
    return template or ""


def compile_tools(llm, tools, tool_choice=None, parallel_tool_calls: bool | None = None,
                  chat_template: str | None = None) -> ToolCalling | None:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (OpenAI's) checked and compiled for
    ``llm`` and its chat template (``chat_template``: a jinja2 text that replaces the model's).

    Returns None without tools (then ``tool_choice`` may only be None, 'none' or 'auto').
    Raises GenerationError with one message: bad tools or tool_choice (``check_tools``,
    ``check_tool_choice``); a template that does not render tools, naming the model; a template
    whose call format yirage does not parse; a parameters schema the grammar library refuses
    (only when the choice forces a call); llguidance missing (likewise)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise GenerationError(f"tool_choice {tool_choice!r} needs tools")
        return None
    tools = check_tools(tools)
    names = [t["function"]["name"] for t in tools]
    choice = check_tool_choice(tool_choice, names)
    template = _template_text(llm, chat_template)
    if not template:
        raise GenerationError(f"the chat template of {llm.name} has no tool format (the model has no chat template): "
                              "give one that has (serve: --chat-template-file F; Python: generate(..., "
                              "chat_template=...))")
    probe = [{"role": "user", "content": "hello"}]
    try:
        rendered = llm.tokenizer.apply_chat_template(probe, tools=tools, chat_template=template or None,
                                                     tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template is the model's code
        raise GenerationError(f"the chat template of {llm.name} failed to render tools ({type(exc).__name__}: "
                              f"{exc}): give one that has a tool format (serve: --chat-template-file F)") from None
    if names[0] not in rendered:
        raise GenerationError(f"the chat template of {llm.name} has no tool format (it does not render 'tools'): "
                              "give one that has (serve: --chat-template-file F; Python: "
                              "generate(..., chat_template=...))")
    fmt = tool_format(template)
    if fmt is None:
        raise GenerationError(f"the chat template of {llm.name} renders tools, but its call format is not one yirage "
                              "parses (hermes <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS] list)")
    parallel = parallel_tool_calls is not False and choice not in names
    calling = ToolCalling(tools, choice, parallel, fmt)
    if choice == "required" or choice in names:
        allowed = [t for t in tools if choice == "required" or t["function"]["name"] == choice]
        calling.response_format = _forcing_grammar(llm, allowed, fmt, parallel and fmt is not LLAMA3_JSON)
    return calling


def _forcing_grammar(llm, tools: list[dict], fmt: ToolFormat, parallel: bool) -> ResponseFormat:
    """The llguidance grammar (Lark with an embedded JSON Schema) of one call, or several when
    ``parallel``, of one of ``tools`` in ``fmt``: markers, then ``{"name": <one of the names>,
    <args_key>: <arguments valid against its parameters>}``."""
    schema = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]}, fmt.args_key: t["function"]["parameters"]},
        "required": ["name", fmt.args_key], "additionalProperties": False} for t in tools],
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    start = _lark_marker(llm, fmt.start)
    if fmt.end is not None:
        block = f'{start} "\\n" call "\\n" {_lark_marker(llm, fmt.end)}'
        body = f'{block} ("\\n" {block})*' if parallel else block
    elif fmt.json_list:
        body = f'{start} "[" call (", " call)* "]"' if parallel else f'{start} "[" call "]"'
    else:
        body = "call"   # Llama 3: the bare JSON object
    lark = f"start: {body}\ncall: %json {json.dumps(schema)}\n"
    problem = "a tool's parameters are not a JSON Schema yirage can follow"
    grammar, tok = checked_grammar(llm, lambda m: m.grammar_from_lark(lark), problem, problem)
    return ResponseFormat("tool_calls", grammar, schema, tok)


def _lark_marker(llm, marker: str) -> str:
    """A marker as a Lark terminal: the special token by id (``<[id]>``) when the marker is one
    special token of the model (which no text spells), else the quoted text."""
    tok = llm.tokenizer
    token_id = tok.convert_tokens_to_ids(marker)
    if isinstance(token_id, int) and tok.decode([token_id]) == marker and \
            tok.decode([token_id], skip_special_tokens=True) == "":
        return f"<[{token_id}]>"
    return json.dumps(marker)
