"""Precompiled models: a second process runs ``yr.compile(model)`` without dynamo's tracing.

``torch.compile`` traces a model's Python (dynamo) and runs AOTAutograd in every process,
whatever its backend caches: on BERT-base that is 2-3 s before yirage's part starts, and
torch keeps no cross-process cache of it for a backend other than Inductor. ``yr.compile``
therefore returns a ``PrecompiledModule``, whose first call

1. computes a key (the model's class, its parameters' and buffers' names, shapes and dtypes,
   the input signature, grad mode, the options, the backend, the versions of Python, torch
   and yirage, a digest of the source of yirage's rewrites, lowering and partitioning, and
   this format) and looks for ``<cache dir>/dynamo/precompiled/<key>.pt2``;
2. on a hit, loads it: dynamo's compiled bytecode and guards and yirage's ATen inference
   graph (re-partitioned; each partition is a hit in the partition cache, cache.py, and its
   C++ in the kernel cache). The entry is used only when all of these hold, otherwise the
   model is compiled afresh and the entry rewritten:
   - its checksum;
   - every source file dynamo traced code from is unchanged (SHA-256 of each file);
   - dynamo's guards pass on this call's arguments (shapes, dtypes, strides, module
     attributes such as ``training``, grad mode);
   - the guards torch cannot serialize (identity of functions, closures and builtins) are
     replaced by checks of the object found now: the same module, qualified name and code
     digest, or the same constant; so is the type of a module with parametrizations (weight
     norm), whose class ``torch.nn.utils.parametrize`` makes anew in every process: checked
     by the class it parametrizes;
3. on a miss, compiles the model with torch's experimental ``aot_compile_fullgraph`` (one
   dynamo trace of the whole forward, then the ``YirageBackend``, whose forward compiler
   returns a serializable ``YirageOutputCode``) and stores the entry.

The model runs in one graph or not at all in this path: a model with graph breaks, forward
hooks, a need for gradients, or a guard or global that cannot be recorded is "declined" (the
reason is logged at DEBUG and kept in ``PrecompiledModule.precompile_status``) and runs through
plain ``torch.compile(model, backend=YirageBackend(...))``, as before. Calls whose arguments
fail the precompiled guards (another shape, train mode) run through that same plain
``torch.compile`` (dynamo's automatic dynamic shapes apply there).

What is not guarded across processes, as in torch's own precompile: globals the model's code
reads at module level (dynamo's global guards are dropped; a changed source is caught).

``stats()`` counts hits, misses, stores, rejected entries and declined models in this process.

This module must never decide what lowers or how a partition compiles (partition.py does).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import importlib
import os
import pickle
import platform
import tempfile
import threading
import types
from pathlib import Path
from typing import Any

import torch

from ..config import cache_subdir, logger
from ..errors import TorchCompileError, YirageError

FORMAT = 1

_STATS = {"hits": 0, "misses": 0, "stores": 0, "rejected": 0, "declined": 0}


def stats() -> dict[str, int]:
    """This process's counts: ``hits`` (entries loaded and used), ``misses`` (no usable
    entry: compiled here), ``stores``, ``rejected`` (an entry present but damaged, stale or
    failing its checks: compiled afresh) and ``declined`` (models run through plain
    torch.compile instead); a copy."""
    return dict(_STATS)


def reset_stats() -> None:
    """Set every count of ``stats()`` back to zero."""
    for k in _STATS:
        _STATS[k] = 0


class Declined(Exception):
    """The model cannot be precompiled (the message says why); it runs through plain
    ``torch.compile``."""


# ---- the backend's serializable forward -------------------------------------------------

def _output_code_base():
    from torch._inductor.output_code import OutputCode
    return OutputCode


def in_aot_compile() -> bool:
    """Whether the backend runs under torch's ``aot_compile_fullgraph`` (which asks for a
    serializable forward: it turns on AOTAutograd's bundled cache)."""
    return bool(torch._functorch.config.bundled_autograd_cache)


