"""The op table: one entry per IR op with its shape rule and its reference meaning.

Each ``OpDef`` has
- ``kind``: how the optimizer treats it: ``elementwise`` (fusable, same shape in and out
  after broadcasting), ``row`` (a reduction/normalization over trailing dims, fusable),
  or ``library`` (a kernel of its own: GEMM, attention, ...),
- ``infer(inputs, attrs) -> (shape, dtype)``: checks the inputs and raises ``ValueError``
  naming the op, the shapes and the rule broken,
- ``reference(args, attrs) -> tensor``: the meaning of the op in torch eager. The reference
  interpreter (interpret.py) is built from these and is the ground truth for every kernel,
- ``mutates``: the positions of the inputs the op writes in place (attention appends k and
  v to the KV cache inputs 3 and 4); schedulers must not reorder a reader of such an input
  across the op,
- ``index_input``: the position of the input holding run-time indices (embedding's ids,
  RoPE's and attention's start_pos, rope_rows' and attention_rows' positions; attention_rows
  also indexes with its slots, input 5; index_select's and gather's index), or None. Kernels check those values against the
  buffer they index before any read or write and report a violation, which the executor
  (and every reference here) raises as ``IndexOutOfRangeError`` (``index_error``).

This module must never generate code or depend on a backend.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..dtypes import DType
from ..errors import GraphError, IndexOutOfRangeError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class TensorType:
    """Static type of an IR tensor: logical shape and element type."""

    shape: Shape
    dtype: DType


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: str  # "elementwise" | "row" | "library"
    arity: int  # number of inputs; -1 when it varies (linear's optional bias)
    infer: Callable[[list[TensorType], dict], TensorType]
    reference: Callable[[list[torch.Tensor], dict], torch.Tensor]
    mutates: tuple[int, ...] = ()  # positions of the inputs written in place
    index_input: int | None = None  # position of the input holding run-time indices


OPS: dict[str, OpDef] = {}


def _register(name, kind, arity, infer, reference, mutates=(), index_input=None):
    OPS[name] = OpDef(name, kind, arity, infer, reference, tuple(mutates), index_input)


#: What the run-time index of each checked op is called in error messages.
INDEX_NAMES = {"embedding": "token id", "rope": "start_pos", "attention": "start_pos",
               "rope_rows": "position", "attention_rows": "slot or position",
               "index_select": "index", "gather": "index"}


def index_error(op: str, value: int, lo: int, hi: int) -> IndexOutOfRangeError:
    """The error for a run-time index ``value`` of ``op`` outside ``[lo, hi)``."""
    hint = {"embedding": "token ids must be below the embedding table's row count (the vocabulary)",
            "rope": "start_pos + T must not exceed the rows of the cos/sin tables",
            "attention": "start_pos + T must not exceed the rows of the KV cache (max_seq_length)",
            "rope_rows": "every row's position must be below the rows of the cos/sin tables",
            "attention_rows": "every row's slot must be below the KV cache's slot count and its position "
                              "below its length (max_seq_length)",
            "index_select": "every index must be below the size of the indexed dim",
            "gather": "every index must be below the size of the indexed dim",
            }.get(op, "")
    return IndexOutOfRangeError(f"{op}: {INDEX_NAMES.get(op, 'index')} {value} is out of range "
                                f"[{lo}, {hi}): {hint}")


def _check_start(op: str, start: int, T: int, rows: int) -> None:
    if not 0 <= start <= rows - T:
        raise index_error(op, start, 0, rows - T + 1)


def _fail(op: str, types: list[TensorType], rule: str):
    shapes = ", ".join(str(tuple(t.shape)) for t in types)
    raise GraphError(f"{op}: incompatible inputs with shapes {shapes}: {rule}")


def broadcast_shape(op: str, a: TensorType, b: TensorType) -> Shape:
    """torch broadcasting of two shapes; ValueError naming the op and both shapes."""
    out = []
    for i in range(1, max(len(a.shape), len(b.shape)) + 1):
        x = a.shape[-i] if i <= len(a.shape) else 1
        y = b.shape[-i] if i <= len(b.shape) else 1
        if x != y and 1 not in (x, y):
            _fail(op, [a, b], f"dims {x} and {y} at position -{i} must be equal or 1 to broadcast")
        out.append(max(x, y))
    return tuple(reversed(out))


def _float(op: str, types: list[TensorType]):
    for t in types:
        if not t.dtype.is_float:
            _fail(op, types, f"needs floating-point inputs, got {t.dtype.value}")


def _unary_infer(name):
    def infer(ts, attrs):
        _float(name, ts)
        return ts[0]
    return infer


def _binary_infer(name):
    def infer(ts, attrs):
        _float(name, ts)
        a, b = ts
        if a.dtype != b.dtype:
            _fail(name, ts, f"dtypes must match, got {a.dtype.value} and {b.dtype.value}")
        return TensorType(broadcast_shape(name, a, b), a.dtype)
    return infer


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (Hendrycks & Gimpel 2016): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
    torch's ``F.gelu(x, approximate="tanh")`` (transformers' ``gelu_pytorch_tanh``, Gemma's MLP)."""
    return F.gelu(x, approximate="tanh")


UNARY: dict[str, Callable] = {
    "exp": torch.exp, "sqrt": torch.sqrt, "square": torch.square, "silu": F.silu,
    "gelu": F.gelu, "gelu_tanh": _gelu_tanh, "relu": torch.relu, "rsqrt": torch.rsqrt, "neg": torch.neg,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "erf": torch.erf, "log": torch.log, "exp2": torch.exp2,
    "abs": torch.abs, "reciprocal": torch.reciprocal, "cos": torch.cos, "sin": torch.sin,
    "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc,
}
BINARY: dict[str, Callable] = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
                               "maximum": torch.maximum, "minimum": torch.minimum, "pow": torch.pow}
#: comparisons: two inputs of one float (or bool) dtype, a bool output
COMPARE: dict[str, Callable] = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le,
                                "gt": torch.gt, "ge": torch.ge}
#: logical ops over bool inputs, a bool output
LOGICAL: dict[str, Callable] = {"logical_and": torch.logical_and, "logical_or": torch.logical_or,
                                "logical_not": torch.logical_not}

for _n, _f in UNARY.items():
    _register(_n, "elementwise", 1, _unary_infer(_n),
              (lambda f: lambda args, attrs: f(args[0]))(_f))
for _n, _f in BINARY.items():
    _register(_n, "elementwise", 2, _binary_infer(_n),
              (lambda f: lambda args, attrs: f(args[0], args[1]))(_f))


def _row_dtype(t: TensorType) -> bool:
    """True for the dtypes a row program loads and stores: the float types and bool."""
    return t.dtype.is_float or t.dtype == DType.bool


def _compare_infer(name):
    def infer(ts, attrs):
        a, b = ts
        if not (_row_dtype(a) and a.dtype == b.dtype):
            _fail(name, ts, f"needs two floating-point (or two bool) inputs of one dtype, got "
                            f"{a.dtype.value} and {b.dtype.value}")
        return TensorType(broadcast_shape(name, a, b), DType.bool)
    return infer


def _logical_infer(name):
    def infer(ts, attrs):
        if any(t.dtype != DType.bool for t in ts):
            _fail(name, ts, f"needs bool inputs, got {', '.join(t.dtype.value for t in ts)}")
        shape = ts[0].shape if len(ts) == 1 else broadcast_shape(name, ts[0], ts[1])
        return TensorType(shape, DType.bool)
    return infer


