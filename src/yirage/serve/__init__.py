"""``yirage serve``: the engines behind an OpenAI-compatible HTTP API (FastAPI + uvicorn; the
``serve`` extra). ``create_app`` builds the application, ``run_server`` runs it (the CLI).

This package must never compute tokens or embeddings itself: the engines do.
"""
from __future__ import annotations

from .app import ServeOptions, create_app

__all__ = ["ServeOptions", "create_app", "run_server", "load_models"]


def load_models(options: ServeOptions):
    """(yr.LLM or None, yr.EmbeddingModel or None) for ``options``; the engines' errors
    (ModelLoadError, BackendUnavailableError, ...) propagate."""
    from ..engines.embed import EmbeddingModel
    from ..engines.generate import LLM

    llm = (LLM(options.model, backend=options.backend, max_seq_length=options.ctx_size,
               kv_cache_dtype=options.kv_cache_dtype, decode_dtype=options.decode_dtype,
               tensor_parallel_size=options.tensor_parallel_size) if options.model else None)
    emb = EmbeddingModel(options.embedding_model, backend=options.backend) if options.embedding_model else None
    return llm, emb


def run_server(options: ServeOptions, host: str = "127.0.0.1", port: int = 8000) -> str | None:
    """Serve until interrupted (Ctrl-C) on ``host``:``port``, loading the models in the
    background (``/health`` answers 503 meanwhile). Returns None, or the error that stopped the
    server (a model that failed to load, a port in use)."""
    import uvicorn

    failure: list[str] = []
    server: uvicorn.Server | None = None

    def stop(message: str) -> None:
        failure.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(options, load=load_models, on_load_error=stop)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False))
    try:
        server.run()
    except SystemExit:   # uvicorn exits when it cannot bind the port (it has logged why)
        failure.append(f"cannot listen on {host}:{port} (in use, or not an address of this machine)")
    return failure[0] if failure else None
