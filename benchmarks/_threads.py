"""The benchmarks' --threads, applied to OpenMP before anything loads it.

``import _threads`` first in a benchmark script (before torch and yirage): it sets
OMP_NUM_THREADS from ``--threads N`` / ``--threads=N`` on the command line (an existing
OMP_NUM_THREADS, else 2, when the flag is absent), since OpenMP reads it once, when its
runtime loads.
"""
from __future__ import annotations

import os
import sys


def argv_threads(argv: list[str]) -> str | None:
    """The value of --threads in ``argv`` (a string), or None."""
    for i, a in enumerate(argv):
        if a.startswith("--threads="):
            return a.split("=", 1)[1]
        if a == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
    return None


_threads = argv_threads(sys.argv)
if _threads:
    os.environ["OMP_NUM_THREADS"] = _threads
else:
    os.environ.setdefault("OMP_NUM_THREADS", "2")