def _where_infer(ts, attrs):
    c, a, b = ts
    if c.dtype != DType.bool:
        _fail("where", ts, f"the condition must be bool, got {c.dtype.value}")
    if not (_row_dtype(a) and a.dtype == b.dtype):
        _fail("where", ts, f"the two branches must share one floating-point (or bool) dtype, got "
                           f"{a.dtype.value} and {b.dtype.value}")
    shape = broadcast_shape("where", TensorType(broadcast_shape("where", c, a), a.dtype), b)
    return TensorType(shape, a.dtype)


for _n, _f in COMPARE.items():
    _register(_n, "elementwise", 2, _compare_infer(_n), (lambda f: lambda args, attrs: f(args[0], args[1]))(_f))
for _n, _f in LOGICAL.items():
    _register(_n, "elementwise", 1 if _n == "logical_not" else 2, _logical_infer(_n),
              (lambda f: lambda args, attrs: f(*args))(_f))
_register("where", "elementwise", 3, _where_infer, lambda args, a: torch.where(args[0], args[1], args[2]))
_register("pow_scalar", "elementwise", 1, _unary_infer("pow_scalar"),
          lambda args, a: torch.pow(args[0], a["exponent"]))


def _cast_infer(ts, attrs):
    if not (_row_dtype(ts[0]) or ts[0].dtype in (DType.int32, DType.int64)):
        _fail("cast", ts, f"casts floating-point, bool, int32 and int64 tensors, got {ts[0].dtype.value}")
    return TensorType(ts[0].shape, DType(attrs["dtype"]))


_register("cast", "elementwise", 1, _cast_infer,
          lambda args, a: args[0].to(DType(a["dtype"]).torch_dtype))
_register("clamp", "elementwise", 1, _unary_infer("clamp"),
          lambda args, a: torch.clamp(args[0], a["min_val"], a["max_val"]))
_register("scale", "elementwise", 1, _unary_infer("scale"),
          lambda args, a: args[0] * a["factor"])


# ---- row ops: reductions and normalizations over trailing dims ----------------------------

def _norm_dim(op: str, t: TensorType, dim: int) -> int:
    if not -len(t.shape) <= dim < len(t.shape):
        _fail(op, [t], f"dim {dim} is out of range for a {len(t.shape)}-d tensor")
    return dim % len(t.shape)


def _reduction_infer(ts, attrs):
    _float("reduction", ts)
    d = _norm_dim("reduction", ts[0], attrs["dim"])
    shape = list(ts[0].shape)
    shape[d] = 1
    return TensorType(tuple(shape), ts[0].dtype)


def _reduction_ref(args, attrs):
    x = args[0]
    return x.float().sum(dim=attrs["dim"], keepdim=True).to(x.dtype)


def _rms_norm_infer(ts, attrs):
    _float("rms_norm", ts)
    ns = tuple(attrs["normalized_shape"])
    if not ns or tuple(ts[0].shape[-len(ns):]) != ns or len(ns) > len(ts[0].shape):
        _fail("rms_norm", ts, f"normalized_shape {ns} must equal the trailing dims of the input")
    return ts[0]


def _rms_norm_ref(args, attrs):
    x = args[0]
    dims = tuple(range(-len(attrs["normalized_shape"]), 0))
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(dim=dims, keepdim=True) + attrs["eps"])
    return y.to(x.dtype)


def _softmax_infer(ts, attrs, name="softmax"):
    _float(name, ts)
    _norm_dim(name, ts[0], attrs["dim"])
    return ts[0]


def _layer_norm_infer(ts, attrs):
    _float("layer_norm", ts)
    x = ts[0]
    ns = tuple(attrs["normalized_shape"])
    if not ns or len(ns) > len(x.shape) or tuple(x.shape[-len(ns):]) != ns:
        _fail("layer_norm", ts, f"normalized_shape {ns} must equal the trailing dims of the input")
    n_affine = (1 if attrs.get("has_weight") else 0) + (1 if attrs.get("has_bias") else 0)
    if len(ts) != 1 + n_affine:
        _fail("layer_norm", ts, f"takes x plus {n_affine} affine input(s) (weight, bias), got {len(ts) - 1}")
    for t in ts[1:]:
        if tuple(t.shape) != ns or t.dtype != x.dtype:
            _fail("layer_norm", ts, f"weight and bias must have shape {ns} and x's dtype {x.dtype.value}")
    return x


def layer_norm_reference(args, attrs):
    """LayerNorm (Ba et al. 2016) as ``F.layer_norm``: (x - mean) / sqrt(var + eps) * weight + bias
    over the trailing dims ``normalized_shape`` (biased variance), in float32, cast back to x's dtype.
    ``args`` is [x] plus weight (if ``has_weight``) and bias (if ``has_bias``)."""
    x, rest = args[0], list(args[1:])
    w = rest.pop(0).float() if attrs.get("has_weight") else None
    b = rest.pop(0).float() if attrs.get("has_bias") else None
    return F.layer_norm(x.float(), tuple(attrs["normalized_shape"]), w, b, attrs["eps"]).to(x.dtype)


def _dims_infer(name):
    """Shape rule of the any-dim reductions: ``attrs["dims"]``, in-range dims (negative count from
    the end) that form one contiguous range; the output keeps them with size 1."""
    def infer(ts, attrs):
        _float(name, ts)
        x = ts[0]
        dims = sorted(_norm_dim(name, x, d) for d in attrs["dims"])
        if not dims or dims != list(range(dims[0], dims[0] + len(dims))):
            _fail(name, ts, f"dims {tuple(attrs['dims'])} must be one or more distinct, adjacent dims "
                            "(reduce non-adjacent dims one after the other)")
        shape = list(x.shape)
        for d in dims:
            shape[d] = 1
        return TensorType(tuple(shape), x.dtype)
    return infer


