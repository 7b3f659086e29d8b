"""A load test of ``yirage serve``: many concurrent requests, some of them abandoned by their
clients, each answer checked against the same request run alone on the engine.

What one run does (``run_load``):

1. ``make_cases``: a pool of distinct requests (chat and text completions; greedy, and seeded
   sampling with ``n`` up to 2), whose reference answers (``references``) come from the engine
   called directly and alone (``yr.LLM.generate``). The references are checked to be pairwise
   different, so an answer delivered to the wrong client cannot pass.
2. ``requests`` client calls from ``concurrency`` threads, in a random order (``seed``): the
   checked ones take every case streamed, then every case not streamed, then cases at random. A share ``cancel_fraction`` of them are long generations
   (``max_tokens`` ``LONG``) that the client abandons: it closes a stream after 0-3 chunks, or
   gives up waiting for a non-streamed answer. A share ``bad_fraction`` are malformed bodies,
   which must get HTTP 400.
3. After the calls: the server's ``yirage_requests_running`` and ``yirage_requests_waiting``
   must return to 0 (abandoned requests freed their slots), the tokens the server generated
   must stay within what the answered requests need plus a small allowance per abandoned
   request (so an abandoned request stopped, rather than running to its ``LONG`` limit), and a
   last round of requests must still get their reference answers.

Failures are collected, not raised: ``LoadReport.failures`` lists every lost, wrong or 5xx
answer. RSS (of this process: the server runs in it, ``serve_in_thread``) is recorded before
and after.

The CI test (tests/serve/test_load.py) runs 60 requests; the full run is

    PYTHONPATH=src python tests/serve/loadgen.py --requests 200 [--concurrency 16] [--parallel 4] [--rounds 3]

(``make load-test``), which prints the report as JSON (with the RSS after each round) and exits 1
on a failure.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import gc
import json
import random
import re
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx
import openai

#: max_tokens of the requests that clients abandon: far more than they may run after the client left
LONG = 400
#: tokens an abandoned request may generate (after the client left, plus those it read) before it stops
CANCEL_ALLOWANCE = 32

CHAT_QUESTIONS = [
    "What is 12 times 7?", "Name three colours.", "Say hello in French.", "What is the capital of Italy?",
    "List two prime numbers.", "What is water made of?", "Give a synonym of happy.", "How many legs has a spider?",
    "Name a planet.", "What is 9 plus 10?", "Spell the word cat backwards.", "Name an animal that can fly.",
]
TEXT_PROMPTS = [
    "The capital of France is", "Once upon a time, a small robot", "1, 2, 3, 4,", "def fibonacci(n):",
    "The three primary colours are", "In the morning, I usually", "Water boils at", "My favourite book is",
]
LONG_CHAT = "Write a very long story about a dragon who learns to cook, with many chapters."
LONG_TEXT = "Chapter 1. It was a dark and stormy night, and"


@dataclass
class Case:
    """One distinct request: ``kind`` 'chat' or 'text', its prompt (a user message or a text
    prompt), ``max_tokens``, ``temperature`` (0: greedy), ``seed``, ``top_p``, ``n`` choices."""

    name: str
    kind: str
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    top_p: float | None = None
    n: int = 1
    ignore_eos: bool = False

    def body(self, model: str, stream: bool) -> dict:
        """The JSON body of this request (``stream_options.include_usage`` when streamed)."""
        b: dict = {"model": model, "max_tokens": self.max_tokens, "temperature": self.temperature, "n": self.n}
        if self.seed is not None:
            b["seed"] = self.seed
        if self.top_p is not None:
            b["top_p"] = self.top_p
        if self.kind == "chat":
            b["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            b["prompt"] = self.prompt
            if self.ignore_eos:
                b["ignore_eos"] = True
        if stream:
            b["stream"] = True
            b["stream_options"] = {"include_usage": True}
        return b


@dataclass
class Expected:
    """A case's answer when run alone: one text and finish reason per choice, total tokens."""

    texts: list[str]
    finish: list[str]
    completion_tokens: int


@dataclass
class LoadReport:
    """What a load run saw. ``failures`` is empty when every check held."""

    requests: int = 0
    answered: int = 0
    abandoned: int = 0
    bad: int = 0
    statuses: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    wall_s: float = 0.0
    generated_tokens: float = 0.0
    expected_tokens: int = 0
    rss_mb_before: float = 0.0
    rss_mb_after: float = 0.0
    settle_s: float = 0.0

    def to_dict(self) -> dict:
        """The report as JSON-ready data (failures cut to the first 50)."""
        d = asdict(self)
        d["failures"] = d["failures"][:50]
        return d


