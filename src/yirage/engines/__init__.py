"""Engines: what users call (``yr.LLM``); they drive models through the runtime."""

import atexit as _atexit
import gc as _gc


def freeze_loaded_objects() -> None:
    """Move every Python object alive now into the collector's permanent generation
    (``gc.freeze``), once a model has loaded: the modules, classes and tensors of torch,
    transformers and the model live as long as the process, and a full collection walked all of
    them (about 230,000 objects, 100 ms) whenever one came due, in the middle of a call: a first
    ``encode`` that built plans ran one. Objects made later are collected as usual; acyclic
    garbage among the frozen ones is still freed by reference counting. vLLM's engine freezes its
    heap after start-up for the same reason. At exit they are handed back (``gc.unfreeze``), so
    that the interpreter's last collections free them as before (nanobind, under Triton,
    reported every frozen binding as leaked otherwise)."""
    global _unfreeze_registered
    if not _unfreeze_registered:
        _atexit.register(_gc.unfreeze)
        _unfreeze_registered = True
    _gc.freeze()


_unfreeze_registered = False
