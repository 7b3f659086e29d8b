"""The CPU kernels of the embedding engine's encoder (``kernels/cpu/embed_kernels.h``): float32
GEMM on weights packed once, bfloat16 GEMM with float32 sums on weights packed once (AVX512-BF16
vdpbf16ps), W8A8 int8 GEMM (AVX-512 VNNI / AVX-VNNI / AVX2 / scalar) and attention over packed
sentences (``attention_varlen``), with the binders library.py's op table uses.

Packed weights are kept in a cache keyed by the weight tensor and the layout (dropped when the
tensor is freed, repacked if it was written in place). Only weights declared constant
(``mark_constant``: the engines declare theirs) are packed for a provider that keeps a copy
(``backends/cpu/providers.py`` chooses the provider of each linear layer by measurement); other
users of ``linear`` pay no extra memory. Every wrapper takes ``lib=``: a
build of the kernel library (tests pass each ISA build), by default the CPU backend's. This
module must never build graphs or import engines.
"""
from __future__ import annotations

import weakref

import torch

from ...errors import YirageError
from ...ir.ops import check_offsets
from .native import _lib, _raise_status, _status

_PANEL = 32  # output columns per packed panel (embed_kernels.h EMB_NR)
_packed: dict[tuple[int, str], tuple] = {}  # (id(weight), kind) -> (data_ptr, _version, packed)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_cpu(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise YirageError(f"{name}: needs a contiguous {dtype} CPU tensor, got {t.dtype} on {t.device}")


