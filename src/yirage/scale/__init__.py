"""Past one machine, on Ray (the ``scale`` extra): ``yirage embed ... --ray`` runs the embedding
job on Ray Data (``embed_job.py``), ``yirage serve --replicas N`` puts ``serve/``'s app behind Ray
Serve (``replicas.py``); ``cluster.py`` connects to Ray (a local one, or a cluster) with clear
errors.

Only this package imports Ray, and only when one of those flags asks for it: ``import yirage``
and every command without them never load it. Ray has no authentication of its own: run a
cluster on a private network only (docs/scaling.md).
"""
from __future__ import annotations

__all__ = ["connect", "run_ray_embed_job", "run_replicas"]


def __getattr__(name: str):
    if name == "connect":
        from .cluster import connect

        return connect
    if name == "run_ray_embed_job":
        from .embed_job import run_ray_embed_job

        return run_ray_embed_job
    if name == "run_replicas":
        from .replicas import run_replicas

        return run_replicas
    raise AttributeError(name)
