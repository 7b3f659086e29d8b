"""Convolution passes: epilogue fusion and the channels-last (NHWC) layout.

``optimize_convolutions(graph, channels_last)`` returns a new graph computing the same outputs
from the same inputs (or ``graph`` itself when it has no ``conv2d``):

1. **Epilogue fusion.** A chain ``conv2d -> [batch_norm] -> [add residual] -> [activation]``,
   each link the only use of the value before it, becomes one ``conv2d`` with the epilogue
   attributes of ir/conv.py: ``bn`` (inference batch norm, which a backend folds into the
   weights when they are constant), ``residual`` (the other operand of the add, of the output's
   shape) and ``activation`` (relu, clamp as ``hardtanh``, silu, sigmoid, tanh). The fused op
   takes the place of the chain's last op, so a residual computed after the convolution (the
   shortcut branch of a ResNet block) is ready for it.
2. **Channels-last layout** (``channels_last=True``). Convolutions and window pools run on
   NHWC tensors (``layout="nhwc"``), and the values between them stay NHWC:
   - elementwise ops whose full-shape operands are NHWC run in NHWC (per-channel operands
     such as ``[C, 1, 1]`` are reshaped to broadcast over the last dim);
   - reductions over adjacent spatial or channel dims run on the NHWC tensor;
   - ``pad`` pads the NHWC value (a zero pad symmetric in H and W that feeds only a
     convolution becomes that convolution's padding, in either layout);
   - a model's own ``permute(0, 2, 3, 1)`` of an NHWC value is that value (ConvNeXt), and a
     ``permute(0, 3, 1, 2)`` back is not copied unless an NCHW consumer needs it;
   - every other op gets NCHW, converted on demand (a ``permute``, or a free ``reshape`` when
     only unit dims move); graph outputs are NCHW.
   A value is converted at most once per layout.

Sources: the layout propagation of TorchInductor's ``layout_optimization`` and oneDNN's
blocked-layout propagation, done here on the IR by replaying the graph in order.

This module must never run a graph or depend on a backend.
"""
from __future__ import annotations

import math
from collections import defaultdict

from ..ir.graph import KernelGraph
from ..ir.ops import OPS

#: reductions whose ``dims`` attr the layout pass remaps
_REDUCTIONS = ("sum", "mean", "amax", "amin", "var")
#: NCHW dim -> its position in NHWC
_NHWC_POS = (0, 3, 1, 2)
#: ops the epilogue takes as the activation (``clamp`` with finite bounds as ``hardtanh``)
_ACT_OPS = {"relu", "silu", "sigmoid", "tanh", "clamp"}


def optimize_convolutions(graph: KernelGraph, channels_last: bool) -> KernelGraph:
    """The graph with conv2d epilogues fused and, with ``channels_last``, convolution chains in
    NHWC (see the module docstring). Returns ``graph`` itself when it has no conv2d (or holds
    threadblock ``customized`` ops, which stay bound to their graph)."""
    if not any(n.op == "conv2d" for n in graph.ops) or any(n.op == "customized" for n in graph.ops):
        return graph
    return _Replay(graph, channels_last).run()


def _users(g: KernelGraph) -> dict[int, list[int]]:
    """{tensor id: the indices of the ops that read it, -1 for each time it is a graph output}."""
    users: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(g.ops):
        for t in n.inputs:
            users[t].append(i)
    for o in g.outputs:
        users[o].append(-1)
    return users


