"""Every entry of the lowering table against torch eager, and the preconditions that decline.

Each case compiles a small function with ``min_block_size=1`` and checks that the ATen op it
names ran inside a yirage partition and that the result matches eager. ``test_every_lowering
_has_a_case`` fails when an op is added to the table without a case here.
"""

import pytest
import torch
import torch.nn.functional as F

from yirage.dynamo.compiler import YirageBackend
from yirage.dynamo.lowering import LOWERINGS
from yirage.dynamo.options import op_name

aten = torch.ops.aten
TOL = dict(rtol=1e-4, atol=1e-5)


def _pos(*shape):
    return torch.rand(*shape) + 0.1


#: case id -> (function, inputs, the ops (names) that must run in yirage)
CASES = {
    "add": (lambda x, y: x + y, lambda: [torch.randn(4, 8), torch.randn(8)], ["aten.add.Tensor"]),
    "add_alpha": (lambda x, y: torch.add(x, y, alpha=2.5), lambda: [torch.randn(4, 8), torch.randn(4, 8)],
                  ["aten.add.Tensor"]),
    "add_scalar": (lambda x: aten.add.Scalar(x, 1.5), lambda: [torch.randn(4, 8)], ["aten.add.Scalar"]),
    "sub": (lambda x, y: x - y, lambda: [torch.randn(4, 8), torch.randn(4, 1)], ["aten.sub.Tensor"]),
    "rsub_scalar": (lambda x: 2.0 - x, lambda: [torch.randn(4, 8)], ["aten.sub.Tensor"]),
    "sub_scalar": (lambda x: aten.sub.Scalar(x, 0.25), lambda: [torch.randn(4, 8)], ["aten.sub.Scalar"]),
    "mul": (lambda x, y: x * y, lambda: [torch.randn(2, 4, 8), torch.randn(4, 8)], ["aten.mul.Tensor"]),
    "mul_scalar": (lambda x: aten.mul.Scalar(x, 3.0), lambda: [torch.randn(4, 8)], ["aten.mul.Scalar"]),
    "div": (lambda x, y: x / y, lambda: [torch.randn(4, 8), _pos(4, 8)], ["aten.div.Tensor"]),
    "div_scalar": (lambda x: aten.div.Scalar(x, 7.0), lambda: [torch.randn(4, 8)], ["aten.div.Scalar"]),
    "exp": (torch.exp, lambda: [torch.randn(4, 8)], ["aten.exp.default"]),
    # YOLOS's interpolation sizes (floor); quarters, negatives and zero
    "floor": (lambda x: torch.floor(x * 2.5), lambda: [torch.arange(-8, 8).float().reshape(2, 8) / 4], ["aten.floor.default"]),
    "ceil": (lambda x: torch.ceil(x * 2.5), lambda: [torch.arange(-8, 8).float().reshape(2, 8) / 4], ["aten.ceil.default"]),
    "trunc": (lambda x: torch.trunc(x * 2.5), lambda: [torch.arange(-8, 8).float().reshape(2, 8) / 4],
              ["aten.trunc.default"]),
    "sqrt": (torch.sqrt, lambda: [_pos(4, 8)], ["aten.sqrt.default"]),
    "rsqrt": (torch.rsqrt, lambda: [_pos(4, 8)], ["aten.rsqrt.default"]),
    "neg": (torch.neg, lambda: [torch.randn(4, 8)], ["aten.neg.default"]),
    "relu": (torch.relu, lambda: [torch.randn(4, 8)], ["aten.relu.default"]),
    "silu": (F.silu, lambda: [torch.randn(4, 8)], ["aten.silu.default"]),
    "gelu": (F.gelu, lambda: [torch.randn(4, 8)], ["aten.gelu.default"]),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), lambda: [torch.randn(4, 8)], ["aten.gelu.default"]),
    "clamp": (lambda x: torch.clamp(x, -0.5, 0.75), lambda: [torch.randn(4, 8)], ["aten.clamp.default"]),
    "clamp_min": (lambda x: aten.clamp_min.default(x, 0.1), lambda: [torch.randn(4, 8)], ["aten.clamp_min.default"]),
    "clamp_max": (lambda x: aten.clamp_max.default(x, 0.1), lambda: [torch.randn(4, 8)], ["aten.clamp_max.default"]),
    "to_copy": (lambda x: (x * 2.0).to(torch.bfloat16), lambda: [torch.randn(4, 8)], ["aten._to_copy.default"]),
    "to_copy_widen": (lambda x: x.to(torch.float32) * 2.0, lambda: [torch.randn(4, 8, dtype=torch.bfloat16)],
                      ["aten._to_copy.default"]),
    "view": (lambda x: x.view(8, 4) * 2.0, lambda: [torch.randn(4, 8)], ["aten.view.default"]),
    "reshape": (lambda x: aten.reshape.default(x, [2, 16]) + 1.0, lambda: [torch.randn(4, 8)],
                ["aten.view.default"]),
    "unsafe_view": (lambda x: aten._unsafe_view.default(x * 2.0, [32]), lambda: [torch.randn(4, 8)],
                    ["aten._unsafe_view.default"]),
    "softmax": (lambda x: torch.softmax(x, -1), lambda: [torch.randn(3, 5, 8)], ["aten._softmax.default"]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (8,), w, b), lambda: [torch.randn(3, 8), torch.randn(8), torch.randn(8)],
                   ["aten.native_layer_norm.default", "getitem"]),
    "layer_norm_plain": (lambda x: F.layer_norm(x, (8,)), lambda: [torch.randn(2, 3, 8)],
                         ["aten.native_layer_norm.default"]),
    "group_norm": (lambda x, w, b: F.group_norm(x * 2.0, 3, w, b, eps=1e-5), lambda: [torch.randn(2, 6, 5, 4),
                                                                                     torch.randn(6), torch.randn(6)],
                   ["aten.native_group_norm.default", "getitem"]),
    "group_norm_plain": (lambda x: F.group_norm(x + 1.0, 2), lambda: [torch.randn(3, 4, 7)],
                         ["aten.native_group_norm.default"]),
    "sum": (lambda x: x.sum(-1), lambda: [torch.randn(3, 5, 8)], ["aten.sum.dim_IntList"]),
    "sum_keepdim": (lambda x: x.sum(-1, keepdim=True), lambda: [torch.randn(3, 8)], ["aten.sum.dim_IntList"]),
    "sum_same_dtype": (lambda x: torch.sum(x, 1, dtype=torch.float32), lambda: [torch.randn(3, 5, 8)],
                       ["aten.sum.dim_IntList"]),
    "mean": (lambda x: x.mean(-1), lambda: [torch.randn(3, 8)], ["aten.mean.dim"]),
    "mm": (torch.mm, lambda: [torch.randn(4, 8), torch.randn(8, 6)], ["aten.mm.default"]),
    "bmm": (torch.bmm, lambda: [torch.randn(2, 4, 8), torch.randn(2, 8, 6)], ["aten.bmm.default"]),
    "addmm": (torch.addmm, lambda: [torch.randn(6), torch.randn(4, 8), torch.randn(8, 6)], ["aten.addmm.default"]),
    "linear": (F.linear, lambda: [torch.randn(2, 4, 8), torch.randn(6, 8), torch.randn(6)], ["aten.linear.default"]),
    "linear_nobias": (F.linear, lambda: [torch.randn(4, 8), torch.randn(6, 8)], ["aten.linear.default"]),
    **{name: (getattr(torch, name), lambda: [torch.randn(3, 7)], [f"aten.{name}.default"])
       for name in ("tanh", "sigmoid", "erf", "exp2", "abs", "cos", "sin")},
    "sdpa_mask": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                  lambda: [torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8),
                           torch.randn(2, 1, 1, 6)], ["aten._scaled_dot_product_flash_attention_for_cpu.default"]),
    "sdpa_causal_gqa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                        lambda: [torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)],
                        ["aten._scaled_dot_product_flash_attention_for_cpu.default"]),
    "constant_pad_nd": (lambda x: F.pad(x, (0, 1, 2, 0), value=0.5), lambda: [torch.randn(2, 3, 4, 5)],
                        ["aten.constant_pad_nd.default"]),
    "hardtanh": (F.relu6, lambda: [torch.randn(3, 7) * 5], ["aten.hardtanh.default"]),
    "addmm_2d_bias": (torch.addmm, lambda: [torch.randn(4, 6), torch.randn(4, 8), torch.randn(8, 6)],
                      ["aten.addmm.default"]),
    "log": (torch.log, lambda: [_pos(3, 7)], ["aten.log.default"]),
    "reciprocal": (torch.reciprocal, lambda: [_pos(3, 7)], ["aten.reciprocal.default"]),
    "maximum": (torch.maximum, lambda: [torch.randn(3, 7), torch.randn(7)], ["aten.maximum.default"]),
    "minimum": (torch.minimum, lambda: [torch.randn(3, 7), torch.randn(3, 7)], ["aten.minimum.default"]),
    "pow": (torch.pow, lambda: [_pos(3, 7), torch.randn(3, 7)], ["aten.pow.Tensor_Tensor"]),
    "pow_scalar": (lambda x: x ** 2.5, lambda: [_pos(3, 7)], ["aten.pow.Tensor_Scalar"]),
    "softmax_dim0": (lambda x: torch.softmax(x, 0), lambda: [torch.randn(3, 5, 8)], ["aten._softmax.default"]),
    "log_softmax": (lambda x: torch.log_softmax(x, 1), lambda: [torch.randn(3, 5, 8)], ["aten._log_softmax.default"]),
    "sum_dim0": (lambda x: x.sum(0), lambda: [torch.randn(3, 5, 8)], ["aten.sum.dim_IntList"]),
    "mean_dims": (lambda x: x.mean((1, 2), keepdim=True), lambda: [torch.randn(3, 5, 8)], ["aten.mean.dim"]),
    "amax": (lambda x: x.amax(1), lambda: [torch.randn(3, 5, 8)], ["aten.amax.default"]),
    "amin": (lambda x: x.amin(-1, keepdim=True), lambda: [torch.randn(3, 5, 8)], ["aten.amin.default"]),
    "var": (lambda x: x.var(1), lambda: [torch.randn(3, 5, 8)], ["aten.var.correction"]),
    "var_biased": (lambda x: torch.var(x, -1, correction=0), lambda: [torch.randn(3, 8)], ["aten.var.correction"]),
    "permute": (lambda x: x.permute(2, 0, 1) * 2.0, lambda: [torch.randn(3, 5, 8)], ["aten.permute.default"]),
    "transpose": (lambda x: x.transpose(0, 1).contiguous() + 1.0, lambda: [torch.randn(3, 5)],
                  ["aten.permute.default"]),
    "expand": (lambda x: x.expand(4, 3, 5) * 2.0, lambda: [torch.randn(3, 1)], ["aten.expand.default"]),
    "slice": (lambda x: x[:, 1:7:2] * 2.0, lambda: [torch.randn(3, 8)], ["aten.slice.Tensor"]),
    "select": (lambda x: x[:, 2] * 2.0, lambda: [torch.randn(3, 8)], ["aten.select.int"]),
    "cat": (lambda x, y: torch.cat([x * 2.0, y], 1), lambda: [torch.randn(3, 4), torch.randn(3, 5)],
            ["aten.cat.default"]),
    **{f"{name}{kind}": (fn, lambda: [torch.randn(3, 7).round(), torch.randn(7).round()],
                         [f"aten.{name}.{'Tensor' if kind == '' else 'Scalar'}"])
       for name in ("eq", "ne", "lt", "le", "gt", "ge")
       for kind, fn in (("", (lambda op: lambda x, y: getattr(torch, op)(x * 2.0, y))(name)),
                        ("_scalar", (lambda op: lambda x, y: getattr(torch, op)(x * 2.0, 1.0) & (y > 0))(name)))},
    "eq_bool": (lambda x, y: (x > 0) == (y > 0), lambda: [torch.randn(3, 7), torch.randn(3, 7)], ["aten.eq.Tensor"]),
    "logical_and": (lambda x, y: torch.logical_and(x > 0, y > 0), lambda: [torch.randn(3, 7), torch.randn(7)],
                    ["aten.logical_and.default"]),
    "logical_or": (lambda x, y: torch.logical_or(x > 0, y > 0), lambda: [torch.randn(3, 7), torch.randn(3, 7)],
                   ["aten.logical_or.default"]),
    "logical_not": (lambda x: torch.logical_not(x > 0), lambda: [torch.randn(3, 7)], ["aten.logical_not.default"]),
    "bitwise_and": (lambda x, y: (x > 0) & (y > 0), lambda: [torch.randn(3, 7), torch.randn(3, 7)],
                    ["aten.bitwise_and.Tensor"]),
    "bitwise_or": (lambda x, y: (x > 0) | (y > 0), lambda: [torch.randn(3, 7), torch.randn(3, 7)],
                   ["aten.bitwise_or.Tensor"]),
    "bitwise_not": (lambda x: ~(x > 0), lambda: [torch.randn(3, 7)], ["aten.bitwise_not.default"]),
    "where": (lambda c, x, y: torch.where(c > 0, x * 2.0, y), lambda: [torch.randn(3, 1), torch.randn(3, 7), torch.randn(7)],
              ["aten.where.self"]),
    "where_scalars": (lambda c: torch.where(c > 0, 0.0, float("-inf")) + c, lambda: [torch.randn(3, 7)],
                      ["aten.where.self", "aten.scalar_tensor.default"]),
    "any": (lambda x: torch.any(x > 0.5, -1, keepdim=True), lambda: [torch.randn(3, 7)], ["aten.any.dim"]),
    "any_dim0": (lambda x: torch.any(x > 0.5, 0), lambda: [torch.randn(3, 7)], ["aten.any.dim"]),
    "to_bool": (lambda x: (x * 2.0).to(torch.bool), lambda: [torch.randn(3, 7).round()], ["aten._to_copy.default"]),
    "from_bool": (lambda x: (x > 0).to(torch.float16) * 2.0, lambda: [torch.randn(3, 7)], ["aten._to_copy.default"]),
    "clone": (lambda x: (x * 2.0).clone() + x, lambda: [torch.randn(3, 7)], ["aten.clone.default"]),
    "clone_input": (lambda x: (x.clone(), x * 2.0), lambda: [torch.randn(3, 7)], ["aten.clone.default"]),
    "lift_fresh_copy": (lambda x: x * torch.tensor([1.0, 2.0, 3.0]), lambda: [torch.randn(2, 3)],
                        ["aten.lift_fresh_copy.default"]),
    "split": (lambda x: [t * 2.0 for t in torch.split(x, [2, 5, 1], dim=1)], lambda: [torch.randn(3, 8)],
              ["aten.split_with_sizes.default", "getitem"]),
    "alias": (lambda x: aten.alias.default(x * 2.0) + 1.0, lambda: [torch.randn(3, 7)], ["aten.alias.default"]),
    "unsqueeze": (lambda x: x.unsqueeze(1) * 2.0, lambda: [torch.randn(3, 7)], ["aten.unsqueeze.default"]),
    "squeeze_dim": (lambda x: aten.squeeze.dim(x * 2.0, 1) + 1.0, lambda: [torch.randn(3, 1, 7)], ["aten.squeeze.dim"]),
    "squeeze_dims": (lambda x: aten.squeeze.dims(x * 2.0, [0, 2]) + 1.0, lambda: [torch.randn(1, 3, 1, 7)],
                     ["aten.squeeze.dims"]),
    "squeeze": (lambda x: aten.squeeze.default(x * 2.0) + 1.0, lambda: [torch.randn(1, 3, 1, 7)],
                ["aten.squeeze.default"]),
    "embedding": (F.embedding, lambda: [torch.randint(0, 11, (2, 5)), torch.randn(11, 8)], ["aten.embedding.default"]),
    "embedding_positions": (lambda ids, w, p: F.embedding(ids, w) + F.embedding(torch.arange(5), p),
                            lambda: [torch.randint(0, 11, (2, 5)), torch.randn(11, 8), torch.randn(9, 8)],
                            ["aten.embedding.default", "aten.arange.default"]),
    "index_select": (lambda x, i: torch.index_select(x * 2.0, 1, i), lambda: [torch.randn(3, 7), torch.tensor([6, 0, 2, 2])],
                     ["aten.index_select.default"]),
    "gather": (lambda x, i: torch.gather(x * 2.0, 1, i), lambda: [torch.randn(3, 7), torch.randint(0, 7, (3, 4))],
               ["aten.gather.default"]),
    "index_constant": (lambda x: (x * 2.0)[torch.arange(3)[:, None], torch.arange(7)[None, ::2]],
                       lambda: [torch.randn(3, 7)], ["aten.index.Tensor"]),
    "arange": (lambda x: x + torch.arange(7, dtype=torch.float32), lambda: [torch.randn(3, 7)],
               ["aten.arange.default"]),
    "arange_step": (lambda x: x + aten.arange.start_step(1, 14, 2).to(torch.float32), lambda: [torch.randn(3, 7)],
                    ["aten.arange.start_step"]),
    "arange_int": (lambda x: x + aten.arange.default(7).to(torch.float32), lambda: [torch.randn(3, 7)],
                   ["aten.arange.default"]),
    "arange_start": (lambda x: x + aten.arange.start(2, 9).to(torch.float32), lambda: [torch.randn(3, 7)],
                     ["aten.arange.start"]),
    "full": (lambda x: x + torch.full((3, 7), 1.5), lambda: [torch.randn(3, 7)], ["aten.full.default"]),
    "zeros": (lambda x: torch.maximum(x, torch.zeros(7)), lambda: [torch.randn(3, 7)], ["aten.zeros.default"]),
    "ones": (lambda x: torch.minimum(x, torch.ones(3, 1)), lambda: [torch.randn(3, 7)], ["aten.ones.default"]),
    "full_like": (lambda x: torch.where(x > 0, torch.full_like(x, 2.0), x), lambda: [torch.randn(3, 7)],
                  ["aten.full_like.default"]),
    "zeros_like": (lambda x: torch.maximum(x, torch.zeros_like(x)), lambda: [torch.randn(3, 7)],
                   ["aten.zeros_like.default"]),
    "ones_like": (lambda x: torch.minimum(x, torch.ones_like(x)), lambda: [torch.randn(3, 7)],
                  ["aten.ones_like.default"]),
    "big_uniform_constant": (lambda x: x + torch.full((40, 50), 0.5), lambda: [torch.randn(40, 50)],
                             ["aten.full.default"]),
    "folded_int_arithmetic": (lambda x: x + ((torch.arange(7) * 3 - 4).abs() > 5).to(torch.float32),
                              lambda: [torch.randn(3, 7)], ["aten.arange.default", "aten.gt.Scalar"]),
    # an attention mask's int64 -> bool and int64 -> float casts (large values round as torch does)
    "to_copy_int64_bool": (lambda m, x: torch.where(m.to(torch.bool), x, -1.0),
                           lambda: [torch.tensor([[1, 0, 3, 2**40], [0, 0, -7, 1]]), torch.randn(2, 4)],
                           ["aten._to_copy.default"]),
    "to_copy_int_float": (lambda m: m.to(torch.float32) * 0.5,
                          lambda: [torch.tensor([[16777217, -3, 2**53 + 1, 0]], dtype=torch.int64)],
                          ["aten._to_copy.default"]),
    "cumsum_int64": (lambda m: m.cumsum(-1) - 1, lambda: [torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])],
                     ["aten.cumsum.default"]),
    "cumsum_float_mid": (lambda x: torch.cumsum(x * 2.0, 1), lambda: [torch.randn(2, 5, 3)], ["aten.cumsum.default"]),
    "vector_norm": (lambda x: x / torch.linalg.vector_norm(x, 2, dim=1, keepdim=True), lambda: [torch.randn(3, 8)],
                    ["aten.linalg_vector_norm.default"]),
    "vector_norm_p": (lambda x: (torch.linalg.vector_norm(x, 1, dim=-1), torch.linalg.vector_norm(x, float("inf")),
                                 torch.linalg.vector_norm(x, 3.0, dim=(0, 1))), lambda: [torch.randn(3, 8, 2)],
                      ["aten.linalg_vector_norm.default"]),
}


