"""Renders a fused row kernel as a sequence of torch eager ops (one launch per statement).

This is the kernel form for backends whose native code generator has not landed yet
(Triton for CUDA/ROCm/XPU, Metal for MPS): the program still runs on that backend's
device, just unfused. It also cross-checks the fusion pass on CPU in the tests.
It must never move tensors between devices.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..ir.ops import BINARY, COMPARE, LOGICAL, UNARY
from ..transforms.fusion import RS, FusedKernel


class EagerKernel:
    """A FusedKernel evaluated with torch ops over (R, D) views."""

    def __init__(self, kernel: FusedKernel):
        self.kernel = kernel

    def bind(self, tensors: list[torch.Tensor], R: int) -> Callable[[], None]:
        """Return a thunk computing the kernel's outputs into ``tensors[len(inputs):]``."""
        k = self.kernel
        ins, outs = tensors[:len(k.inputs)], tensors[len(k.inputs):]
        return lambda: self._run(ins, outs, R)

    def _view(self, x: torch.Tensor, mode: str, R: int) -> torch.Tensor:
        D = self.kernel.D
        if mode in ("full", "expand"):
            return x.reshape(R, D).float()
        if mode == "row":
            return x.reshape(1, D).float()
        if mode == "col":
            return x.reshape(R, 1).float()
        return x.reshape(1, 1).float()

    def _run(self, ins, outs, R):
        k = self.kernel
        v: dict[int, torch.Tensor] = {}
        for s in k.stmts:
            if s.op == "load":
                v[s.id] = self._view(ins[s.args[0]], k.inputs[s.args[0]].mode, R)
                continue
            a = [v[i] for i in s.args]
            if s.op in UNARY:
                v[s.id] = UNARY[s.op](a[0])
            elif s.op in BINARY:
                v[s.id] = BINARY[s.op](a[0], a[1])
            elif s.op in COMPARE or s.op in LOGICAL:  # bool values are 0.0 / 1.0 floats
                v[s.id] = (COMPARE.get(s.op) or LOGICAL[s.op])(*(x if s.op in COMPARE else x != 0 for x in a)).float()
            elif s.op == "to_bool":
                v[s.id] = (a[0] != 0).float()
            elif s.op == "where":
                v[s.id] = torch.where(a[0] != 0, a[1], a[2])
            elif s.op == "pow_scalar":
                v[s.id] = torch.pow(a[0], s.attrs["exponent"])
            elif s.op == "clamp":
                v[s.id] = a[0].clamp(s.attrs["lo"], s.attrs["hi"])
            elif s.op == "affine":
                v[s.id] = a[0] * s.attrs["a"] + s.attrs["b"]
            elif s.op == "sum":
                v[s.id] = a[0].sum(dim=1, keepdim=True)
            elif s.op == "max":
                v[s.id] = a[0].amax(dim=1, keepdim=True)
            else:  # pragma: no cover
                raise NotImplementedError(s.op)
        for (sid, _, _), out in zip(k.outputs, outs):
            val = v[sid]
            shape = (R, 1) if k.stmts[sid].kind == RS else (R, k.D)
            out.view(shape).copy_((val != 0 if out.dtype == torch.bool else val).expand(shape))
