"""The request bodies of ``yirage serve``'s OpenAI-compatible API, as pydantic models, and the
checks that turn a bad body into one clear message (``BadRequest``, answered with HTTP 400).

The fields follow OpenAI's API reference (``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``). A field the API defines but yirage does not implement is refused when it
asks for something (a non-zero penalty, ``suffix``, ``best_of``);
a field the API does not define is refused by name. Nothing is silently ignored.

This module must never touch an engine: it only parses and checks.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

#: the most stop strings a request may give (OpenAI's limit)
MAX_STOPS = 4
#: the most choices (``n``) a request may ask for
MAX_N = 8


class BadRequest(Exception):
    """A request the server refuses with HTTP ``status`` and an OpenAI-style error body
    (``headers``: extra response headers, such as ``Retry-After``)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.kind = message, status, param, kind
        self.headers = headers


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)   # a wrong type is refused, never coerced ("3", true)


class TextPart(_Strict):
    """One part of a message's content list; only ``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    """A call's ``function``: the ``name`` and the ``arguments`` as JSON text."""

    name: str
    arguments: str


class ToolCallMessage(_Strict):
    """One of an assistant message's ``tool_calls``: ``id``, ``type`` 'function', ``function``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """A chat message: ``role`` and ``content`` (a string, a list of text parts, or null for an
    assistant turn); an assistant turn may carry ``tool_calls``, a ``tool`` turn answers one by
    its ``tool_call_id``; ``name`` goes to the template as it is."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message has a tool_call_id")
        return self

    def text(self) -> str:
        """The content as one string (parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as a chat template takes it: 'developer' as 'system', the content as one
        string (null for an assistant turn with calls and no text), calls and ids as dicts."""
        out: dict = {"role": "system" if self.role == "developer" else self.role,
                     "content": None if self.content is None and self.tool_calls else self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: ``name`` (1-64 letters, digits, '_' or '-'), an optional
    ``description``, the JSON Schema ``schema`` and ``strict`` (accepted; the output always
    follows the schema)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: 'text', 'json_object' (any JSON object) or 'json_schema' (JSON valid
    against ``json_schema.schema``), constrained by a grammar (engines/structured.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def as_dict(self) -> dict | None:
        """The format as ``yr.LLM.generate``'s ``response_format`` (None for 'text'); BadRequest
        when 'json_schema' comes without its ``json_schema`` or another type with one."""
        if self.type == "json_schema" and self.json_schema is None:
            raise BadRequest("response_format 'json_schema' needs a 'json_schema' object with 'name' and 'schema'",
                             param="response_format.json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise BadRequest(f"response_format '{self.type}' takes no 'json_schema' (use type 'json_schema')",
                             param="response_format.json_schema")
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": self.json_schema.name,
                                                       "schema": self.json_schema.schema_}}


class _Sampling(_Strict):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    stop: Union[str, list[str], None] = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # defined by the API, implemented only at their neutral values
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None   # token id (a decimal string) -> bias in [-100, 100]
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_supported(self) -> None:
        """BadRequest for a defined field asking for what yirage does not implement."""
        unsupported = {"frequency_penalty": self.frequency_penalty != 0, "presence_penalty": self.presence_penalty != 0}
        for name, asked in unsupported.items():
            if asked:
                raise BadRequest(f"'{name}' is not supported by yirage serve: leave it out", param=name)
        if self.stream_options is not None and not self.stream:
            raise BadRequest("'stream_options' is only allowed with 'stream': true", param="stream_options")


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if self.response_format is not None:
            self.response_format.as_dict()
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise BadRequest("'max_tokens' and 'max_completion_tokens' differ: give one", param="max_tokens")

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        """None without logprobs, else the alternatives per token (``top_logprobs``, default 0)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` a string or token ids (one prompt; a list of
    several prompts is refused), ``ignore_eos`` (vLLM's extension, for benchmarks)."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    ignore_eos: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix or (self.best_of not in (None, 1)):
            name = "suffix" if self.suffix else "best_of"
            raise BadRequest(f"'{name}' is not supported by yirage serve", param=name)

    def logprobs_k(self) -> int | None:
        """None without logprobs, else the alternatives per token."""
        return self.logprobs

    def single_prompt(self) -> "str | list[int]":
        """The one prompt: a string or a list of token ids. BadRequest for several or none."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise BadRequest(f"one prompt per request, got {len(p)}: send them as separate requests "
                                 "(the server runs them concurrently)", param="prompt")
            p = p[0]
        if not p:
            raise BadRequest("the prompt is empty", param="prompt")
        return p


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings``: ``input`` a string, a list of strings, a list of token ids or a
    list of token id lists; ``encoding_format`` 'float' or 'base64' (little-endian float32)."""

    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def items(self) -> tuple[list[str] | None, list[list[int]] | None]:
        """(texts, None) or (None, token id lists). BadRequest for an empty input."""
        x = self.input
        if isinstance(x, str):
            x = [x]
        if not x:
            raise BadRequest("'input' is empty", param="input")
        if isinstance(x[0], str):
            return list(x), None
        if isinstance(x[0], int):
            return None, [list(x)]
        return None, [list(s) for s in x]


def parse(model: type[BaseModel], body: Any) -> Any:
    """``body`` (parsed JSON) as ``model``; BadRequest naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        msg = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field (not part of the API, or not supported by yirage serve)"
        raise BadRequest(f"{where or 'body'}: {msg}", param=where or None) from None
    if hasattr(req, "check_supported"):
        req.check_supported()
    return req
