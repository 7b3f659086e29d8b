"""The reference interpreter: runs a KernelGraph op by op with each op's torch reference.

It defines what every op means; compiled kernels are tested against it. It runs on
whatever device the inputs are on. It must never be used as a silent substitute for a
compiled backend.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import GraphError
from .ops import OPS


def check_inputs(graph, inputs: Sequence[torch.Tensor]) -> None:
    """Raise GraphError if ``inputs`` do not match the graph's declared inputs: ``inputs``
    must be a list (or tuple) of torch tensors, one per ``new_input`` in order, each of the
    declared shape (the storage shape for quantized dtypes) and dtype. The message names the
    input (index and name), what was expected and what was given."""
    if isinstance(inputs, torch.Tensor) or not isinstance(inputs, Sequence) or isinstance(inputs, (str, bytes)):
        hint = ": wrap a single tensor in a list, [x]" if isinstance(inputs, torch.Tensor) else ""
        raise GraphError(f"inputs must be a list of tensors, one per new_input of the graph, got "
                         f"{type(inputs).__name__}{hint}")
    if len(inputs) != len(graph.inputs):
        raise GraphError(f"the graph has {len(graph.inputs)} inputs, got {len(inputs)} tensors: pass one "
                         "tensor per new_input, in the order they were declared")
    for i, (tid, x) in enumerate(zip(graph.inputs, inputs)):
        t = graph.tensors[tid]
        want = t.dtype.storage_shape(t.shape)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != want or x.dtype != t.dtype.torch_dtype:
            got = f"shape {tuple(x.shape)} and dtype {x.dtype}" if isinstance(x, torch.Tensor) else \
                f"{type(x).__name__} (not a torch tensor)"
            name = f" ({graph.names[tid]!r})" if tid in graph.names else ""
            raise GraphError(f"input {i}{name}: expected a tensor of shape {want} and dtype "
                             f"{t.dtype.torch_dtype} ({t.dtype.value}), got {got}")


def interpret(graph, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Evaluate ``graph`` on ``inputs``; returns the marked outputs.

    Ops that update state (attention's KV cache) update the input tensors in place,
    exactly as compiled kernels do. Raises GraphError when ``inputs`` do not match the
    graph's inputs (see ``check_inputs``).
    """
    check_inputs(graph, inputs)
    env = dict(zip(graph.inputs, inputs))
    for node in graph.ops:
        env[node.output] = OPS[node.op].reference([env[i] for i in node.inputs], node.attrs)
    return [env[o] for o in graph.outputs]