def output_code(module, run, options):
    """A ``YirageOutputCode`` (an Inductor ``OutputCode``, the type AOTAutograd's bundled cache
    serializes) that runs ``run`` (``module``'s forward, or it checked against eager) and
    serializes ``module`` (the partitioned ATen inference graph ``partition.lower_graph``
    returned)."""
    code = _yirage_output_code_class()(module=module, options=options, run=run)
    code._boxed_call = True   # an instance attribute: AOTAutograd's wrappers copy __dict__
    return code


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A node's ``meta["val"]`` (a fake tensor of static shape) as stored: much cheaper to
    store and rebuild than the fake tensor itself (a few microseconds against half a
    millisecond each through ``GraphPickler``)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str

    @staticmethod
    def of(value):
        """The spec of a static-shaped tensor (or a tuple/list of them), else None."""
        if isinstance(value, (tuple, list)):
            specs = [TensorSpec.of(v) for v in value]
            return None if any(s is None for s in specs) else tuple(specs)
        if not isinstance(value, torch.Tensor) or any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride())):
            return None
        return TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype, str(value.device))

    @staticmethod
    def make(spec, mode):
        """The fake tensor(s) of ``spec`` (a ``TensorSpec`` or a tuple of them) in fake ``mode``."""
        from torch._subclasses.fake_tensor import FakeTensor
        if isinstance(spec, tuple):
            return tuple(TensorSpec.make(s, mode) for s in spec)
        meta = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")
        return FakeTensor(mode, meta, torch.device(spec.device))   # as FakeTensorMode.from_tensor makes one


_DROPPED_META = ("nn_module_stack", "source_fn_stack", "example_value", "stack_trace", "from_node", "seq_nr")


def _copy_for_storage(gm):
    """A copy of ``gm``'s graph (its own nodes and meta dicts) as a new GraphModule over the
    same attributes, its node values as ``TensorSpec`` where static, and its debug meta
    dropped."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        for k in _DROPPED_META:
            node.meta.pop(k, None)
        spec = TensorSpec.of(node.meta.get("val"))
        if spec is not None:
            node.meta["val"] = spec
    return torch.fx.GraphModule(gm, graph)


def _thaw(gm, mode) -> None:
    """Turn the ``TensorSpec`` values of ``gm``'s nodes back into fake tensors."""
    for node in gm.graph.nodes:
        v = node.meta.get("val")
        if isinstance(v, TensorSpec) or (isinstance(v, tuple) and v and all(isinstance(x, TensorSpec) for x in v)):
            node.meta["val"] = TensorSpec.make(v, mode)


_OUTPUT_CODE_CLASS = None


def _yirage_output_code_class():
    global _OUTPUT_CODE_CLASS
    if _OUTPUT_CODE_CLASS is not None:
        return _OUTPUT_CODE_CLASS

    @dataclasses.dataclass
    class YirageOutputCode(_output_code_base()):
        """yirage's compiled ATen inference graph as AOTAutograd's forward (boxed call: a list
        of input tensors, in the graph's placeholder order; returns its outputs).

        Stored as the partitioned graph with each partition as its torch ops (``torch.fx``'s
        ``GraphPickler``; node values as ``TensorSpec``) and each partition's constant and
        static input positions; ``post_compile`` (after loading) rebuilds the partitions
        (``partition.restore_partitions``), each a hit in the compile cache."""

        module: Any = None
        options: Any = None
        run: Any = None
        _serialized: bytes | None = None
        _layout: dict | None = None

        def __call__(self, inputs):
            return self.run(*inputs)

        def prepare_for_serialization(self) -> None:
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            from torch.fx._graph_pickler import GraphPickler, Options

            from .partition import YiragePartition
            top = _copy_for_storage(self.module)
            layout = {}
            for name, part in self.module.named_children():
                if isinstance(part, YiragePartition):
                    setattr(top, name, _copy_for_storage(part.torch_module))
                    layout[name] = (list(part.constant_positions), sorted(part.static_positions))
            # real tensors: a model's folded constants pickle as host copies, which on a GPU is a
            # device-to-host copy that an active fake mode (torch's AOT compile) would refuse
            with unset_fake_temporarily():
                self._serialized = GraphPickler.dumps(top, Options(ops_filter=None))
            self._layout = layout
            self.module = self.run = None

        def post_compile(self, *args, **kwargs) -> None:
            if self.run is not None or self._serialized is None:
                return
            from torch._subclasses import FakeTensorMode
            from torch.fx._graph_pickler import GraphPickler
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            from .partition import restore_partitions
            mode = FakeTensorMode(shape_env=ShapeEnv())
            gm = GraphPickler.loads(self._serialized, mode)
            for m in (gm, *(getattr(gm, name) for name in self._layout)):
                _thaw(m, mode)
                m.recompile()
            restore_partitions(gm, self.options, self._layout)
            self.module, self.run = gm, gm.forward

        def set_triton_bundle(self, triton_bundle) -> None:
            pass

    YirageOutputCode.__module__ = __name__
    YirageOutputCode.__qualname__ = "YirageOutputCode"
    globals()["YirageOutputCode"] = _OUTPUT_CODE_CLASS = YirageOutputCode
    return YirageOutputCode


