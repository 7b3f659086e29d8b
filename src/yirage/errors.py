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


class GraphError(YirageError, ValueError):
    """A kernel graph is built or called wrongly: a bad dim, shape, dtype or attribute, or
    input tensors that do not match the declared inputs. The message names the op (or the
    input) and the rule broken. Also a ValueError, for code that catches that."""


class IndexOutOfRangeError(YirageError, IndexError):
    """A run-time index (token id, RoPE/attention position, KV-cache row) lies outside the
    buffer it indexes. Kernels check before any read or write; the message names the op,
    the value and the valid range. Also an IndexError."""


class CacheError(YirageError):
    """No usable on-disk cache: neither the configured cache directory (``YIRAGE_CACHE_DIR``,
    else ``~/.cache/yirage``) nor the per-user fallback in the temporary directory can be
    created and written, or a cache entry cannot be written or repaired. The message names
    the directory and says to point ``YIRAGE_CACHE_DIR`` at a writable directory."""


class BenchmarkError(YirageError, ValueError):
    """Bad arguments to ``yr.benchmark_backends`` / ``yirage benchmark``: an unknown op, dtype or
    quantization type, a size that is not a positive integer, both ``iterations`` and
    ``duration_seconds``, a dtype a named backend cannot hold; or a plot that cannot be drawn
    (matplotlib missing: ``pip install 'yirage[plot]'``). The message names the argument and
    what is allowed. Also a ValueError."""


class ConfigError(YirageError):
    """The user config file (``$XDG_CONFIG_HOME/yirage/config.json``, see ``yirage.config``)
    cannot be read, is malformed (not JSON, not an object, a setting of the wrong type) or
    cannot be written. The message names the file and says how to repair it (``yirage set
    --unset``, or edit or delete the file)."""


class TorchCompileError(YirageError):
    """The torch.compile front end (``yirage.dynamo``: ``torch.compile(m, backend="yirage")``,
    ``yr.compile``, ``yr.explain``) was asked for something it cannot do: an unknown ``mode``, an
    unknown option or an option of the wrong type (the message names the valid ones); with
    ``fallback="raise"``, a partition that could not be lowered, compiled or run, or a graph
    that needs gradients; with ``verify=True``, a first call whose outputs differ from eager
    (the message names the output and the error). Raised inside torch.compile, dynamo wraps it
    in its ``BackendCompilerFailed``, whose message carries this one."""


class DistributedError(YirageError):
    """Tensor parallelism across processes (``yirage.runtime.distributed``, ``yr.LLM(...,
    tensor_parallel_size=N)``) failed or was set up wrongly: a rank, world size or address that
    is not valid, a process group that could not form within its timeout, a collective that failed
    or timed out because a peer rank died or hung (the message names the rank that saw it and,
    where known, the rank that failed), or ranks that disagree on the model or the world size."""


class YirageFallbackWarning(UserWarning):
    """The torch.compile front end runs something in torch instead of yirage that it was
    asked to compile: a partition that failed to lower, compile or run (``fallback="eager"``),
    a graph that needs gradients, or ops with dynamic shapes. One warning per occurrence,
    naming the ops and the reason; ``yr.explain`` lists them too. Filter it with
    ``warnings.filterwarnings("ignore", category=yr.YirageFallbackWarning)``."""


class EmulatedPrecisionWarning(UserWarning):
    """A precision the user asked for has no hardware dot product on this CPU (bfloat16 without
    AMX-BF16, AVX512-BF16 or AVX-NE-CONVERT; int8 without VNNI; Arm without bf16 / dotprod), so
    yirage emulates it (converts to float32, or widens the integers) and runs it as asked. One
    warning per process and precision, saying what it measured against float32 here.
    ``yr.auto_configure_backend`` and ``yirage optimize`` never recommend such a precision."""
