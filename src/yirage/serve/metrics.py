"""Prometheus metrics of ``yirage serve`` (``GET /metrics``), with ``prometheus_client``.

Names follow vLLM's and llama-server's where they overlap: requests running and waiting,
prompt and generated tokens, time to first token, time between tokens, end-to-end request
time, KV-cache usage, and finished requests by finish reason. Each server has its own
registry, so two servers in one process (tests) do not collide.

This module must never time anything itself: the engine observes.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: seconds buckets of the latency histograms
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Metrics:
    """The server's metrics in their own ``registry``."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("yirage_requests_running", "Generation requests on the engine now.", registry=r)
        self.waiting = Gauge("yirage_requests_waiting", "Generation requests waiting for the engine.", registry=r)
        self.prompt_tokens = Counter("yirage_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.cached_prompt_tokens = Counter("yirage_prompt_tokens_cached",
                                            "Prompt tokens found in a slot's KV cache (prefix reuse), not prefilled.",
                                            registry=r)
        self.generation_tokens = Counter("yirage_generation_tokens", "Tokens generated.", registry=r)
        self.embedding_inputs = Counter("yirage_embedding_inputs", "Texts or token lists embedded.", registry=r)
        self.ttft = Histogram("yirage_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first generated text.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram("yirage_inter_token_latency_seconds",
                                     "Seconds between consecutive pieces of generated text.",
                                     buckets=_ITL_BUCKETS, registry=r)
        self.request_seconds = Histogram("yirage_e2e_request_latency_seconds",
                                         "Seconds a generation ran, prefill to last token.", registry=r)
        self.kv_usage = Gauge("yirage_kv_cache_usage_ratio",
                              "Share of the KV cache's positions the running sequence holds (0..1).", registry=r)
        self.finished = Counter("yirage_request_success", "Finished generations by finish reason.",
                                ["finish_reason"], registry=r)
        self.errors = Counter("yirage_request_errors", "Requests answered with an error, by HTTP status.",
                              ["status"], registry=r)

    def render(self) -> tuple[bytes, str]:
        """(the text exposition of every metric, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