def _var_ref(x: torch.Tensor, dims, correction: float) -> torch.Tensor:
    """torch.var, quiet about N - correction <= 0 (the result is then inf or NaN, as asked)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="var\\(\\): degrees of freedom")
        return torch.var(x, dim=dims, correction=correction, keepdim=True)


#: any-dim reductions: the torch function over float32 (keepdim=True), then cast back
REDUCTIONS: dict[str, Callable] = {
    "sum": lambda x, dims, a: x.sum(dim=dims, keepdim=True),
    "mean": lambda x, dims, a: x.mean(dim=dims, keepdim=True),
    "amax": lambda x, dims, a: x.amax(dim=dims, keepdim=True),
    "amin": lambda x, dims, a: x.amin(dim=dims, keepdim=True),
    "var": lambda x, dims, a: _var_ref(x, dims, a["correction"]),
}

_register("reduction", "row", 1, _reduction_infer, _reduction_ref)
for _n, _f in REDUCTIONS.items():
    _register(_n, "row", 1, _dims_infer(_n),
              (lambda f: lambda args, a: f(args[0].float(), tuple(a["dims"]), a).to(args[0].dtype))(_f))
_register("log_softmax", "row", 1, lambda ts, attrs: _softmax_infer(ts, attrs, "log_softmax"),
          lambda args, a: torch.log_softmax(args[0].float(), dim=a["dim"]).to(args[0].dtype))
_register("layer_norm", "row", -1, _layer_norm_infer, layer_norm_reference)
_register("rms_norm", "row", 1, _rms_norm_infer, _rms_norm_ref)
_register("softmax", "row", 1, _softmax_infer,
          lambda args, a: torch.softmax(args[0].float(), dim=a["dim"]).to(args[0].dtype))


# ---- library ops: each runs as its own kernel ---------------------------------------------

def _matmul_infer(ts, attrs):
    a, b = ts
    _float("matmul", ts)
    if a.dtype != b.dtype:
        _fail("matmul", ts, f"dtypes must match, got {a.dtype.value} and {b.dtype.value}")
    if len(a.shape) < 2 or len(b.shape) < 2:
        _fail("matmul", ts, "both inputs need at least 2 dims (matmul multiplies the last two)")
    if a.shape[-1] != b.shape[-2]:
        _fail("matmul", ts, f"inner dims must agree: {a.shape[-1]} != {b.shape[-2]}")
    batch = broadcast_shape("matmul", TensorType(a.shape[:-2], a.dtype), TensorType(b.shape[:-2], b.dtype))
    return TensorType((*batch, a.shape[-2], b.shape[-1]), a.dtype)


def dequantize(w: torch.Tensor, dtype: DType, shape: Shape) -> torch.Tensor:
    """Float32 values of a weight; block-quantized storage is decoded per the GGML formats.

    Args:
        w: storage (``uint8`` of ``dtype.storage_shape(shape)`` for the block-quantized types).
        shape: logical shape; the last dim is the blocked one.
    Returns: float32 tensor of ``shape`` on w's device, bitwise the values of gguf-py's
    ``gguf.quants.dequantize`` (llama.cpp ggml-common.h layouts): q8_0 and q4_1 decoded in torch,
    the other types (q4_0, q5_0, q5_1, q2_k .. q6_k) by ``gguf.quants.dequantize`` itself on the CPU.
    """
    if not dtype.is_quantized:
        return w.float()
    if dtype in PLAIN_TYPES:   # a row-group layout: its plain blocks
        return dequantize(from_row_groups(w.reshape(shape[0], -1), PLAIN_TYPES[dtype]), PLAIN_TYPES[dtype], shape)
    per, nbytes = dtype.block
    blocks = w.reshape(-1, nbytes)
    if dtype not in (DType.q8_0, DType.q4_1):
        import gguf

        kind = gguf.GGMLQuantizationType[dtype.value.upper()]
        vals = gguf.quants.dequantize(blocks.detach().cpu().numpy(), kind)
        return torch.from_numpy(vals.astype("float32", copy=False)).to(w.device).reshape(shape)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if dtype == DType.q8_0:
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        vals = d * q
    else:  # q4_1: d, m, then 16 bytes: low nibbles are weights 0..15, high nibbles 16..31
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()
        qs = blocks[:, 4:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()
        vals = d * q + m
    return vals.reshape(shape)


#: rows per group of the row-group layouts (kernels/cpu/row_groups.h)
ROW_GROUP = 16
#: each plain block format with a row-group layout, and that layout's dtype
ROW_GROUP_TYPES = {DType.q4_1: DType.q4_1r16, DType.q8_0: DType.q8_0r16}
#: the plain format of each row-group dtype
PLAIN_TYPES = {v: k for k, v in ROW_GROUP_TYPES.items()}


def _row_group_fields(dtype: DType) -> tuple[int, int, int]:
    """(2-byte scale fields, quant bytes, block bytes) of a plain format with a row-group layout."""
    nbytes = dtype.block[1]
    fields = {DType.q4_1: 2, DType.q8_0: 1}[dtype]
    return fields, nbytes - 2 * fields, nbytes


def to_row_groups(w: torch.Tensor, dtype: DType) -> torch.Tensor:
    """``dtype`` (q4_1 or q8_0) storage [N, K/32 * block bytes] (uint8, N a multiple of 16)
    reordered as its row-group layout (``ROW_GROUP_TYPES``): rows 16g..16g+15 become group g, its
    blocks in order, each a unit of 16 blocks {each 2-byte scale field of the 16 rows (d, and m for
    q4_1), then for j = 0, 1, .. the quant bytes qs[4j..4j+3] of the 16 rows} (the layout of
    kernels/cpu/row_groups.h; llama.cpp's ggml-cpu repack.cpp interleaves Q4_0 rows alike). Same
    bytes, a new tensor. Raises ValueError for another shape or format."""
    if dtype not in ROW_GROUP_TYPES:
        raise ValueError(f"to_row_groups: no row-group layout for {dtype.value}; use one of "
                         f"{[d.value for d in ROW_GROUP_TYPES]}")
    fields, qbytes, nbytes = _row_group_fields(dtype)
    N, rowbytes = w.shape
    if w.dtype != torch.uint8 or N % ROW_GROUP or rowbytes % nbytes:
        raise ValueError(f"to_row_groups takes {dtype.value} storage [N, K/32*{nbytes}] uint8 with N a multiple "
                         f"of {ROW_GROUP}, got {tuple(w.shape)} {w.dtype}")
    nb, G = rowbytes // nbytes, N // ROW_GROUP
    b = w.reshape(G, ROW_GROUP, nb, nbytes)
    scales = b[..., :2 * fields].reshape(G, ROW_GROUP, nb, fields, 2).permute(0, 2, 3, 1, 4)
    qs = b[..., 2 * fields:].reshape(G, ROW_GROUP, nb, qbytes // 4, 4).permute(0, 2, 3, 1, 4)
    return torch.cat([scales.reshape(G, nb, -1), qs.reshape(G, nb, -1)], dim=2).reshape(N, rowbytes)


def from_row_groups(w: torch.Tensor, dtype: DType) -> torch.Tensor:
    """The inverse of ``to_row_groups``: row-group storage back to plain ``dtype`` storage."""
    fields, qbytes, nbytes = _row_group_fields(dtype)
    N, rowbytes = w.shape
    nb, G = rowbytes // nbytes, N // ROW_GROUP
    u = w.reshape(G, nb, ROW_GROUP * nbytes)
    scales = u[..., :32 * fields].reshape(G, nb, fields, ROW_GROUP, 2).permute(0, 1, 3, 2, 4)
    qs = u[..., 32 * fields:].reshape(G, nb, qbytes // 4, ROW_GROUP, 4).permute(0, 1, 3, 2, 4)
    blocks = torch.cat([scales.reshape(G, nb, ROW_GROUP, -1), qs.reshape(G, nb, ROW_GROUP, -1)], dim=3)
    return blocks.permute(0, 2, 1, 3).reshape(N, rowbytes)


#: linear's ``weight_layout`` attr: "nk" (the default: [out_features, in_features], nn.Linear's)
#: or "kn" ([in_features, out_features]: ``x @ w``, as GPT-2's Conv1D and ``addmm`` store it)
WEIGHT_LAYOUTS = ("nk", "kn")


def linear_nk(w_shape, attrs) -> tuple[int, int]:
    """(out_features N, in_features K) of a ``linear`` weight of shape ``w_shape``."""
    N, K = w_shape
    return (K, N) if attrs.get("weight_layout", "nk") == "kn" else (N, K)


def _linear_infer(ts, attrs):
    x, w = ts[0], ts[1]
    if not x.dtype.is_float:
        _fail("linear", ts, f"x must be floating point, got {x.dtype.value}")
    if len(w.shape) != 2:
        _fail("linear", ts, "weight must be 2-d [out_features, in_features]")
    layout = attrs.get("weight_layout", "nk")
    if layout not in WEIGHT_LAYOUTS or (layout == "kn" and w.dtype != x.dtype):
        _fail("linear", ts, f"weight_layout must be one of {WEIGHT_LAYOUTS} ('kn' for a float weight of x's "
                            f"dtype only), got {layout!r}")
    N, K = linear_nk(w.shape, attrs)
    if x.shape[-1] != K:
        _fail("linear", ts, f"x's last dim {x.shape[-1]} must equal the weight's in_features {K}")
    mixed = x.dtype == DType.float32 and w.dtype == DType.bfloat16   # bfloat16 GEMM, float32 activations
    if not w.dtype.is_quantized and w.dtype != x.dtype and not mixed:
        _fail("linear", ts, f"dtypes must match (or float32 x with a bfloat16 weight), got {x.dtype.value} "
                            f"and {w.dtype.value}")
    if len(ts) == 3 and (tuple(ts[2].shape) != (N,) or ts[2].dtype != x.dtype):
        _fail("linear", ts, f"bias must have shape ({N},) and x's dtype {x.dtype.value}")
    if w.dtype in PLAIN_TYPES and N % ROW_GROUP:
        _fail("linear", ts, f"a {w.dtype.value} weight needs out_features a multiple of {ROW_GROUP}, got {N}")
    compute = attrs.get("compute_dtype")
    if compute == "int8":
        if x.dtype != DType.float32 or w.dtype not in INT8_COMPUTE_WEIGHTS or layout != "nk":
            _fail("linear", ts, "compute_dtype='int8' needs float32 x and a q4_1 or q8_0 weight "
                                f"([out_features, in_features]), got {x.dtype.value} and {w.dtype.value}")
    elif compute is not None and (compute != "bfloat16" or x.dtype != DType.float32
                                  or not (w.dtype.is_quantized or w.dtype == DType.float32)):
        _fail("linear", ts, f"compute_dtype={compute!r}: only 'bfloat16', with float32 x and a float32 or "
                            "block-quantized weight (a bfloat16 weight computes in bfloat16 already), or 'int8', "
                            "with float32 x and a q4_1 or q8_0 weight")
    return TensorType((*x.shape[:-1], N), x.dtype)


#: the weight formats whose ``linear`` may take ``compute_dtype='int8'``
INT8_COMPUTE_WEIGHTS = (DType.q4_1, DType.q4_1r16, DType.q8_0, DType.q8_0r16)


def quantize_blocks_int8(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` [..., K] (K a multiple of 32) as ``linear``'s ``compute_dtype='int8'`` sees
    it: each block of 32 consecutive values quantized to int8 with its own scale amax / 127
    (``quantize_rows_int8`` per block: round-half-even, a zero block stays zero) and decoded
    back to float32 (q * scale). llama.cpp's q8 activations of its quantized GEMVs."""
    q, s = quantize_rows_int8(x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32))
    return (q.float() * s).reshape(x.shape)


