"""``yirage serve``: an OpenAI-compatible HTTP API over ``yr.LLM`` and ``yr.EmbeddingModel``,
built on FastAPI and uvicorn, with Prometheus metrics.

Endpoints (OpenAI's API reference; vLLM's and llama-server's extensions where named):

| endpoint | what |
|---|---|
| ``GET /v1/models`` | the served models |
| ``POST /v1/chat/completions`` | chat (``stream`` as SSE ``chat.completion.chunk`` events) |
| ``POST /v1/completions`` | text or token-id prompts, ``ignore_eos``, ``stream`` |
| ``POST /v1/embeddings`` | strings or token id lists; ``encoding_format`` float or base64 |
| ``GET /health`` | 503 while the models load, then 200 |
| ``GET /metrics`` | Prometheus text format |

Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` with a
4xx status for what the client can fix (malformed JSON, invalid UTF-8, JSON nested deeper than
``MAX_JSON_DEPTH``, a string with a lone UTF-16 surrogate, a bad or unsupported field, an unknown
model: 400/404; a body over ``max_body_bytes``: 413; no or a wrong API key: 401), never a 5xx for
a body (a hypothesis fuzz test posts generated ones), 503 with ``Retry-After`` when ``max_queue``
requests already wait, and 503 while
loading; a request that runs past ``timeout_s`` gets 504. Generations run on one engine thread
(``engine.py``): continuous batching of up to ``parallel`` sequences, or one at a time with
``parallel=1``; embeddings run in the server's thread pool (the model is thread-safe).

This module must never compute a token or an embedding itself: it parses, queues and formats.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import hmac
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import logger
from ..errors import GenerationError, YirageError
from .engine import BatchingEngine, GenerationJob, LLMEngine, QueueFull
from .metrics import Metrics
from ..engines.generate import TokenLogprob
from .protocol import BadRequest, ChatCompletionRequest, CompletionRequest, EmbeddingRequest, parse


#: seconds a client refused for a full queue is asked to wait (``Retry-After``)
RETRY_AFTER_S = 1


@dataclass
class ServeOptions:
    """What ``create_app`` serves: ``model`` (an LLM: a registry name, GGUF file or HF
    directory; None for none), ``embedding_model`` (likewise, or None), ``backend``, ``ctx_size``
    (the LLM's max_seq_length in tokens), ``api_key`` (None: no authentication),
    ``max_queue`` (waiting generation requests), ``timeout_s`` (seconds per request),
    ``parallel`` (sequences decoded together by continuous batching; 1: one at a time on the
    persistent decode kernel), ``max_batch_tokens`` (rows per batching step; None:
    ``BatchingEngine``'s default), ``kv_cache_dtype`` (the LLM's: None or 'float16'),
    ``decode_dtype`` (the LLM's: None or 'int8'), ``max_body_bytes`` (a larger request body gets
    413 before it is read whole), ``chat_template`` (a jinja2 chat template, the text of
    ``--chat-template-file``, used instead of the model's; None: the model's),
    ``tensor_parallel_size`` (the LLM's: its ranks on this host; 1: this process runs it)."""

    model: str | None = None
    embedding_model: str | None = None
    backend: str | None = None
    ctx_size: int = 4096
    api_key: str | None = None
    max_queue: int = 64
    timeout_s: float = 600.0
    parallel: int = 4
    max_batch_tokens: int | None = None
    kv_cache_dtype: str | None = None
    decode_dtype: str | None = None
    max_body_bytes: int = 32 << 20
    chat_template: str | None = None
    tensor_parallel_size: int = 1


#: JSON nesting deeper than this is refused (400): OpenAI bodies nest a few levels, a tool's
#: JSON Schema a few dozen; Python's JSON decoder raised RecursionError (a 500) at about 1000
MAX_JSON_DEPTH = 128


def check_json(value: Any) -> None:
    """BadRequest unless ``value`` (parsed JSON) nests at most ``MAX_JSON_DEPTH`` levels and every
    string in it is Unicode text (JSON's ``\\ud800`` escapes can spell lone UTF-16 surrogates,
    which no tokenizer takes). Iterative: never recurses, whatever the depth."""
    stack = [(value, 1, "body")]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape): "
                                 "not Unicode text", param=where) from None
            continue
        if isinstance(v, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at {where})")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, item in items:
                if isinstance(k, str):
                    stack.append((k, depth + 1, f"{where} key"))
                stack.append((item, depth + 1, f"{where}.{k}" if isinstance(v, dict) else f"{where}[{k}]"))


