"""Exceptions that yirage raises on bad input or a missing capability.

Every error says what is wrong and what to do about it; the CLI prints ``str(error)``
as one line. This module must never import torch or anything heavy.
"""


class YirageError(Exception):
    """Base class of every error yirage raises on purpose."""


class BackendUnavailableError(YirageError):
    """A backend name is unknown, or the backend's runtime/hardware is missing.

    The message names the backend, says why it is unavailable and lists the
    available backends. yirage never replaces the requested backend silently.
    """


class ToolchainError(YirageError):
    """The C++ compiler is missing or failed to build a generated kernel."""


class ModelLoadError(YirageError):
    """A model name, file or directory cannot be resolved or parsed."""


class GenerationError(YirageError):
    """Bad generation arguments: prompt too long, non-positive token counts, ..."""