def _linear_ref(args, attrs):
    """x @ W^T (+ bias) computed in float32 (block-quantized W decoded first), then cast to
    x's dtype: what every linear kernel computes (float32 accumulation). A bfloat16 W with
    float32 x is a bfloat16 GEMM: x rounded to bfloat16 (nearest even), products summed in
    float32, the sum rounded to bfloat16 (what oneDNN's bfloat16 GEMM returns, as torch's
    autocast computes a linear layer), then the float32 bias added; float32 out. A float32 or
    block-quantized W with ``compute_dtype='bfloat16'`` is decoded, rounded to bfloat16, and then
    the same.
    ``weight_layout='kn'``: W is stored [K, N] (x @ W). ``compute_dtype='int8'`` (q4_1/q8_0 W):
    x quantized per block of 32 first (``quantize_blocks_int8``), then the float32 product
    (the kernels' integer block sums are exact; only their float combination rounds)."""
    x, w = args[0], args[1]
    if attrs.get("compute_dtype") == "int8":
        x = quantize_blocks_int8(x)
    if attrs.get("weight_layout") == "kn":
        w = w.t()
    if attrs.get("w_dtype"):
        w = dequantize(w, DType(attrs["w_dtype"]), tuple(attrs["w_shape"]))
    if attrs.get("compute_dtype") == "bfloat16":
        w = w.to(torch.bfloat16)
    if x.dtype == torch.float32 and w.dtype == torch.bfloat16:
        y = F.linear(x.to(torch.bfloat16), w).float()
        return y + args[2] if len(args) == 3 else y
    if x.dtype == torch.float32:
        return F.linear(x, w, args[2] if len(args) == 3 else None)
    bias = args[2].float() if len(args) == 3 else None
    return F.linear(x.float(), w.float(), bias).to(x.dtype)


def _stack_parts(ts, attrs) -> tuple[list, list]:
    """(weights, biases) of a ``linear_stack`` (biases empty without ``bias``)."""
    k = attrs["parts"]
    return ts[1:1 + k], ts[1 + k:]


def _linear_stack_infer(ts, attrs):
    k = attrs.get("parts")
    if not isinstance(k, int) or k < 1 or len(ts) != 1 + k * (2 if attrs.get("bias") else 1):
        _fail("linear_stack", ts, f"needs x, the {k} weights and, with bias=True, their {k} biases")
    weights, biases = _stack_parts(ts, attrs)
    x = ts[0]
    for w in weights:
        if w.dtype != x.dtype or not x.dtype.is_float or len(w.shape) != 2 or w.shape != weights[0].shape:
            _fail("linear_stack", ts, "every weight must be a 2-d float tensor of x's dtype and of the first's shape")
    shapes = [_linear_infer([x, w] + ([b] if biases else []),
                            {"weight_layout": attrs.get("weight_layout", "nk")}).shape
              for w, b in zip(weights, biases or weights)]
    return TensorType((k, *shapes[0]), x.dtype)


def _linear_stack_ref(args, attrs):
    """torch.stack of the k linear layers of x (``_linear_ref`` each): [k, ..., N]."""
    k, bias = attrs["parts"], attrs.get("bias")
    layout = {"weight_layout": attrs.get("weight_layout", "nk")}
    return torch.stack([_linear_ref([args[0], args[1 + i]] + ([args[1 + k + i]] if bias else []), layout)
                        for i in range(k)])


def _linear_w8a8_infer(ts, attrs):
    x, w = ts[0], ts[1]
    if x.dtype != DType.float32:
        _fail("linear_w8a8", ts, f"x must be float32, got {x.dtype.value}")
    if len(w.shape) != 2 or w.dtype != DType.int8:
        _fail("linear_w8a8", ts, "the weight must be int8 [in_features, out_features] (transposed)")
    K, N = w.shape
    if x.shape[-1] != K:
        _fail("linear_w8a8", ts, f"x's last dim {x.shape[-1]} must equal the weight's in_features {K}")
    for t in ts[2:]:
        if tuple(t.shape) != (N,) or t.dtype != DType.float32:
            _fail("linear_w8a8", ts, f"weight scales and bias must be float32 ({N},)")
    if len(ts) not in (3, 4):
        _fail("linear_w8a8", ts, "takes x, weight, weight scales and an optional bias")
    G = attrs.get("group_size", 0)
    if not isinstance(G, int) or G < 0 or (G and (K % G or G % 4)):
        _fail("linear_w8a8", ts, f"group_size must be 0 or a multiple of 4 dividing in_features {K}, got {G!r}")
    return TensorType((*x.shape[:-1], N), x.dtype)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each row (last dim) of float ``x``: (q int8, scale float32
    [..., 1]) with ``x ~ q * scale``, scale = max|row| / 127 (a zero row gets scale 1), q =
    round-half-even(x / scale) in [-127, 127]."""
    s = x.abs().amax(dim=-1, keepdim=True).float() / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x.float() / s).clamp_(-127, 127).to(torch.int8), s


def linear_w8a8_reference(x, w_t, w_scale, bias=None, group_size: int = 0):
    """W8A8 linear: int8 weights quantized per output channel, float32 activations quantized
    per token (row) on the fly, integer dot products (exact int32 accumulation), then
    ``acc * x_scale[m] * w_scale[n] + bias[n]`` in float32. ``w_t`` is int8 [K, N] (the
    transposed weight: in_features x out_features), ``w_scale``/``bias`` float32 [N].
    Dynamic per-token activation quantization as in LLM.int8()/SmoothQuant (Dettmers et al. 2022;
    Xiao et al. 2023) without outlier handling. ``group_size`` G > 0 quantizes each token per
    group of G consecutive features (its own scale each; G divides K): y = (sum over groups of
    the group's exact integer dot product * its x scale) * w_scale + bias, in float32."""
    K = w_t.shape[0]
    if group_size:
        M = x.numel() // K
        q, s = quantize_rows_int8(x.reshape(M, K // group_size, group_size))  # [M, g, G], [M, g, 1]
        wg = w_t.double().reshape(K // group_size, group_size, -1)              # [g, G, N]
        acc = torch.einsum("mgk,gkn->mgn", q.double(), wg)                        # exact per group
        y = (acc.float() * s).sum(1) * w_scale.float()
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], w_t.shape[1])
    q, s = quantize_rows_int8(x.reshape(-1, K))
    acc = torch.matmul(q.double(), w_t.double())  # exact (|acc| <= 127^2 K << 2^53); any device
    y = acc.float() * s * w_scale.float()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], w_t.shape[1])