def _rope(x, cos, sin):   # transformers' rotate-half RoPE: rewrite_rotary_emb makes it one op
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


CASES["rotary_emb"] = (_rope, lambda: [torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)],
                       ["yirage.rotary_emb.default"])

#: the conv-net lowerings (dynamo/lowering_conv.py)
CASES.update({
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), lambda: [torch.randn(2, 3, 11, 9),
                                                                               torch.randn(5, 3, 3, 3), torch.randn(5)],
               ["aten.convolution.default"]),
    "conv2d_depthwise": (lambda x, w: F.conv2d(x, w, None, padding=1, groups=4) * 2.0,
                         lambda: [torch.randn(1, 4, 7, 8), torch.randn(4, 1, 3, 3)], ["aten.convolution.default"]),
    "batch_norm": (lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=False, eps=1e-3) * 2.0,
                   lambda: [torch.randn(2, 5, 4, 3), torch.randn(5), torch.rand(5) + 0.5, torch.randn(5), torch.randn(5)],
                   ["aten._native_batch_norm_legit_no_training.default", "getitem"]),
    "max_pool2d": (lambda x: F.max_pool2d(x * 2.0, 3, 2, 1), lambda: [torch.randn(2, 3, 11, 9)],
                   ["aten.max_pool2d_with_indices.default"]),
    "avg_pool2d": (lambda x: F.avg_pool2d(x * 2.0, 3, 2, 1, count_include_pad=False), lambda: [torch.randn(2, 3, 11, 9)],
                   ["aten.avg_pool2d.default"]),
    # padding="valid" reaches the op as padding=[0] (torch's one-element int[2])
    "conv2d_valid": (lambda x, w: F.conv2d(x * 2.0, w, None, stride=2, padding="valid"),
                     lambda: [torch.randn(2, 3, 11, 9), torch.randn(4, 3, 3, 3)], ["aten.convolution.default"]),
    # ceil mode: GoogLeNet's 3x3 / 2 max pool (55x55 -> 28x28, its last windows past the end),
    # with padding and dilation too; EfficientNet's ceil-mode average pool over the whole map
    "max_pool2d_ceil": (lambda x: F.max_pool2d(x * 2.0, 3, 2, ceil_mode=True), lambda: [torch.randn(2, 3, 12, 9)],
                        ["aten.max_pool2d_with_indices.default"]),
    "max_pool2d_ceil_padded": (lambda x: F.max_pool2d(x - 5.0, 3, 2, 1, dilation=2, ceil_mode=True),
                               lambda: [torch.randn(1, 2, 10, 13)], ["aten.max_pool2d_with_indices.default"]),
    "avg_pool2d_ceil_whole": (lambda x: F.avg_pool2d(x * 2.0, (7, 5), ceil_mode=True), lambda: [torch.randn(2, 3, 7, 5)],
                              ["aten.avg_pool2d.default"]),
    # one 1x1 output whose 5x5 window covers a corner of the 7x7 map (ceil mode's second window
    # would start past the map): floor mode's window, not the mean
    "avg_pool2d_ceil_corner": (lambda x: F.avg_pool2d(x * 2.0, 5, 8, ceil_mode=True), lambda: [torch.randn(1, 2, 7, 7)],
                               ["aten.avg_pool2d.default"]),
    # EfficientNet's pooler: a kernel far larger than the map, one window (the mean)
    "avg_pool2d_ceil_kernel_past_map": (lambda x: F.avg_pool2d(x * 2.0, 40, ceil_mode=True),
                                        lambda: [torch.randn(2, 3, 7, 5)], ["aten.avg_pool2d.default"]),
})