def _epilogue_chains(g: KernelGraph, users: dict[int, list[int]]) -> dict[int, tuple[int, dict]]:
    """{index of the chain's last op: (index of its conv2d, epilogue)} for every conv2d with an
    epilogue to fuse; epilogue keys: ``bn`` (op index), ``residual`` (tensor id), ``act`` (op
    index), ``absorbed`` (op indices)."""
    claimed: set[int] = set()   # ops already in a chain (an add may follow two convolutions)

    def only_user(t: int):
        u = users[t]
        return u[0] if len(u) == 1 and u[0] >= 0 and u[0] not in claimed else None

    chains = {}
    for i, n in enumerate(g.ops):
        if n.op != "conv2d" or any(k in n.attrs for k in ("bn", "residual", "activation", "layout")):
            continue
        cur, ep, end = n.output, {"absorbed": []}, i
        shape, dtype = g.tensors[cur].shape, g.tensors[cur].dtype
        j = only_user(cur)
        if j is not None and g.ops[j].op == "batch_norm" and g.ops[j].inputs[0] == cur:
            ep["bn"], cur, end = j, g.ops[j].output, j
            ep["absorbed"].append(j)
            j = only_user(cur)
        if j is not None and g.ops[j].op == "add" and len(set(g.ops[j].inputs)) == 2:
            other = next(t for t in g.ops[j].inputs if t != cur)
            if g.tensors[other].shape == shape and g.tensors[other].dtype == dtype:
                ep["residual"], cur, end = other, g.ops[j].output, j
                ep["absorbed"].append(j)
                j = only_user(cur)
        if j is not None and g.ops[j].op in _ACT_OPS:
            a = g.ops[j].attrs
            if g.ops[j].op != "clamp" or all(math.isfinite(a[k]) for k in ("min_val", "max_val")):
                ep["act"], cur, end = j, g.ops[j].output, j
                ep["absorbed"].append(j)
        if ep["absorbed"]:
            chains[end] = (i, ep)
            claimed.update(ep["absorbed"])
    return chains


def _foldable_pads(g: KernelGraph, users: dict[int, list[int]]) -> dict[int, tuple[int, list[int]]]:
    """{index of a conv2d: (index of the zero ``pad`` before it, the padding to add)} where the
    pad's output feeds only that convolution's x and pads H and W symmetrically (the "same"
    padding of TensorFlow-style models, MobileNetV2's); the pad then folds into the conv."""
    producer = {n.output: i for i, n in enumerate(g.ops)}
    folds = {}
    for i, n in enumerate(g.ops):
        j = producer.get(n.inputs[0]) if n.op == "conv2d" else None
        if j is None or g.ops[j].op != "pad" or users[n.inputs[0]] != [i]:
            continue
        pads, value = g.ops[j].attrs["pads"], g.ops[j].attrs["value"]
        if (value == 0 and len(pads) == 4 and list(pads[0]) == [0, 0] and list(pads[1]) == [0, 0]
                and pads[2][0] == pads[2][1] and pads[3][0] == pads[3][1]):
            folds[i] = (j, [pads[2][0], pads[3][0]])
    return folds


