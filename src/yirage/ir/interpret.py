"""The reference interpreter: runs a KernelGraph op by op with each op's torch reference.

It defines what every op means; compiled kernels are tested against it. It runs on
whatever device the inputs are on. It must never be used as a silent substitute for a
compiled backend.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .ops import OPS


def check_inputs(graph, inputs: Sequence[torch.Tensor]) -> None:
    """Raise ValueError if ``inputs`` do not match the graph's declared inputs."""
    if len(inputs) != len(graph.inputs):
        raise ValueError(f"graph has {len(graph.inputs)} inputs, got {len(inputs)} tensors")
    for i, (tid, x) in enumerate(zip(graph.inputs, inputs)):
        t = graph.tensors[tid]
        want = t.dtype.storage_shape(t.shape)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != want or x.dtype != t.dtype.torch_dtype:
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"input {i}: expected a tensor of shape {want} and dtype "
                             f"{t.dtype.torch_dtype} ({t.dtype.value}), got {got}")


def interpret(graph, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Evaluate ``graph`` on ``inputs``; returns the marked outputs.

    Ops that update state (attention's KV cache) update the input tensors in place,
    exactly as compiled kernels do.
    """
    check_inputs(graph, inputs)
    env = dict(zip(graph.inputs, inputs))
    for node in graph.ops:
        env[node.output] = OPS[node.op].reference([env[i] for i in node.inputs], node.attrs)
    return [env[o] for o in graph.outputs]
