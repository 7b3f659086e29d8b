"""The torch.compile front end: ``torch.compile(model, backend="yirage")``, ``yr.compile``,
``yr.explain``.

    import torch, yirage as yr
    m = yr.compile(model)                       # or torch.compile(model, backend="yirage")
    with torch.no_grad():
        y = m(x)
    print(yr.explain(model, x))                 # partitions, and why each torch op stayed

Dynamo captures FX graphs; AOTAutograd turns them into core-ATen inference graphs
(compiler.py); the lowering table (lowering.py) says which ATen ops become yirage IR; the
partitioner (partition.py) groups those into partitions, each compiled as a ``KNGraph`` (a
µGraph) for the chosen backend, and leaves the rest as torch ops in the same GraphModule.

The name "yirage" reaches torch through the ``torch_dynamo_backends`` entry point of the
installed package (no import needed); ``register()`` adds it by hand (``import yirage``
calls it when ``torch._dynamo`` is already loaded, and importing this package does).

This package must never import anything above it (engines, models, the CLI); and this
``__init__`` stays light: the compiler modules load on first use.
"""
from __future__ import annotations

import sys


def backend(gm, example_inputs, mode: str | None = None, options: dict | None = None):
    """torch.compile's "yirage" backend: dynamo calls it with each captured FX graph and its
    example inputs and runs what it returns. ``mode``/``options``: see ``compile``. Raises
    TorchCompileError for bad options (dynamo wraps it in ``BackendCompilerFailed``)."""
    from .compiler import backend as _backend
    return _backend(gm, example_inputs, mode=mode, options=options)


def compile(model, mode: str | None = None, options: dict | None = None, **torch_compile_kwargs):  # noqa: A001
    """``torch.compile(model, backend=<yirage>)``: PyTorch inference through yirage.

    Args:
        model: a ``torch.nn.Module`` or a function of tensors.
        mode: None (the fixed fusion of each partition); "reduce-overhead" (plan reuse: each
            partition keeps its bound plan between calls with the same input tensors, as None
            does on the CPU; GPU backends capture it after a few calls); "max-autotune"
            (``superoptimize`` each partition within ``options["time_budget_s"]``).
        options: a dict with any of
            ``backend`` (a yirage backend name; default ``yr.get_backend()``),
            ``dtype`` (None, or "bfloat16": the GEMMs of float32 linear layers compute in
            bfloat16; see ``options.CompileOptions``),
            ``min_block_size`` (int >= 1, default 2: smaller partitions stay torch),
            ``torch_executed_ops`` (ATen op names such as "aten.gelu" that always run in torch),
            ``fallback`` ("eager", default: a partition that fails runs in torch with one
            ``YirageFallbackWarning``; "raise": TorchCompileError),
            ``verify`` (bool: compare the first call of each graph with eager),
            ``cache_dir`` (where compiled kernels go), ``time_budget_s`` (max-autotune's budget
            per partition, default 10), ``freeze`` (bool, default True: the parameters and
            buffers are constant weights the backend may keep prepacked).
        torch_compile_kwargs: passed to ``torch.compile`` (``fullgraph``, ``dynamic``, ...).
            ``dynamic`` keeps torch's default, None: the first shape compiles statically,
            and the first call with another shape recompiles once with the changed dims
            symbolic (dynamo's automatic dynamic shapes), after which new sizes reuse that
            graph. ``dynamic=True`` makes every dim symbolic from the first call;
            ``dynamic=False`` compiles each shape anew (up to dynamo's recompile limit).
            With symbolic dims each yirage partition is compiled per concrete input
            signature on first use, and its C++ takes row counts and widths at run time,
            so a new sequence length normally costs no C++ build (see partition.py).
            ``isolate_recompiles`` defaults to True where torch has it (``own_recompiles``).

    Returns, for an ``nn.Module``, a ``PrecompiledModule`` (precompile.py): its first call
    loads the model's graph precompiled by an earlier process (dynamo's bytecode and guards and
    yirage's partitions, checked against the model's source and this call's arguments), or
    compiles and stores it, so that a second process skips dynamo's tracing and AOTAutograd;
    a model that cannot be precompiled (graph breaks, hooks, ...) and calls whose arguments
    fail its guards run through plain ``torch.compile``. For a function, what
    ``torch.compile`` returns. Inference only: a graph that needs gradients runs eager with
    one warning (see yirage/dynamo/compiler.py).

    Raises:
        TorchCompileError: an unknown mode or option key (the message lists the valid ones) or
            a bad option value, checked here before anything compiles.
    """
    import torch
    from .compiler import YirageBackend, own_recompiles
    backend = YirageBackend(mode, options)
    torch_compile_kwargs = {**own_recompiles(), **torch_compile_kwargs}
    if isinstance(model, torch.nn.Module):
        from .precompile import PrecompiledModule
        return PrecompiledModule(model, backend, **torch_compile_kwargs)
    return torch.compile(model, backend=backend, **torch_compile_kwargs)


def explain(model, *inputs, mode: str | None = None, options: dict | None = None, **kwargs):
    """Compile ``model`` for yirage, run it once on ``inputs`` under ``torch.no_grad()`` and
    return an ``ExplainReport`` (partitions, their ops, every torch op and why it was not
    lowered; ``print`` it for a table). See yirage/dynamo/explain.py."""
    from .explain import explain as _explain
    return _explain(model, *inputs, mode=mode, options=options, **kwargs)


def register() -> None:
    """Register ``backend`` as torch.compile's "yirage" backend if torch does not know the
    name yet (it does when the package's entry point is installed). Imports torch._dynamo."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry
    if any(ep.name == "yirage" for ep in entry_points(group="torch_dynamo_backends")):
        return   # torch loads the installed entry point itself (registering here too is a duplicate)
    if "yirage" not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=backend, name="yirage")


if "torch._dynamo" in sys.modules:
    register()