def _compile_run(fn, inputs, **options):
    be = YirageBackend(options={"min_block_size": 1, **options})
    with torch.no_grad():
        out = torch.compile(fn, backend=be, fullgraph=True)(*inputs)
    return out, be


@pytest.mark.parametrize("case", sorted(CASES))
def test_lowering_matches_eager(case):
    fn, make_inputs, ops = CASES[case]
    inputs = make_inputs()
    out, be = _compile_run(fn, inputs)
    torch.testing.assert_close(out, fn(*inputs), **TOL)
    ran = {o for r in be.reports for p in r.partitions if p.runs_in == "yirage" for o in p.ops}
    assert set(ops) <= ran, (ops, ran, [t for r in be.reports for t in r.torch_ops])


def test_every_lowering_has_a_case():
    covered = {o for _, _, ops in CASES.values() for o in ops}
    table = {op_name(t) if hasattr(t, "overloadpacket") else t.__name__ for t in LOWERINGS}
    assert table - covered == set()


@pytest.mark.parametrize("fn, inputs, op, why", [
    (lambda x: x.sum((0, 2)), [torch.randn(3, 4, 8)], "aten.sum.dim_IntList", "not adjacent"),
    (lambda x, y: x + y, [torch.randn(3, 8), torch.randn(3, 8, dtype=torch.float16)], "aten.add.Tensor",
     "mixed dtypes"),
    (lambda x: x.to(torch.bfloat16).to(torch.float32) * 2.0, [torch.randn(3, 8)], "aten._to_copy.default",
     "narrowing cast"),
    (lambda x: torch.relu(x * 2), [torch.arange(8).reshape(2, 4)], "aten.relu.default", "torch.int64"),
    (lambda x, i: (x * 2.0)[i], [torch.randn(5, 3), torch.tensor([4, 0, 4])], "aten.index.Tensor",
     "not a constant"),
    (lambda x: (x * 2.0, torch.cumprod(torch.arange(1, 7), 0)), [torch.randn(3)], "aten.arange.start",
     "a constant that only torch ops read"),
    (lambda x: torch.cumsum(x * 2.0, 0, dtype=torch.float64), [torch.randn(3)], "aten.cumsum.default",
     "a cast in the op is not lowered"),
    (lambda x: torch.linalg.vector_norm(x * 2.0, 0), [torch.randn(3)], "aten.linalg_vector_norm.default",
     "ord=0"),
    (lambda x, y: (x > 0) == (y > 0.5).to(torch.float32), [torch.randn(3, 4), torch.randn(3, 4)], "aten.eq.Tensor",
     "mixed dtypes"),
    (lambda x: (x > 0) > 0.5, [torch.randn(3, 4)], "aten.gt.Scalar", "bool tensor compared with a number"),
    (lambda x: F.avg_pool2d(x * 2.0, 3, 2, ceil_mode=True), [torch.randn(1, 2, 12, 9)], "aten.avg_pool2d.default",
     "windows past the input's end"),
    (lambda x, i: F.embedding(i.int(), x * 2.0), [torch.randn(5, 3), torch.tensor([1, 2])], "aten.embedding.default",
     "ids are not an int64 tensor"),
])
def test_preconditions_decline_with_a_reason(fn, inputs, op, why):
    out, be = _compile_run(fn, inputs)
    torch.testing.assert_close(out, fn(*inputs))
    reasons = {t.op: t.reason for r in be.reports for t in r.torch_ops}
    assert why in reasons[op], reasons


