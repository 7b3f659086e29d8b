"""Triton library kernels: one source for CUDA, ROCm and XPU (and Triton's CPU interpreter).

The launch functions below are what the Triton backend calls. Each takes its output tensors,
writes them and returns None; sizes come from tensor shapes; none reads a device value on the
host or allocates on the per-call path (``attention_workspace`` is the one allocation helper,
called once at bind time), so a decode step can be captured in a CUDA graph. Inputs are
validated on the host (shapes and dtypes only) and ValueError names what is wrong.

- :func:`linear` (linear.py): ``x @ W^T (+ bias)``, W float or GGUF q8_0/q4_1 blocks
  (llama.cpp ggml-common.h layouts); a GEMV for M <= 8 rows, a ``tl.dot`` GEMM above.
- :func:`matmul` (matmul.py): ``torch.matmul`` with broadcast batch dims.
- :func:`embedding` (embedding.py): row gather from a float or q8_0/q4_1 table.
- :func:`rope` (rope.py): rotate-half RoPE at positions ``start_pos[0] + t``; :func:`rope_rows`
  at a position per row (continuous batching); :func:`rotary_emb` with per-element cos/sin
  tensors broadcast to x (transformers' ``apply_rotary_pos_emb``), x strided.
- :func:`attention`, :func:`attention_workspace` (attention.py): causal GQA over a KV cache,
  full or in a sliding window (``window``); flash-decoding for T == 1, FlashAttention for T > 1.
- :func:`argmax` (argmax.py): first index of the row maximum, NaN wins.
- :func:`linear_w8a8`, :func:`linear_w8a8_workspace` (int8.py): W8A8 linear (per-token, optionally
  per-group int8 activations quantized at run time, int8 weights, exact int32 ``tl.dot``);
  the int8/scale workspace is the bind-time allocation.
- :func:`attention_varlen` (attention_varlen.py): bidirectional multi-head attention over
  sentences packed back to back (FlashAttention over a flat grid of token-row tiles). The one
  exception to the rules above: by default it validates its offsets on the host (a
  device-to-host copy) and raises yirage's errors (``GraphError``, ``IndexOutOfRangeError``);
  ``check_offsets=False`` checks them on the device instead, with no sync.
- :func:`attention_rows` (attention_rows.py): the continuous-batching step's attention, each
  row over its own slot of the KV cache (after writing its k, v there), slots and positions
  checked on the device;
- :func:`sdpa` (sdpa.py): scaled dot-product attention over [B, H, S, D] (additive mask with
  broadcast strides, causal, GQA, scale), FlashAttention's forward pass;
- :func:`cumsum_mid` (strided.py): running sums along any dim;
- :func:`reduce_mid`, :func:`softmax_mid` (strided.py): reductions (sum, mean, amax, amin, var) and
  softmax/log_softmax over the middle dim of an [outer, n, inner] view (a dim that is not the last).
- :func:`strided_copy`, :func:`strided_copy_meta` (strided.py): the layout ops (permute, expand,
  slice, select, cat) as strided copies; the metadata tensor is the bind-time allocation.
- :func:`conv2d`, :func:`pool2d` (conv.py): convolution as an implicit GEMM (a direct kernel for
  depthwise) with its epilogue (bias, BatchNorm scale/shift, residual, activation), and max /
  average pooling, over NCHW or NHWC tensors.
- :func:`index_copy`, :func:`index_copy_meta` (indexing.py): index_select and gather with run-time
  indices, each checked on the device into ``status`` (an index out of range reads nothing).

The main kernels are autotuned (keys: the shape arguments) on a GPU; under
``TRITON_INTERPRET=1`` only each list's first config runs (see ``_common.autotune``).
Modules here import only torch, triton and each other (attention_varlen.py also yirage's
errors, and ``ir.ops.check_offsets`` when it runs).
"""
from ._common import interpreting
from .argmax import argmax
from .conv import conv2d, pool2d
from .attention import AttentionWorkspace, attention, attention_workspace
from .attention_rows import attention_rows
from .attention_varlen import attention_varlen
from .embedding import embedding
from .indexing import index_copy, index_copy_meta
from .int8 import W8A8Workspace, linear_w8a8, linear_w8a8_workspace
from .linear import linear
from .matmul import matmul
from .rope import rope, rope_rows, rotary_emb
from .sdpa import sdpa
from .strided import cumsum_mid, fits_int32, reduce_mid, softmax_mid, strided_copy, strided_copy_meta

__all__ = ["AttentionWorkspace", "interpreting", "argmax", "attention", "attention_workspace", "attention_varlen",
           "embedding", "linear", "matmul", "rope", "reduce_mid", "softmax_mid", "cumsum_mid", "strided_copy",
           "strided_copy_meta", "fits_int32", "index_copy", "index_copy_meta", "W8A8Workspace", "linear_w8a8", "linear_w8a8_workspace",
           "conv2d", "pool2d", "sdpa", "rope_rows", "rotary_emb", "attention_rows"]