def make_cases() -> list[Case]:
    """The pool of distinct requests whose answers are checked: 12 chat and 8 text greedy
    requests of 8-24 tokens, and 4 seeded sampled ones (two with n=2)."""
    cases = [Case(f"chat{i}", "chat", q, max_tokens=8 + 4 * (i % 5)) for i, q in enumerate(CHAT_QUESTIONS)]
    cases += [Case(f"text{i}", "text", p, max_tokens=8 + 4 * (i % 5), ignore_eos=i % 2 == 0)
              for i, p in enumerate(TEXT_PROMPTS)]
    cases += [Case("chat-sampled", "chat", "Tell me a fun fact.", 16, temperature=0.8, seed=11),
              Case("chat-sampled-n2", "chat", "Invent a name for a cat.", 12, temperature=1.0, seed=5, n=2,
                   top_p=0.9),
              Case("text-sampled", "text", "The best thing about summer is", 16, temperature=0.7, seed=3),
              Case("text-sampled-n2", "text", "A good name for a boat is", 10, temperature=0.9, seed=8, n=2)]
    return cases


def references(llm, cases: list[Case]) -> dict[str, Expected]:
    """Each case's answer from ``llm.generate`` alone (choice i seeded with seed + i, as the
    server seeds it). Raises AssertionError when two cases share an answer (cross-wiring
    between them would then go unseen)."""
    refs = {}
    for c in cases:
        prompt = [{"role": "user", "content": c.prompt}] if c.kind == "chat" else c.prompt
        results = [llm.generate(prompt, max_new_tokens=c.max_tokens, temperature=c.temperature,
                                top_p=c.top_p, seed=None if c.seed is None else c.seed + i,
                                chat=c.kind == "chat", ignore_eos=c.ignore_eos) for i in range(c.n)]
        refs[c.name] = Expected([r.text for r in results], [r.finish_reason for r in results],
                                sum(len(r.token_ids) for r in results))
    answers = [tuple(e.texts) for e in refs.values()]
    assert len(set(answers)) == len(answers), "two cases have the same reference answer: change a prompt"
    return refs


def rss_mb(pid: str = "self") -> float:
    """Resident memory of process ``pid`` in MiB (after a garbage collection and, with glibc,
    ``malloc_trim``, so that freed memory is not counted); 0.0 where /proc is missing."""
    if pid == "self":
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def scrape(url: str) -> dict[str, float]:
    """The server's Prometheus samples (``GET /metrics``) as {name with labels: value}."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _sse_events(lines) -> list[dict]:
    """The JSON events of an SSE body up to ``data: [DONE]`` (AssertionError without it)."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return events
        events.append(json.loads(data))
    raise AssertionError("the stream ended without data: [DONE]")


def _check(case: Case, ref: Expected, texts: list[str], finish: list[str], tokens: int | None) -> str | None:
    """None when the answer is the reference's, else what differs."""
    if texts != ref.texts:
        return f"text {texts!r} != alone {ref.texts!r}"
    if finish != ref.finish:
        return f"finish_reason {finish} != alone {ref.finish}"
    if tokens is not None and tokens != ref.completion_tokens:
        return f"completion_tokens {tokens} != alone {ref.completion_tokens}"
    return None