def test_layer_norm_with_used_statistics_stays_torch():
    def fn(x):
        out, mean, rstd = aten.native_layer_norm.default(x, [8], None, None, 1e-5)
        return out * 2.0, mean
    x = torch.randn(3, 8)
    out, be = _compile_run(fn, [x])
    torch.testing.assert_close(out, fn(x))
    reasons = {t.op: t.reason for r in be.reports for t in r.torch_ops}
    assert "mean/rstd outputs are used" in reasons["aten.native_layer_norm.default"]


class _Conv1D(torch.nn.Module):
    """GPT-2's Conv1D: ``addmm(bias, x.view(-1, K), w).view(..., N)`` with w [K, N]."""

    def __init__(self, k, n):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(torch.randn(k, n) * 0.1), torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        y = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return y.view(x.size()[:-1] + (self.weight.size(1),))


@pytest.mark.parametrize("proj", ["linear", "conv1d"])
def test_gemm_on_3d_rows_keeps_its_shape_for_the_epilogue(proj, monkeypatch, tmp_path):
    """nn.Linear / Conv1D on [batch, seq, K] decompose to view -> GEMM -> view: the GEMM runs on
    the 3-d rows, so no reshape stands between it and the GELU after it (which the CPU backend
    fuses into the GEMM's epilogue); a GEMM whose 2-d result has another reader keeps it."""
    from yirage.dynamo import cache
    from yirage.kernel import KNGraph

    graphs = []
    real_store = cache.store
    monkeypatch.setattr(cache, "store", lambda k, entry: (graphs.append(KNGraph.from_json(entry.graph)),
                                                           real_store(k, entry)))
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 32) if proj == "linear" else _Conv1D(16, 32)
    model = torch.nn.Sequential(layer, torch.nn.GELU(approximate="tanh")).eval()
    x = torch.randn(2, 5, 16)
    torch._dynamo.reset()
    out, _ = _compile_run(model, [x], cache_dir=str(tmp_path))   # a fresh cache: the graph is built
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), **TOL)
    (g,) = graphs
    (lin,) = [n for n in g.ops if n.op == "linear"]
    assert g.tensors[lin.output].shape == (2, 5, 32)
    assert not [n for n in g.ops if n.op == "reshape" and lin.output in n.inputs]

    def two_readers(x):   # the 2-d result is read twice: the GEMM stays on 2-d rows
        y = torch.addmm(layer.bias, x.view(-1, 16), layer.weight if proj == "conv1d" else layer.weight.t())
        return F.gelu(y.view(2, 5, 32)), y.sum(0)
    graphs.clear()
    torch._dynamo.reset()
    out, _ = _compile_run(two_readers, [x])
    with torch.no_grad():
        for got, want in zip(out, two_readers(x)):
            torch.testing.assert_close(got, want, **TOL)


