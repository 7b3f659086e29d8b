"""The CPU kernel library (``yirage/kernels/cpu/library.cpp`` and its other translation units),
built once by runtime/toolchain.py and loaded through ctypes: the ``SIGNATURES`` of its entry
points, ``library()`` (the default build, with the machine's prefetch level applied), and the
helpers every caller of its kernels shares (``_lib``: a given build or the default one; the
int64 [4] status slot a kernel reports a rejected size in, ``_status`` / ``_raise_status``).

The lowest module of the CPU backend: library.py, conv.py, embed.py and providers.py import it,
and it imports none of them.
"""
from __future__ import annotations

import ctypes
import functools
import platform

import torch

from ...errors import YirageError
from ...runtime.toolchain import load_kernel_library
from ...tuning import profile as tuning

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float

#: GGML block formats of ggml_quants.h, each with the q4_1 entry points (yr_linear_T,
#: yr_embedding_T, yr_task_linear_T) plus yr_task_embedding_T and yr_dequant_T.
GGML_FORMATS = ("q4_0", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")

#: the row-group layouts of kernels/cpu/row_groups.h (ir.ops.ROW_GROUP_TYPES)
ROW_GROUP_FORMATS = ("q4_1r16", "q8_0r16")

#: name -> ctypes argtypes of every entry point of the CPU library (library.cpp,
#: library_quants.cpp, library_encoder.cpp; restype is always None).
SIGNATURES: dict[str, tuple] = {
    "yr_linear_q4_1": (_P, _P, _P, _P, _I, _I, _I),    # x, w, bias|None, y, M, N, K
    "yr_linear_q8_0": (_P, _P, _P, _P, _I, _I, _I),
    "yr_linear_f32": (_P, _P, _P, _P, _I, _I, _I),
    "yr_linear_q4_1_q8": (_P, _P, _P, _P, _I, _I, _I),   # the same, x quantized to int8 (compute_dtype='int8')
    # q4_1 / q8_0 rows in groups of 16 (row_groups.h)
    **{f"yr_linear_{t}{q}": (_P, _P, _P, _P, _I, _I, _I) for t in ROW_GROUP_FORMATS for q in ("", "_q8")},
    **{f"yr_dequant_{t}": (_P, _P, _I, _I) for t in ROW_GROUP_FORMATS},   # src, dst floats, nblocks, blocks per row
    **{f"yr_repack_{t}": (_P, _P, _I, _I) for t in ROW_GROUP_FORMATS},    # plain src, dst, N, blocks per row
    "yr_embedding_q8_0r16": (_P, _P, _P, _I, _I, _I, _P),
    "yr_simd_bits": (_P,),   # out int64 [1]: 512, 256, 128 (NEON) or 0, the widest SIMD path compiled in
    "yr_row_groups_native": (_P,),   # out int64 [1]: 1 where row_groups.h has its AVX-512 VNNI kernels
    "yr_linear_q8_0_q8": (_P, _P, _P, _P, _I, _I, _I),
    "yr_embedding_q8_0": (_P, _P, _P, _I, _I, _I, _P),  # ids, table, out, T, D, V, status
    "yr_embedding_q4_1": (_P, _P, _P, _I, _I, _I, _P),
    "yr_embedding_f32": (_P, _P, _P, _I, _I, _I, _P),
    **{f"yr_linear_{t}": (_P, _P, _P, _P, _I, _I, _I) for t in GGML_FORMATS},
    **{f"yr_embedding_{t}": (_P, _P, _P, _I, _I, _I, _P) for t in GGML_FORMATS},
    **{f"yr_dequant_{t}": (_P, _P, _I) for t in ("q4_1", "q8_0", *GGML_FORMATS)},  # src blocks, dst floats, nblocks
    # x, cos, sin, start_pos, out, T, H, Dh, S (table rows), status
    "yr_rope": (_P, _P, _P, _P, _P, _I, _I, _I, _I, _P),
    # q, k, v, k_cache, v_cache, start_pos, out, T, Hq, Hkv, Dh, max_seq, scale, status
    "yr_attention": (_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _P),
    # the same with the sliding window (0: full causal; W >= 1: keys p - W < j <= p) before status
    "yr_attention_window": (_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _I, _P),
    # the same over float16 caches (a float16 KV cache; q, k, v, out float32)
    "yr_attention_window_f16kv": (_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _I, _P),
    # x, cos, sin, positions [T], out, T, H, Dh, S (table rows), status
    "yr_rope_rows": (_P, _P, _P, _P, _P, _I, _I, _I, _I, _P),
    # x, cos, sin, out, geometry {n0, n1, n2, D, strides of x, cos, sin, out}, its length, dtype code,
    # x/cos/sin/out lengths, status
    "yr_rotary_emb": (_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P),
    "yr_linear_task_rows": (_P,),   # out int64 [2]: the most rows of the q4_1/q8_0 and other linear tasks
    "yr_quantized_rows_bytes": (_I, _I, _P),   # M, K, out int64 [1]: yr_task_quantize_rows_q8's buffer
    # q, k, v, k_cache, v_cache, slots, positions, out, T, Hq, Hkv, Dh, num_slots, max_seq, scale, window, status
    "yr_attention_rows": (_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _P),
    "yr_attention_rows_f16kv": (_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _P),
    "yr_argmax": (_P, _P, _I, _I),                      # x, out, R, D
    "yr_rows_parallel": (_P, _P, _I, _I, _I, _I, _P),   # row task fn, its args, lo, hi, rows, min_rows, status
    # embedding encoder (kernels/cpu/embed_kernels.h); the trailing _I are buffer lengths, then status
    "yr_set_prefetch_level": (_I,),                     # 0: prefetch to L1, 1: to L2 (prefetch_level)
    "yr_emb_pack_f32": (_P, _P, _I, _I, _I, _P),       # w [N, K], P, N, K, p_len, status
    # x, P, bias, y, M, N, K, x/p/y lengths, row epilogue fn (or NULL) and its args, status
    "yr_emb_gemm_f32": (_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P),
    # x, P, bias, y [planes, M, Np], M, planes, Np, K, x/p/y lengths, status
    "yr_emb_gemm_f32_planes": (_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _P),
    # x, P, bias, y, M, K, parts, widths [parts], x/p/y lengths, row epilogue fn (or NULL) and its args, status
    "yr_emb_gemm_f32_parts": (_P, _P, _P, _P, _I, _I, _I, _P, _I, _I, _I, _P, _P, _P),
    "yr_emb_pack_bf16": (_P, _P, _I, _I, _I, _P),      # w [N, K] bf16 bits, P, N, K, p_len, status
    # x, P, bias, y, M, N, K, x/p/y lengths, row epilogue fn (or NULL) and its args, status
    "yr_emb_gemm_bf16": (_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P),
    "yr_emb_pack_s8": (_P, _P, _P, _I, _I, _I, _I, _I, _P),  # wt [K, N], P, comp, K, N, group, p/comp_len
    # x, qbuf, sbuf, P, comp, ws, bias, y, M, N, K, group, x/q/s/p/comp/y lengths, epilogue fn, args, status
    "yr_emb_linear_w8a8": (_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P, _P, _P),
    # x, P, bias, y, geometry {N, H, W, C, O, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw, mc, kc}, x/p/y lengths,
    # row epilogue fn (or NULL) and its args, status (kernels/cpu/conv_gemm.h)
    "yr_conv_igemm_f32": (_P, _P, _P, _P, _P, _I, _I, _I, _P, _P, _P),
    # q, k, v, mask|NULL, out, geometry {B, Hq, Hkv, Tq, Tk, Dh, causal, mask strides b/h/i, then the
    # b/h/t strides of q, k, v, out}, its length, scale, q/kv/mask/out lengths, status
    "yr_sdpa_f32": (_P, _P, _P, _P, _P, _P, _I, _F, _I, _I, _I, _I, _P),
    # qkv, offsets, out, T, B, H, Dh, scale, qkv_len, out_len, status
    "yr_emb_attention_varlen": (_P, _P, _P, _I, _I, _I, _I, _F, _I, _I, _P),
}
#: task entry points (address taken, called by the persistent kernel scheduler only)
TASK_SYMBOLS = ("yr_task_linear_q4_1", "yr_task_linear_q8_0", "yr_task_linear_q4_1_q8", "yr_task_linear_q8_0_q8",
                *(f"yr_task_linear_{t}{q}" for t in ROW_GROUP_FORMATS for q in ("", "_q8")),
                "yr_task_embedding_q8_0r16", "yr_task_quantize_rows_q8",
                "yr_task_linear_f32", "yr_task_embedding",
                "yr_task_rope", "yr_task_rope_rows", "yr_task_attention_rows_append", "yr_task_attention_rows",
                "yr_task_attention_append", "yr_task_attention_partial",
                *(f"yr_task_attention_{t}_f16kv" for t in ("rows_append", "rows", "append", "partial")),
                "yr_task_attention_combine", "yr_task_argmax_partial", "yr_task_argmax_reduce",
                *(f"yr_task_{op}_{t}" for op in ("linear", "embedding") for t in GGML_FORMATS))


def bind_signatures(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set argtypes/restype of every function of ``SIGNATURES`` on ``lib``; return ``lib``."""
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = list(argtypes)
        fn.restype = None
    return lib


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The C++ kernel library, built on first use (cached on disk), with signatures set and the
    machine's prefetch level applied (``prefetch_level``).

    Raises:
        ToolchainError: no C++ compiler, or it rejected the source.
    """
    lib = bind_signatures(load_kernel_library("library", symbols=tuple(SIGNATURES) + TASK_SYMBOLS))
    lib.yr_set_prefetch_level(prefetch_level(lib))
    return lib


#: weight bytes the prefetch measurement streams through: more than a server's last-level
#: cache holds, so every sweep reads them from DRAM as a decode step does
PREFETCH_SWEEP_BYTES = 128 << 20
#: levels of yr_set_prefetch_level by candidate name
PREFETCH_LEVELS = {"l1": 0, "l2": 1}


def prefetch_level(lib: ctypes.CDLL) -> int:
    """Where this machine's kernels should prefetch the weights and caches they stream (0: L1,
    ``prefetcht0``; 1: L2, ``prefetcht2``), by measurement (``tuning.choose``, once per
    machine, cached in its profile; L1 with ``YIRAGE_TUNE=off``): q4_1 GEMVs of SmolLM2's MLP
    shape (1 x 576 -> 1536) over ``PREFETCH_SWEEP_BYTES`` of weights, as a decode step reads
    them, with each level. On the Zen 4 EPYC of the README, L2 decoded 1.4x faster: with L1,
    the core stalls on the prefetch instructions once L1's miss buffers are full. Only x86-64
    builds have the L2 variant (library_core.h ``prefetch_bytes``); elsewhere: 0, unmeasured."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return 0
    rows, K = 1536, 576
    per = rows * (K // 32) * 20   # q4_1: 20 bytes per block of 32
    count = max(2, PREFETCH_SWEEP_BYTES // per)
    shared = {}

    def factory(level: int):
        def make():
            if not shared:   # one buffer for both candidates; 0x11 bytes: finite fp16 scales
                shared.update(w=torch.full((count * per,), 0x11, dtype=torch.uint8), x=torch.randn(1, K),
                              y=torch.empty(1, rows))
            w, x, y = shared["w"].data_ptr(), shared["x"].data_ptr(), shared["y"].data_ptr()

            def run():
                lib.yr_set_prefetch_level(level)
                for i in range(count):
                    lib.yr_linear_q4_1(x, w + i * per, None, y, 1, rows, K)
            run.samples = shared
            return run
        return make
    key = tuning.shape_class("gemv_prefetch", "q4_1/dram", 1, rows, K, torch.get_num_threads())
    choice = tuning.choose(key, {name: factory(level) for name, level in PREFETCH_LEVELS.items()}, "l1")
    return PREFETCH_LEVELS[choice.provider]


def _lib(lib=None):
    """``lib`` (a build of the kernel library with signatures bound) or the default build."""
    if lib is not None:
        return lib
    return library()


def _status() -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int64)


def _raise_status(status: torch.Tensor, what: str) -> None:
    """YirageError naming the size a kernel rejected (status = {1, value, lo, hi}); the status
    is cleared first, so a thunk called again after the cause is fixed does not raise anew."""
    if int(status[0]):
        value, lo, hi = status[1:].tolist()
        status.zero_()
        raise YirageError(f"{what}: size {value} outside [{lo}, {hi}) (a buffer is too small or a size is invalid)")