def call_checked(client: openai.OpenAI, model: str, case: Case, ref: Expected, stream: bool) -> str | None:
    """One request with the openai client; None when its answer equals ``ref``, else why not
    (an API error's status is in the message: 'status 500: ...')."""
    body = case.body(model, stream)
    extra = {k: body.pop(k) for k in ("ignore_eos",) if k in body}
    api = client.chat.completions if case.kind == "chat" else client.completions
    try:
        if not stream:
            r = api.create(**body, extra_body=extra or None)
            texts = [c.message.content if case.kind == "chat" else c.text for c in r.choices]
            return _check(case, ref, texts, [c.finish_reason for c in r.choices], r.usage.completion_tokens)
        texts, finish, usage = [""] * case.n, [None] * case.n, None
        for chunk in api.create(**body, extra_body=extra or None):
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for c in chunk.choices:
                piece = c.delta.content if case.kind == "chat" else c.text
                texts[c.index] += piece or ""
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
        if usage is None:
            return "the stream had no usage chunk"
        return _check(case, ref, texts, finish, usage)
    except openai.APIStatusError as e:
        return f"status {e.status_code}: {e.message}"
    except (openai.APIError, httpx.HTTPError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def call_abandoned(url: str, model: str, rng: random.Random) -> tuple[str | None, int]:
    """A long request whose client goes away: a stream closed after 0-3 chunks, or a
    non-streamed call given up after 0.2-0.8 s. Returns (problem or None, chunks read)."""
    chat = rng.random() < 0.4
    case = Case("long", "chat" if chat else "text", LONG_CHAT if chat else LONG_TEXT, LONG,
                ignore_eos=not chat)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    stream = rng.random() < 0.7
    if stream:
        keep = rng.randint(0, 3)
        read = 0
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", url + path, json=case.body(model, stream=True)) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}: {r.read()[:200]!r}", 0
                for line in r.iter_lines():
                    if read >= keep:
                        break
                    if line.startswith("data: "):
                        read += 1
        return None, read
    try:
        with httpx.Client(timeout=httpx.Timeout(60, read=rng.uniform(0.2, 0.8))) as http:
            r = http.post(url + path, json=case.body(model, stream=False))
        if r.status_code >= 500:
            return f"status {r.status_code}: {r.text[:200]}", 0
    except httpx.ReadTimeout:
        pass
    return None, 0


BAD_BODIES = ['{"model": "MODEL", "messages": [', '{"model": "MODEL", "messages": [], "max_tokens": 4}',
              '{"model": "MODEL", "prompt": "x", "max_tokens": -1}', '{"model": "MODEL", "prompt": 5}']


def call_bad(url: str, model: str, rng: random.Random) -> str | None:
    """A malformed body; None when the server answers 400 with an OpenAI-style error."""
    body = rng.choice(BAD_BODIES).replace("MODEL", model)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    if r.status_code != 400 or "error" not in r.json():
        return f"bad body {body!r}: status {r.status_code} {r.text[:200]}"
    return None


def wait_idle(url: str, timeout_s: float = 30.0) -> float:
    """Seconds until the server reports no request running or waiting; raises AssertionError
    after ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        m = scrape(url)
        if m.get("yirage_requests_running", 0) == 0 and m.get("yirage_requests_waiting", 0) == 0:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"still busy after {timeout_s:g} s: running "
                                 f"{m.get('yirage_requests_running')}, waiting {m.get('yirage_requests_waiting')}")
        time.sleep(0.05)


def run_load(url: str, model: str, cases: list[Case], refs: dict[str, Expected], requests: int = 60,
             concurrency: int = 8, cancel_fraction: float = 0.2, bad_fraction: float = 0.05, seed: int = 0,
             rss=lambda: rss_mb()) -> LoadReport:
    """Run the load against the server at ``url`` (see the module docstring) and return the
    report; ``rss`` measures the server's resident MiB (default: this process)."""
    rng = random.Random(seed)
    n_abandon, n_bad = round(cancel_fraction * requests), round(bad_fraction * requests)
    kinds = ["abandon"] * n_abandon + ["bad"] * n_bad + ["checked"] * (requests - n_abandon - n_bad)
    rng.shuffle(kinds)
    # every case streamed once, then every case not streamed, then at random (n_checked permitting)
    checked = [(c, True) for c in cases] + [(c, False) for c in cases]
    checked += [(rng.choice(cases), rng.random() < 0.5) for _ in range(max(0, kinds.count("checked") - len(checked)))]
    picks = iter(checked)
    plan = []
    for i, what in enumerate(kinds):
        case, stream = next(picks) if what == "checked" else (rng.choice(cases), rng.random() < 0.5)
        plan.append((i, what, case, stream, random.Random(rng.random())))
    report = LoadReport(requests=requests)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    before = scrape(url)
    report.rss_mb_before = rss()
    lock = threading.Lock()

    def one(item) -> None:
        i, what, case, stream, r = item
        problem = None
        try:
            if what == "checked":
                problem = call_checked(client, model, case, refs[case.name], stream)
            elif what == "abandon":
                problem, _ = call_abandoned(url, model, r)
            else:
                problem = call_bad(url, model, r)
        except Exception as e:  # noqa: BLE001 - a failure of this request, reported
            problem = f"{type(e).__name__}: {e}"
        with lock:
            key = {"checked": "answered", "abandon": "abandoned", "bad": "bad"}[what]
            setattr(report, key, getattr(report, key) + 1)
            if problem:
                report.failures.append(f"request {i} ({what} {case.name}, stream={stream}): {problem}")
                m = re.match(r"status (\d+)", problem)
                if m:
                    report.statuses[m.group(1)] = report.statuses.get(m.group(1), 0) + 1
            if what == "checked" and not problem:
                report.expected_tokens += refs[case.name].completion_tokens

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, plan))
    report.wall_s = time.perf_counter() - t0
    try:
        report.settle_s = wait_idle(url)
    except AssertionError as e:
        report.failures.append(f"after the load: {e}")
    # later requests still get their answers alone
    last = [c for c in cases if c.temperature == 0][:4]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for c, problem in zip(last, pool.map(lambda c: call_checked(client, model, c, refs[c.name], False), last)):
            if problem:
                report.failures.append(f"after the load ({c.name}): {problem}")
            else:
                report.expected_tokens += refs[c.name].completion_tokens
    after = scrape(url)
    report.generated_tokens = after.get("yirage_generation_tokens_total", 0) - before.get(
        "yirage_generation_tokens_total", 0)
    allowance = report.expected_tokens + CANCEL_ALLOWANCE * report.abandoned
    if report.generated_tokens > allowance:
        report.failures.append(f"the server generated {report.generated_tokens:.0f} tokens, more than the answered "
                               f"requests' {report.expected_tokens} plus {CANCEL_ALLOWANCE} per abandoned request "
                               f"({report.abandoned}): abandoned requests kept running")
    for status, n in ((k[len('yirage_request_errors_total{status="'):-2], v) for k, v in after.items()
                      if k.startswith("yirage_request_errors_total{")):
        if status.startswith("5") and n > before.get(f'yirage_request_errors_total{{status="{status}"}}', 0):
            report.failures.append(f"the server counted {n:.0f} HTTP {status} errors")
    report.rss_mb_after = rss()
    return report