def _embedding_infer(ts, attrs):
    ids, table = ts
    if ids.dtype not in (DType.int32, DType.int64):
        _fail("embedding", ts, f"ids must be int32 or int64, got {ids.dtype.value}")
    if len(table.shape) != 2:
        _fail("embedding", ts, "table must be 2-d [vocab, dim]")
    if table.dtype == DType.q4_1r16:
        _fail("embedding", ts, "q4_1r16 is a linear weight layout; keep an embedding table in q4_1")
    if table.dtype in PLAIN_TYPES and table.shape[0] % ROW_GROUP:
        _fail("embedding", ts, f"a {table.dtype.value} table needs a vocabulary that is a multiple of {ROW_GROUP}, "
                               f"got {table.shape[0]}")
    out = DType.float32 if table.dtype.is_quantized else table.dtype
    return TensorType((*ids.shape, table.shape[1]), out)


def _embedding_ref(args, attrs):
    ids, table = args
    V = table.shape[0]
    bad = (ids < 0) | (ids >= V)
    if bool(bad.any()):
        raise index_error("embedding", int(ids[bad][0]), 0, V)
    if attrs.get("w_dtype"):
        table = dequantize(table, DType(attrs["w_dtype"]), tuple(attrs["w_shape"]))
    return F.embedding(ids.long(), table)


def _rope_infer(ts, attrs):
    x, cos, sin, pos = ts
    if len(x.shape) != 3 or x.shape[-1] % 2:
        _fail("rope", ts, "x must be [T, heads, head_dim] with an even head_dim")
    if len(cos.shape) != 2 or cos.shape != sin.shape or cos.shape[1] != x.shape[-1] // 2:
        _fail("rope", ts, "cos and sin tables must both be [max_seq, head_dim // 2]")
    if pos.shape != (1,) or pos.dtype != DType.int64:
        _fail("rope", ts, "start_pos must be an int64 tensor of shape (1,)")
    if not x.dtype.is_float or cos.dtype != DType.float32 or sin.dtype != DType.float32:
        _fail("rope", ts, "x must be floating point and the cos/sin tables float32")
    return x


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int) -> torch.Tensor:
    """Rotate-half RoPE (Su et al. 2021, as in transformers' Llama): x is [T, H, Dh] (any float
    dtype, computed in float32 and cast back), cos/sin [max_seq, Dh/2] float32."""
    T, half = x.shape[0], x.shape[-1] // 2
    _check_start("rope", start, T, cos.shape[0])
    c = cos[start:start + T].unsqueeze(1)
    s = sin[start:start + T].unsqueeze(1)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def _rotary_emb_infer(ts, attrs):
    x, cos, sin = ts
    if not 1 <= len(x.shape) <= 4 or x.shape[-1] % 2:
        _fail("rotary_emb", ts, "x must have 1 to 4 dims with an even last dim (the head dim)")
    if not x.dtype.is_float or cos.dtype != x.dtype or sin.dtype != x.dtype:
        _fail("rotary_emb", ts, "x must be floating point and cos and sin of x's dtype")
    for t in (cos, sin):
        if len(t.shape) > len(x.shape) or not t.shape or t.shape[-1] != x.shape[-1] or (
                broadcast_shape("rotary_emb", x, t) != tuple(x.shape)):
            _fail("rotary_emb", ts, "cos and sin must broadcast to x's shape, with x's last dim")
    return x


def rotary_emb_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with per-element tables (Su et al. 2021; transformers'
    ``apply_rotary_pos_emb``): ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) =
    cat(-x[..., D/2:], x[..., :D/2])``, cos and sin broadcast to x [..., D]; computed in float32
    and cast back to x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos.float() + rotated * sin.float()).to(x.dtype)


#: the dtypes attention and attention_rows take (a float16 KV cache: kv_cache_dtype='float16')
KV_DTYPES_RULE = ("q, k, v and the KV caches must share one floating-point dtype, or the caches be float16 "
                  "with float32 q, k, v (a float16 KV cache)")


def _kv_dtypes_ok(ts) -> bool:
    """q, k, v and the two caches: one float dtype, or float32 q, k, v with float16 caches."""
    q, k, v, kc, vc = (t.dtype for t in ts)
    if not q.is_float or k != q or v != q or kc != vc:
        return False
    return kc == q or (q == DType.float32 and kc == DType.float16)


