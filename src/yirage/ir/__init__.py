"""Kernel-graph IR: typed tensors and ops (the Mirage-style builder lives in graph.py)."""
