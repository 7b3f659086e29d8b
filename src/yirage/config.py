"""Process-wide settings read from the environment.

- ``YIRAGE_BACKEND``: default backend name (or ``auto``).
- ``YIRAGE_LOG_LEVEL``: logging level of the ``yirage`` logger (DEBUG, INFO, WARNING, ...).
- ``YIRAGE_CACHE_DIR``: where compiled kernels and converted tokenizers are cached
  (default ``~/.cache/yirage``).

This module must never import a backend or torch.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("yirage")


def configure_logging() -> None:
    """Apply ``YIRAGE_LOG_LEVEL`` (default WARNING) to the ``yirage`` logger."""
    level = os.environ.get("YIRAGE_LOG_LEVEL", "WARNING").upper()
    logger.setLevel(getattr(logging, level, logging.WARNING))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[yirage %(levelname)s] %(message)s"))
        logger.addHandler(handler)


def cache_dir() -> Path:
    """The cache root (``YIRAGE_CACHE_DIR`` or ``~/.cache/yirage``); created if missing."""
    root = Path(os.environ.get("YIRAGE_CACHE_DIR") or Path.home() / ".cache" / "yirage")
    root.mkdir(parents=True, exist_ok=True)
    return root
