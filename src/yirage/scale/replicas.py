"""``yirage serve --replicas N``: ``serve/``'s FastAPI application as a Ray Serve deployment of N
replicas (or an autoscaled range), local by default, a cluster with ``--ray-address``.

Each replica is one Ray actor of ``cpus_per_replica`` CPUs that loads the models and builds the
app with ``serve.create_app`` (``serve.ingress`` with a builder, run at the replica's start): one
batching engine with that many torch/OpenMP threads. Ray Serve's HTTP proxy listens on
``host:port`` and routes each request to a replica; the app's own rules hold on every replica:
the OpenAI API, its 4xx bodies, ``--api-key`` (checked by the app in the replica, so at the
ingress of every request), SSE streaming (passed through the proxy), ``/health``. ``/metrics``
answers with the metrics of the replica that took that request; the sum over replicas is Ray's
metrics export (docs/scaling.md).

A replica whose process dies is restarted by Ray Serve; requests it was running end with an
error (a 5xx, or an SSE stream cut short), never a hang, and the other replicas' requests are
not touched.
"""
from __future__ import annotations

import signal
import threading
import time

from ..config import thread_env
from ..errors import YirageError
from ..serve import ServeOptions

#: the Ray Serve application's name (``serve status`` shows it)
APP_NAME = "yirage"


def parse_autoscale(text: str) -> tuple[int, int]:
    """(min, max) replicas from ``MIN:MAX`` (0 <= MIN <= MAX, MAX >= 1). YirageError otherwise."""
    lo, sep, hi = text.partition(":")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit():
        raise YirageError(f"--autoscale takes MIN:MAX replicas (e.g. 1:4), got {text!r}")
    lo_n, hi_n = int(lo), int(hi)
    if hi_n < 1 or lo_n > hi_n:
        raise YirageError(f"--autoscale {text}: need 0 <= MIN <= MAX and MAX >= 1")
    return lo_n, hi_n


def deployment(options: ServeOptions, replicas: int | None = None, cpus_per_replica: int = 1,
               autoscale: tuple[int, int] | None = None):
    """The Ray Serve application (a bound deployment) serving ``options``: ``replicas`` fixed
    replicas, or ``autoscale`` = (min, max) mapped to Ray Serve's ``autoscaling_config`` (the
    target of ongoing requests per replica is ``options.parallel``, the sequences one engine
    decodes together); each replica ``cpus_per_replica`` CPUs and as many threads. A replica takes
    up to ``options.max_queue + options.parallel`` requests at once: the engine's own queue
    limit (503 with Retry-After) then applies as it does without Ray."""
    from ray import serve

    def build_app():   # runs in the replica; its OpenMP/MKL threads were set before its process started
        import torch

        torch.set_num_threads(cpus_per_replica)
        from ..serve import create_app, load_models

        llm, emb = load_models(options)
        return create_app(options, llm, emb)

    scaling = ({"num_replicas": replicas} if autoscale is None else
               {"autoscaling_config": {"min_replicas": autoscale[0], "max_replicas": autoscale[1],
                                       "initial_replicas": max(1, autoscale[0]),
                                       "target_ongoing_requests": options.parallel}})
    cls = serve.deployment(serve.ingress(build_app)(), name="YirageServer",
                           ray_actor_options={"num_cpus": cpus_per_replica,
                                              "runtime_env": {"env_vars": thread_env(cpus_per_replica)}},
                           max_ongoing_requests=options.max_queue + options.parallel,
                           health_check_period_s=2, health_check_timeout_s=30, **scaling)
    return cls.bind()


def start_replicas(options: ServeOptions, host: str = "127.0.0.1", port: int = 8000, *, replicas: int | None = None,
                   address: str | None = None, cpus_per_replica: int | None = None,
                   autoscale: tuple[int, int] | None = None):
    """Connect to Ray (``cluster.connect(address)``), start Ray Serve's proxy on ``host:port``
    and deploy ``deployment(...)``; return once every replica has loaded its models.

    Args:
        replicas: fixed replicas (None with ``autoscale``).
        cpus_per_replica: None: the cluster's CPUs // replicas (at least 1); 1 when autoscaled.

    Returns: the connected ``ray`` module.

    Raises: YirageError: bad counts, Ray missing or not answering, more CPUs per replica than
    the cluster has, or a deployment that failed (a replica that could not load its models:
    ``serve.run`` waits for every replica and raises with Ray Serve's message).
    """
    from .cluster import connect

    if (replicas is None) == (autoscale is None):
        raise YirageError("give --replicas N or --autoscale MIN:MAX")
    if replicas is not None and replicas < 1:
        raise YirageError(f"--replicas must be a positive integer, got {replicas}")
    if cpus_per_replica is not None and cpus_per_replica < 1:
        raise YirageError(f"--cpus-per-replica must be a positive integer, got {cpus_per_replica}")
    ray = connect(address)
    cluster_cpus = int(ray.cluster_resources().get("CPU", 1))
    if cpus_per_replica is None:
        cpus_per_replica = max(1, cluster_cpus // replicas) if replicas else 1
    if cpus_per_replica > cluster_cpus:
        raise YirageError(f"--cpus-per-replica {cpus_per_replica} is more than the Ray cluster's {cluster_cpus} CPUs")
    from ray import serve

    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(deployment(options, replicas, cpus_per_replica, autoscale), name=APP_NAME, route_prefix="/")
    except Exception as e:  # noqa: BLE001 - Ray Serve's deployment errors carry the replica's
        raise YirageError(f"the replicas failed to start: {_last_line(e)}") from None
    return ray


def _last_line(e) -> str:
    """The last non-empty line of an error (Ray puts the replica's traceback before it)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


def run_replicas(options: ServeOptions, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    """``start_replicas`` then serve until interrupted (Ctrl-C or SIGTERM); Ray Serve and this
    process's connection to Ray (with the local Ray it started) are shut down on the way out. Raises what ``start_replicas`` raises."""
    ray = start_replicas(options, host, port, **kwargs)
    from ray import serve

    def terminate(signum, frame):   # SIGTERM (a service manager's stop): leave through the cleanup
        raise SystemExit(0)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, terminate)
    try:
        while True:
            time.sleep(1.0)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
