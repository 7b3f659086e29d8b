"""Specializing a partition's FX graph to one concrete input signature (dynamic shapes).

Dynamo and AOTAutograd hand a backend graphs whose sizes may be symbolic (``s0``, ``2*s0``):
``torch.compile(m, dynamic=True)``, ``torch._dynamo.mark_dynamic`` and dynamo's automatic
dynamic shapes after a second input shape. yirage's IR has static shapes, so a partition
is compiled per *signature*: the shape and dtype of each tensor input and the value of
each integer (SymInt) input of one call.

    sig = signature(inputs)                   # ((('t', (2, 12, 64), torch.float32, 'cpu'), ('i', 12)), ...)
    gm2 = specialize(partition_gm, inputs)    # integer inputs inlined, meta["val"] concrete

``specialize`` copies the graph, writes each integer input's value into the nodes that read
it, and runs the copy under a fresh ``FakeTensorMode`` (no shape environment: every size
is an int) so that every node's ``meta["val"]`` holds a fake tensor of its concrete shape.
The lowering table then emits IR from it exactly as from a static graph.

This module must never run real computation, and never touch the graph it is given.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..errors import TorchCompileError


def is_symbolic(val) -> bool:
    """Whether ``val`` (a node's ``meta["val"]``: a tensor, a SymInt, or a tuple of them)
    has a symbolic size or is a symbolic integer."""
    if isinstance(val, (tuple, list)):
        return any(is_symbolic(v) for v in val)
    if isinstance(val, torch.SymInt):
        return True
    if isinstance(val, torch.Tensor):
        return any(not isinstance(d, int) for d in val.shape)
    return False


def signature(inputs: Sequence) -> tuple:
    """The key of one call's compiled variant: per input, ``('t', shape, dtype, device type)``
    for a tensor, ``('i', value)`` for an integer.

    Raises TorchCompileError for any other input (a float, a SymFloat, ...)."""
    sig = []
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor):
            sig.append(("t", tuple(int(d) for d in x.shape), x.dtype, x.device.type))
        elif isinstance(x, int) and not isinstance(x, bool):
            sig.append(("i", int(x)))
        else:
            raise TorchCompileError(f"partition input {i} is a {type(x).__name__}; partitions take "
                                    "tensors and integers (sizes) only")
    return tuple(sig)


def specialize(gm: GraphModule, inputs: Sequence) -> GraphModule:
    """A copy of ``gm`` (a partition: placeholders, call_function nodes, output) for the
    concrete ``inputs`` of one call (real tensors and ints): integer placeholders are
    replaced by their values where nodes read them (the placeholders stay, unused), and
    every node's ``meta["val"]`` is a fake tensor of its concrete shape.

    Raises TorchCompileError when an input is neither a tensor nor an int, and whatever an
    op raises on these shapes (a shape the graph cannot take)."""
    signature(inputs)   # type check
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise TorchCompileError(f"the partition takes {len(placeholders)} inputs, got {len(inputs)}")
    ints = {p: x for p, x in zip(placeholders, inputs) if not isinstance(x, torch.Tensor)}
    graph = torch.fx.Graph()
    env: dict = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: ints[n] if n in ints else env[n])
    copy = GraphModule(gm, graph)
    mode = FakeTensorMode()
    with mode:
        fakes = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
                 for x in inputs]
    FakeTensorProp(copy, mode).propagate_dont_convert_inputs(*fakes)
    return copy