def __getattr__(name: str):
    # pickle finds the class by name: define it on first use (it subclasses an Inductor type,
    # which this module does not import at load)
    if name == "YirageOutputCode":
        return _yirage_output_code_class()
    raise AttributeError(name)


# ---- fingerprints of what torch cannot serialize -----------------------------------------

def _code_digest(code: types.CodeType) -> str:
    """SHA-256 of a code object's bytecode, names and constants (nested code by its digest).
    Not ``marshal``: its output depends on reference counts, so it differs between processes."""
    h = hashlib.sha256(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_argcount,
                   code.co_kwonlyargcount, code.co_flags, code.co_qualname)).encode())
    for c in code.co_consts:
        h.update(_code_digest(c).encode() if isinstance(c, types.CodeType) else repr(c).encode())
    return h.hexdigest()


def fingerprint(value) -> tuple | None:
    """A picklable stand-in for ``value`` that another process can compare with the object it
    finds: constants by value; tuples, lists and dicts (string or integer keys) by their items;
    functions by module, qualified name and code digest, code by digest, builtins, classes
    and modules by name, a transformers model config by class and content
    (``_config_fingerprint``). None when ``value`` (or an item of it) has none."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return ("const", type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        parts = [fingerprint(v) for v in value]
        return None if any(p is None for p in parts) else (type(value).__name__, tuple(parts))
    if type(value) is dict and all(isinstance(k, (str, int)) for k in value):
        parts = sorted((fingerprint(k), fingerprint(v)) for k, v in value.items())
        return None if any(p is None for _, p in parts) else ("dict", tuple(parts))
    if isinstance(value, types.FunctionType):
        return ("function", value.__module__, value.__qualname__, _code_digest(value.__code__))
    if isinstance(value, types.CodeType):
        return ("code", _code_digest(value))
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, type) and _parametrized_class(value):
        base = value.__bases__[0]
        return ("parametrized class", base.__module__, base.__qualname__)
    if isinstance(value, (types.BuiltinFunctionType, type)):
        return ("name", getattr(value, "__module__", None), getattr(value, "__qualname__", None))
    if isinstance(value, types.UnionType):     # a field's type: int | None
        return ("union", repr(value))
    if isinstance(value, dataclasses.Field):   # a config class's field, held by its validators
        default = ("missing",) if value.default is dataclasses.MISSING else fingerprint(value.default)
        return None if default is None else ("field", value.name, str(value.type), default)
    return _config_fingerprint(value)


def _parametrized_class(cls: type) -> bool:
    """Whether ``cls`` is a class ``torch.nn.utils.parametrize`` created (``Parametrized<Base>``,
    one per module and process, subclassing the module's own class)."""
    return (cls.__module__ == "torch.nn.utils.parametrize" and cls.__name__.startswith("Parametrized")
            and len(cls.__bases__) == 1 and issubclass(cls, torch.nn.Module))


def _parametrized(value) -> bool:
    """Whether ``value`` is a module with parametrizations (weight norm: wav2vec2's positional
    convolution)."""
    return isinstance(value, torch.nn.Module) and _parametrized_class(type(value))


def _config_fingerprint(value) -> tuple | None:
    """A transformers ``PretrainedConfig`` by class and content (``to_json_string``: every
    field, defaults included), or None for anything else. Encoder-decoder models (BART, T5)
    hand ``self.config`` to helpers that dynamo inlines, and it guards the object's identity:
    an equal config in another process makes the same trace (the values dynamo read from it
    are guarded as well, as checks under it)."""
    cls = type(value)
    if not any(c.__name__ in ("PretrainedConfig", "PreTrainedConfig") and c.__module__.startswith("transformers.")
               for c in cls.__mro__):
        return None
    try:
        text = value.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 - a config with a field JSON cannot hold: no fingerprint
        return None
    return ("hf-config", cls.__module__, cls.__qualname__, hashlib.sha256(text.encode()).hexdigest())


class GuardFilter:
    """Dynamo's ``guard_filter_fn`` for a precompiled graph. It keeps every local guard torch
    can serialize and drops global guards (torch's own policy for ``aot_compile``). A local
    guard torch cannot serialize (identity of a function, closure or builtin), and every guard
    on a value reached through one, becomes a ``check``: the guard's source expression and the
    ``fingerprint`` of its value, compared with the object found in the loading process.

    ``unsupported`` holds the names of guards that have no fingerprint (the model is then
    declined)."""

    def __init__(self):
        self.checks: list[tuple[str, tuple]] = []
        self.unsupported: list[str] = []

    def __call__(self, entries) -> list[bool]:
        from torch._dynamo.guards import CheckFunctionManager
        bad = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
        roots = [e.name for e in entries
                 if not e.is_global and (e.guard_type in bad or bad & set(e.derived_guard_types))]
        keep = []
        for e in entries:
            if e.guard_type == "TYPE_MATCH" and not e.is_global and e.has_value and _parametrized(e.value):
                # the class torch.nn.utils.parametrize made for this module exists in this
                # process only: its type is checked by the class it parametrizes
                self.checks.append((f"type({e.name})", fingerprint(type(e.value))))
                keep.append(False)
                continue
            under = any(e.name == r or e.name.startswith((r + ".", r + "[")) for r in roots)
            if under and not e.is_global:
                fp = fingerprint(e.value) if e.has_value else None
                if fp is None:
                    self.unsupported.append(e.name)
                else:
                    self.checks.append((e.name, fp))
            keep.append(not (under or e.is_global))
        return keep


def failed_check(checks, f_locals: dict) -> str | None:
    """The first ``GuardFilter`` check that the objects reached from ``f_locals`` (the traced
    function's arguments and closure variables by name) now fail (its source expression, as
    dynamo names it: ``self._modules['encoder'].__class__``), or None when all pass."""
    from torch._dynamo.guards import _get_closure_vars
    scope = {**_get_closure_vars(), **f_locals}
    for name, fp in checks:
        try:
            value = eval(name, scope)  # noqa: S307 - dynamo's own guard source expression
        except Exception:  # noqa: BLE001 - not reachable now: the check fails
            return name
        if fingerprint(value) != fp:
            return name
    return None


# ---- the entry ---------------------------------------------------------------------------

def traced_function(model: torch.nn.Module) -> types.FunctionType:
    """The function dynamo traces for ``model`` (its forward, unbound)."""
    from torch._dynamo.convert_frame import get_traced_fn
    return get_traced_fn(model.forward)[0]


def closure_data(fn: types.FunctionType) -> dict[str, object]:
    """The functions and classes in ``fn``'s closure (a decorated forward's wrapped function),
    which pickle cannot store by name: passed by reference when saving and loading."""
    out = {}
    for i, cell in enumerate(fn.__closure__ or ()):
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if isinstance(v, (types.FunctionType, type)):
            out[f"closure_{i}"] = v
    return out


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def installed_globals(env, f_globals: dict) -> dict[str, tuple]:
    """The globals dynamo installed in the traced function's module for the compiled bytecode
    (names starting with "__", such as ``___module_collections_<id>``; the loading process does
    not have them) that torch does not record itself: name -> ("module", name) or ("object",
    module, qualname). The model's own globals are found in its module when loading. Raises
    Declined for one that cannot be found again by name."""
    out = {}
    for ref in sorted(env.external_refs):
        if (not ref.startswith("__") or ref in env.used_globals or ref in env.import_sources
                or ref.startswith("__compiled_fn_") or ref not in f_globals):
            continue
        v = f_globals[ref]
        if isinstance(v, types.ModuleType):
            out[ref] = ("module", v.__name__)
        elif isinstance(v, (types.FunctionType, type, types.BuiltinFunctionType)) and \
                _safe_resolve(v.__module__, v.__qualname__) is v:
            out[ref] = ("object", v.__module__, v.__qualname__)
        else:
            raise Declined(f"the compiled code reads a global ({ref}) that cannot be stored")
    return out


def _safe_resolve(module: str, qualname: str):
    try:
        return _resolve(module, qualname)
    except Exception:  # noqa: BLE001
        return None


#: the ``InlinedSource.module`` prefix of a source recorded as a whole file (``_file_sources``)
FILE_SOURCE = "file:"


def _file_digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def sources_changed(source_info) -> str | None:
    """The first source file (or, as torch records them, function: ``module:first-last``)
    that dynamo traced and that differs now, or None."""
    from torch._dynamo.package import _hash_sourcelines
    for s in source_info.inlined_sources:
        if s.module.startswith(FILE_SOURCE):
            if _file_digest(s.module[len(FILE_SOURCE):]) != s.checksum:
                return s.module[len(FILE_SOURCE):]
            continue
        try:
            now = _hash_sourcelines(importlib.import_module(s.module), s.firstlineno, s.lastlineno)
        except Exception:  # noqa: BLE001 - a module that cannot be read again: changed
            now = None
        if now != s.checksum:
            return f"{s.module}:{s.firstlineno}-{s.lastlineno}"
    return None


def _file_sources():
    """A replacement for torch's ``SourceInfo.add_code`` while yirage precompiles: each traced
    code object's whole source file is recorded by its SHA-256 (``FILE_SOURCE`` + path),
    instead of torch's per-function line ranges, which tokenize every function (0.4 s on
    BERT-base) and store each module's whole text in the entry (3 MB). Coarser: any change to
    a file the model's code runs through invalidates the entry. Code without a source file
    (generated code) is skipped, as torch skips it."""
    from torch._dynamo.package import InlinedSource
    digests: dict[str, str | None] = {}

    def add_code(self, code) -> None:
        path = code.co_filename
        if path not in digests:
            digests[path] = _file_digest(path) if os.path.isfile(path) else None
        if digests[path] is not None:
            self.inlined_sources.add(InlinedSource(module=FILE_SOURCE + path, firstlineno=0, lastlineno=0,
                                                   checksum=digests[path], content=""))
    return add_code


def _tree_signature(x) -> object:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), tuple(x.stride()), str(x.dtype), str(x.device), x.requires_grad)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_tree_signature(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((str(k), _tree_signature(v)) for k, v in x.items()))
    if x is None or isinstance(x, (bool, int, float, str)):
        return ("const", type(x).__name__, x)
    return ("object", type(x).__module__, type(x).__qualname__)