def pack_f32(w: torch.Tensor, lib=None) -> torch.Tensor:
    """``w`` float32 [N, K] (out x in features) packed into panels of 32 output columns:
    float32 [ceil(N/32), K, 32], zero-padded (the layout ``gemm_f32_packed`` reads).
    YirageError for a tensor that is not a contiguous 2-D float32 CPU tensor."""
    _check_cpu("pack_f32", w, torch.float32)
    if w.dim() != 2 or w.numel() == 0:
        raise YirageError(f"pack_f32: needs a non-empty [N, K] weight, got {tuple(w.shape)}")
    N, K = w.shape
    P = torch.empty(((N + _PANEL - 1) // _PANEL, K, _PANEL), dtype=torch.float32)
    st = _status()
    _lib(lib).yr_emb_pack_f32(w.data_ptr(), P.data_ptr(), N, K, P.numel(), st.data_ptr())
    _raise_status(st, "pack_f32")
    return P


def gemm_f32_packed(x: torch.Tensor, P: torch.Tensor, N: int, bias: torch.Tensor | None, out: torch.Tensor,
                    lib=None) -> None:
    """``out`` [M, N] = ``x`` [M, K] @ W^T + ``bias`` [N] (or none), float32, with W packed by
    ``pack_f32`` (P [ceil(N/32), K, 32]). Register-blocked FMA GEMM (12 x 32 tiles with
    AVX-512), k-blocks of 384. YirageError for buffers that do not fit the sizes."""
    for name, t, dt in (("x", x, torch.float32), ("P", P, torch.float32), ("out", out, torch.float32)):
        _check_cpu(f"gemm_f32_packed: {name}", t, dt)
    if bias is not None:
        _check_cpu("gemm_f32_packed: bias", bias, torch.float32)
        if bias.numel() != N:
            raise YirageError(f"gemm_f32_packed: bias has {bias.numel()} values, expected N = {N}")
    M, K = x.shape
    st = _status()
    _lib(lib).yr_emb_gemm_f32(x.data_ptr(), P.data_ptr(), _ptr(bias), out.data_ptr(), M, N, K, x.numel(),
                           P.numel(), out.numel(), None, None, st.data_ptr())
    _raise_status(st, "gemm_f32_packed")


def pack_bf16(w: torch.Tensor, lib=None) -> torch.Tensor:
    """``w`` bfloat16 [N, K] (out x in features) packed for ``gemm_bf16_packed``: bfloat16
    [ceil(N/32), Kp/2, 32, 2] with Kp = K rounded up to even, the pairs (k, k+1) of each output
    column side by side (what vdpbf16ps multiplies), zero-padded. YirageError for a tensor that
    is not a non-empty, contiguous 2-D bfloat16 CPU tensor."""
    _check_cpu("pack_bf16", w, torch.bfloat16)
    if w.dim() != 2 or w.numel() == 0:
        raise YirageError(f"pack_bf16: needs a non-empty [N, K] weight, got {tuple(w.shape)}")
    N, K = w.shape
    P = torch.empty(((N + _PANEL - 1) // _PANEL, (K + 1) // 2, _PANEL, 2), dtype=torch.bfloat16)
    st = _status()
    _lib(lib).yr_emb_pack_bf16(w.data_ptr(), P.data_ptr(), N, K, P.numel(), st.data_ptr())
    _raise_status(st, "pack_bf16")
    return P


def _check_bf16_gemm(x, P, N, bias, out) -> None:
    """YirageError unless the buffers of ``gemm_bf16_packed`` have the dtypes and devices it
    needs, ``x`` and ``out`` are 2-D and ``bias`` has N values (the C++ kernel checks the sizes
    against the lengths again)."""
    for name, t, dt in (("x", x, torch.float32), ("P", P, torch.bfloat16), ("out", out, torch.float32)):
        _check_cpu(f"gemm_bf16_packed: {name}", t, dt)
    if x.dim() != 2 or out.dim() != 2:
        raise YirageError(f"gemm_bf16_packed: x and out must be 2-D, got {tuple(x.shape)} and {tuple(out.shape)}")
    if bias is not None:
        _check_cpu("gemm_bf16_packed: bias", bias, torch.float32)
        if bias.numel() != N:
            raise YirageError(f"gemm_bf16_packed: bias has {bias.numel()} values, expected N = {N}")


def gemm_bf16_packed(x: torch.Tensor, P: torch.Tensor, N: int, bias: torch.Tensor | None, out: torch.Tensor,
                     lib=None) -> None:
    """``out`` float32 [M, N] = float32(bf16(bf16(``x``) @ W^T)) + ``bias``: ``x`` float32 [M, K]
    rounded to bfloat16 (round to nearest even, as ``x.to(torch.bfloat16)``), products with W
    bfloat16 [N, K] (packed by ``pack_bf16``: P) summed in float32, the sums rounded to
    bfloat16 (what ``F.linear(x.bfloat16(), w)`` returns with oneDNN), then ``bias`` float32
    [N] (or none) added in float32. AVX512-BF16 vdpbf16ps in 12 x 32 register tiles (FMAs on
    the bf16 halves with AVX-512F alone, scalar otherwise), k-blocks of 1536; the sums differ
    from oneDNN's by their order only. YirageError for buffers that do not fit the sizes."""
    _check_bf16_gemm(x, P, N, bias, out)
    M, K = x.shape
    st = _status()
    _lib(lib).yr_emb_gemm_bf16(x.data_ptr(), P.data_ptr(), _ptr(bias), out.data_ptr(), M, N, K, x.numel(),
                               P.numel(), out.numel(), None, None, st.data_ptr())
    _raise_status(st, "gemm_bf16_packed")


def _groups(K: int, group: int) -> tuple[int, int]:
    """(groups per row, bytes per quantized row) of activation groups of ``group`` features (0: the row)."""
    G = group if group > 0 else K
    return K // G, K // G * ((G + 3) // 4 * 4)


def _check_group(K: int, group: int) -> None:
    if group < 0 or group > K or (group > 0 and (K % group or group % 4)):
        raise YirageError(f"int8 linear: group size {group} must be 0 or a multiple of 4 dividing K = {K}")


def pack_s8(w_t: torch.Tensor, group: int = 0, lib=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w_t`` int8 [K, N] (in x out features) packed for the int8 GEMM with activation groups
    of ``group`` features (0: whole rows): (P uint8 [ceil(N/32), Kp/4, 32, 4] with Kp the bytes
    of a quantized row, comp int32 [groups, ceil(N/32) * 32] = 128 * the weight column sums of
    each group). YirageError for a tensor that is not a contiguous 2-D int8 CPU tensor or a
    group size that is not 0 or a multiple of 4 dividing K."""
    _check_cpu("pack_s8", w_t, torch.int8)
    if w_t.dim() != 2 or w_t.numel() == 0:
        raise YirageError(f"pack_s8: needs a non-empty [K, N] weight, got {tuple(w_t.shape)}")
    K, N = w_t.shape
    _check_group(K, group)
    ng, Kp = _groups(K, group)
    np_ = (N + _PANEL - 1) // _PANEL
    P = torch.empty((np_, Kp // 4, _PANEL, 4), dtype=torch.uint8)
    comp = torch.empty((ng, np_ * _PANEL), dtype=torch.int32)
    st = _status()
    _lib(lib).yr_emb_pack_s8(w_t.data_ptr(), P.data_ptr(), comp.data_ptr(), K, N, group, P.numel(), comp.numel(),
                          st.data_ptr())
    _raise_status(st, "pack_s8")
    return P, comp


class W8A8Scratch:
    """Per-call buffers of ``linear_w8a8_packed`` for up to ``M`` rows of ``K`` features in
    groups of ``group``: the quantized rows (uint8 [M, Kp]) and their scales (float32 [M, groups])."""

    def __init__(self, M: int, K: int, group: int = 0):
        ng, Kp = _groups(K, group)
        self.q = torch.empty((M, Kp), dtype=torch.uint8)
        self.s = torch.empty((M, ng), dtype=torch.float32)


def linear_w8a8_packed(x: torch.Tensor, P: torch.Tensor, comp: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None, out: torch.Tensor, scratch: W8A8Scratch, group: int = 0,
                       lib=None) -> None:
    """W8A8 linear (``ir.ops.linear_w8a8_reference``): ``x`` float32 [M, K] quantized per row and
    group of ``group`` features (0: whole rows; symmetric int8, round half to even), integer dot
    products with the weight packed by ``pack_s8`` for the same group (AVX-512 VNNI vpdpbusd on
    u8 = q + 128 minus ``comp``, the same on ymm with AVX-VNNI; AVX2 vpmaddubsw with the sign
    trick; scalar), then ``sum_g acc_g * x_scale_g``, times ``w_scale[n]``, plus ``bias[n]``
    into ``out`` float32 [M, N].
    YirageError for a bad group size or buffers that do not fit the sizes."""
    _check_w8a8(x, P, comp, w_scale, bias, out, scratch, group)
    M, K = x.shape
    N = out.shape[1]
    st = _status()
    _lib(lib).yr_emb_linear_w8a8(x.data_ptr(), scratch.q.data_ptr(), scratch.s.data_ptr(), P.data_ptr(),
                              comp.data_ptr(), w_scale.data_ptr(), _ptr(bias), out.data_ptr(), M, N, K, group,
                              x.numel(), scratch.q.numel(), scratch.s.numel(), P.numel(), comp.numel(), out.numel(),
                              None, None, st.data_ptr())
    _raise_status(st, "linear_w8a8_packed")


def _check_w8a8(x, P, comp, w_scale, bias, out, scratch, group) -> None:
    """YirageError unless the buffers of ``linear_w8a8_packed`` have the dtypes, devices and
    lengths it needs (the C++ kernel checks the sizes against the lengths again)."""
    for name, t, dt in (("x", x, torch.float32), ("P", P, torch.uint8), ("comp", comp, torch.int32),
                        ("w_scale", w_scale, torch.float32), ("out", out, torch.float32),
                        ("scratch.q", scratch.q, torch.uint8), ("scratch.s", scratch.s, torch.float32)):
        _check_cpu(f"linear_w8a8_packed: {name}", t, dt)
    K, N = x.shape[1], out.shape[1]
    for name, t in (("w_scale", w_scale), ("bias", bias)):
        if t is not None and t.numel() != N:
            raise YirageError(f"linear_w8a8_packed: {name} has {t.numel()} values, expected N = {N}")
    if bias is not None:
        _check_cpu("linear_w8a8_packed: bias", bias, torch.float32)
    _check_group(K, group)


def attention_varlen(qkv: torch.Tensor, offsets: torch.Tensor, num_heads: int, scale: float,
                     out: torch.Tensor, status: torch.Tensor | None = None, lib=None) -> None:
    """``ir.ops.attention_varlen_reference`` into ``out`` [T, H*Dh]: qkv float32 [T, 3*H*Dh],
    offsets int64 [B+1] (0, non-decreasing, at most T). Per (sentence, head): scores with K
    transposed in scratch, softmax with a vectorized exp (Cephes expf), then P V.
    IndexOutOfRangeError for bad offsets (nothing written), YirageError for bad sizes."""
    T, three_hd = qkv.shape
    if three_hd % (3 * num_heads) or offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() < 1:
        raise YirageError(f"attention_varlen: qkv [T, 3*H*Dh] with H = {num_heads} and int64 offsets [B+1] needed, "
                          f"got {tuple(qkv.shape)} and {offsets.dtype} {tuple(offsets.shape)}")
    hd = three_hd // 3
    st = _status() if status is None else status
    _lib(lib).yr_emb_attention_varlen(qkv.data_ptr(), offsets.data_ptr(), out.data_ptr(), T, offsets.numel() - 1,
                                   num_heads, hd // num_heads, scale, qkv.numel(), out.numel(), st.data_ptr())
    if int(st[0]):
        st.zero_()
        check_offsets([int(o) for o in offsets.tolist()], T)  # raises IndexOutOfRangeError
        raise YirageError("attention_varlen: sizes do not fit the buffers")


# ---- constant weights and the packed-weight cache ----------------------------------------
_constant: dict[int, int] = {}   # id(weight) -> data_ptr, for weights declared constant


def mark_constant(w: torch.Tensor) -> None:
    """Declare ``w`` a constant weight (an engine's, frozen for its lifetime): kernel providers
    may then keep a packed copy of it in their own layout (``backends/cpu/providers.py``).
    Weights not declared constant (a kernel graph's inputs) are read as they are. Writes to
    ``w`` stay visible: a packed copy is remade when ``w``'s version or storage changes."""
    key = id(w)
    if key not in _constant:
        weakref.finalize(w, _constant.pop, key, None)
    _constant[key] = w.data_ptr()


def is_constant(w: torch.Tensor) -> bool:
    """Was ``w`` declared with ``mark_constant`` (and still has the same storage)?"""
    return _constant.get(id(w)) == w.data_ptr()


def _cached(w: torch.Tensor, kind: str, make, deps: tuple = ()):
    """The packed form ``kind`` of ``w``, made by ``make(w)`` once (again if w changed, or one
    of ``deps``: tensors the packed form is also derived from, such as the batch-norm
    statistics folded into a convolution's weight)."""
    key = (id(w), kind)
    stamp = (w.data_ptr(), w._version, tuple((d.data_ptr(), d._version) for d in deps))
    hit = _packed.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    packed = make(w)
    if hit is None:
        weakref.finalize(w, _packed.pop, key, None)
    _packed[key] = (stamp, packed)
    return packed


def has_packed(w: torch.Tensor, kind: str) -> bool:
    """Is a packed form ``kind`` of ``w`` held (possibly stale)?"""
    return (id(w), kind) in _packed


def forget_packed(w: torch.Tensor, kind: str) -> None:
    """Drop the packed form ``kind`` of ``w`` (a provider that was measured, not chosen)."""
    _packed.pop((id(w), kind), None)


def prepack_linear(w: torch.Tensor) -> None:
    """Declare ``w`` float32 [N, K] constant and pack it for the float32 GEMM now."""
    mark_constant(w)
    _cached(w, "f32", pack_f32)


def packed_linear_weight(w: torch.Tensor) -> torch.Tensor | None:
    """The float32 GEMM's packed form of ``w`` if ``w`` is a constant weight (packed now if it
    was not, repacked if written since), else None."""
    return _cached(w, "f32", pack_f32) if is_constant(w) else None


# ---- binders (library.OPS) -------------------------------------------------------------
def bind_linear_f32_packed(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                           epilogue: tuple[int, int] | None = None, weight_layout: str = "nk"):
    """Thunk of an fp32 ``linear`` on the packed GEMM (``w`` packed once, again if written).
    ``epilogue``: None or ``(fn, args)``, the addresses of a fused row kernel's task entry
    (``void fn(const int64_t* args, int64_t lo, int64_t hi)``) and of its argument array
    (kept alive by the caller), run by the GEMM on each block of finished output rows.
    ``weight_layout`` "kn": ``w`` is [K, N] (packed from its transpose, a temporary copy)."""
    if weight_layout == "kn":
        K, N = w.shape
        kind, pack = "f32/kn", (lambda t: pack_f32(t.t().contiguous()))
    else:
        N, K = w.shape
        kind, pack = "f32", pack_f32
    M = x.numel() // K
    # repacked if w was written or its storage replaced
    return bind_gemm_f32(x.view(M, K), out.view(M, N), lambda: (_cached(w, kind, pack), bias), epilogue)


def bind_gemm_f32(x2: torch.Tensor, o2: torch.Tensor, weights, epilogue: tuple[int, int] | None = None):
    """Thunk of ``o2 = x2 @ W^T + bias`` on the packed float32 GEMM: ``x2`` [M, K] and ``o2`` [M, N]
    float32, contiguous; ``weights()`` returns ``(P, bias)``, P the packed form of W [N, K]
    (``pack_f32``) and bias float32 [N] or None. It is called at every run, so the caller's
    cache can remake P when the weight is written. ``epilogue`` as ``bind_linear_f32_packed``.
    Raises YirageError (at run time) when P's size does not fit N x K (the kernel checks)."""
    (M, K), N = x2.shape, o2.shape[1]
    lib, st = _lib(), _status()
    epi_fn, epi_args = epilogue if epilogue is not None else (None, None)

    def run():
        P, bias = weights()
        lib.yr_emb_gemm_f32(x2.data_ptr(), P.data_ptr(), _ptr(bias), o2.data_ptr(), M, N, K, x2.numel(),
                            P.numel(), o2.numel(), epi_fn, epi_args, st.data_ptr())
        if st[0]:
            _raise_status(st, "linear (packed float32)")
    return run


#: the largest stacked weight (bytes) that ``library.merge_linears`` and ``conv.stack_candidates``
#: measure these stacked GEMMs at: the measurement allocates sample weights of the case's shapes
#: (and packs them twice), and GEMMs this large are compute-bound, where one wider GEMM gained
#: nothing here (q/k/v at M = 1024: within 4%)
MERGE_MAX_WEIGHT_BYTES = 64 << 20


def bind_gemm_f32_parts(x2: torch.Tensor, out: torch.Tensor, widths: list[int], weights,
                        epilogue: tuple[int, int] | None = None):
    """Thunk of one GEMM over parts of different widths that share x (parallel 1x1 convolutions
    merged, backends/cpu/conv.py): part i is ``x2 @ W_i^T + b_i`` [M, widths[i]], its rows
    contiguous at element offset ``M * sum(widths[:i])`` of the flat ``out``
    (``yr_emb_gemm_f32_parts``). ``x2`` float32 [M, K] and ``out`` float32 [M * sum(widths)],
    contiguous; ``weights()`` returns ``(P, bias)`` at every run: P the concatenation of each
    W_i's ``pack_f32``, bias None or each b_i zero-padded to a multiple of 32 and
    concatenated. ``epilogue`` as ``bind_linear_f32_packed``'s. Raises YirageError (at run
    time) when a size does not fit (the kernel checks)."""
    (M, K), parts = x2.shape, len(widths)
    wt = torch.tensor(widths, dtype=torch.int64)
    lib, st = _lib(), _status()
    epi_fn, epi_args = epilogue if epilogue is not None else (None, None)

    def run():
        P, bias = weights()
        lib.yr_emb_gemm_f32_parts(x2.data_ptr(), P.data_ptr(), _ptr(bias), out.data_ptr(), M, K, parts,
                                  wt.data_ptr(), x2.numel(), P.numel(), out.numel(), epi_fn, epi_args, st.data_ptr())
        if st[0]:
            _raise_status(st, "conv2d_stack (packed float32)")
    run.widths = wt   # the kernel reads it through a raw pointer
    return run


def bind_linear_stack_f32(x2: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor] | None,
                          out: torch.Tensor, weight_layout: str = "nk"):
    """Thunk of ``linear_stack`` on the packed float32 GEMM: ``out[i]`` = ``x2`` @ W_i^T + b_i for
    the k weights (each [Np, K], or [K, Np] with ``weight_layout`` "kn"), one GEMM over the
    weights stacked and packed once (remade when any of them or a bias is written), each
    output plane written in place (``yr_emb_gemm_f32_planes``). ``x2`` float32 [M, K], ``out``
    float32 [k, ..., Np] (M rows per plane) contiguous, Np a multiple of 32. Raises YirageError (at run time) when a
    size does not fit (the kernel checks)."""
    (M, K), planes, Np = x2.shape, out.shape[0], out.shape[-1]
    kn = weight_layout == "kn"
    deps = tuple(weights[1:]) + tuple(biases or ())
    kind = "f32-stack/" + "/".join(str(id(t)) for t in deps) + ("/kn" if kn else "")

    def pack(_):
        w = torch.cat([t.t() if kn else t for t in weights]).contiguous()
        return pack_f32(w), None if biases is None else torch.cat(biases).float().contiguous()
    _cached(weights[0], kind, pack, deps)   # stacked and packed now, once
    lib, st = _lib(), _status()
    o2 = out.view(planes, M, Np)

    def run():
        P, bias = _cached(weights[0], kind, pack, deps)
        lib.yr_emb_gemm_f32_planes(x2.data_ptr(), P.data_ptr(), _ptr(bias), o2.data_ptr(), M, planes, Np, K,
                                   x2.numel(), P.numel(), o2.numel(), st.data_ptr())
        if st[0]:
            _raise_status(st, "linear_stack (packed float32)")
    return run


def bind_linear_bf16_packed(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                            epilogue: tuple[int, int] | None = None, weight_layout: str = "nk"):
    """Thunk of a bfloat16 ``linear`` (``gemm_bf16_packed``'s rounding): ``x`` float32 [..., K],
    ``w`` bfloat16 [N, K], ``bias`` float32 [N] or None, into ``out`` float32 [..., N]. The
    weight is packed once per tensor (again if it was written in place or its storage
    replaced). A float32 ``w`` (bfloat16 compute) is rounded to bfloat16 when packed;
    ``weight_layout`` "kn": ``w`` is [K, N] (packed from its transpose). ``epilogue`` as in
    ``bind_linear_f32_packed``. YirageError (at bind time) for buffers of the wrong dtype or
    size."""
    kn, convert = weight_layout == "kn", w.dtype == torch.float32
    K, N = w.shape if kn else (w.shape[1], w.shape[0])
    M = x.numel() // K
    kind = "bf16" + ("/f32" if convert else "") + ("/kn" if kn else "")

    def pack(t):
        t = t.t() if kn else t
        return pack_bf16(t.to(torch.bfloat16).contiguous() if (kn or convert) else t)
    _check_cpu("linear (packed bfloat16): x", x, torch.float32)
    _check_cpu("linear (packed bfloat16): out", out, torch.float32)
    x2, o2 = x.view(M, K), out.view(M, N)
    P = _cached(w, kind, pack)
    _check_bf16_gemm(x2, P, N, bias, o2)
    fn, st = _lib().yr_emb_gemm_bf16, _status()
    epi = epilogue if epilogue is not None else (None, None)

    def run():
        P = _cached(w, kind, pack)  # repacked if w was written
        fn(x2.data_ptr(), P.data_ptr(), _ptr(bias), o2.data_ptr(), M, N, K, x2.numel(), P.numel(), o2.numel(),
           *epi, st.data_ptr())
        if st[0]:
            _raise_status(st, "linear (packed bfloat16)")
    return run


def bind_linear_w8a8(node, graph, args, out, status, epilogue: tuple[int, int] | None = None):
    """Thunk of ``linear_w8a8`` on the C++ int8 GEMM (weights packed once per tensor);
    ``epilogue`` as in ``bind_linear_f32_packed``."""
    return bind_linear_w8a8_args(args, out, int(node.attrs.get("group_size", 0)), epilogue)


def bind_linear_w8a8_args(args: list[torch.Tensor], out: torch.Tensor, group: int,
                          epilogue: tuple[int, int] | None = None):
    """``bind_linear_w8a8`` from the op's tensors (x float32 [.., K], w_t int8 [K, N], w_scale
    float32 [N], optional bias float32 [N]) and its activation group size."""
    x, w_t, w_scale = args[0], args[1], args[2]
    bias = args[3] if len(args) == 4 else None
    K, N = w_t.shape
    M = x.numel() // K
    x2, o2 = x.view(M, K), out.view(M, N)
    scratch = W8A8Scratch(M, K, group)
    kind = f"s8/{group}"
    P, comp = _cached(w_t, kind, lambda w: pack_s8(w, group))
    _check_w8a8(x2, P, comp, w_scale, bias, o2, scratch, group)
    fn, st = _lib().yr_emb_linear_w8a8, _status()
    tail = (_ptr(bias), o2.data_ptr(), M, N, K, group, x2.numel(), scratch.q.numel(), scratch.s.numel())
    epi = epilogue if epilogue is not None else (None, None)

    def run():
        P, comp = _cached(w_t, kind, lambda w: pack_s8(w, group))  # repacked if w_t was written
        fn(x2.data_ptr(), scratch.q.data_ptr(), scratch.s.data_ptr(), P.data_ptr(), comp.data_ptr(),
           w_scale.data_ptr(), *tail, P.numel(), comp.numel(), o2.numel(), *epi, st.data_ptr())
        if st[0]:
            _raise_status(st, "linear_w8a8")
    return run


def bind_attention_varlen(node, graph, args, out, status):
    """Thunk of ``attention_varlen`` on the C++ kernel (float32 qkv). Bad offsets are recorded
    in the executor's ``status`` slot (the op's ``index_input``), which raises
    IndexOutOfRangeError after the run; nothing is written then."""
    qkv, offsets = args
    h, scale = node.attrs["num_heads"], node.attrs["scale"]
    T, three_hd = qkv.shape
    fn = _lib().yr_emb_attention_varlen
    p = (qkv.data_ptr(), offsets.data_ptr(), out.data_ptr(), T, offsets.numel() - 1, h, three_hd // 3 // h, scale,
         qkv.numel(), out.numel(), status.data_ptr())
    return lambda: fn(*p)


__all__ = ["pack_f32", "gemm_f32_packed", "pack_bf16", "gemm_bf16_packed", "bind_linear_bf16_packed", "pack_s8",
           "linear_w8a8_packed", "W8A8Scratch", "attention_varlen", "mark_constant", "is_constant", "prepack_linear", "bind_gemm_f32",
           "packed_linear_weight", "has_packed", "forget_packed"]