@contextlib.contextmanager
def serve_in_thread(app):
    """Serve the FastAPI ``app`` with uvicorn on a free local port in a daemon thread; yields
    the base URL and stops the server on exit. AssertionError when it does not start in 60 s."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def main(argv=None) -> int:
    """The full load test (``make load-test``): prints the report as JSON; 1 on a failure."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16, help="client threads")
    ap.add_argument("--parallel", type=int, default=4, help="the server's --parallel (1: one at a time)")
    ap.add_argument("--cancel", type=float, default=0.25, help="share of requests their clients abandon")
    ap.add_argument("--bad", type=float, default=0.05, help="share of malformed requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the load this many times (new seeds), to see whether memory keeps growing")
    ap.add_argument("--rss-tolerance-mb", type=float, default=64.0,
                    help="the most the resident memory may grow between the warm-up and the end")
    ap.add_argument("-o", "--output", help="also write the report JSON here")
    args = ap.parse_args(argv)
    import yirage as yr
    from yirage.runtime.machine import machine_record
    from yirage.serve import ServeOptions, create_app

    model = "smollm2-135m-instruct"
    llm = yr.LLM(model, backend="cpu", max_seq_length=512)
    cases = make_cases()
    refs = references(llm, cases)
    app = create_app(ServeOptions(model, max_queue=256, timeout_s=300, parallel=args.parallel), llm=llm)
    with serve_in_thread(app) as url:
        warm = run_load(url, model, cases, refs, requests=max(20, args.requests // 10),
                        concurrency=args.concurrency, cancel_fraction=args.cancel, seed=args.seed + 1)
        reports = [run_load(url, model, cases, refs, requests=args.requests, concurrency=args.concurrency,
                            cancel_fraction=args.cancel, bad_fraction=args.bad, seed=args.seed + 100 * r)
                   for r in range(args.rounds)]
    report = reports[-1]
    for r in reports[:-1]:
        report.failures[:0] = r.failures
    grew = report.rss_mb_after - warm.rss_mb_after
    if grew > args.rss_tolerance_mb:
        report.failures.append(f"resident memory grew by {grew:.0f} MiB (warm-up end {warm.rss_mb_after:.0f} MiB, "
                               f"end {report.rss_mb_after:.0f} MiB; tolerance {args.rss_tolerance_mb:g})")
    out = {"report": report.to_dict(), "warmup_failures": warm.failures[:20], "rss_mb_after_warmup":
           warm.rss_mb_after, "rss_mb_after_each_round": [round(r.rss_mb_after, 1) for r in reports],
           "args": vars(args), "machine": machine_record()}
    text = json.dumps(out, indent=2, default=str)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    return 1 if report.failures or warm.failures else 0


if __name__ == "__main__":
    sys.exit(main())