class _Replay:
    """Builds the new graph op by op; ``forms[tid]`` maps an old tensor to its new tensors by
    layout ("nchw": as in the old graph; "nhwc": a 4-d value permuted to [N, H, W, C])."""

    def __init__(self, g: KernelGraph, channels_last: bool):
        self.g, self.channels_last = g, channels_last
        self.ng = g.blank_like()   # with the front end's settings (e.g. runtime_row_width)
        self.forms: dict[int, dict[str, object]] = {}
        self.bcast: dict[int, object] = {}

    # ---- values in a layout
    def get(self, tid: int, layout: str = "nchw"):
        forms = self.forms[tid]
        if layout not in forms:
            if layout == "nhwc":
                forms["nhwc"] = self._permute(forms["nchw"], (0, 2, 3, 1))
            else:
                forms["nchw"] = self._permute(forms["nhwc"], (0, 3, 1, 2))
        return forms[layout]

    def _permute(self, x, dims):
        """``x`` permuted: a free reshape when only unit dims move, else a copy."""
        shape = tuple(x.shape[d] for d in dims)
        kept = [d for d in dims if x.shape[d] != 1]
        if kept == sorted(kept):
            return self.ng.reshape(x, shape)
        return self.ng.permute(x, dims)

    def _broadcast_nhwc(self, tid: int):
        """An operand broadcast against a 4-d NHWC value: padded to 4-d, then permuted."""
        if tid not in self.bcast:
            x, shape = self.get(tid), self.g.tensors[tid].shape
            if len(shape) == 0:
                self.bcast[tid] = x
            else:
                padded = (1,) * (4 - len(shape)) + tuple(shape)
                if padded != tuple(shape):
                    x = self.ng.reshape(x, padded)
                self.bcast[tid] = self._permute(x, (0, 2, 3, 1))
        return self.bcast[tid]

    def _has_nhwc(self, tid: int) -> bool:
        return "nhwc" in self.forms[tid]

    # ---- the replay
    def run(self) -> KernelGraph:
        g, ng = self.g, self.ng
        for tid in g.inputs:
            t = g.tensors[tid]
            self.forms[tid] = {"nchw": ng.new_input(t.shape, t.dtype, g.names.get(tid))}
        users = _users(g)
        chains = _epilogue_chains(g, users)
        self.folds = _foldable_pads(g, users)
        skip = {i for c, ep in chains.values() for i in (c, *ep["absorbed"])} | {j for j, _ in self.folds.values()}
        for i, n in enumerate(g.ops):
            if i in chains:
                conv, ep = chains[i]
                self.forms[n.output] = self._conv(conv, ep)
            elif i not in skip:
                self.forms[n.output] = self._conv(i) if n.op == "conv2d" else self._op(n)
        for o in g.outputs:
            ng.mark_output(self.get(o))
        return ng

    def _conv(self, i: int, ep=None) -> dict:
        """The conv2d at op index ``i`` (with the epilogue ``ep`` of ``_epilogue_chains``) in the
        pass's layout."""
        g, ep, n = self.g, ep or {}, self.g.ops[i]
        nhwc = self.channels_last and len(g.tensors[n.inputs[0]].shape) == 4
        layout = "nhwc" if nhwc else "nchw"
        attrs = dict(n.attrs, bias=len(n.inputs) == 3)
        x = n.inputs[0]
        if i in self.folds:   # a symmetric zero pad before it: conv padding instead
            j, extra = self.folds[i]
            x = g.ops[j].inputs[0]
            attrs["padding"] = [p + e for p, e in zip(n.attrs["padding"], extra)]
        ins = [self.get(x, layout), *(self.get(t) for t in n.inputs[1:])]
        if "bn" in ep:
            bn = g.ops[ep["bn"]]
            attrs["bn"] = {"eps": bn.attrs["eps"], "affine": bn.attrs["affine"]}
            ins += [self.get(t) for t in bn.inputs[1:]]
        if "residual" in ep:
            attrs["residual"] = True
            ins.append(self.get(ep["residual"], layout))
        if "act" in ep:
            act = g.ops[ep["act"]]
            if act.op == "clamp":
                attrs["activation"], attrs["act_args"] = "hardtanh", [act.attrs["min_val"], act.attrs["max_val"]]
            else:
                attrs["activation"] = act.op   # relu, silu, sigmoid, tanh: ir/conv.py ACTIVATIONS
        if nhwc:
            attrs["layout"] = "nhwc"
        return {layout: self.ng._add("conv2d", ins, **attrs)}

    def _op(self, n) -> dict:
        g, ng = self.g, self.ng
        out = g.tensors[n.output]
        ins = n.inputs
        four = len(out.shape) == 4
        if self.channels_last and n.op in ("max_pool2d", "avg_pool2d") and self._has_nhwc(ins[0]):
            return {"nhwc": ng._add(n.op, [self.get(ins[0], "nhwc")], **n.attrs, layout="nhwc")}
        if (self.channels_last and four and OPS[n.op].kind == "elementwise"
                and any(g.tensors[t].shape == out.shape and self._has_nhwc(t) for t in ins)):
            args = [self.get(t, "nhwc") if g.tensors[t].shape == out.shape else self._broadcast_nhwc(t) for t in ins]
            return {"nhwc": ng._add(n.op, args, **n.attrs)}
        if self.channels_last and n.op in _REDUCTIONS and four and self._has_nhwc(ins[0]):
            dims = sorted(_NHWC_POS[d % 4] for d in n.attrs["dims"])
            if dims == list(range(dims[0], dims[0] + len(dims))):
                return {"nhwc": ng._add(n.op, [self.get(ins[0], "nhwc")], **dict(n.attrs, dims=tuple(dims)))}
        if self.channels_last and n.op == "pad" and four and self._has_nhwc(ins[0]):
            pads = n.attrs["pads"]
            return {"nhwc": ng._add("pad", [self.get(ins[0], "nhwc")],
                                    **dict(n.attrs, pads=[list(pads[d]) for d in (0, 2, 3, 1)]))}
        if self.channels_last and n.op == "permute" and four:
            dims = tuple(n.attrs["dims"])
            if dims == (0, 2, 3, 1) and self._has_nhwc(ins[0]):
                return {"nchw": self.get(ins[0], "nhwc")}
            if dims == (0, 3, 1, 2):   # the NHWC form of the result is the input as it is
                return {"nhwc": self.get(ins[0])}
        return {"nchw": ng._add(n.op, [self.get(t) for t in ins], **n.attrs)}


__all__ = ["optimize_convolutions"]