@dataclass
class _State:
    options: ServeOptions
    metrics: Metrics = field(default_factory=Metrics)
    llm: Any = None
    engine: LLMEngine | None = None
    embedder: Any = None
    ready: bool = False
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def names(self, kind: str) -> set[str]:
        """The names a request may give for the served LLM ('llm') or embedding model."""
        spec, obj = (self.options.model, self.llm) if kind == "llm" else (self.options.embedding_model, self.embedder)
        if obj is None:
            return set()
        return {n for n in (spec, getattr(obj, "name", None)) if n}


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           metrics: Metrics | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.errors.labels(status=str(status)).inc()
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


class _ApiKey:
    """ASGI middleware: a request to ``/v1/...`` without ``Authorization: Bearer <key>`` gets 401.
    (Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would copy every streamed chunk
    through a memory stream and hide the client's disconnect behind its own receive.)"""

    def __init__(self, app, key: str, metrics: Metrics):
        self.app, self.expected, self.metrics = app, f"Bearer {key}".encode(), metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(auth, self.expected):
                response = _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                  kind="authentication_error", metrics=self.metrics)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(options: ServeOptions, llm=None, embedder=None,
               load: Callable[[ServeOptions], tuple[Any, Any]] | None = None,
               on_load_error: Callable[[str], None] | None = None) -> FastAPI:
    """The FastAPI application of ``yirage serve``.

    Args:
        options: what to serve (``ServeOptions``).
        llm, embedder: models already loaded (tests); the server is ready at once.
        load: otherwise, called in a background thread at startup with ``options``; returns
            (llm or None, embedding model or None). Until it returns, ``/health`` and every
            endpoint answer 503.
        on_load_error: called with the message when ``load`` raises (the CLI stops the server).
    """
    state = _State(options)

    def become_ready(model, emb) -> None:
        state.llm, state.embedder = model, emb
        if model is not None and options.parallel > 1:
            state.engine = BatchingEngine(model, options.parallel, options.max_queue, state.metrics,
                                          options.max_batch_tokens)
        elif model is not None:
            state.engine = LLMEngine(model, options.max_queue, state.metrics)
        state.ready = True

    def load_in_background() -> None:
        try:
            become_ready(*load(options))
            # the objects of the loaded libraries and models live as long as the server: kept out
            # of the cyclic collector's scans, whose full passes over them took 3-4% of a busy
            # server's CPU (the usual measure for long-lived Python servers)
            gc.freeze()
            logger.info("yirage serve: models loaded")
        except Exception as e:  # noqa: BLE001 - reported through /health and on_load_error
            state.load_error = str(e) if isinstance(e, YirageError) else f"{type(e).__name__}: {e}"
            if on_load_error is not None:
                on_load_error(state.load_error)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if load is None:
            become_ready(llm, embedder)
        else:
            threading.Thread(target=load_in_background, name="yirage-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.close()

    app = FastAPI(title="yirage", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.yirage = state

    # ---- errors: always an OpenAI-style body ------------------------------------------------
    @app.exception_handler(BadRequest)
    async def _bad(request: Request, e: BadRequest):
        return _error(e.status, e.message, e.param, e.kind, state.metrics, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        msg = {404: f"no route {request.method} {request.url.path}: see GET /v1/models, POST "
                    "/v1/chat/completions, /v1/completions, /v1/embeddings",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return _error(e.status_code, msg, metrics=state.metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return _error(400, str(e), metrics=state.metrics)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone):
        state.metrics.errors.labels(status="499").inc()
        return Response(status_code=499)   # nginx's "client closed request": nobody reads it

    if options.api_key:
        app.add_middleware(_ApiKey, key=options.api_key, metrics=state.metrics)

    def ready() -> _State:
        if state.load_error is not None:
            raise BadRequest(f"the model failed to load: {state.load_error}", 503, kind="service_unavailable")
        if not state.ready:
            raise BadRequest("the model is still loading: retry shortly", 503, kind="service_unavailable")
        return state

    async def body(request: Request) -> Any:
        limit = options.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BadRequest(f"the request body is {declared} bytes, more than --max-body-bytes {limit}", 413,
                             kind="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(f"the request body is more than --max-body-bytes {limit} bytes", 413,
                                 kind="request_too_large")
            chunks.append(chunk)
        try:
            value = json.loads(b"".join(chunks))
        except RecursionError:
            raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        check_json(value)
        return value

    def check_model(name: str, kind: str) -> None:
        names = state.names(kind)
        if not names:
            what = "an LLM (-m MODEL)" if kind == "llm" else "an embedding model (--embedding-model M)"
            raise BadRequest(f"this server has no {what}", 404, param="model", kind="not_found_error")
        if name not in names:
            raise BadRequest(f"model {name!r} is not served here; served: {', '.join(sorted(names))}", 404,
                             param="model", kind="not_found_error")

    # ---- routes ---------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.load_error is not None:
            return _error(503, f"the model failed to load: {state.load_error}", kind="service_unavailable")
        if not state.ready:
            return _error(503, "loading", kind="service_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        data, ctype = state.metrics.render()
        return Response(data, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        s = ready()
        data = [{"id": n, "object": "model", "created": s.created, "owned_by": "yirage"}
                for kind in ("llm", "embedding") for n in sorted(s.names(kind))[:1]]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        s = ready()
        req = parse(ChatCompletionRequest, await body(request))
        check_model(req.model, "llm")
        messages = [m.for_template() for m in req.messages]
        calling = await _tool_calling(s, req)
        fmt = await _response_format(s.llm, req.response_format)
        if calling is not None and calling.response_format is not None:
            if fmt is not None:
                raise BadRequest("a response_format cannot be combined with a tool_choice that forces a call",
                                 param="response_format")
            fmt = calling.response_format
        ids = _prompt_ids(s.llm, messages, chat=True, tools=None if calling is None else calling.tools,
                          chat_template=s.options.chat_template)
        return await _respond(s, request, req, ids, req.token_limit(), "chat", ignore_eos=False, response_format=fmt,
                              calling=calling)

    @app.post("/v1/completions")
    async def completions(request: Request):
        s = ready()
        req = parse(CompletionRequest, await body(request))
        check_model(req.model, "llm")
        prompt = req.single_prompt()
        ids = _prompt_ids(s.llm, prompt, chat=False)
        echo = None
        if req.echo:   # the prompt as given, then (with logprobs) its tokens' logprobs
            text = prompt if isinstance(prompt, str) else s.llm.tokenizer.decode(ids, skip_special_tokens=False)
            scored = None
            if req.logprobs is not None:
                try:
                    scored = await run_in_threadpool(s.llm.prompt_logprobs, ids, req.logprobs)
                except GenerationError as e:   # what this LLM cannot score (tensor_parallel_size > 1)
                    raise BadRequest(str(e), param="logprobs") from None
                scored[0] = TokenLogprob(ids[0], None)   # the first token, scored against nothing
            echo = (text, scored)
        return await _respond(s, request, req, ids, req.max_tokens, "text", ignore_eos=req.ignore_eos, echo=echo)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        s = ready()
        req = parse(EmbeddingRequest, await body(request))
        check_model(req.model, "embedding")
        dim = s.embedder.get_sentence_embedding_dimension()
        if req.dimensions is not None and req.dimensions != dim:
            raise BadRequest(f"'dimensions' {req.dimensions}: this model's embeddings have {dim}", param="dimensions")
        texts, id_lists = req.items()

        def run():
            lists = s.embedder.tokenize(texts) if texts is not None else id_lists
            return lists, s.embedder.encode_ids(lists)
        try:
            lists, vectors = await run_in_threadpool(run)
        except YirageError as e:
            raise BadRequest(str(e), param="input") from None
        s.metrics.embedding_inputs.inc(len(lists))
        tokens = sum(len(x) for x in lists)
        data = [{"object": "embedding", "index": i, "embedding": _encode_vector(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": req.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return app


def _prompt_ids(llm, prompt, chat: bool, tools=None, chat_template: str | None = None) -> list[int]:
    """The prompt's token ids (checked here, before the request queues), rendered with ``tools``
    and ``chat_template`` (--chat-template-file) for chat; BadRequest if bad."""
    try:
        return llm.prompt_ids(prompt, chat, tools, chat_template)
    except YirageError as e:
        raise BadRequest(str(e), param="messages" if chat else "prompt") from None


async def _tool_calling(s: _State, req):
    """The request's tools compiled for the LLM and the served chat template
    (``engines.tools.ToolCalling``; in a worker thread: a forcing grammar takes a while), or None
    without tools; BadRequest for bad tools, tool_choice, or a template without a tool format."""
    if not req.tools and req.tool_choice is None:
        return None
    try:
        return await run_in_threadpool(s.llm.tool_calling, req.tools, req.tool_choice, req.parallel_tool_calls,
                                       s.options.chat_template)
    except YirageError as e:
        raise BadRequest(str(e), param="tool_choice" if "tool_choice" in str(e) else "tools") from None


async def _response_format(llm, response_format):
    """The request's ``response_format`` compiled for ``llm`` (engines/structured.py; in a worker
    thread: a large schema takes a while), or None for free text; BadRequest for a schema the
    grammar library refuses, or when it is not installed."""
    spec = None if response_format is None else response_format.as_dict()
    if spec is None:
        return None
    try:
        return await run_in_threadpool(llm.response_format, spec)
    except YirageError as e:
        raise BadRequest(str(e), param="response_format") from None


def _encode_vector(v, fmt: str):
    if fmt == "base64":   # little-endian float32 bytes, as OpenAI's clients decode them
        return base64.b64encode(v.contiguous().numpy().astype("<f4").tobytes()).decode("ascii")
    return v.tolist()


def _job(s: _State, req, ids: list[int], limit: int | None, ignore_eos: bool, response_format=None) -> GenerationJob:
    kwargs = {"max_new_tokens": limit or s.llm.max_seq_length, "temperature": req.temperature,
              "top_p": req.top_p if req.top_p < 1.0 else None, "seed": req.seed, "stop": req.stops() or None,
              "ignore_eos": ignore_eos, "response_format": response_format, "logit_bias": _logit_bias(s, req),
              "logprobs": req.logprobs_k()}
    return GenerationJob(ids, kwargs, n=req.n, chat=False)


def _assistant_message(text: str, calling) -> dict:
    """The chat reply's ``message``: with tools, the calls parsed out of ``text`` go to
    ``tool_calls`` (``content`` keeps the rest, null when nothing is left)."""
    if calling is None:
        return {"role": "assistant", "content": text}
    content, calls = calling.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}


def _token_text(llm, token_id: int) -> str:
    """A token's text as OpenAI's logprobs show it: the token decoded alone (special ones too)."""
    return llm.tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(llm, items) -> dict:
    """Chat's ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]} of ``items``
    (``TokenLogprob``s)."""
    def entry(token_id: int, logprob: float) -> dict:
        text = _token_text(llm, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                        for x in items]}


def _completion_logprobs(llm, items, offset: int = 0) -> dict:
    """Completions' ``logprobs`` (the legacy form): tokens, token_logprobs, top_logprobs ({token:
    logprob} per position) and text_offset (characters before each token, from ``offset``) of
    ``items`` (``TokenLogprob``s; an echoed prompt's first token, scored against nothing, has
    logprob None and no alternatives)."""
    tokens, values, tops, offsets = [], [], [], []
    for x in items:
        offsets.append(offset)
        text = _token_text(llm, x.token_id)
        tokens.append(text)
        values.append(x.logprob)
        tops.append({_token_text(llm, t): lp for t, lp in x.top} if x.logprob is not None else None)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _logit_bias(s: _State, req) -> dict[int, float] | None:
    """The request's ``logit_bias`` checked against the LLM's vocabulary; BadRequest if bad."""
    from ..engines.generate import check_logit_bias

    try:
        check_logit_bias(req.logit_bias, s.llm.config.vocab_size)
    except YirageError as e:
        raise BadRequest(str(e), param="logit_bias") from None
    return req.logit_bias or None


def _check_limit(s: _State, ids: list[int], limit: int | None, param: str) -> None:
    """BadRequest (400) when the prompt and ``limit`` new tokens do not fit the context
    (``--ctx-size``, the LLM's max_seq_length), as vLLM answers: a huge ``max_tokens`` is a bad
    request, not a silent cut. Without a limit, generation stops at the context's end."""
    ctx = s.llm.max_seq_length
    if limit is not None and len(ids) + limit > ctx:
        raise BadRequest(f"'{param}' {limit} and the prompt's {len(ids)} tokens need {len(ids) + limit} tokens, "
                         f"more than the context of {ctx} (--ctx-size): ask for at most {ctx - len(ids)} new "
                         f"tokens", param=param)


async def _respond(s: _State, request: Request, req, ids: list[int], limit: int | None, kind: str,
                   ignore_eos: bool, response_format=None, echo: tuple | None = None, calling=None):
    _check_limit(s, ids, limit, "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None
                 else "max_tokens")
    try:
        job = s.engine.submit(_job(s, req, ids, limit, ignore_eos, response_format))
    except QueueFull as e:
        raise BadRequest(str(e), 503, kind="service_unavailable",
                         headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    meta = {"id": rid, "created": int(time.time()), "model": req.model}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _JobStream(job, _sse(s, job, meta, kind, len(ids), include_usage, req.logprobs_k() is not None, echo,
                                    calling))
    try:
        results = await _results_unless_gone(job, request, s.options.timeout_s)
    finally:   # answered, failed, timed out, or the client went away: the job ends here
        job.cancelled.set()
    completion = sum(len(r.token_ids) for r in results)
    if kind == "chat":
        choices = [{"index": i, "message": _assistant_message(r.text, calling),
                    "logprobs": None if r.logprobs is None else _chat_logprobs(s.llm, r.logprobs),
                    "finish_reason": r.finish_reason} for i, r in enumerate(results)]
        for c in choices:
            if c["message"].get("tool_calls") and c["finish_reason"] == "stop":
                c["finish_reason"] = "tool_calls"
        obj = "chat.completion"
    else:
        head, scored = echo if echo is not None else ("", None)
        choices = [{"index": i, "text": head + r.text,
                    "logprobs": None if r.logprobs is None else _completion_logprobs(s.llm, (scored or []) + r.logprobs),
                    "finish_reason": r.finish_reason} for i, r in enumerate(results)]
        obj = "text_completion"
    cached = results[0].cached_tokens if results else 0   # the prefix its (first) slot already held
    return {**meta, "object": obj, "choices": choices,
            "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                      "total_tokens": len(ids) + completion, "prompt_tokens_details": {"cached_tokens": cached}}}


class _JobStream(StreamingResponse):
    """The SSE response of a streamed job: however it ends (finished, the client went away, the
    server shuts down), the job is cancelled, so that its sequence stops and frees its slot at
    once, not when the garbage collector finalizes the event generator."""

    def __init__(self, job: GenerationJob, events: AsyncIterator[bytes]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancelled.set()


async def _results_unless_gone(job: GenerationJob, request: Request, timeout_s: float) -> list:
    """The job's results (``_results``), watching the connection meanwhile: BadRequest 504 after
    ``timeout_s``; ``ClientGone`` (no answer is sent) when the client disconnects first."""
    results = asyncio.ensure_future(_results(job))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({results, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (results, gone):
            t.cancel()
    if results in done:
        return results.result()
    if gone in done:
        raise ClientGone()
    raise BadRequest(f"the request did not finish within {timeout_s:g} s (--timeout)", 504, kind="timeout")


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read: the next ASGI message of a
    request is ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client closed its connection before its answer was ready: nothing is sent."""


async def _results(job: GenerationJob) -> list:
    """Wait for the job's end; its results, or BadRequest with the engine's message."""
    while True:
        event = await job.events.get()
        if event[0] == "done":
            return event[1]
        if event[0] == "error":
            raise BadRequest(event[1])


def _sse_data(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def _sse(s: _State, job: GenerationJob, meta: dict, kind: str, prompt_tokens: int,
               include_usage: bool, logprobs: bool = False, echo: tuple | None = None,
               calling=None) -> AsyncIterator[bytes]:
    """The SSE events of a streamed completion: chunks as the pieces come (with the logprobs of
    their tokens when asked for), each choice's final chunk with its finish reason (and the
    logprobs of tokens no chunk carried yet), the usage chunk if asked for, then ``data: [DONE]``.
    ``echo`` (completions): (prompt text, its TokenLogprobs or None), each choice's first chunk.
    ``calling`` (chat with tools, ``engines.tools.ToolCalling``): text that may be a tool call
    is held back until it is known; each call goes out as OpenAI streams one, a
    ``delta.tool_calls`` chunk with its index, id, type and name, then one with its arguments."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(i: int, text: str | None, finish: str | None = None, first: bool = False, items=None,
              delta: dict | None = None) -> bytes:
        lp = None
        if logprobs and items is not None:
            lp = (_chat_logprobs(s.llm, items) if kind == "chat"
                  else _completion_logprobs(s.llm, items, chars.get(i, 0)))
            sent[i] = sent.get(i, 0) + len(items)
        chars[i] = chars.get(i, 0) + len(text or "")
        if kind == "chat":
            if delta is None:
                delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
        return _sse_data({**meta, "object": obj, "choices": [choice]})

    deadline = time.monotonic() + s.options.timeout_s
    started: set[int] = set()
    sent: dict[int, int] = {}   # choice -> logprobs sent so far
    chars: dict[int, int] = {}  # choice -> characters of text sent so far (text_offset)
    parsers: dict = {}          # choice -> its ToolCallStream (chat with tools)
    calls: dict[int, int] = {}  # choice -> tool calls sent so far

    def opening(i: int) -> list[bytes]:   # a choice's first chunk(s): the role, or the echoed prompt
        if i in started:
            return []
        started.add(i)
        if kind == "chat":
            return [chunk(i, None, first=True)]
        if echo is not None:
            out = [chunk(i, echo[0], items=echo[1] or [])]
            sent[i] = 0   # the echoed prompt's logprobs are not the generation's
            return out
        return []

    def pieces(i: int, parts: list, items) -> list[bytes]:
        """Chunks of what choice ``i``'s tool-call parser let out (text and ToolCalls); the
        logprobs ``items`` ride on the first, or wait for the final chunk if nothing went out."""
        out = []
        for part in parts:
            if isinstance(part, str):
                out.append(chunk(i, part, items=items))
            else:
                k = calls.get(i, 0)
                calls[i] = k + 1
                head = {"index": k, "id": part.id, "type": "function", "function": {"name": part.name, "arguments": ""}}
                out.append(chunk(i, None, items=items, delta={"tool_calls": [head]}))
                out.append(chunk(i, None, delta={"tool_calls": [{"index": k, "function": {"arguments": part.arguments}}]}))
            items = None
        return out

    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                job.cancelled.set()
                yield _sse_data({"error": {"message": f"the request did not finish within {s.options.timeout_s:g} s "
                                                      "(--timeout)", "type": "timeout", "param": None, "code": 504}})
                break
            if event[0] == "piece":
                _, i, text, items = event
                for c in opening(i):
                    yield c
                if calling is None:
                    yield chunk(i, text, items=items)
                    continue
                parser = parsers.setdefault(i, calling.stream())
                for c in pieces(i, parser.feed(text), items):
                    yield c
            elif event[0] == "error":
                yield _sse_data({"error": {"message": event[1], "type": "invalid_request_error", "param": None,
                                           "code": 400}})
                break
            else:
                results = event[1]
                for i, r in enumerate(results):
                    for c in opening(i):
                        yield c
                    if calling is not None:
                        for c in pieces(i, parsers.setdefault(i, calling.stream()).finish(), None):
                            yield c
                    tail = None if r.logprobs is None else r.logprobs[sent.get(i, 0):]
                    finish = "tool_calls" if calls.get(i) and r.finish_reason == "stop" else r.finish_reason
                    yield chunk(i, None, finish, items=tail)
                if include_usage:
                    completion = sum(len(r.token_ids) for r in results)
                    yield _sse_data({**meta, "object": obj, "choices": [],
                                     "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                               "total_tokens": prompt_tokens + completion}})
                break
        yield b"data: [DONE]\n\n"
    finally:   # the client went away (or the stream ended): stop the generation
        job.cancelled.set()
