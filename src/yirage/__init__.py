"""yirage: a compiler and runtime for tensor programs and LLM inference.

    import yirage as yr
    yr.get_available_backends(); yr.set_backend("auto")
    g = yr.new_kernel_graph(); ...; g(inputs=[...])
    llm = yr.LLM("smollm2-135m-instruct"); print(llm.generate("Hi").text)

This module only re-exports the public API; nothing else lives here.
"""
from .config import configure_logging as _configure_logging
from .dtypes import DType, bfloat16, float16, float32, int32, int64, q4_1, q8_0
from .errors import (BackendUnavailableError, CacheError, GenerationError, GraphError,
                     IndexOutOfRangeError, ModelLoadError, ToolchainError, YirageError)
from .backends import (Backend, BackendInfo, MemoryInfo, get_available_backends, get_backend,
                       get_backend_info, get_memory_info, is_backend_available, set_backend)
from .ir.graph import DTensor
from .kernel import KNGraph, new_kernel_graph

#: The runnable kernel graph (``yr.new_kernel_graph()`` returns one); the IR class it extends
#: is ``yirage.ir.graph.KernelGraph``.
KernelGraph = KNGraph

__version__ = "0.1.0"

_configure_logging()


def __getattr__(name):
    # The LLM engine pulls in transformers; import it only when asked for.
    if name in ("LLM", "GenerationResult"):
        from .engines import generate
        return getattr(generate, name)
    raise AttributeError(f"module 'yirage' has no attribute {name!r}")


__all__ = [
    "Backend", "BackendInfo", "MemoryInfo", "BackendUnavailableError", "GenerationError",
    "ModelLoadError", "ToolchainError", "YirageError", "GraphError", "IndexOutOfRangeError", "CacheError",
    "DType", "DTensor", "KernelGraph", "KNGraph",
    "LLM", "GenerationResult", "new_kernel_graph", "get_available_backends", "get_backend",
    "get_backend_info", "get_memory_info", "is_backend_available", "set_backend",
    "float32", "float16", "bfloat16", "int32", "int64", "q4_1", "q8_0",
]