def _attention_infer(ts, attrs):
    q, k, v, kc, vc, pos = ts
    if len(q.shape) != 3 or len(k.shape) != 3 or k.shape != v.shape:
        _fail("attention", ts, "q must be [T, Hq, Dh]; k and v [T, Hkv, Dh]")
    T, hq, dh = q.shape
    if k.shape[0] != T or k.shape[2] != dh or hq % k.shape[1]:
        _fail("attention", ts, "k/v must have the same T and Dh as q, and Hq divisible by Hkv (GQA)")
    if kc.shape != vc.shape or len(kc.shape) != 3 or kc.shape[1:] != k.shape[1:]:
        _fail("attention", ts, "KV caches must both be [max_seq, Hkv, Dh]")
    if pos.shape != (1,) or pos.dtype != DType.int64:
        _fail("attention", ts, "start_pos must be an int64 tensor of shape (1,)")
    if not _kv_dtypes_ok(ts[:5]):
        _fail("attention", ts, KV_DTYPES_RULE)
    window = attrs.get("window", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise GraphError(f"attention: window must be 0 (full causal) or a positive integer, got {window!r}")
    return q


def attention_reference(q, k, v, k_cache, v_cache, start: int, scale: float, window: int = 0) -> torch.Tensor:
    """Causal GQA attention over a KV cache; writes k, v into the caches at ``start``.

    Shapes: q [T, Hq, Dh], k/v [T, Hkv, Dh], caches [max_seq, Hkv, Dh], one float dtype, or
    float16 caches with float32 q, k, v (k, v rounded to float16 as they are written); computed
    in float32, returned in q's dtype; returns [T, Hq, Dh]. Query head h reads KV
    head ``h // (Hq // Hkv)``. The query at position ``p = start + t`` attends keys ``j`` with
    ``j <= p`` (``window`` 0 or None: full causal) and, for ``window = W >= 1``, also
    ``j > p - W`` (transformers' ``masking_utils.sliding_window_causal_mask_function``).
    """
    T, hq, _ = q.shape
    _check_start("attention", start, T, k_cache.shape[0])
    k_cache[start:start + T] = k
    v_cache[start:start + T] = v
    keys = k_cache[:start + T].transpose(0, 1)  # [Hkv, S, Dh]
    vals = v_cache[:start + T].transpose(0, 1)
    rep = hq // keys.shape[0]
    keys, vals = keys.repeat_interleave(rep, 0), vals.repeat_interleave(rep, 0)
    scores = torch.einsum("thd,hsd->hts", q.float(), keys.float()) * scale
    S = start + T
    j, p = torch.arange(S)[None, :], (start + torch.arange(T))[:, None]
    causal = j <= p
    if window:
        causal &= j > p - window
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.einsum("hts,hsd->thd", torch.softmax(scores, dim=-1), vals.float())
    return out.to(q.dtype)


def _rope_rows_infer(ts, attrs):
    x, cos, sin, pos = ts
    if len(x.shape) != 3 or x.shape[-1] % 2:
        _fail("rope_rows", ts, "x must be [T, heads, head_dim] with an even head_dim")
    if len(cos.shape) != 2 or cos.shape != sin.shape or cos.shape[1] != x.shape[-1] // 2:
        _fail("rope_rows", ts, "cos and sin tables must both be [max_seq, head_dim // 2]")
    if pos.shape != (x.shape[0],) or pos.dtype != DType.int64:
        _fail("rope_rows", ts, f"positions must be an int64 tensor of shape ({x.shape[0]},): one per row of x")
    if not x.dtype.is_float or cos.dtype != DType.float32 or sin.dtype != DType.float32:
        _fail("rope_rows", ts, "x must be floating point and the cos/sin tables float32")
    return x


def _check_rows(op: str, values: torch.Tensor, hi: int) -> None:
    """IndexOutOfRangeError for the first of ``values`` (int64 [T]) outside [0, hi)."""
    bad = (values < 0) | (values >= hi)
    if bool(bad.any()):
        raise index_error(op, int(values[bad][0]), 0, hi)


def rope_rows_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with a position per row: row t of x [T, H, Dh] (any float dtype, computed
    in float32 and cast back) is rotated at ``positions[t]`` (int64 [T]) with the tables cos/sin
    [max_seq, Dh/2] float32. IndexOutOfRangeError for a position outside [0, max_seq)."""
    _check_rows("rope_rows", positions, cos.shape[0])
    half = x.shape[-1] // 2
    idx = positions.long().to(cos.device)
    c, s = cos[idx].unsqueeze(1), sin[idx].unsqueeze(1)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def _attention_rows_infer(ts, attrs):
    q, k, v, kc, vc, slots, pos = ts
    if len(q.shape) != 3 or len(k.shape) != 3 or k.shape != v.shape:
        _fail("attention_rows", ts, "q must be [T, Hq, Dh]; k and v [T, Hkv, Dh]")
    T, hq, dh = q.shape
    if k.shape[0] != T or k.shape[2] != dh or hq % k.shape[1]:
        _fail("attention_rows", ts, "k/v must have the same T and Dh as q, and Hq divisible by Hkv (GQA)")
    if kc.shape != vc.shape or len(kc.shape) != 4 or kc.shape[2:] != k.shape[1:]:
        _fail("attention_rows", ts, "KV caches must both be [slots, max_seq, Hkv, Dh]")
    for name, t in (("slots", slots), ("positions", pos)):
        if t.shape != (T,) or t.dtype != DType.int64:
            _fail("attention_rows", ts, f"{name} must be an int64 tensor of shape ({T},): one per row")
    if not _kv_dtypes_ok(ts[:5]):
        _fail("attention_rows", ts, KV_DTYPES_RULE)
    window = attrs.get("window", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise GraphError(f"attention_rows: window must be 0 (full causal) or a positive integer, got {window!r}")
    return q


def attention_rows_reference(q, k, v, k_cache, v_cache, slots, positions, scale: float,
                             window: int = 0) -> torch.Tensor:
    """Causal GQA attention of rows from several sequences, each over its own slot of a KV cache
    (continuous batching: decode rows and prefill chunks in one batch).

    Shapes: q [T, Hq, Dh], k/v [T, Hkv, Dh], caches [num_slots, max_seq, Hkv, Dh], one float dtype
    or float16 caches with float32 q, k, v (as ``attention_reference``); computed in float32,
    returned in q's dtype; slots, positions int64 [T]. First every row t
    writes k[t], v[t] at ``cache[slots[t], positions[t]]`` (rows in order: if two rows name the
    same place the later one's write lands); then row t, query head h, attends the keys ``j`` of
    its slot with ``j <= positions[t]`` (and ``j > positions[t] - window`` for ``window >= 1``),
    KV head ``h // (Hq // Hkv)``. Rows of one sequence's prefill chunk thus see each other
    causally. IndexOutOfRangeError (nothing written) for a slot outside [0, num_slots) or a
    position outside [0, max_seq).
    """
    T, hq, _ = q.shape
    n_slots, S = k_cache.shape[:2]
    _check_rows("attention_rows", slots, n_slots)
    _check_rows("attention_rows", positions, S)
    sl, ps = slots.tolist(), positions.tolist()
    for t in range(T):
        k_cache[sl[t], ps[t]] = k[t]
        v_cache[sl[t], ps[t]] = v[t]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    rep = hq // k.shape[1]
    for t in range(T):
        p = ps[t]
        j0 = max(0, p - window + 1) if window else 0
        keys = k_cache[sl[t], j0:p + 1].float().repeat_interleave(rep, 1)  # [L, Hq, Dh]
        vals = v_cache[sl[t], j0:p + 1].float().repeat_interleave(rep, 1)
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[t].float(), keys) * scale, dim=-1)
        out[t] = torch.einsum("hl,lhd->hd", w, vals)
    return out.to(q.dtype)


def _argmax_infer(ts, attrs):
    d = _norm_dim("argmax", ts[0], attrs["dim"])
    if d != len(ts[0].shape) - 1:
        _fail("argmax", ts, "argmax is supported over the last dim only")
    return TensorType(ts[0].shape[:-1], DType.int64)


_register("matmul", "library", 2, _matmul_infer, lambda args, a: torch.matmul(args[0], args[1]))
_register("linear", "library", -1, _linear_infer, _linear_ref)
_register("linear_stack", "library", -1, _linear_stack_infer, _linear_stack_ref)
_register("linear_w8a8", "library", -1, _linear_w8a8_infer,
          lambda args, a: linear_w8a8_reference(*args, group_size=a.get("group_size", 0)))
_register("embedding", "library", 2, _embedding_infer, _embedding_ref, index_input=0)
_register("rope", "library", 4, _rope_infer,
          lambda args, a: rope_reference(args[0], args[1], args[2], int(args[3][0])), index_input=3)
_register("rotary_emb", "library", 3, _rotary_emb_infer, lambda args, a: rotary_emb_reference(*args))
_register("attention", "library", 6, _attention_infer,
          lambda args, a: attention_reference(*args[:5], int(args[5][0]), a["scale"], a.get("window", 0)),
          mutates=(3, 4),
          index_input=5)
_register("rope_rows", "library", 4, _rope_rows_infer,
          lambda args, a: rope_rows_reference(*args), index_input=3)
_register("attention_rows", "library", 7, _attention_rows_infer,
          lambda args, a: attention_rows_reference(*args, a["scale"], a.get("window", 0)),
          mutates=(3, 4), index_input=6)
def _attention_bidir_infer(ts, attrs):
    qkv, mask = ts
    h = attrs["num_heads"]
    if len(qkv.shape) != 3 or qkv.shape[2] % (3 * h):
        _fail("attention_bidir", ts, f"qkv must be [B, S, 3 * H * Dh] with H = num_heads = {h}")
    if tuple(mask.shape) != tuple(qkv.shape[:2]) or mask.dtype != DType.float32:
        _fail("attention_bidir", ts, "key_mask must be float32 [B, S] (0 keeps a key, -inf drops it)")
    if not qkv.dtype.is_float:
        _fail("attention_bidir", ts, f"qkv must be floating point, got {qkv.dtype.value}")
    return TensorType((*qkv.shape[:2], qkv.shape[2] // 3), qkv.dtype)


def attention_bidir_reference(qkv: torch.Tensor, key_mask: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
    """Bidirectional (encoder) multi-head attention with a key-padding mask (Vaswani et al. 2017;
    BERT, Devlin et al. 2019).

    qkv [B, S, 3 * H * Dh]: the packed output of one QKV projection (q, then k, then v, each
    H heads of Dh); key_mask float32 [B, S], added to every query's scores for that key
    (0 keeps it, -inf drops a padding key). Returns [B, S, H * Dh] in qkv's dtype (computed in
    float32): softmax(q k^T * scale + key_mask) v per batch and head. Every query row must keep
    at least one key (else its row is NaN).
    """
    B, S, three_hd = qkv.shape
    dh = three_hd // (3 * num_heads)
    q, k, v = qkv.float().view(B, S, 3, num_heads, dh).permute(2, 0, 3, 1, 4)  # [B, H, S, Dh] each
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale + key_mask.float()[:, None, None, :]
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, H, S, Dh]
    return out.transpose(1, 2).reshape(B, S, num_heads * dh).to(qkv.dtype)


def _attention_varlen_infer(ts, attrs):
    qkv, offsets = ts
    h = attrs["num_heads"]
    if len(qkv.shape) != 2 or qkv.shape[1] % (3 * h):
        _fail("attention_varlen", ts, f"qkv must be [T, 3 * H * Dh] with H = num_heads = {h}")
    if len(offsets.shape) != 1 or offsets.shape[0] < 2 or offsets.dtype != DType.int64:
        _fail("attention_varlen", ts, "offsets must be int64 [B + 1] (the first token of each sentence, then the end)")
    if not qkv.dtype.is_float:
        _fail("attention_varlen", ts, f"qkv must be floating point, got {qkv.dtype.value}")
    return TensorType((qkv.shape[0], qkv.shape[1] // 3), qkv.dtype)


def check_offsets(offsets: list[int], T: int) -> None:
    """IndexOutOfRangeError unless offsets start at 0, never decrease and end at most at T."""
    prev = 0
    for i, o in enumerate(offsets):
        if not prev <= o <= T or (i == 0 and o != 0):
            raise index_error("attention_varlen", o, prev, T + 1)
        prev = o


def attention_varlen_reference(qkv: torch.Tensor, offsets: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
    """Bidirectional multi-head attention over packed sentences (no padding between them).

    qkv [T, 3 * H * Dh] holds the tokens of B sentences back to back (q, k, v packed along the last
    dim); sentence b is rows ``offsets[b] .. offsets[b+1]-1`` (offsets int64 [B + 1], from 0,
    non-decreasing, at most T). Each token attends every token of its own sentence:
    softmax(q k^T * scale) v per head. Rows past ``offsets[B]`` (bucket padding) are zero.
    Returns [T, H * Dh] in qkv's dtype (computed in float32). IndexOutOfRangeError for bad offsets.
    """
    T, three_hd = qkv.shape
    hd = three_hd // 3
    dh = hd // num_heads
    offs = [int(o) for o in offsets.tolist()]
    check_offsets(offs, T)
    out = torch.zeros((T, hd), dtype=torch.float32, device=qkv.device)
    for s, e in zip(offs[:-1], offs[1:]):
        if e > s:
            q, k, v = qkv[s:e].float().view(e - s, 3, num_heads, dh).permute(1, 2, 0, 3)  # [H, L, Dh]
            p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1)
            out[s:e] = torch.matmul(p, v).transpose(0, 1).reshape(e - s, hd)
    return out.to(qkv.dtype)


_register("attention_varlen", "library", 2, _attention_varlen_infer,
          lambda args, a: attention_varlen_reference(args[0], args[1], a["num_heads"], a["scale"]), index_input=1)
_register("attention_bidir", "library", 2, _attention_bidir_infer,
          lambda args, a: attention_bidir_reference(args[0], args[1], a["num_heads"], a["scale"]))
_register("argmax", "library", 1, _argmax_infer, lambda args, a: torch.argmax(args[0], dim=a["dim"]))


def _allreduce_infer(ts, attrs):
    _float("allreduce", ts)
    return ts[0]


def allreduce_reference(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over every rank of torch.distributed's default process group (a new
    tensor, x's shape and dtype); ``x`` itself (copied) on one process, where no group is
    initialized. Tensor parallelism's reduction after a row-parallel linear (Mirage MPK's
    ``allreduce_layer``)."""
    out = x.clone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(out)
    return out


_register("allreduce", "library", 1, _allreduce_infer, lambda args, a: allreduce_reference(args[0]))


def _sdpa_infer(ts, attrs):
    q, k, v = ts[:3]
    if any(len(t.shape) != 4 for t in (q, k, v)) or not q.dtype.is_float or k.dtype != q.dtype or v.dtype != q.dtype:
        _fail("sdpa", ts, "q, k, v must be 4-d [B, H, S, D] of one float dtype")
    (B, H, S, D), (Bk, Hk, T, Dk) = q.shape, k.shape
    if Bk != B or Dk != D or tuple(v.shape[:3]) != (B, Hk, T) or Hk == 0 or H % Hk:
        _fail("sdpa", ts, "k must be [B, Hk, T, D] and v [B, Hk, T, Dv] with Hk dividing q's heads H (GQA)")
    if len(ts) == 4:
        m = ts[3]
        if (m.dtype != q.dtype or len(m.shape) != 4 or m.shape[3] != T
                or any(n not in (1, full) for n, full in zip(m.shape[:3], (B, H, S)))):
            _fail("sdpa", ts, "mask must be an additive float mask of q's dtype, [B or 1, H or 1, S or 1, T]")
    return TensorType((B, H, S, v.shape[3]), q.dtype)


def sdpa_reference(q, k, v, mask=None, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention (Vaswani et al. 2017) as torch computes it:
    ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)``,
    with GQA (k/v heads repeated over the query heads they serve)."""
    if mask is not None and causal:   # one additive mask: torch's GPU kernels refuse both together
        S, T = q.shape[2], k.shape[2]
        keep = torch.ones(S, T, dtype=torch.bool, device=q.device).tril()   # torch's is_causal: top-left aligned
        mask, causal = torch.where(keep, mask, torch.tensor(float("-inf"), dtype=mask.dtype, device=mask.device)), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


_register("sdpa", "library", -1, _sdpa_infer,
          lambda args, a: sdpa_reference(*args[:3], args[3] if len(args) == 4 else None, a["causal"], a["scale"]))


def _reshape_infer(ts, attrs):
    shape = tuple(attrs["shape"])
    if any(d <= 0 for d in shape):
        _fail("reshape", ts, f"every dim of the new shape {shape} must be positive")
    if math.prod(shape) != math.prod(ts[0].shape):
        _fail("reshape", ts, f"cannot reshape to {shape}: element counts differ")
    return TensorType(shape, ts[0].dtype)


def _slice_infer(ts, attrs):
    n = ts[0].shape[0] if ts[0].shape else 0
    if not 0 <= attrs["start"] < attrs["end"] <= n:
        _fail("slice_rows", ts, f"need 0 <= start < end <= {n}, got [{attrs['start']}, {attrs['end']})")
    return TensorType((attrs["end"] - attrs["start"], *ts[0].shape[1:]), ts[0].dtype)


_register("slice_rows", "library", 1, _slice_infer, lambda args, a: args[0][a["start"]:a["end"]])
_register("reshape", "library", 1, _reshape_infer, lambda args, a: args[0].reshape(a["shape"]))


# ---- layout ops: copies of strided views (kernels of their own; a view op would need no copy) --

def _permute_infer(ts, attrs):
    x, dims = ts[0], tuple(attrs["dims"])
    if sorted(dims) != list(range(len(x.shape))):
        _fail("permute", ts, f"dims {dims} must be a permutation of 0..{len(x.shape) - 1}")
    return TensorType(tuple(x.shape[d] for d in dims), x.dtype)


def _expand_infer(ts, attrs):
    x, shape = ts[0], tuple(attrs["shape"])
    lead = len(shape) - len(x.shape)
    if lead < 0 or any(n <= 0 for n in shape) or any(
            x.shape[i] not in (1, shape[i + lead]) for i in range(len(x.shape))):
        _fail("expand", ts, f"cannot expand to {shape}: each dim of x must be 1 or equal the new one "
                            "(new dims go in front)")
    return TensorType(shape, x.dtype)


def _slice_dim_infer(ts, attrs):
    x, d = ts[0], attrs["dim"]
    _norm_dim("slice", x, d)
    start, end, step = attrs["start"], attrs["end"], attrs["step"]
    if step < 1 or not 0 <= start < end <= x.shape[d]:
        _fail("slice", ts, f"need step >= 1 and 0 <= start < end <= {x.shape[d]} along dim {d}, "
                           f"got start={start} end={end} step={step}")
    shape = list(x.shape)
    shape[d] = (end - start + step - 1) // step
    return TensorType(tuple(shape), x.dtype)


def _select_infer(ts, attrs):
    x, d, i = ts[0], attrs["dim"], attrs["index"]
    _norm_dim("select", x, d)
    if not 0 <= i < x.shape[d]:
        _fail("select", ts, f"index {i} is out of range [0, {x.shape[d]}) along dim {d}")
    return TensorType(x.shape[:d] + x.shape[d + 1:], x.dtype)


def _cat_infer(ts, attrs):
    d = attrs["dim"]
    x = ts[0]
    _norm_dim("cat", x, d)
    for t in ts[1:]:
        if t.dtype != x.dtype or len(t.shape) != len(x.shape) or any(
                t.shape[i] != x.shape[i] for i in range(len(x.shape)) if i != d):
            _fail("cat", ts, f"every input must have the first's dtype {x.dtype.value} and rank, and equal "
                             f"sizes except along dim {d}")
    shape = list(x.shape)
    shape[d] = sum(t.shape[d] for t in ts)
    return TensorType(tuple(shape), x.dtype)


def _cumsum_infer(ts, attrs):
    x = ts[0]
    _norm_dim("cumsum", x, attrs["dim"])
    if not (x.dtype.is_float or x.dtype in (DType.bool, DType.int32, DType.int64)) or x.dtype.is_quantized:
        _fail("cumsum", ts, f"sums float, bool, int32 and int64 tensors, got {x.dtype.value}")
    return TensorType(x.shape, x.dtype if x.dtype.is_float else DType.int64)


_register("cumsum", "library", 1, _cumsum_infer, lambda args, a: torch.cumsum(args[0], a["dim"]))
_register("permute", "library", 1, _permute_infer, lambda args, a: args[0].permute(*a["dims"]).contiguous())
_register("expand", "library", 1, _expand_infer, lambda args, a: args[0].expand(*a["shape"]).contiguous())
_register("slice", "library", 1, _slice_dim_infer,
          lambda args, a: args[0][(slice(None),) * a["dim"] + (slice(a["start"], a["end"], a["step"]),)].contiguous())
_register("select", "library", 1, _select_infer, lambda args, a: args[0].select(a["dim"], a["index"]).contiguous())
_register("cat", "library", -1, _cat_infer, lambda args, a: torch.cat(list(args), dim=a["dim"]))


def _pad_infer(ts, attrs):
    x, pads = ts[0], attrs["pads"]
    if len(pads) != len(x.shape) or any(len(p) != 2 or min(p) < 0 for p in pads):
        _fail("pad", ts, f"pads must be one (before, after) pair of non-negative integers per dim, got {pads}")
    return TensorType(tuple(n + lo + hi for n, (lo, hi) in zip(x.shape, pads)), x.dtype)


def _pad_ref(args, a):
    flat = [n for lo_hi in reversed(a["pads"]) for n in lo_hi]   # F.pad: the last dim first
    return F.pad(args[0], flat, value=a["value"])


_register("pad", "library", 1, _pad_infer, _pad_ref)


# ---- indexing with run-time indices: index_select, gather (checked, see ``index_input``) --------

#: dtypes the indexing ops move (they copy elements, never compute on them)
INDEXED_DTYPES = (DType.float32, DType.float16, DType.bfloat16, DType.bool, DType.int32, DType.int64)


def _indexed(op: str, ts: list[TensorType]):
    x, index = ts
    if x.dtype not in INDEXED_DTYPES:
        _fail(op, ts, f"x must be float32/float16/bfloat16, bool, int32 or int64, got {x.dtype.value}")
    if index.dtype != DType.int64:
        _fail(op, ts, f"index must be int64, got {index.dtype.value}")
    if not x.shape:
        _fail(op, ts, "x must have at least one dim")


def _index_select_infer(ts, attrs):
    _indexed("index_select", ts)
    x, index = ts
    d = _norm_dim("index_select", x, attrs["dim"])
    if len(index.shape) != 1:
        _fail("index_select", ts, "index must be 1-d")
    shape = list(x.shape)
    shape[d] = index.shape[0]
    return TensorType(tuple(shape), x.dtype)


def _gather_infer(ts, attrs):
    _indexed("gather", ts)
    x, index = ts
    d = _norm_dim("gather", x, attrs["dim"])
    if len(index.shape) != len(x.shape) or any(
            index.shape[i] > x.shape[i] for i in range(len(x.shape)) if i != d):
        _fail("gather", ts, f"index must have x's rank and no dim larger than x's, except dim {d}")
    return TensorType(index.shape, x.dtype)


def _check_index(op: str, index: torch.Tensor, n: int) -> None:
    """IndexOutOfRangeError for the first of ``index`` (int64) outside [0, n)."""
    bad = (index < 0) | (index >= n)
    if bool(bad.any()):
        raise index_error(op, int(index[bad].flatten()[0]), 0, n)


def index_select_reference(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.index_select(x, dim, index)``: the slices of x along ``dim`` at ``index`` (int64
    [K], each in ``[0, x.shape[dim])``, repeats allowed); x keeps its dtype; the output has x's
    shape with dim ``dim`` of size K. IndexOutOfRangeError for an index out of range (torch would
    raise IndexError or read out of bounds on some devices)."""
    _check_index("index_select", index, x.shape[dim])
    return torch.index_select(x, dim, index)


def gather_reference(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.gather(x, dim, index)``: ``out[p] = x[p with coordinate dim replaced by index[p]]``
    for every coordinate p of index (int64, x's rank, no dim larger than x's except ``dim``; each
    value in ``[0, x.shape[dim])``). The output has index's shape and x's dtype.
    IndexOutOfRangeError for an index out of range."""
    _check_index("gather", index, x.shape[dim])
    return torch.gather(x, dim, index)


_register("index_select", "library", 2, _index_select_infer,
          lambda args, a: index_select_reference(args[0], args[1], a["dim"]), index_input=1)
_register("gather", "library", 2, _gather_infer,
          lambda args, a: gather_reference(args[0], args[1], a["dim"]), index_input=1)

# the convolutional-network ops (conv2d, pooling, batch_norm) register themselves
from . import conv as _conv  # noqa: E402,F401
