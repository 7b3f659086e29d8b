"""yirage: a compiler and runtime for tensor programs and LLM inference.

    import yirage as yr
    yr.get_available_backends(); yr.set_backend("auto")
    g = yr.new_kernel_graph(); ...; g(inputs=[...])
    llm = yr.LLM("smollm2-135m-instruct"); print(llm.generate("Hi").text)

This module only re-exports the public API (and registers torch.compile's "yirage" backend
when torch._dynamo is already loaded); nothing else lives here. The exports load on
first use (PEP 562), so ``import yirage`` and the ``yirage`` command start without torch:
the CLI can then answer ``--help`` at once and turn a Ctrl-C during start-up into one line.
"""
import importlib
import sys as _sys

from .config import apply_isa_cap as _apply_isa_cap
from .config import configure_logging as _configure_logging

# YIRAGE_ISA's cap of torch's vendor libraries, before anything here can start them
_apply_isa_cap()

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(["DType", "bfloat16", "float16", "float32", "int8", "int32", "int64", "q4_1", "q8_0", "q4_0", "q5_0",
                     "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs", "bool_"], "yirage.dtypes"),
    **dict.fromkeys(["BackendUnavailableError", "BenchmarkError", "CacheError", "ConfigError", "EmulatedPrecisionWarning", "GenerationError", "GraphError",
                     "IndexOutOfRangeError", "ModelLoadError", "ToolchainError", "TorchCompileError", "YirageError",
                     "YirageFallbackWarning"],
                    "yirage.errors"),
    **dict.fromkeys(["Backend", "BackendInfo", "MemoryInfo", "get_available_backends", "get_backend",
                     "get_backend_info", "get_memory_info", "is_backend_available", "set_backend"],
                    "yirage.backends"),
    "DTensor": "yirage.ir.graph",
    **dict.fromkeys(["TBGraph", "STensor", "new_threadblock_graph"], "yirage.ir.threadblock"),
    **dict.fromkeys(["KNGraph", "new_kernel_graph"], "yirage.kernel"),
    "PersistentKernel": "yirage.persistent_kernel",
    **dict.fromkeys(["LLM", "GenerationResult"], "yirage.engines.generate"),
    "EmbeddingModel": "yirage.engines.embed",
    **dict.fromkeys(["auto_configure_backend", "BackendOptimizer"], "yirage.tools.optimize"),
    "benchmark_backends": "yirage.tools.benchmark",
    **dict.fromkeys(["compile", "explain"], "yirage.dynamo"),
}
_ALIASES = {
    # The runnable kernel graph (``yr.new_kernel_graph()`` returns one); the IR class it
    # extends is ``yirage.ir.graph.KernelGraph``.
    "KernelGraph": "KNGraph",
    # torch's spelling of the bool dtype (yirage.dtypes cannot name a module global ``bool``)
    "bool": "bool_",
}

__all__ = sorted([*_EXPORTS, *_ALIASES])

_configure_logging()

# torch.compile's "yirage" backend comes from the installed entry point; a source tree that is
# not installed gets it here when torch._dynamo is already loaded (never loaded for this).
# By name, like the exports: the modules below this one import ``yirage`` for its version.
if "torch._dynamo" in _sys.modules:
    importlib.import_module("yirage.dynamo").register()


def __getattr__(name: str):
    target = _ALIASES.get(name, name)
    if target not in _EXPORTS:
        raise AttributeError(f"module 'yirage' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[target]), target)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