def key(model: torch.nn.Module, args: tuple, kwargs: dict, options, backend: str, dynamic) -> str:
    """The entry key of ``model`` called with ``args``/``kwargs`` (see the module docstring).
    With ``dynamic=True`` the input sizes are left out (the graph is symbolic)."""
    from .. import __version__
    cls = type(model)
    params = [(n, tuple(p.shape), str(p.dtype), str(p.device), p.requires_grad)
              for n, p in model.named_parameters()]
    buffers = [(n, tuple(b.shape), str(b.dtype), str(b.device)) for n, b in model.named_buffers()]
    sig = _tree_signature((args, kwargs))
    if dynamic is True:
        sig = _strip_sizes(sig)
    # options in field order, sets sorted: a frozenset's repr follows string hashing, which
    # differs from process to process
    opts = tuple(sorted(v) if isinstance(v, frozenset) else v
                 for v in (getattr(options, f.name) for f in dataclasses.fields(options)))
    parts = repr((FORMAT, cls.__module__, cls.__qualname__, params, buffers, sig, torch.is_grad_enabled(),
                  torch.is_inference_mode_enabled(), opts, backend, dynamic,
                  __version__, torch.__version__, platform.python_version(), _front_end_digest()))
    return hashlib.sha256(parts.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _front_end_digest() -> str:
    """SHA-256 of the source of the modules that decide the stored graph: its rewrites, what
    lowers and how it is partitioned. An entry stored by other code (a yirage checkout between
    versions) is compiled afresh, not loaded with the old rewrites and partitions."""
    from . import compiler, lowering, lowering_conv, partition, specialize
    h = hashlib.sha256()
    for mod in (compiler, lowering, lowering_conv, partition, specialize):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()


def _strip_sizes(sig):
    if isinstance(sig, tuple) and sig and sig[0] == "tensor":
        return ("tensor", len(sig[1]), sig[3], sig[4], sig[5])
    if isinstance(sig, tuple):
        return tuple(_strip_sizes(s) for s in sig)
    return sig


def entry_path(k: str, options) -> Path:
    """Where the entry of key ``k`` lives: ``<cache dir>/dynamo/precompiled/<k>.pt2``
    (``options.cache_dir`` overrides the cache dir). Raises CacheError when none is usable."""
    if options.cache_dir is not None:
        d = Path(options.cache_dir) / "dynamo" / "precompiled"
    else:
        d = cache_subdir("dynamo") / "precompiled"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{k}.pt2"


def clear(cache_dir: str | None = None) -> int:
    """Delete every stored precompiled model (under ``cache_dir``, or the usual cache dir);
    returns how many. The next ``yr.compile`` of each model compiles and stores it again.
    Raises CacheError when no cache directory is usable."""
    from .options import CompileOptions
    d = entry_path("x", CompileOptions(cache_dir=cache_dir)).parent
    n = 0
    for path in d.glob("*.pt2"):
        path.unlink(missing_ok=True)
        n += 1
    return n


@dataclasses.dataclass
class Entry:
    """One precompiled model as stored: torch's serialized ``AOTCompiledFunction``, the
    globals it needs (``installed_globals``) and the ``GuardFilter`` checks."""

    aot: bytes
    installed: dict
    checks: list


def _write(path: Path, entry: Entry) -> None:
    body = pickle.dumps(dataclasses.asdict(entry), protocol=pickle.HIGHEST_PROTOCOL)
    blob = pickle.dumps({"format": FORMAT, "sha256": hashlib.sha256(body).hexdigest(), "body": body},
                        protocol=pickle.HIGHEST_PROTOCOL)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pt2")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read(path: Path) -> Entry:
    """The entry at ``path``. Raises FileNotFoundError when absent, ValueError when damaged."""
    blob = path.read_bytes()
    try:
        doc = pickle.loads(blob)   # noqa: S301 - our own cache directory, checksummed below
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("unknown format")
        body = doc["body"]
        if not isinstance(body, bytes) or hashlib.sha256(body).hexdigest() != doc.get("sha256"):
            raise ValueError("the payload does not match its sha256")
        return Entry(**pickle.loads(body))   # noqa: S301
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a damaged entry
        raise ValueError(f"{type(e).__name__}: {e}") from None


# ---- the module -------------------------------------------------------------------------

class PrecompiledModule(torch.nn.Module):
    """``yr.compile(model)``'s result for an ``nn.Module``: calls run a graph precompiled once
    per machine (see the module docstring), or plain ``torch.compile`` where that does not
    apply.

    Args:
        model: the module (registered as ``_orig_mod``, like ``torch.compile``'s result).
        backend: the ``YirageBackend`` both paths compile with.
        torch_compile_kwargs: for the plain ``torch.compile`` path (``dynamic``, ``fullgraph``,
            ...); ``dynamic`` is honoured by the precompiled path too.

    Attributes:
        precompile_status: "not called yet", "loaded <path>", "compiled and stored <path>",
            "compiled (not stored: <why>)" or "declined: <why>".

    Calls take and return what ``model`` does. Thread-safe: the first call is made once.
    """

    def __init__(self, model: torch.nn.Module, backend, **torch_compile_kwargs):
        super().__init__()
        self._orig_mod = model
        self.training = model.training   # as the model; train()/eval() on this module reach the model too
        object.__setattr__(self, "_yirage_backend", backend)
        object.__setattr__(self, "_dynamo", torch.compile(model, backend=backend, **torch_compile_kwargs))
        object.__setattr__(self, "_dynamic", torch_compile_kwargs.get("dynamic"))
        object.__setattr__(self, "_aot", None)
        object.__setattr__(self, "_first_done", False)
        object.__setattr__(self, "_first_lock", threading.Lock())
        self.precompile_status = "not called yet"

    def __getattr__(self, name: str):
        # the model's own attributes (``config``, ...), as torch.compile's OptimizedModule gives them
        try:
            return super().__getattr__(name)
        except AttributeError:
            mod = self.__dict__.get("_modules", {}).get("_orig_mod")
            if mod is None:
                raise
            return getattr(mod, name)

    def forward(self, *args, **kwargs):
        if not self._first_done:
            with self._first_lock, _gc_paused():
                if not self._first_done:
                    self._first_call(args, kwargs)
                    object.__setattr__(self, "_first_done", True)
                    return self._call(args, kwargs)
        return self._call(args, kwargs)

    def _call(self, args, kwargs):
        aot = self._aot
        if aot is not None and aot.guard_check(self._orig_mod, *args, **kwargs):
            return aot.fn(self._orig_mod, *args, **kwargs)
        return self._dynamo(*args, **kwargs)

    # ---- the first call -----------------------------------------------------------------
    def _first_call(self, args, kwargs) -> None:
        try:
            self._check_supported(args, kwargs)
            from ..backends import resolve_backend
            options = self._yirage_backend.options
            k = key(self._orig_mod, args, kwargs, options, resolve_backend(options.backend).value, self._dynamic)
            path = entry_path(k, options)
        except (Declined, YirageError, OSError) as e:
            return self._decline(str(e))
        if self._load(path, args, kwargs):
            return
        _STATS["misses"] += 1
        try:
            aot, guards = self._compile(args, kwargs)
        except Declined as e:
            return self._decline(str(e))
        object.__setattr__(self, "_aot", aot)
        try:
            self._store(path, aot, guards)
            self.precompile_status = f"compiled and stored {path}"
            _STATS["stores"] += 1
        except (Declined, OSError, RuntimeError, pickle.PicklingError, TypeError, AttributeError) as e:
            self.precompile_status = f"compiled (not stored: {e})"
            logger.debug("yirage precompile: %s", self.precompile_status)

    def _decline(self, why: str) -> None:
        _STATS["declined"] += 1
        self.precompile_status = f"declined: {why}"
        logger.debug("yirage precompile: %s; running through torch.compile", why)

    def _check_supported(self, args, kwargs) -> None:
        from torch.nn.modules import module as nn_module
        if not _has_aot_compile():
            raise Declined(f"torch {torch.__version__} has no aot_compile_fullgraph")
        m = self._orig_mod
        if m._forward_hooks or m._forward_pre_hooks or nn_module._global_forward_hooks or \
                nn_module._global_forward_pre_hooks:
            raise Declined("the model has forward hooks")
        from .compiler import needs_grad
        tensors = [p for p in m.parameters()] + [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        if needs_grad(tensors):
            raise Declined("the call needs gradients")
        import torch._inductor.config as inductor_config
        if inductor_config.force_disable_caches:
            raise Declined("torch._inductor.config.force_disable_caches is set")

    def _load(self, path: Path, args, kwargs) -> bool:
        """Use the entry at ``path`` if it passes every check; True when it did."""
        try:
            entry = _read(path)
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as e:
            return self._reject(path, f"damaged ({e})")
        from torch._dynamo.aot_compile import AOTCompiledFunction
        fn = traced_function(self._orig_mod)
        try:
            f_globals = dict(fn.__globals__)
            for name, ref in entry.installed.items():
                f_globals[name] = importlib.import_module(ref[1]) if ref[0] == "module" else _resolve(ref[1], ref[2])
            aot = AOTCompiledFunction.deserialize(entry.aot, f_globals=f_globals,
                                                  external_closure_data=closure_data(fn))
            aot.disable_guard_check()
        except Exception as e:  # noqa: BLE001 - a stale or damaged entry is compiled afresh
            return self._reject(path, f"cannot be loaded ({type(e).__name__}: {e})")
        changed = sources_changed(aot.source_info())
        if changed:
            return self._reject(path, f"the source of {changed} changed")
        f_locals = aot.prepare_f_locals(self._orig_mod, *args, **kwargs)
        failed = failed_check(entry.checks, f_locals)
        if failed:
            return self._reject(path, f"{failed} is not what it was")
        if not aot.guard_check(self._orig_mod, *args, **kwargs):
            return self._reject(path, "its guards fail on this call")
        object.__setattr__(self, "_aot", aot)
        self.precompile_status = f"loaded {path}"
        _STATS["hits"] += 1
        return True

    def _reject(self, path: Path, why: str) -> bool:
        _STATS["rejected"] += 1
        logger.debug("yirage precompile: entry %s %s; compiling afresh", path, why)
        return False

    def _compile(self, args, kwargs):
        from torch._dynamo.aot_compile import aot_compile_fullgraph
        from torch._dynamo.hooks import Hooks
        guards = GuardFilter()
        try:
            with _torch_precompile_patches():
                    aot = aot_compile_fullgraph(self._orig_mod.forward, (args, kwargs), hooks=Hooks(guard_filter_fn=guards),
                                            backend=self._yirage_backend, dynamic=self._dynamic)
        except TorchCompileError:
            raise
        except Exception as e:  # noqa: BLE001 - graph breaks, unserializable guards, ...: plain torch.compile
            cause = e.__cause__ if isinstance(e.__cause__, TorchCompileError) else None
            if cause is not None:
                raise cause from None
            text = str(e).strip()
            raise Declined(type(e).__name__ + (f": {text.splitlines()[0]}" if text else "")) from None
        if guards.unsupported:
            raise Declined(f"a guard that cannot be stored ({guards.unsupported[0]})")
        aot.disable_guard_check()
        return aot, guards

    def _store(self, path: Path, aot, guards: GuardFilter) -> None:
        from torch._dynamo.aot_compile import AOTCompiledFunction
        fn = traced_function(self._orig_mod)
        installed = installed_globals(aot._artifacts.runtime_env, fn.__globals__)
        data = AOTCompiledFunction.serialize(aot, closure_data(fn)).serialized_data
        _write(path, Entry(data, installed, guards.checks))


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off while a model's first call loads or compiles it
    (on again after, if it was on). Loading allocates many small objects, and with torch and
    transformers imported each full collection scans millions: 0.2 s of a BERT-base load."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _torch_precompile_patches():
    """While ``aot_compile_fullgraph`` runs for yirage (all three are torch internals; where
    one is missing, it is not patched):
    - AOTAutograd's cache key (Inductor's FX-graph hash, which imports Inductor's code
      generators: 1.5-2 s on BERT-base) is a nonce, as torch itself uses under ``aot_compile``
      when the key cannot be computed;
    - the bundled entry is not written to torch's own cache directory (it could never be found
      under a nonce; yirage stores the serialized function itself);
    - traced sources are recorded per file (``_file_sources``);
    - dynamo's record for automatic dynamic shapes starts empty (``_own_code_state``)."""
    from unittest import mock
    with contextlib.ExitStack() as stack:
        stack.enter_context(_own_code_state())
        try:
            from torch._functorch._aot_autograd import autograd_cache as ac
        except ImportError:
            ac = None
        if hasattr(ac, "autograd_cache_key"):
            stack.enter_context(mock.patch.object(ac, "autograd_cache_key",
                                                  lambda *a, **k: (f"yirage-{os.urandom(8).hex()}", [])))
        if hasattr(getattr(ac, "AOTAutogradCache", None), "_write_to_local_cache"):
            stack.enter_context(mock.patch.object(ac.AOTAutogradCache, "_write_to_local_cache",
                                                  staticmethod(lambda *a, **k: None)))
        from torch._dynamo import package
        if hasattr(getattr(package, "SourceInfo", None), "add_code"):
            stack.enter_context(mock.patch.object(package.SourceInfo, "add_code", _file_sources()))
        from torch._dynamo import guards
        pickler = getattr(guards, "GuardsStatePickler", None)
        if hasattr(pickler, "reducer_override") and hasattr(pickler, "_unpickle_module"):
            stack.enter_context(mock.patch.object(pickler, "reducer_override",
                                                  _parametrized_reducer(pickler.reducer_override)))
        yield


def _parametrized_reducer(reducer_override):
    """Dynamo's guard-state pickler, which stores a module in its guard tree by its state
    (``torch.nn.Module.__getstate__``) unless its class is defined at module level (then by
    pickle's default, which ``torch.nn.utils.parametrize``'s classes refuse: "Serialization
    of parametrized modules is only supported through state_dict()"), also storing a
    parametrized module by its state. Its type is checked by ``GuardFilter``."""
    def reduce(self, obj):
        if _parametrized(obj) and id(obj) in self.guard_tree_values:
            for attr in obj.__dict__.values():   # as dynamo's own branch for modules
                if not (isinstance(attr, (torch.Tensor, torch.nn.Module)) or id(attr) in self.guard_tree_values
                        or callable(attr)):
                    self.missing_values[id(attr)] = attr
            return type(self)._unpickle_module, (torch.nn.Module.__getstate__(obj),)
        return reducer_override(self, obj)
    return reduce


@contextlib.contextmanager
def _own_code_state():
    """Dynamo's automatic dynamic shapes (``torch._dynamo.pgo``) keep what each compile saw
    per code object. Models behind one shared ``forward`` wrapper (transformers' decorators)
    therefore saw each other's values: after RoBERTa (``padding_idx`` 1, dropout 0.1),
    ALBERT's (0 and 0.0) were marked dynamic, the symbolic dropout probability made dynamo
    restart its analysis inside ``aot_compile_fullgraph``, and ALBERT was declined. So the
    precompile starts from an empty record, as the model would alone in a process; after it,
    the code objects it compiled carry this model's record (what its own later recompiles
    through torch.compile start from) and the others keep theirs. Under dynamo's compile
    lock (an RLock), so that no compile in another thread sees the swap."""
    try:
        from torch._dynamo import convert_frame, pgo
        before, lock = pgo.get_code_state(), convert_frame.compile_lock
    except (ImportError, AttributeError):   # a torch without them: nothing to isolate
        yield
        return
    with lock:
        own = type(before)(pgo.CodeState)
        pgo._CODE_STATE = own
        try:
            yield
        finally:
            before.update(own)
            pgo._CODE_STATE = before


def _has_aot_compile() -> bool:
    try:
        from torch._dynamo.aot_compile import aot_compile_fullgraph  # noqa: F401
    except ImportError:
        return False
    return True