def _rotary_attention(q_proj, k_proj, cos, sin, x, heads):
    """transformers' Llama RoPE on q and k heads made by view + transpose of projections."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, S, _ = x.shape
    q = q_proj(x).view(B, S, heads, -1).transpose(1, 2)
    k = k_proj(x).view(B, S, heads // 2, -1).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k


def test_transformers_rope_is_one_rotary_emb_op(monkeypatch, tmp_path):
    """transformers' apply_rotary_pos_emb (mul, two slices, neg, cat, mul, add per tensor)
    becomes one ``rotary_emb`` each for q and k, straight on the transposed heads (which the
    CPU executor then passes as a strided view), with no cat, neg or slice left, and matches
    eager; where the pattern differs (a cat of other halves) the ops lower as they are."""
    from yirage.dynamo import cache
    from yirage.kernel import KNGraph

    graphs = []
    real_store = cache.store
    monkeypatch.setattr(cache, "store", lambda k, entry: (graphs.append(KNGraph.from_json(entry.graph)),
                                                           real_store(k, entry)))
    torch.manual_seed(0)
    heads, D, B, S = 4, 16, 2, 6
    q_proj, k_proj = torch.nn.Linear(32, heads * D), torch.nn.Linear(32, heads // 2 * D)
    angles = torch.randn(B, S, D // 2).repeat(1, 1, 2)
    cos, sin, x = angles.cos(), angles.sin(), torch.randn(B, S, 32)

    def fn(x, cos, sin):
        return _rotary_attention(q_proj, k_proj, cos, sin, x, heads)
    torch._dynamo.reset()
    out, _ = _compile_run(fn, [x, cos, sin], cache_dir=str(tmp_path))
    with torch.no_grad():
        for got, want in zip(out, fn(x, cos, sin)):
            torch.testing.assert_close(got, want, **TOL)
    (g,) = graphs
    ops = [n.op for n in g.ops]
    assert ops.count("rotary_emb") == 2 and not {"cat", "neg", "slice"} & set(ops), ops
    producers = {n.output: n.op for n in g.ops}
    assert all(producers[n.inputs[0]] == "permute" for n in g.ops if n.op == "rotary_emb")

    def not_rope(x, cos, sin):   # the halves the other way round: not rotate_half
        half = x.shape[-1] // 2
        return x * cos + torch.cat([x[..., :half], -x[..., half:]], dim=-1) * sin
    graphs.clear()
    torch._dynamo.reset()
    xs = torch.randn(B, S, D)
    out, _ = _compile_run(not_rope, [xs, cos, sin], cache_dir=str(tmp_path))
    torch.testing.assert_close(out, not_rope(xs, cos, sin), **TOL)
    (g,) = graphs
    assert "rotary_emb" not in [n.op for n in g.ops]


def _fast_gelu(x):   # transformers' FastGELUActivation: the same function, other ops
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608028654 * (1.0 + 0.044715 * x * x)))


def _near_gelu(x):   # NewGELU with 0.0447 for 0.044715: not the tanh GELU
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.0447 * torch.pow(x, 3.0))))


@pytest.mark.parametrize("act, rewritten", [("gelu_new", True), ("gelu_fast", True), ("near", False),
                                            ("two_inputs", False)])
def test_written_out_tanh_gelu_is_one_gelu(act, rewritten, monkeypatch, tmp_path):
    """transformers' NewGELU (GPT-2's activation: 8 ATen ops) and FastGELU (other ops, the same
    function) become one ``gelu_tanh`` in the IR, with no tanh or pow left, and match eager;
    an expression that is close to but not the tanh GELU (another coefficient), or that reads a
    second tensor (here a weight of ones: the GELU's value, not its function), lowers as it is."""
    from transformers.activations import FastGELUActivation, NewGELUActivation

    from yirage.dynamo import cache
    from yirage.kernel import KNGraph

    graphs = []
    real_store = cache.store
    monkeypatch.setattr(cache, "store", lambda k, entry: (graphs.append(KNGraph.from_json(entry.graph)),
                                                           real_store(k, entry)))
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 32)
    fns = {"gelu_new": NewGELUActivation(), "gelu_fast": FastGELUActivation(), "near": _near_gelu,
           # the tanh GELU's value (w is ones), but w is a second tensor the result depends on
           "two_inputs": lambda y: 0.5 * y * (1.0 + torch.tanh(0.7978845608028654 * (y + 0.044715 * y * y * y * w)))}
    w = torch.ones(32)

    def fn(x):
        return fns[act](lin(x)) * 3.0
    x = torch.randn(2, 5, 16) * 3.0
    torch._dynamo.reset()
    out, _ = _compile_run(fn, [x], cache_dir=str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(out, fn(x), **TOL)
    (g,) = graphs
    ops = [n.op for n in g.ops]
    if rewritten:
        assert ops.count("gelu_tanh") == 1 and not {"tanh", "pow_scalar"} & set(ops), ops
    else:
        assert "gelu_tanh" not in ops and "tanh" in ops, ops


def test_written_out_gelu_matches_only_the_tanh_gelu():
    """The recognizer itself, on a traced graph: NewGELU and FastGELU (torch eager's own
    tanh GELU as the reference) are found at their last node, the near miss nowhere."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from transformers.activations import FastGELUActivation, NewGELUActivation

    from yirage.dynamo.lowering import _written_out_gelu_tanh

    x = torch.randn(4, 8)
    for fn, found in ((NewGELUActivation(), True), (FastGELUActivation(), True), (_near_gelu, False)):
        gm = make_fx(fn)(x)   # records each node's value as meta["val"]
        hits = [n for n in gm.graph.nodes if _written_out_gelu_tanh(n) is not None]
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        assert hits == ([out] if found else []), (fn, hits)
        if found:
            torch.testing.assert_close(fn(x), F.gelu(x, approximate="tanh"), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kept, rewritten", [("aten.mul", "yirage.rotary_emb.default"),
                                             ("aten.addmm", "aten.linear.default")])
def test_torch_executed_ops_are_not_folded_into_a_rewrite(kept, rewritten):
    """An op the user keeps in torch (``torch_executed_ops``) stays a torch op even where a
    rewrite would fold it into another (RoPE's multiplies into ``rotary_emb``, nn.Linear's addmm
    into ``linear``); the result matches eager."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    def fn(x, cos, sin):
        return _rope(lin(x), cos, sin)
    x, cos, sin = torch.randn(2, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    torch._dynamo.reset()
    out, be = _compile_run(fn, [x, cos, sin], torch_executed_ops=[kept])
    with torch.no_grad():
        torch.testing.assert_close(out, fn(x, cos, sin), **TOL)
    ran = {o for r in be.reports for p in r.partitions if p.runs_in == "yirage" for o in p.ops}
    assert rewritten not in ran
    assert any(t.op.startswith(kept) for r in be.reports for t in r.torch_ops)
