"""``yirage serve --replicas 2`` on Ray Serve (a local Ray instance): the ``openai`` client gets
the engine's answers through Ray's proxy, streamed and not, with the app's API key and 4xx rules;
one replica's process killed while 16 streams run: the other replica's streams finish with the
tokens they would get alone, the killed one's end with an error (never a hang, never a silent
cut), Ray restarts the replica and later requests succeed."""
import socket
import threading
import time

import pytest

from conftest import kill_one, ray_worker_pids

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

LLM_NAME = "smollm2-135m-instruct"
KEY = "test-key"
REPLICA = "ray::ServeReplica:yirage:YirageServer"


@pytest.fixture(scope="module")
def replicas(ray_local):
    """Two replicas of SmolLM2 (8 sequences each, 1 CPU each) on a free local port."""
    from ray import serve

    from yirage.scale.replicas import APP_NAME, start_replicas
    from yirage.serve import ServeOptions

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_replicas(ServeOptions(LLM_NAME, ctx_size=512, parallel=8, max_queue=32, timeout_s=120, api_key=KEY),
                   "127.0.0.1", port, replicas=2, cpus_per_replica=1)
    yield f"http://127.0.0.1:{port}"
    serve.delete(APP_NAME)


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def messages(i):
    return [{"role": "user", "content": f"Write a short story about the number {i}."}]


@pytest.mark.slow
def test_two_replicas_answer_as_the_engine(replicas, smollm):
    assert len(ray_worker_pids(REPLICA)) == 2
    c = client(replicas)
    r = c.chat.completions.create(model=LLM_NAME, messages=messages(3), max_tokens=12, temperature=0)
    ref = smollm.generate(messages(3), max_new_tokens=12, temperature=0)
    assert r.choices[0].message.content == ref.text
    chunks = list(c.chat.completions.create(model=LLM_NAME, messages=messages(3), max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.finish_reason
    assert httpx.get(f"{replicas}/health").status_code == 200
    # the app's rules hold behind Ray's proxy: the API key, and one 4xx body
    bad = httpx.post(f"{replicas}/v1/chat/completions", json={"model": LLM_NAME, "messages": messages(1)})
    assert bad.status_code == 401 and "error" in bad.json()
    bad = httpx.post(f"{replicas}/v1/chat/completions", json={"model": LLM_NAME, "messages": "x", "max_tokens": -1},
                     headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.slow
def test_a_killed_replica_fails_its_streams_only_and_comes_back(replicas, smollm):
    from ray import serve

    n, tokens = 16, 128
    prompts = [smollm.encode_prompt(messages(i)) for i in range(n)]
    refs = [smollm.generate(p, max_new_tokens=tokens, temperature=0, ignore_eos=True).text for p in prompts]
    c = client(replicas)
    outcome, started = {}, [threading.Event() for _ in range(n)]

    def stream(i):
        text, finish = [], None
        try:
            for ch in c.completions.create(model=LLM_NAME, prompt=prompts[i], max_tokens=tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
                started[i].set()
                if ch.choices:
                    text.append(ch.choices[0].text or "")
                    finish = ch.choices[0].finish_reason or finish
            outcome[i] = ("done", "".join(text), finish)
        except Exception as e:  # noqa: BLE001 - an error is what a killed replica's stream must end with
            outcome[i] = ("error", f"{type(e).__name__}: {str(e)[:150]}", None)
        finally:
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t, e in zip(threads, started):   # one at a time, so that the router sees each replica's load
        t.start()
        assert e.wait(180), "a stream got no first chunk"
    kill_one(REPLICA)
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a stream hung after its replica was killed"
    done = [i for i in range(n) if outcome[i][0] == "done"]
    failed = [i for i in range(n) if outcome[i][0] == "error"]
    assert done and failed, outcome
    for i in failed:   # cut by the kill: a connection error or a 5xx from Ray, not the engine's 503
        assert "retry later" not in outcome[i][1], outcome[i]
    for i in done:   # never a silently cut stream: a finished one is the whole answer
        assert outcome[i][1:] == (refs[i], "length"), (i, outcome[i])
    # Ray Serve restarts the replica: later requests all succeed
    deadline = time.monotonic() + 240
    while True:
        app = serve.status().applications["yirage"]
        states = app.deployments["YirageServer"].replica_states
        if app.status == "RUNNING" and states.get("RUNNING", 0) == 2:
            break
        assert time.monotonic() < deadline, f"the replica did not come back: {app}"
        time.sleep(0.5)
    for i in range(4):
        r = c.chat.completions.create(model=LLM_NAME, messages=messages(i), max_tokens=8, temperature=0)
        assert r.choices[0].message.content == smollm.generate(messages(i), max_new_tokens=8, temperature=0).text


def test_autoscale_is_ray_serves_autoscaling_config(yirage_cli):
    """--autoscale MIN:MAX becomes the deployment's autoscaling_config (read from Ray's deployment
    object, without starting it); bad counts are one clear error."""
    pytest.importorskip("ray")
    from yirage.scale.replicas import deployment, parse_autoscale
    from yirage.serve import ServeOptions

    d = deployment(ServeOptions(LLM_NAME, parallel=4, max_queue=16), None, 2, parse_autoscale("1:3"))._bound_deployment
    auto = d._deployment_config.autoscaling_config   # Ray's own record of the config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 3, 4)
    assert d.ray_actor_options["num_cpus"] == 2 and d.max_ongoing_requests == 20
    fixed = deployment(ServeOptions(LLM_NAME), 3, 1)._bound_deployment
    assert fixed.num_replicas == 3 and fixed._deployment_config.autoscaling_config is None
    for args, words in ((["--autoscale", "3:1"], "need 0 <= MIN <= MAX"), (["--autoscale", "x"], "takes MIN:MAX"),
                        (["--replicas", "2", "--autoscale", "1:2"], "not both"),
                        (["--ray-address", "auto"], "give --replicas N or --autoscale"),
                        (["--replicas", "0"], "--replicas must be a positive integer")):
        code, _, err = yirage_cli("serve", *args)
        assert code == 1 and words in err, (args, err)
