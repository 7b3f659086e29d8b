// GGML block formats beyond q4_1/q8_0, read in place: Q4_0, Q5_0, Q5_1 (blocks of 32 weights),
// the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (super-blocks of 256 weights) and the non-linear
// 4-bit IQ4_NL (blocks of 32) and IQ4_XS (super-blocks of 256). Layouts are
// llama.cpp's (ggml/src/ggml-common.h); dequantized values equal gguf-py's
// gguf.quants.dequantize bit for bit (gguf/quants.py, the numerical reference).
//
// Included by library_quants.cpp after library_core.h, whose
// helpers it uses (F16 table, vf/vload/vfma/vsum, YR_IN_REGISTER, GEMV_ROWS, gemv_range, gemv_groups,
// YR_DISPATCH_ROWS, linear_packed, transpose_block, embedding_rows, report, scratch, ...).
// Entry points (bound by yirage/backends/cpu/native.py), for T in q4_0 q5_0 q5_1 q2_k q3_k
// q4_k q5_k q6_k iq4_nl iq4_xs, with the argument lists of their q4_1 counterparts:
//   yr_linear_T(x, w, bias|0, y, M, N, K)          y[M, N] = x[M, K] @ W[N, K]^T (+ bias)
//   yr_embedding_T(ids, table, out, T, D, V, status)
//   yr_task_linear_T(a = {x, w, bias|0, y, M, N, K, stride}, lo, hi)  weight rows [lo, hi)
//   yr_task_embedding_T(a = {ids, table, out, T, D, V, status, *}, lo, hi)   tokens [lo, hi)
//   yr_dequant_T(src, dst, nblocks)                 nblocks blocks -> nblocks * QB floats
// K (and D) must be a whole number of blocks (the IR's storage_shape checks it).
//
// How a block is decoded. Each format has one `visit(blk, v)` per instruction set that calls
// v(j, w) for consecutive vectors w of VL dequantized weights (j: offset of w's first weight in
// the block). The same visitor dequantizes (v stores w) and runs the GEMV (v multiplies w with
// x into an accumulator), so the GEMV reads the blocks in place and keeps the weights in
// registers. Every w is the exact float32 value of gguf-py:
// - all products of scales and integers are exact in float32 (an fp16 scale has 11
//   significant bits, a sub-block scale <= 7 bits, a quant <= 6 bits: <= 24 bits), so the
//   only rounding is the final "+ m" / "- dmin*m", and an FMA rounds it exactly as numpy's
//   separate multiply and add do (-ffp-contract=fast cannot change a result); IQ4_NL / IQ4_XS
//   values d * kv (d * (ls - 32) * kv) have <= 11 + 6 + 7 bits: exact, no rounding at all;
// - AVX-512: the 16 (or 32, or 4/8 repeated) possible values of a sub-block are built with one
//   FMA into a lookup table and the quants index it with vpermps (_mm512_permutexvar_ps) or,
//   for 5-bit quants, vpermt2ps (_mm512_permutex2var_ps), as in library.cpp's q4_1 kernel;
//   Q5_K and Q6_K convert quants assembled 64 at a time with byte ops (int8 -> float);
// - AVX2: quants are widened to int32, converted and scaled (one FMA or multiply); IQ4_NL /
//   IQ4_XS first map the nibbles to their int8 values with pshufb (16-byte table);
// - scalar: the formulas of gguf-py, one weight at a time.
//
// The GEMV (gemv_rows_fmt, M < GEMM_MIN_M) reads GEMV_ROWS weight rows at a time, as library.cpp's:
// blocks of 32 block by block with the block's x in registers for all the rows (Q5_0 with its
// own `dot`: constant tables, d applied once per block); the AVX-512 K-quants chunk by chunk
// (64 weights, visit_chunk, or the format's dot_chunk), the rows' next blocks prepared (scales,
// and for some the quants, decoded into a small buffer) while the current ones are read; the
// others row by row. Rows are prefetched from the loop (prefetch_rows). The GEMM packs panels dequantized by the visitor (pack_fmt, for
// library.cpp's linear_packed). Measured with benchmarks/kernels_cpu.py (ggml_gemv).
//
// Rules: as library.cpp (no allocation of caller memory, no torch/Python, run-time indices
// checked, a scalar path for every target).

#pragma once

namespace {

// =================================================================================
// Block sizes (llama.cpp ggml-common.h)
// =================================================================================

constexpr int64_t QK_K = 256;          // weights per K-quant super-block
constexpr int64_t Q4_0_BYTES = 18;     // {fp16 d; uint8 qs[16]}
constexpr int64_t Q5_0_BYTES = 22;     // {fp16 d; uint8 qh[4]; uint8 qs[16]}
constexpr int64_t Q5_1_BYTES = 24;     // {fp16 d; fp16 m; uint8 qh[4]; uint8 qs[16]}
constexpr int64_t Q2_K_BYTES = 84;     // {uint8 scales[16]; uint8 qs[64]; fp16 d; fp16 dmin}
constexpr int64_t Q3_K_BYTES = 110;    // {uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; fp16 d}
constexpr int64_t Q4_K_BYTES = 144;    // {fp16 d; fp16 dmin; uint8 scales[12]; uint8 qs[128]}
constexpr int64_t Q5_K_BYTES = 176;    // {fp16 d; fp16 dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]}
constexpr int64_t Q6_K_BYTES = 210;    // {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d}
constexpr int64_t IQ4_NL_BYTES = 18;   // {fp16 d; uint8 qs[16]}
constexpr int64_t IQ4_XS_BYTES = 136;  // {fp16 d; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128]}

// IQ4_NL / IQ4_XS: a 4-bit quant indexes this non-linear table (llama.cpp ggml-common.h
// kvalues_iq4nl; gguf-py IQ4_NL.kvalues).
alignas(16) constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

inline uint32_t load_u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline uint64_t load_u64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }

// Makes GCC forget what an array holds, so that its elements are read back from memory. The
// per-block scales are stored as a vector and read as scalars: without this GCC keeps them in
// a register and broadcasts each with vpermd (one more vector op, 1.25x slower Q4_K) where
// a broadcast load ({1to16} operand) costs no vector op.
#if defined(__GNUC__)
#define YR_FROM_MEMORY(a) __asm__("" : "+m"(a))
#else
#define YR_FROM_MEMORY(a) (void)0
#endif

// fp16 at p -> float (exact): from library.cpp's table (the blocks of 32: the cheapest per block
// when hot) or converted (half_cvt: the K-quants, once per 256 weights; with cold weights the
// table lookup, dependent on the scale's load, misses the caches the weights stream through).
inline float half_at(const uint8_t* p) {
#if defined(YR_AVX512) || defined(YR_AVX2)
    return F16.v[load_u16(p)];
#else
    return fp16_to_fp32(load_u16(p));
#endif
}
inline float half_cvt(const uint8_t* p) {
#if defined(__F16C__)
    return _cvtsh_ss(load_u16(p));
#else
    return fp16_to_fp32(load_u16(p));
#endif
}

// =================================================================================
// Scalar dequantization of one block: gguf-py's formulas, weight by weight. The scalar
// visitors use them; they document each layout.
// =================================================================================

// Q4_0: w[j] = d * ((qs[j] & 15) - 8), w[j + 16] = d * ((qs[j] >> 4) - 8).
inline void scalar_q4_0(const uint8_t* b, float* out) {
    const float d = half_at(b);
    for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)((b[2 + j] & 15) - 8);
        out[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
    }
}

// Q5_0: 5-bit q = nibble | bit j of the little-endian uint32 qh << 4; w = d * (q - 16).
inline void scalar_q5_0(const uint8_t* b, float* out) {
    const float d = half_at(b);
    const uint32_t qh = load_u32(b + 2);
    for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)((int)((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
        out[j + 16] = d * (float)((int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
}

// Q5_1: as Q5_0 with a minimum: w = d * q + m.
inline void scalar_q5_1(const uint8_t* b, float* out) {
    const float d = half_at(b), m = half_at(b + 2);
    const uint32_t qh = load_u32(b + 4);
    for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)((b[8 + j] & 15) | (((qh >> j) & 1) << 4)) + m;
        out[j + 16] = d * (float)((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
    }
}

// Q2_K: 16 sub-blocks of 16; scales[i] = min << 4 | scale. Weight 128h + 32s + l (h < 2,
// s < 4, l < 32) is q = (qs[32h + l] >> 2s) & 3 of sub-block (128h + 32s + l) / 16;
// w = (d * scale) * q - dmin * min.
inline void scalar_q2_k(const uint8_t* b, float* out) {
    const float d = half_cvt(b + 80), dmin = half_cvt(b + 82);
    for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
            for (int l = 0; l < 32; ++l) {
                const int k = 128 * h + 32 * s + l;
                const float dl = d * (float)(b[k / 16] & 15), ml = dmin * (float)(b[k / 16] >> 4);
                out[k] = dl * (float)((b[16 + 32 * h + l] >> (2 * s)) & 3) - ml;
            }
}

// The 16 signed 6-bit scales of Q3_K, scale - 32: the low 4 bits of scale i are the low (i < 8)
// or high (i >= 8) nibble of scales[i % 8], its high 2 bits are bits 2(i / 4) of scales[8 + i % 4].
inline int q3_k_scale(const uint8_t* sc, int i) {
    const int lo = i < 8 ? sc[i] & 15 : sc[i - 8] >> 4;
    const int hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (lo | (hi << 4)) - 32;
}

// Q3_K: weight k = 128h + 32s + l: q = ((qs[32h + l] >> 2s) & 3) - 4 * !(hmask[l] >> (4h + s) & 1),
// w = (d * scale[k / 16]) * q.
inline void scalar_q3_k(const uint8_t* b, float* out) {
    const float d = half_cvt(b + 108);
    for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
            for (int l = 0; l < 32; ++l) {
                const int k = 128 * h + 32 * s + l;
                const int lo = (b[32 + 32 * h + l] >> (2 * s)) & 3;
                const int hb = (b[l] >> (4 * h + s)) & 1;
                out[k] = (d * (float)q3_k_scale(b + 96, k / 16)) * (float)(lo - (hb ? 0 : 4));
            }
}

// The 8 6-bit scales and mins of Q4_K/Q5_K (12 bytes; gguf-py Q4_K.get_scale_min):
// i < 4: sc = s[i] & 63, min = s[i + 4] & 63; i >= 4: sc = (s[i + 4] & 15) | (s[i - 4] >> 6) << 4,
// min = (s[i + 4] >> 4) | (s[i] >> 6) << 4.
inline void k_scale_min(const uint8_t* s, int i, int* sc, int* mn) {
    if (i < 4) {
        *sc = s[i] & 63;
        *mn = s[i + 4] & 63;
    } else {
        *sc = (s[i + 4] & 15) | ((s[i - 4] >> 6) << 4);
        *mn = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
    }
}

// Q4_K: 8 sub-blocks of 32: sub-block 2c is the low nibbles of qs[32c .. 32c+31], 2c+1 their
// high nibbles; w = (d * sc) * q - dmin * min.
inline void scalar_q4_k(const uint8_t* b, float* out) {
    const float d = half_at(b), dmin = half_at(b + 2);
    for (int i = 0; i < 8; ++i) {
        int sc, mn;
        k_scale_min(b + 4, i, &sc, &mn);
        const float dl = d * (float)sc, ml = dmin * (float)mn;
        const uint8_t* qs = b + 16 + 32 * (i / 2);
        for (int l = 0; l < 32; ++l) out[32 * i + l] = dl * (float)((qs[l] >> (4 * (i % 2))) & 15) - ml;
    }
}

// Q5_K: Q4_K plus a fifth bit: bit i of qh[l] for weight l of sub-block i.
inline void scalar_q5_k(const uint8_t* b, float* out) {
    const float d = half_at(b), dmin = half_at(b + 2);
    for (int i = 0; i < 8; ++i) {
        int sc, mn;
        k_scale_min(b + 4, i, &sc, &mn);
        const float dl = d * (float)sc, ml = dmin * (float)mn;
        const uint8_t* qs = b + 48 + 32 * (i / 2);
        for (int l = 0; l < 32; ++l) {
            const int q = ((qs[l] >> (4 * (i % 2))) & 15) | (((b[16 + l] >> i) & 1) << 4);
            out[32 * i + l] = dl * (float)q - ml;
        }
    }
}

// Q6_K: weight k = 128h + 64n + l (n < 2, l < 64) has low bits (ql[64h + l] >> 4n) & 15;
// weight k = 128h + 32s + l (s < 4, l < 32) has high bits (qh[32h + l] >> 2s) & 3;
// w = (d * scales[k / 16]) * (q - 32).
inline void scalar_q6_k(const uint8_t* b, float* out) {
    const float d = half_cvt(b + 208);
    for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
            for (int l = 0; l < 32; ++l) {
                const int k = 128 * h + 32 * s + l;
                const int lo = (b[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 15;
                const int hi = (b[128 + 32 * h + l] >> (2 * s)) & 3;
                out[k] = (d * (float)(int8_t)b[192 + k / 16]) * (float)((lo | (hi << 4)) - 32);
            }
}

// IQ4_NL (gguf-py IQ4_NL): w[j] = d * kv[qs[j] & 15], w[j + 16] = d * kv[qs[j] >> 4] (j < 16),
// the nibble order of Q4_0.
inline void scalar_iq4_nl(const uint8_t* b, float* out) {
    const float d = half_at(b);
    for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)IQ4_VALUES[b[2 + j] & 15];
        out[j + 16] = d * (float)IQ4_VALUES[b[2 + j] >> 4];
    }
}

// The 6-bit scale of IQ4_XS sub-block i < 8, minus 32: low 4 bits the nibble i % 2 of
// scales_l[i / 2] (byte 4 + i / 2), high 2 bits bits 2i, 2i + 1 of the little-endian uint16
// scales_h (bytes 2-3).
inline int iq4_xs_scale(const uint8_t* b, int i) {
    const int lo = (b[4 + i / 2] >> (4 * (i % 2))) & 15;
    const int hi = (load_u16(b + 2) >> (2 * i)) & 3;
    return (lo | (hi << 4)) - 32;
}

// IQ4_XS (gguf-py IQ4_XS): 8 sub-blocks of 32; sub-block i is the 16 bytes qs[16i ..] (byte 8 +
// 16i ..), low nibbles its weights 0..15, high nibbles 16..31 (as IQ4_NL);
// w = (d * (ls_i - 32)) * kv[nibble].
inline void scalar_iq4_xs(const uint8_t* b, float* out) {
    const float d = half_cvt(b);
    for (int i = 0; i < 8; ++i) {
        const float dl = d * (float)iq4_xs_scale(b, i);
        const uint8_t* qs = b + 8 + 16 * i;
        for (int j = 0; j < 16; ++j) {
            out[32 * i + j] = dl * (float)IQ4_VALUES[qs[j] & 15];
            out[32 * i + 16 + j] = dl * (float)IQ4_VALUES[qs[j] >> 4];
        }
    }
}

// =================================================================================
// Sub-block scales of the K-quants, vectorized (SSE on 16 bytes, shared by AVX-512 and AVX2)
// =================================================================================

#if defined(YR_AVX512) || defined(YR_AVX2)
// Q4_K/Q5_K: the 12 scale bytes at s -> 16 bytes {sc[0..7], min[0..7]} (k_scale_min).
// Reads 16 bytes at s (the block goes on past its scales).
inline __m128i k_scale_min_bytes(const uint8_t* s) {
    const __m128i v = _mm_loadu_si128((const __m128i*)s);                        // d_ m_ md junk
    const __m128i t1 = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i t2 = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i a = _mm_and_si128(t1, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i hi_nib = _mm_and_si128(_mm_srli_epi16(t1, 4), _mm_setr_epi32(0, 0, 0, 0x0F0F0F0F));
    const __m128i top2 = _mm_and_si128(_mm_srli_epi16(t2, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(a, _mm_or_si128(hi_nib, top2));
}

// Q3_K: the 12 scale bytes at s -> 16 int8 scale - 32 (q3_k_scale). Reads exactly 12 bytes.
inline __m128i q3_k_scale_bytes(const uint8_t* s) {
    const __m128i low8 = _mm_loadl_epi64((const __m128i*)s);
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(low8, _mm_set1_epi8(15)),
                                          _mm_and_si128(_mm_srli_epi16(low8, 4), _mm_set1_epi8(15)));
    const __m128i h = _mm_srlv_epi32(_mm_set1_epi32((int)load_u32(s + 8)), _mm_setr_epi32(0, 2, 4, 6));
    const __m128i hi = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi8(3)), 4);
    return _mm_sub_epi8(_mm_or_si128(lo, hi), _mm_set1_epi8(32));
}

// IQ4_XS: p[i] = d * (ls_i - 32) for the 8 sub-blocks (iq4_xs_scale), 8 floats (p unaligned).
inline void iq4_xs_scales_f32(const uint8_t* b, float* p) {
    const __m256i lo = _mm256_srlv_epi32(_mm256_set1_epi32((int)load_u32(b + 4)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i h = _mm256_srlv_epi32(_mm256_set1_epi32((int)load_u16(b + 2)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    const __m256i ls = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)),
                                       _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(3)), 4));
    _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_set1_ps(half_cvt(b)),
                                      _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32)))));
}

// IQ4_NL / IQ4_XS: 16 quant bytes at q -> their 32 values kv[nibble] as int8 (pshufb of the
// table): lo = weights 0..15 (low nibbles), hi = weights 16..31 (high nibbles).
inline void iq4_bytes(const uint8_t* q, __m128i& lo, __m128i& hi) {
    const __m128i kv = _mm_load_si128((const __m128i*)IQ4_VALUES);
    const __m128i v = _mm_loadu_si128((const __m128i*)q), m = _mm_set1_epi8(15);
    lo = _mm_shuffle_epi8(kv, _mm_and_si128(v, m));
    hi = _mm_shuffle_epi8(kv, _mm_and_si128(_mm_srli_epi16(v, 4), m));
}
#endif

// Formats whose blocks are decoded in two steps: prepare(b, p) writes PREP floats of per-block
// data (scales, ...) to p, visit_prepared(b, p, v) reads them. The GEMV prepares the next block
// while it visits the current one: a vector stored and read back at once as scalars (a scale
// per sub-block) stalls on store-to-load forwarding.
template <class F>
struct Prepared {
    template <class V>
    static inline void visit(const uint8_t* b, V&& v) {
        alignas(64) float p[F::PREP];
        F::prepare(b, p);
        YR_FROM_MEMORY(p);
        F::visit_prepared(b, p, v);
    }
};

// =================================================================================
// Visitors, AVX-512: v(j, w) for w = weights j .. j+15 of the block
// =================================================================================

#if defined(YR_AVX512)

inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline __m512i u8x16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
// Bit 4 (0x10) of each lane from b, its other bits from a (ternary logic "c ? b : a", c = 0x10).
inline __m512i take_bit4(__m512i a, __m512i b) {
    return _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi32(0x10), 0xD8);
}

struct Q4_0 {
    static constexpr int64_t QB = 32, BYTES = Q4_0_BYTES;
    static constexpr int PREP = 0;
    template <class V>
    static inline void visit(const uint8_t* b, V&& v) {
        const __m512 lut = _mm512_mul_ps(_mm512_set1_ps(half_at(b)), _mm512_sub_ps(iota16(), _mm512_set1_ps(8)));
        const __m512i q = u8x16(b + 2);
        v(0, _mm512_permutexvar_ps(q, lut));
        v(16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut));
    }
};

// 5-bit quants (Q5_0, Q5_1): the 32 values in two tables lo (q < 16) and hi (q >= 16); bit 4 of
// the vpermt2ps index picks the half. It is bit j of qh for the lane of weight j, moved there
// by a rotation of qh broadcast to all lanes (mask registers loaded per block measured slower).
inline void q5_index(const uint8_t* qh, const uint8_t* qs, __m512i& i0, __m512i& i1) {
    const __m512i q = u8x16(qs);
    const __m512i h = _mm512_set1_epi32((int)load_u32(qh));
    const __m512i rot0 = _mm512_setr_epi32(28, 29, 30, 31, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11);  // j - 4
    i0 = take_bit4(q, _mm512_rorv_epi32(h, rot0));
    i1 = take_bit4(_mm512_srli_epi32(q, 4), _mm512_rorv_epi32(h, _mm512_add_epi32(rot0, _mm512_set1_epi32(16))));
}

template <class V>
inline void visit_q5(const uint8_t* qh, const uint8_t* qs, __m512 lo, __m512 hi, V&& v) {
    __m512i i0, i1;
    q5_index(qh, qs, i0, i1);
    v(0, _mm512_permutex2var_ps(lo, i0, hi));
    v(16, _mm512_permutex2var_ps(lo, i1, hi));
}

struct Q5_0 {
    static constexpr int64_t QB = 32, BYTES = Q5_0_BYTES;
    static constexpr int PREP = 0;
    template <class V>
    static inline void visit(const uint8_t* b, V&& v) {
        const __m512 d = _mm512_set1_ps(half_at(b));
        visit_q5(b + 2, b + 6, _mm512_mul_ps(d, _mm512_sub_ps(iota16(), _mm512_set1_ps(16))), _mm512_mul_ps(d, iota16()), v);
    }
    // GEMV: acc += d * (x0 . (q[0:16] - 16) + x1 . (q[16:32] - 16)), q - 16 from constant
    // tables (no table built per block).
    static inline void dot(const uint8_t* b, __m512 x0, __m512 x1, __m512& acc) {
        const __m512 lo = _mm512_sub_ps(iota16(), _mm512_set1_ps(16)), hi = iota16();
        __m512i i0, i1;
        q5_index(b + 2, b + 6, i0, i1);
        const __m512 w0 = _mm512_permutex2var_ps(lo, i0, hi), w1 = _mm512_permutex2var_ps(lo, i1, hi);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(half_at(b)), _mm512_fmadd_ps(x1, w1, _mm512_mul_ps(x0, w0)), acc);
    }
};

struct Q5_1 {
    static constexpr int64_t QB = 32, BYTES = Q5_1_BYTES;
    static constexpr int PREP = 0;
    template <class V>
    static inline void visit(const uint8_t* b, V&& v) {
        const __m512 d = _mm512_set1_ps(half_at(b)), m = _mm512_set1_ps(half_at(b + 2));
        visit_q5(b + 4, b + 8, _mm512_fmadd_ps(d, iota16(), m),
                 _mm512_fmadd_ps(d, _mm512_add_ps(iota16(), _mm512_set1_ps(16)), m), v);
    }
};

// K-quants with AVX-512 are read in chunks of 64 weights (4 vectors): visit_chunk(b, p, c, v)
// calls v(i, w) for vector i < 4 of chunk c < 4 (weights 64c + 16i ..). The GEMV runs a chunk
// of 8 weight rows at a time with the chunk's x in registers (gemv_rows_chunked).
template <class F>
struct Chunked : Prepared<F> {
    static constexpr int CHUNKS = 4;
    // prepare() of the blocks b + r * rb (r < R) into p + r * PREP
    template <int R>
    static inline void prepare_rows(const uint8_t* b, int64_t rb, float* p) {
        for (int r = 0; r < R; ++r) F::prepare(b + r * rb, p + r * F::PREP);
    }
    template <class V>
    static inline void visit_prepared(const uint8_t* b, const float* p, V&& v) {
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) F::visit_chunk(b, p, c, [&](int i, __m512 w) { v(64 * c + 16 * i, w); });
    }
};

// Q2_K: p = {dl[16] = d * scale_i, nml[16] = -(dmin * min_i)}; each sub-block's 4 values
// dl*q - ml (q < 4) repeat 4 times in a 16-entry table, so index bits 2-3 don't matter.
// Vector i of chunk c is sub-block 4c + i. (Measured slower: the quants placed when the block
// is prepared, as Q3_K's, 0.87x; the min as an FMA of x instead of the table's addend, 0.95x.)
struct Q2_K : Chunked<Q2_K> {
    static constexpr int64_t QB = QK_K, BYTES = Q2_K_BYTES;
    static constexpr int PREP = 32;
    static inline void prepare(const uint8_t* b, float* p) {
        const __m512i sc = u8x16(b);
        _mm512_store_ps(p, _mm512_mul_ps(_mm512_set1_ps(half_cvt(b + 80)),
                                         _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(15)))));
        _mm512_store_ps(p + 16, _mm512_mul_ps(_mm512_set1_ps(-half_cvt(b + 82)),
                                              _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4))));
    }
    template <class V>
    static inline void visit_chunk(const uint8_t* b, const float* p, int c, V&& v) {
        const __m512 pat = _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
        const int h = c / 2, s = 2 * (c % 2);          // weights 128h + 32s + l, s and s + 1
        const __m512i q0 = _mm512_srli_epi32(u8x16(b + 16 + 32 * h), 2 * s);
        const __m512i q1 = _mm512_srli_epi32(u8x16(b + 32 + 32 * h), 2 * s);
        const auto lut = [&](int i) {
            return _mm512_fmadd_ps(_mm512_set1_ps(p[4 * c + i]), pat, _mm512_set1_ps(p[16 + 4 * c + i]));
        };
        v(0, _mm512_permutexvar_ps(q0, lut(0)));
        v(1, _mm512_permutexvar_ps(q1, lut(1)));
        v(2, _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 2), lut(2)));
        v(3, _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 2), lut(3)));
    }
};

// The 32 bytes at src -> dword j = bytes {src[j], src[16 + j], src[j], src[16 + j]} (Q3_K's
// chunk layout: byte k of dword j = weight 16k + j of the chunk): one vpermb with AVX512-VBMI,
// else byte and word unpacks.
inline __m512i bytes_j_16j(const uint8_t* src) {
#if defined(__AVX512VBMI__)
    const __m512i j = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(0x01010101));
    return _mm512_permutexvar_epi8(_mm512_add_epi8(j, _mm512_set1_epi32(0x10001000)),
                                   _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)src)));
#else
    const __m128i lo = _mm_loadu_si128((const __m128i*)src), hi = _mm_loadu_si128((const __m128i*)(src + 16));
    const __m128i u0 = _mm_unpacklo_epi8(lo, hi), u1 = _mm_unpackhi_epi8(lo, hi);   // words {j, 16 + j}
    __m512i r = _mm512_castsi128_si512(_mm_unpacklo_epi16(u0, u0));
    r = _mm512_inserti32x4(r, _mm_unpackhi_epi16(u0, u0), 1);
    r = _mm512_inserti32x4(r, _mm_unpacklo_epi16(u1, u1), 2);
    return _mm512_inserti32x4(r, _mm_unpackhi_epi16(u1, u1), 3);
#endif
}

// Q3_K: p = {dl[16] = d * (scale_i - 32), then the 256 table indices as bytes}: index = low 2
// bits | high bit << 2 (bit 3 free: the 8 values repeat), value = dl * (index - 4). The
// indices are assembled when the block is prepared, 64 bytes (a chunk) per vector op, in the
// order read back: byte k of dword j of chunk c is weight 64c + 16k + j, so that vector k of
// the chunk is the chunk's 64 bytes shifted right by 8k, read by vpermps as they are (it reads
// the low 4 bits of each dword): no byte -> dword widening per vector. (Shuffles, vpmovzxbd
// and vpermps alike, measured the scarce resource: 2 per 16 weights before, 1 + 3/16 now;
// 1.15-1.2x the GB/s hot, 1.05x from DRAM.)
// Weight 64c + 16k + j is 128h + 32s + l with h = c / 2, s = 2(c % 2) + k / 2, l = 16(k % 2) + j:
// the bytes qs[32h + l] and hmask[l] are placed with vpermb (once per block), then shifted by
// 16-bit lanes (s differs between the two words of a dword) and merged.
struct Q3_K : Chunked<Q3_K> {
    static constexpr int64_t QB = QK_K, BYTES = Q3_K_BYTES;
    static constexpr int PREP = 16 + 64;
    static inline void prepare(const uint8_t* b, float* p) {
        _mm512_store_ps(p, _mm512_mul_ps(_mm512_set1_ps(half_cvt(b + 108)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q3_k_scale_bytes(b + 96)))));
        uint8_t* out = reinterpret_cast<uint8_t*>(p + 16);
        const __m512i hm = bytes_j_16j(b), q[2] = {bytes_j_16j(b + 32), bytes_j_16j(b + 64)};
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const int h = c / 2, s = 2 * (c % 2), hb = 4 * h + s;    // s, hb: the low word; + 1: the high word
            const __m512i lo = _mm512_srlv_epi16(q[h], _mm512_set1_epi32(((2 * s + 2) << 16) | (2 * s)));
            const __m512i hi = hb >= 2 ? _mm512_srlv_epi16(hm, _mm512_set1_epi32(((hb - 1) << 16) | (hb - 2)))
                                       : _mm512_sllv_epi16(hm, _mm512_set1_epi32((1 << 16) | 2));
            _mm512_store_si512((void*)(out + 64 * c), _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(4), 0xD8));
        }
    }
    template <class V>
    static inline void visit_chunk(const uint8_t*, const float* p, int c, V&& v) {
        const __m512 pat = _mm512_setr_ps(-4, -3, -2, -1, 0, 1, 2, 3, -4, -3, -2, -1, 0, 1, 2, 3);
        const __m512i q = _mm512_load_si512((const void*)(reinterpret_cast<const uint8_t*>(p + 16) + 64 * c));
        v(0, _mm512_permutexvar_ps(q, _mm512_mul_ps(_mm512_set1_ps(p[4 * c]), pat)));
        v(1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 8), _mm512_mul_ps(_mm512_set1_ps(p[4 * c + 1]), pat)));
        v(2, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 16), _mm512_mul_ps(_mm512_set1_ps(p[4 * c + 2]), pat)));
        v(3, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 24), _mm512_mul_ps(_mm512_set1_ps(p[4 * c + 3]), pat)));
    }
};

// Q4_K/Q5_K: p[i] = d * sc_i (i < 8) and p[8 + i] = dmin * min_i (subtracted with vfmsub).
// {d, dmin} -> [d x 8, dmin x 8]
inline __m512 k_d_dmin(const uint8_t* b) {
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)load_u32(b)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                 _mm512_castps128_ps512(dd));
}
inline void k_scales_f32(const uint8_t* b, float* p) {
    _mm512_store_ps(p, _mm512_mul_ps(k_d_dmin(b), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k_scale_min_bytes(b + 4)))));
}
// The same for the blocks of 4 rows (b + r * rb, r < 4) into p + r * stride: the byte
// unpacking of k_scale_min_bytes done once for the 4 (one 128-bit lane each).
inline void k_scales_f32_x4(const uint8_t* b, int64_t rb, float* p, int stride) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(b + 4)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(b + rb + 4)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(b + 2 * rb + 4)), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(b + 3 * rb + 4)), 3);
    const __m512i t1 = _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11)));
    const __m512i t2 = _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7)));
    const __m512i a = _mm512_and_si512(t1, _mm512_broadcast_i32x4(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)));
    const __m512i hi_nib = _mm512_and_si512(_mm512_srli_epi16(t1, 4), _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0, 0, 0x0F0F0F0F)));
    const __m512i top2 = _mm512_and_si512(_mm512_srli_epi16(t2, 2), _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
    const __m512i sm = _mm512_ternarylogic_epi32(a, hi_nib, top2, 0xFE);    // a | hi_nib | top2
    const auto row = [&](__m128i bytes, int r) {
        _mm512_store_ps(p + r * stride, _mm512_mul_ps(k_d_dmin(b + r * rb), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes))));
    };
    row(_mm512_castsi512_si128(sm), 0);
    row(_mm512_extracti32x4_epi32(sm, 1), 1);
    row(_mm512_extracti32x4_epi32(sm, 2), 2);
    row(_mm512_extracti32x4_epi32(sm, 3), 3);
}

// Q4_K: sub-block i's 16 values d*sc*q - dmin*min in one table (an FMA). Chunk c holds
// sub-blocks 2c (low nibbles of qs[32c ..]) and 2c + 1 (their high nibbles).
// prepare_rows of Q4_K/Q5_K (R <= 8 rows): 4 rows at a time, then one by one.
template <int R, int STRIDE = 16>
inline void k_scales_rows(const uint8_t* b, int64_t rb, float* p) {
    static_assert(R <= 8, "GEMV_ROWS <= 8");
    if constexpr (R >= 4) k_scales_f32_x4(b, rb, p, STRIDE);
    if constexpr (R == 8) k_scales_f32_x4(b + 4 * rb, rb, p + 4 * STRIDE, STRIDE);
    for (int r = R / 4 * 4; r < R; ++r) k_scales_f32(b + r * rb, p + r * STRIDE);
}

struct Q4_K : Chunked<Q4_K> {
    static constexpr int64_t QB = QK_K, BYTES = Q4_K_BYTES;
    static constexpr int PREP = 16;
    static inline void prepare(const uint8_t* b, float* p) { k_scales_f32(b, p); }
    template <int R>
    static inline void prepare_rows(const uint8_t* b, int64_t rb, float* p) { k_scales_rows<R>(b, rb, p); }
    template <class V>
    static inline void visit_chunk(const uint8_t* b, const float* p, int c, V&& v) {
        const __m512 iota = iota16();
        const __m512i q0 = u8x16(b + 16 + 32 * c), q1 = u8x16(b + 32 + 32 * c);
        const __m512 la = _mm512_fmsub_ps(_mm512_set1_ps(p[2 * c]), iota, _mm512_set1_ps(p[8 + 2 * c]));
        const __m512 lb = _mm512_fmsub_ps(_mm512_set1_ps(p[2 * c + 1]), iota, _mm512_set1_ps(p[9 + 2 * c]));
        v(0, _mm512_permutexvar_ps(q0, la));
        v(1, _mm512_permutexvar_ps(q1, la));
        v(2, _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), lb));
        v(3, _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), lb));
    }
};

// Q5_K: the 256 5-bit quants are assembled 64 at a time with byte operations when the block
// is prepared (p = {d * sc_i, dmin * min_i (16 floats), then the quants as bytes}): chunk c's
// 64 bytes are the low (sub-block 2c) then high (2c + 1) nibbles of qs[32c ..], bit 4 of each
// from bit 2c / 2c + 1 of qh[l] (a rotation of qh's dwords). Each 16 weights: bytes -> int32 ->
// float, w = (d * sc) * q - dmin * min (one FMA: the product is exact). The GEMV (dot_chunk)
// applies the scale and the min once per sub-block instead: sc * (x . q) - min * sum(x).
// Measured 1.15-1.3x the GB/s (hot and from DRAM, 1 thread) of 32-entry tables indexed with
// vpermt2ps and the fifth bit merged per vector (whose table FMAs also each needed a broadcast
// of their own: two scalars per table). Q3_K's layout (no widening, bytes taken by shifts and
// masks) measured slower here (0.85x): with int -> float conversions the integer ops, not
// the shuffles, are the bottleneck; so did words of two quants widened at once (0.92x).
struct Q5_K : Chunked<Q5_K> {
    static constexpr int64_t QB = QK_K, BYTES = Q5_K_BYTES;
    static constexpr int PREP = 16 + 64;
    static inline void prepare_quants(const uint8_t* b, float* p) {
        uint8_t* out = reinterpret_cast<uint8_t*>(p + 16);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 16)));
        const __m512i shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const __m512i qs = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 48 + 32 * c)));
            const __m512i rot = _mm512_inserti64x4(_mm512_set1_epi32((4 - 2 * c) & 31),
                                                   _mm256_set1_epi32((3 - 2 * c) & 31), 1);
            const __m512i q = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(qs, shr), _mm512_rolv_epi32(qh, rot),
                                                        _mm512_set1_epi8(0x10), 0xD8);
            _mm512_store_si512((void*)(out + 64 * c), _mm512_and_si512(q, _mm512_set1_epi8(31)));
        }
    }
    static inline void prepare(const uint8_t* b, float* p) {
        k_scales_f32(b, p);
        prepare_quants(b, p);
    }
    template <int R>
    static inline void prepare_rows(const uint8_t* b, int64_t rb, float* p) {
        k_scales_rows<R, PREP>(b, rb, p);
        for (int r = 0; r < R; ++r) prepare_quants(b + r * rb, p + r * PREP);
    }
    template <class V>
    static inline void visit_chunk(const uint8_t*, const float* p, int c, V&& v) {
        const uint8_t* q = reinterpret_cast<const uint8_t*>(p + 16) + 64 * c;
        const __m512 sa = _mm512_set1_ps(p[2 * c]), ma = _mm512_set1_ps(p[8 + 2 * c]);
        const __m512 sb = _mm512_set1_ps(p[2 * c + 1]), mb = _mm512_set1_ps(p[9 + 2 * c]);
        v(0, _mm512_fmsub_ps(sa, _mm512_cvtepi32_ps(u8x16(q)), ma));
        v(1, _mm512_fmsub_ps(sa, _mm512_cvtepi32_ps(u8x16(q + 16)), ma));
        v(2, _mm512_fmsub_ps(sb, _mm512_cvtepi32_ps(u8x16(q + 32)), mb));
        v(3, _mm512_fmsub_ps(sb, _mm512_cvtepi32_ps(u8x16(q + 48)), mb));
    }
    // GEMV: x . w over the chunk's sub-blocks a = 2c, b = 2c + 1 as sc * (x . q) - min * sum(x)
    // (xa, xb: the sums x0 + x1, x2 + x3 of the chunk, shared by the rows): every scale and
    // min is a broadcast operand ({1to16}) of an FMA, none needs its own broadcast.
    static inline void dot_chunk(const float* p, int c, __m512 x0, __m512 x1, __m512 x2, __m512 x3, __m512 xa,
                                 __m512 xb, __m512& a0, __m512& a1) {
        const uint8_t* q = reinterpret_cast<const uint8_t*>(p + 16) + 64 * c;
        const __m512 ta = _mm512_fmadd_ps(x1, _mm512_cvtepi32_ps(u8x16(q + 16)), _mm512_mul_ps(x0, _mm512_cvtepi32_ps(u8x16(q))));
        const __m512 tb = _mm512_fmadd_ps(x3, _mm512_cvtepi32_ps(u8x16(q + 48)), _mm512_mul_ps(x2, _mm512_cvtepi32_ps(u8x16(q + 32))));
        a0 = _mm512_fnmadd_ps(_mm512_set1_ps(p[8 + 2 * c]), xa, _mm512_fmadd_ps(_mm512_set1_ps(p[2 * c]), ta, a0));
        a1 = _mm512_fnmadd_ps(_mm512_set1_ps(p[9 + 2 * c]), xb, _mm512_fmadd_ps(_mm512_set1_ps(p[2 * c + 1]), tb, a1));
    }
};

// Q6_K: p = {d * scale_i (16 floats), then the 256 quants q - 32 as int8}, assembled 64 at a
// time with byte operations; each 16 weights: int8 -> float, times their sub-block's scale.
struct Q6_K : Chunked<Q6_K> {
    static constexpr int64_t QB = QK_K, BYTES = Q6_K_BYTES;
    static constexpr int PREP = 16 + 64;
    static inline void prepare(const uint8_t* b, float* p) {
        _mm512_store_ps(p, _mm512_mul_ps(_mm512_set1_ps(half_cvt(b + 208)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 192))))));
        const __m512i low4 = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30), k32 = _mm512_set1_epi8(32);
        // 16-bit lane shifts: the first 256 bits (s even) and the second (s odd) differ
        const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        const __m512i shr = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
        for (int h = 0; h < 2; ++h) {
            // 64 ql bytes: low nibbles = weights 0..63 of the half, high nibbles = 64..127;
            // qh (32 bytes, twice): bits 2s, 2s+1 for weights 32s .. 32s+31.
            const __m512i ql = _mm512_loadu_si512((const void*)(b + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h)));
            const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, low4), _mm512_sllv_epi16(qh, shl), bits45, 0xD8);
            const __m512i hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                                         _mm512_srlv_epi16(qh, shr), bits45, 0xD8);
            _mm512_store_si512((void*)(p + 16 + 32 * h), _mm512_sub_epi8(lo, k32));
            _mm512_store_si512((void*)(p + 32 + 32 * h), _mm512_sub_epi8(hi, k32));
        }
    }
    template <class V>
    static inline void visit_chunk(const uint8_t*, const float* p, int c, V&& v) {
        const int8_t* q = reinterpret_cast<const int8_t*>(p + 16) + 64 * c;
        for (int i = 0; i < 4; ++i)
            v(i, _mm512_mul_ps(_mm512_set1_ps(p[4 * c + i]),
                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)(q + 16 * i))))));
    }
};

// IQ4_NL / IQ4_XS: the 16 values of the non-linear table (IQ4_VALUES) as floats, scaled by the
// block's (or sub-block's) scale into one lookup table (one multiply: the products are exact)
// that the nibbles index with vpermps, as Q4_0's.
inline __m512 iq4_values16() {
    return _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
}

struct IQ4_NL {
    static constexpr int64_t QB = 32, BYTES = IQ4_NL_BYTES;
    static constexpr int PREP = 0;
    template <class V>
    static inline void visit(const uint8_t* b, V&& v) {
        const __m512 lut = _mm512_mul_ps(_mm512_set1_ps(half_at(b)), iq4_values16());
        const __m512i q = u8x16(b + 2);
        v(0, _mm512_permutexvar_ps(q, lut));
        v(16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut));
    }
};

// IQ4_XS: p = {d * (ls_i - 32), i < 8}; chunk c (64 weights) is sub-blocks 2c (the 16 bytes
// qs[32c ..]: low nibbles vector 0, high nibbles vector 1) and 2c + 1 (qs[32c + 16 ..]:
// vectors 2, 3), each with its table d * (ls - 32) * kv.
struct IQ4_XS : Chunked<IQ4_XS> {
    static constexpr int64_t QB = QK_K, BYTES = IQ4_XS_BYTES;
    static constexpr int PREP = 8;
    static inline void prepare(const uint8_t* b, float* p) { iq4_xs_scales_f32(b, p); }
    template <class V>
    static inline void visit_chunk(const uint8_t* b, const float* p, int c, V&& v) {
        const __m512 kv = iq4_values16();
        const __m512i q0 = u8x16(b + 8 + 32 * c), q1 = u8x16(b + 24 + 32 * c);
        const __m512 la = _mm512_mul_ps(_mm512_set1_ps(p[2 * c]), kv), lb = _mm512_mul_ps(_mm512_set1_ps(p[2 * c + 1]), kv);
        v(0, _mm512_permutexvar_ps(q0, la));
        v(1, _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), la));
        v(2, _mm512_permutexvar_ps(q1, lb));
        v(3, _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), lb));
    }
};

// =================================================================================
// Integer GEMV for the low-bit K-quants (AVX512-VNNI): Q2_K and Q3_K
// =================================================================================
// With 2-3 bits a weight, the float path (a table lookup and an FMA per 16 weights) is
// compute-bound at about 0.45-0.55x Q4_1's GB/s. Here the quants stay bytes and meet x in
// vpdpbusd (64 byte products a vector op). x is first split per block of 256 into three int8
// parts: s = max|x| / 127, x1 = round(x / s), x2 = round(128 (x - s x1) / s), x3 likewise for
// what x1 and x2 leave, so x = s (x1 + x2 / 128 + x3 / 16384) to within s / 32768, about
// max|x| 2^-22: near the precision of float32 at the block's largest element (so results stay
// within float32 tolerance, unlike the 8-bit activations of llama.cpp's q8_K). Base 128 keeps
// x2 and x3 in [-64, 64]; with base 256 a remainder of exactly s / 2 needed 128, which int8
// saturates (an error of 0.002 s per such element: x at half steps of s). The 16 sub-block
// sums of x are kept in float for the terms that do not depend on the quants (Q2_K's
// minimums, Q3_K's offset of 4). A lane of vpdpbusd sums 4
// neighbouring products, all of one sub-block of 16, so each lane is scaled by its
// sub-block's scale after the three products (combined as ((p1 << 7) + p2 << 7) + p3: at
// most 4 * 7 * 127 * 16513 < 2^26).
#if defined(__AVX512VNNI__)
#define YR_INT_GEMV 1
// The base of x's int8 parts: part p + 1 counts steps of 1 / SPLIT_STEP of part p's.
constexpr int SPLIT_SHIFT = 7;
constexpr float SPLIT_STEP = 128.0f, SPLIT_UNIT = SPLIT_STEP * SPLIT_STEP;

// One block of 256 floats xb split into three int8 parts q1, q2, q3 [256] with
// xb ~ s * (q1 + q2 / 128 + q3 / 16384), s = max|xb| / 127 (returned); sums [16] (may be null)
// gets the sum of each 16 floats.
inline float split3_block(const float* xb, int8_t* q1, int8_t* q2, int8_t* q3, float* sums) {
    __m512 mx = _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xb + 16 * i)));
    const float m = _mm512_reduce_max_ps(mx);
    const float sc = m > 0 ? m / 127.0f : 1.0f;
    const __m512 s1 = _mm512_set1_ps(sc), s2 = _mm512_set1_ps(sc / SPLIT_STEP);
    const __m512 inv1 = _mm512_set1_ps(1.0f / sc), inv2 = _mm512_set1_ps(SPLIT_STEP / sc),
                 inv3 = _mm512_set1_ps(SPLIT_UNIT / sc);
    for (int i = 0; i < 16; ++i) {
        const __m512 v = _mm512_loadu_ps(xb + 16 * i);
        const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv1));             // round to nearest
        const __m512 r1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(a), s1, v);       // exact (Sterbenz)
        const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(r1, inv2));
        const __m512 r2 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(b), s2, r1);
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(r2, inv3));
        _mm_storeu_si128((__m128i*)(q1 + 16 * i), _mm512_cvtsepi32_epi8(a));
        _mm_storeu_si128((__m128i*)(q2 + 16 * i), _mm512_cvtsepi32_epi8(b));
        _mm_storeu_si128((__m128i*)(q3 + 16 * i), _mm512_cvtsepi32_epi8(c));
        if (sums) sums[i] = _mm512_reduce_add_ps(v);
    }
    return sc;
}

// x [K] (K a multiple of 256) -> x1, x2, x3 [K] int8, sunit [K / 256] = s / SPLIT_UNIT, sums [K / 16].
inline void quantize_x_int(const float* x, int64_t K, int8_t* x1, int8_t* x2, int8_t* x3, float* sunit,
                           float* sums) {
    for (int64_t b = 0; b < K / QK_K; ++b) {
        const int64_t o = b * QK_K;
        sunit[b] = split3_block(x + o, x1 + o, x2 + o, x3 + o, sums + b * 16) / SPLIT_UNIT;
    }
}

// 32 bytes at p in both 256-bit halves, shifted right by 16-bit lanes by lo (low half) and hi.
inline __m512i bytes_x2_srl(const uint8_t* p, int lo, int hi) {
    return _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p)),
                             _mm512_inserti64x4(_mm512_set1_epi16((short)lo), _mm256_set1_epi16((short)hi), 1));
}
inline __m512i bytes_x2_sll(const uint8_t* p, int lo, int hi) {
    return _mm512_sllv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p)),
                             _mm512_inserti64x4(_mm512_set1_epi16((short)lo), _mm256_set1_epi16((short)hi), 1));
}

// Each format: PREP_INT floats per block, prepare_int(b, p, s) = {scale of sub-block i
// times s = sunit of the block (16), offset of sub-block i (16): the weight is scale * u + offset}, and
// u_chunk(b, c) = the 64 unsigned quants u of weights 64c .. 64c + 63 in order.
struct Q2_K_Int {
    static constexpr int64_t QB = QK_K, BYTES = Q2_K_BYTES;
    static constexpr int PREP_INT = 32;
    static inline void prepare_int(const uint8_t* b, float* p, float xscale) {
        const __m512i sc = u8x16(b);
        const float d = half_cvt(b + 80);
        _mm512_store_ps(p, _mm512_mul_ps(_mm512_set1_ps(d * xscale), _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(15)))));
        _mm512_store_ps(p + 16, _mm512_mul_ps(_mm512_set1_ps(-half_cvt(b + 82)), _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4))));
    }
    // weight 128h + 32s + l: bits 2s of qs[32h + l]; chunk c = (h, s) = (c / 2, 2 (c % 2)) and s + 1
    static inline __m512i u_chunk(const uint8_t* b, int c) {
        const int h = c / 2, s = 2 * (c % 2);
        return _mm512_and_si512(bytes_x2_srl(b + 16 + 32 * h, 2 * s, 2 * s + 2), _mm512_set1_epi8(3));
    }
};

struct Q3_K_Int {
    static constexpr int64_t QB = QK_K, BYTES = Q3_K_BYTES;
    static constexpr int PREP_INT = 32;
    static inline void prepare_int(const uint8_t* b, float* p, float xscale) {
        const float d = half_cvt(b + 108);
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q3_k_scale_bytes(b + 96)));
        _mm512_store_ps(p, _mm512_mul_ps(_mm512_set1_ps(d * xscale), sc));
        _mm512_store_ps(p + 16, _mm512_mul_ps(_mm512_set1_ps(-4.0f * d), sc));
    }
    // weight 128h + 32s + l: u = bits 2s of qs[32h + l] | bit (4h + s) of hmask[l] << 2
    static inline __m512i u_chunk(const uint8_t* b, int c) {
        const int h = c / 2, s = 2 * (c % 2), t = 4 * h + s;   // t, t + 1: the hmask bits of the halves
        const __m512i lo = bytes_x2_srl(b + 32 + 32 * h, 2 * s, 2 * s + 2);
        const __m512i hb = t >= 2 ? bytes_x2_srl(b, t - 2, t - 1) : bytes_x2_sll(b, 2 - t, 1 - t);
        // (lo & 3) | (hb & 4)
        return _mm512_ternarylogic_epi32(_mm512_and_si512(lo, _mm512_set1_epi8(3)), hb, _mm512_set1_epi8(4), 0xF8);
    }
};

// With AVX512-VBMI (the kernels used here; gemv_rows_int above is the VNNI-only fallback):
// whole sub-blocks per lane. Each dword lane (L, d) of a vector (L: the 128-bit lane, = (h, t)
// = (L / 2, L % 2); d < 4) always holds weights of the one sub-block 8h + 2d + t (the qs field
// d of the 16 bytes qs[32h + 16t ..]), in every chunk c: the lane reads the field d of the
// bytes of qs dword (L, d ^ c). For c < 2 that dword is in the lane's own qword, for c >= 2 in
// the other one (vpshufd swaps them once per block), so one vpmultishiftqb moves the field to
// bits 0-1 (and, for Q3_K, one more moves hmask bit 4h + d of the same bytes to bit 2). So a
// row's int32 lanes sum the whole block (4 chunks x 3 x parts: 12 vpdpbusd, ((P1 << 7) + P2
// << 7) + P3 <= 16 * 7 * 128 * 16513 < 2^28) and the block costs one convert and one FMA with
// its 16 scales in lane order (decoded into a vector, widened by a zero-masked vpermb) instead
// of Q2_K_Int's shift pair, vpermps, convert and FMA per chunk and per-block prepare. x's parts
// are stored once per call in that order (quantize_x_lanes), with each lane's sub-block sum of
// x as an int32 (Q3_K: q = u - 4, one vpsubd per block; Q2_K: the minimums, one FMA).
// 1 thread, hot GB/s 14.5-15.5 -> 19.5-20.5 (Q3_K), 14.5-15.5 -> 16-18 (Q2_K); from DRAM
// 0.74-0.78x -> 0.91-1.13x Q4_1 (Q3_K), 0.79-0.92x -> 0.95-1.2x (Q2_K) (benchmarks/kernels_cpu.py).
// Measured and dropped: two dpbusd chains a row (latency is hidden by the 8 rows: same);
// prefetch 6 or 10 blocks ahead (3 lines each) instead of 3 (2 lines): 0.85-0.9x at K = 4096.
#if defined(__AVX512VBMI__)
#define YR_KQ_LANES 1
struct LaneTables {
    alignas(64) uint8_t lo[2][64];   // multishift controls of the qs fields, chunk parity p
    alignas(64) uint8_t hb[2][64];   // ... of the hmask bits (to bit 2)
    alignas(64) uint8_t order[64];   // byte 4k: lane k's sub-block (vpermb of the 16 scales)
    uint8_t perm[256];               // x position 64c + 16L + 4d + i -> weight of the block
    constexpr LaneTables() : lo(), hb(), order(), perm() {
        for (int k = 0; k < 64; ++k) {
            const int L = k / 16, d = (k / 4) % 4, i = k % 4, h = L / 2;
            for (int p = 0; p < 2; ++p) {
                lo[p][k] = (uint8_t)((32 * ((d & 1) ^ p) + 8 * i + 2 * d) & 63);
                hb[p][k] = (uint8_t)((32 * ((d & 1) ^ p) + 8 * i + 4 * h + d - 2 + 64) & 63);
            }
        }
        for (int k = 0; k < 16; ++k) order[4 * k] = (uint8_t)(8 * (k / 8) + 2 * (k % 4) + (k / 4) % 2);
        for (int k = 0; k < 256; ++k) {
            const int c = k / 64, L = (k / 16) % 4, d = (k / 4) % 4, i = k % 4;
            perm[k] = (uint8_t)(128 * (L / 2) + 32 * d + 16 * (L % 2) + 4 * (d ^ c) + i);
        }
    }
};
inline constexpr LaneTables LANE_TAB{};

// The 12 scale bytes at s -> the 6-bit scales + 32 (0..63), of sub-block order[4k] in dword k
// (as q3_k_scale_bytes, in 4 xmm ops: the low nibbles by a 64-bit shift, the high bit pairs
// rotated to bits 4-5; vpermb with zero-masking orders and widens them).
inline __m512i q3k_scale_lanes(const uint8_t* s, __m512i order) {
    const __m128i lo = _mm_srlv_epi64(_mm_set1_epi64x((long long)load_u64(s)), _mm_setr_epi32(0, 0, 4, 0));
    const __m128i hi = _mm_rolv_epi32(_mm_set1_epi32((int)load_u32(s + 8)), _mm_setr_epi32(4, 2, 0, 30));
    const __m128i u = _mm_ternarylogic_epi32(_mm_and_si128(lo, _mm_set1_epi8(15)), hi, _mm_set1_epi8(0x30), 0xF8);
    return _mm512_maskz_permutexvar_epi8(0x1111111111111111ULL, order, _mm512_castsi128_si512(u));
}

// x [K] -> xq [K / 256][3][256] (x1, x2, x3 of each block in lane order), sunit [K / 256],
// x4 [K / 256][16] = 4 ((X1 << 7) + X2 << 7) + X3) for the 16 weights of lane k's sub-block
// (Xp: the sum of part p over them; |.| <= 4 * 16 * 128 * 16513 < 2^28).
inline void quantize_x_lanes(const float* x, int64_t K, int8_t* xq, float* sunit, int32_t* x4) {
    alignas(64) float xr[QK_K];
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < K / QK_K; ++b) {
        const float* xb = x + b * QK_K;
        for (int k = 0; k < QK_K; ++k) xr[k] = xb[LANE_TAB.perm[k]];
        int8_t* q = xq + b * 3 * QK_K;
        const float sc = split3_block(xr, q, q + QK_K, q + 2 * QK_K, nullptr);
        __m512i X = _mm512_setzero_si512();
        for (int p = 0; p < 3; ++p) {
            if (p) X = _mm512_slli_epi32(X, SPLIT_SHIFT);
            for (int c = 0; c < 4; ++c)
                X = _mm512_dpbusd_epi32(X, ones, _mm512_loadu_si512((const void*)(q + p * QK_K + 64 * c)));
        }
        _mm512_storeu_si512((void*)(x4 + 16 * b), _mm512_slli_epi32(X, 2));
        sunit[b] = sc / SPLIT_UNIT;
    }
}

// y[r] = x . W[r, :] (+ bias[r]) for r < R (Q3_K rows), from quantize_x_lanes's x.
template <int R>
inline void gemv_rows_q3k(const int8_t* xq, const float* xscale, const int32_t* x4, const uint8_t* w, int64_t rb,
                          int64_t nb, const float* bias, float* y) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i lo0 = _mm512_load_si512((const void*)LANE_TAB.lo[0]), lo1 = _mm512_load_si512((const void*)LANE_TAB.lo[1]);
    const __m512i hb0 = _mm512_load_si512((const void*)LANE_TAB.hb[0]), hb1 = _mm512_load_si512((const void*)LANE_TAB.hb[1]);
    const __m512i order = _mm512_load_si512((const void*)LANE_TAB.order);
    const __m512i m3 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi8(4);
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < R; ++r) prefetch_bytes(w + r * rb + (b + 3) * Q3_K_BYTES, Q3_K_BYTES);
        const int8_t* xb = xq + b * 3 * QK_K;
        const __m512i xo = _mm512_loadu_si512((const void*)(x4 + 16 * b));
        const float xs = xscale[b];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * rb + b * Q3_K_BYTES;
            const __m512i qs0 = _mm512_loadu_si512((const void*)(blk + 32));
            const __m512i hm0 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)blk));
            const __m512i qs1 = _mm512_shuffle_epi32(qs0, _MM_PERM_BADC), hm1 = _mm512_shuffle_epi32(hm0, _MM_PERM_BADC);
            const auto U = [&](__m512i qs, __m512i hm, __m512i cl, __m512i ch) {   // (field & 3) | (bit & 4)
                return _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_multishift_epi64_epi8(cl, qs), m3),
                                                 _mm512_multishift_epi64_epi8(ch, hm), m4, 0xF8);
            };
            const __m512i u[4] = {U(qs0, hm0, lo0, hb0), U(qs0, hm0, lo1, hb1), U(qs1, hm1, lo0, hb0), U(qs1, hm1, lo1, hb1)};
            __m512i a = _mm512_setzero_si512();
            for (int p = 0; p < 3; ++p) {
                if (p) a = _mm512_slli_epi32(a, SPLIT_SHIFT);
                for (int c = 0; c < 4; ++c)
                    a = _mm512_dpbusd_epi32(a, u[c], _mm512_loadu_si512((const void*)(xb + p * QK_K + 64 * c)));
            }
            const float dx = half_cvt(blk + 108) * xs;   // (scale + 32) dx - 32 dx: exact but the one rounding
            const __m512 sc = _mm512_fmsub_ps(_mm512_cvtepi32_ps(q3k_scale_lanes(blk + 96, order)), _mm512_set1_ps(dx),
                                              _mm512_set1_ps(32.0f * dx));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a, xo)), sc, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = _mm512_reduce_add_ps(acc[r]);
        y[r] = bias ? s + bias[r] : s;
    }
}
// Q2_K in the same lane order: u = the qs field alone (vpmultishiftqb and a mask), the block's
// sum scaled by d * scale per lane, and the minimums' term -dmin * min * (x's lane sums, from
// quantize_x_lanes's x4 / 4: one convert per block for all the rows).
template <int R>
inline void gemv_rows_q2k(const int8_t* xq, const float* xscale, const int32_t* x4, const uint8_t* w, int64_t rb,
                          int64_t nb, const float* bias, float* y) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i lo0 = _mm512_load_si512((const void*)LANE_TAB.lo[0]), lo1 = _mm512_load_si512((const void*)LANE_TAB.lo[1]);
    const __m512i order = _mm512_load_si512((const void*)LANE_TAB.order);
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m128i m15 = _mm_set1_epi8(15);
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < R; ++r) prefetch_bytes(w + r * rb + (b + 3) * Q2_K_BYTES, Q2_K_BYTES);
        const int8_t* xb = xq + b * 3 * QK_K;
        const __m512 xsum = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)(x4 + 16 * b)));   // 4 X
        const float xs = xscale[b];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * rb + b * Q2_K_BYTES;
            const __m512i qs0 = _mm512_loadu_si512((const void*)(blk + 16));
            const __m512i qs1 = _mm512_shuffle_epi32(qs0, _MM_PERM_BADC);
            const __m512i u[4] = {_mm512_and_si512(_mm512_multishift_epi64_epi8(lo0, qs0), m3),
                                  _mm512_and_si512(_mm512_multishift_epi64_epi8(lo1, qs0), m3),
                                  _mm512_and_si512(_mm512_multishift_epi64_epi8(lo0, qs1), m3),
                                  _mm512_and_si512(_mm512_multishift_epi64_epi8(lo1, qs1), m3)};
            __m512i a = _mm512_setzero_si512();
            for (int p = 0; p < 3; ++p) {
                if (p) a = _mm512_slli_epi32(a, SPLIT_SHIFT);
                for (int c = 0; c < 4; ++c)
                    a = _mm512_dpbusd_epi32(a, u[c], _mm512_loadu_si512((const void*)(xb + p * QK_K + 64 * c)));
            }
            const __m128i sm = _mm_loadu_si128((const __m128i*)blk);
            const __m512 sc = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(
                0x1111111111111111ULL, order, _mm512_castsi128_si512(_mm_and_si128(sm, m15))));
            const __m512 mn = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(
                0x1111111111111111ULL, order, _mm512_castsi128_si512(_mm_and_si128(_mm_srli_epi16(sm, 4), m15))));
            const __m512 t = _mm512_mul_ps(mn, _mm512_set1_ps(-0.25f * half_cvt(blk + 82) * xs));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(sc, _mm512_set1_ps(half_cvt(blk + 80) * xs)),
                                     _mm512_fmadd_ps(t, xsum, acc[r]));
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = _mm512_reduce_add_ps(acc[r]);
        y[r] = bias ? s + bias[r] : s;
    }
}
#endif  // __AVX512VBMI__

template <class F> struct IntOf { using type = void; };
template <> struct IntOf<Q2_K> { using type = Q2_K_Int; };
template <> struct IntOf<Q3_K> { using type = Q3_K_Int; };

// y[r] = x . W[r, :] (+ bias[r]) for r < R from x's int8 parts (see quantize_x_int).
template <class I, int R>
inline void gemv_rows_int(const int8_t* x1, const int8_t* x2, const int8_t* x3, const float* xscale, const float* sums,
                          const uint8_t* w, int64_t rb, int64_t nb, const float* bias, float* y) {
    __m512 acc[R], off[R];
    for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm512_setzero_ps();
    alignas(64) float prep[2][R][I::PREP_INT];
    for (int r = 0; r < R; ++r) I::prepare_int(w + r * rb, prep[0][r], xscale[0]);
    const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < R; ++r) prefetch_bytes(w + r * rb + (b + 6) * I::BYTES, I::BYTES + 64);
        if (b + 1 < nb)
            for (int r = 0; r < R; ++r) I::prepare_int(w + r * rb + (b + 1) * I::BYTES, prep[(b + 1) & 1][r], xscale[b + 1]);
        YR_FROM_MEMORY(prep);
        const float* pb = prep[b & 1][0];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const __m512i xa = _mm512_loadu_si512((const void*)(x1 + b * QK_K + 64 * c));
            const __m512i xb = _mm512_loadu_si512((const void*)(x2 + b * QK_K + 64 * c));
            const __m512i xc = _mm512_loadu_si512((const void*)(x3 + b * QK_K + 64 * c));
            const __m512i idx = _mm512_add_epi32(quarter, _mm512_set1_epi32(4 * c));
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m512i u = I::u_chunk(w + r * rb + b * I::BYTES, c);
                __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xa);
                a = _mm512_dpbusd_epi32(_mm512_slli_epi32(a, SPLIT_SHIFT), u, xb);
                a = _mm512_dpbusd_epi32(_mm512_slli_epi32(a, SPLIT_SHIFT), u, xc);
                const __m512 sc = _mm512_permutexvar_ps(idx, _mm512_load_ps(pb + r * I::PREP_INT));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), sc, acc[r]);
            }
        }
        const __m512 xs = _mm512_loadu_ps(sums + 16 * b);
        for (int r = 0; r < R; ++r) off[r] = _mm512_fmadd_ps(_mm512_load_ps(pb + r * I::PREP_INT + 16), xs, off[r]);
    }
    for (int r = 0; r < R; ++r) {
        const float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], off[r]));
        y[r] = bias ? s + bias[r] : s;
    }
}
#endif  // __AVX512VNNI__

// =================================================================================
// Visitors, AVX2: v(j, w) for w = weights j .. j+7
// =================================================================================

#elif defined(YR_AVX2)

inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline __m256 i2f(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline __m256i and_i(__m256i v, int m) { return _mm256_and_si256(v, _mm256_set1_epi32(m)); }
// bits j .. j+7 of qh, one per lane, moved to bit 4
inline __m256i qh_bit4(uint32_t qh, int j) {
    const __m256i sh = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(j));
    return _mm256_slli_epi32(and_i(_mm256_srlv_epi32(_mm256_set1_epi32((int)qh), sh), 1), 4);
}

struct Q4_0 {
    static constexpr int64_t QB = 32, BYTES = Q4_0_BYTES;
    static constexpr int PREP = 0;
    template <class V>
    static inline void visit(const uint8_t* b, V&& v) {
        const __m256 d = _mm256_set1_ps(half_at(b));
        const __m256i k8 = _mm256_set1_epi32(8);
        for (int j = 0; j < 16; j += 8) {
            const __m256i q = u8x8(b + 2 + j);
            v(j, _mm256_mul_ps(d, i2f(_mm256_sub_epi32(and_i(q, 15), k8))));
            v(j + 16, _mm256_mul_ps(d, i2f(_mm256_sub_epi32(_mm256_srli_epi32(q, 4), k8))));
        }
    }
};

struct Q5_0 {
    static constexpr int64_t QB = 32, BYTES = Q5_0_BYTES;
    static constexpr int PREP = 0;
    template <class V>
    static inline void visit(const uint8_t* b, V&& v) {
        const __m256 d = _mm256_set1_ps(half_at(b));
        const uint32_t qh = load_u32(b + 2);
        const __m256i k16 = _mm256_set1_epi32(16);
        for (int j = 0; j < 16; j += 8) {
            const __m256i q = u8x8(b + 6 + j);
            v(j, _mm256_mul_ps(d, i2f(_mm256_sub_epi32(_mm256_or_si256(and_i(q, 15), qh_bit4(qh, j)), k16))));
            v(j + 16, _mm256_mul_ps(d, i2f(_mm256_sub_epi32(
                                           _mm256_or_si256(_mm256_srli_epi32(q, 4), qh_bit4(qh, j + 16)), k16))));
        }
    }
};

struct Q5_1 {
    static constexpr int64_t QB = 32, BYTES = Q5_1_BYTES;
    static constexpr int PREP = 0;
    template <class V>
    static inline void visit(const uint8_t* b, V&& v) {
        const __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
        const uint32_t qh = load_u32(b + 4);
        for (int j = 0; j < 16; j += 8) {
            const __m256i q = u8x8(b + 8 + j);
            v(j, _mm256_fmadd_ps(d, i2f(_mm256_or_si256(and_i(q, 15), qh_bit4(qh, j))), m));
            v(j + 16, _mm256_fmadd_ps(d, i2f(_mm256_or_si256(_mm256_srli_epi32(q, 4), qh_bit4(qh, j + 16))), m));
        }
    }
};

// Q2_K: p = {dl[16] = d * scale_i, nml[16] = -(dmin * min_i)}; w = dl * q + nml.
struct Q2_K : Prepared<Q2_K> {
    static constexpr int64_t QB = QK_K, BYTES = Q2_K_BYTES;
    static constexpr int PREP = 32;
    static inline void prepare(const uint8_t* b, float* p) {
        const __m256 d = _mm256_set1_ps(half_cvt(b + 80)), nm = _mm256_set1_ps(-half_cvt(b + 82));
        for (int i = 0; i < 16; i += 8) {
            const __m256i sc = u8x8(b + i);
            _mm256_store_ps(p + i, _mm256_mul_ps(d, i2f(and_i(sc, 15))));
            _mm256_store_ps(p + 16 + i, _mm256_mul_ps(nm, i2f(_mm256_srli_epi32(sc, 4))));
        }
    }
    template <class V>
    static inline void visit_prepared(const uint8_t* b, const float* p, V&& v) {
        for (int h = 0; h < 2; ++h)
            for (int l = 0; l < 32; l += 8) {
                __m256i q = u8x8(b + 16 + 32 * h + l);
                for (int s = 0; s < 4; ++s) {
                    const int i = 8 * h + 2 * s + l / 16;
                    v(128 * h + 32 * s + l,
                      _mm256_fmadd_ps(_mm256_set1_ps(p[i]), i2f(and_i(q, 3)), _mm256_set1_ps(p[16 + i])));
                    q = _mm256_srli_epi32(q, 2);
                }
            }
    }
};

// Q3_K: p = dl[16] = d * (scale_i - 32); w = dl * (low 2 bits | high bit << 2) - 4).
struct Q3_K : Prepared<Q3_K> {
    static constexpr int64_t QB = QK_K, BYTES = Q3_K_BYTES;
    static constexpr int PREP = 16;
    static inline void prepare(const uint8_t* b, float* p) {
        const __m128i sc = q3_k_scale_bytes(b + 96);
        const __m256 d = _mm256_set1_ps(half_cvt(b + 108));
        _mm256_store_ps(p, _mm256_mul_ps(d, i2f(_mm256_cvtepi8_epi32(sc))));
        _mm256_store_ps(p + 8, _mm256_mul_ps(d, i2f(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    }
    template <class V>
    static inline void visit_prepared(const uint8_t* b, const float* p, V&& v) {
        const __m256i k4 = _mm256_set1_epi32(4);
        for (int h = 0; h < 2; ++h)
            for (int l = 0; l < 32; l += 8) {
                __m256i q = u8x8(b + 32 + 32 * h + l);
                __m256i hb = _mm256_srli_epi32(u8x8(b + l), 4 * h);
                for (int s = 0; s < 4; ++s) {
                    const int i = 8 * h + 2 * s + l / 16;
                    const __m256i val = _mm256_sub_epi32(_mm256_or_si256(and_i(q, 3), _mm256_slli_epi32(and_i(hb, 1), 2)), k4);
                    v(128 * h + 32 * s + l, _mm256_mul_ps(_mm256_set1_ps(p[i]), i2f(val)));
                    q = _mm256_srli_epi32(q, 2);
                    hb = _mm256_srli_epi32(hb, 1);
                }
            }
    }
};

// Q4_K/Q5_K: p[i] = d * sc_i (i < 8) and p[8 + i] = -(dmin * min_i).
inline void k_scales_f32(const uint8_t* b, float* p) {
    const __m128i sm = k_scale_min_bytes(b + 4);
    _mm256_store_ps(p, _mm256_mul_ps(_mm256_set1_ps(half_cvt(b)), i2f(_mm256_cvtepu8_epi32(sm))));
    _mm256_store_ps(p + 8, _mm256_mul_ps(_mm256_set1_ps(-half_cvt(b + 2)),
                                         i2f(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)))));
}

struct Q4_K : Prepared<Q4_K> {
    static constexpr int64_t QB = QK_K, BYTES = Q4_K_BYTES;
    static constexpr int PREP = 16;
    static inline void prepare(const uint8_t* b, float* p) { k_scales_f32(b, p); }
    template <class V>
    static inline void visit_prepared(const uint8_t* b, const float* p, V&& v) {
        for (int c = 0; c < 4; ++c) {
            const __m256 sa = _mm256_set1_ps(p[2 * c]), ma = _mm256_set1_ps(p[8 + 2 * c]);
            const __m256 sb = _mm256_set1_ps(p[2 * c + 1]), mb = _mm256_set1_ps(p[9 + 2 * c]);
            for (int l = 0; l < 32; l += 8) {
                const __m256i q = u8x8(b + 16 + 32 * c + l);
                v(64 * c + l, _mm256_fmadd_ps(sa, i2f(and_i(q, 15)), ma));
                v(64 * c + 32 + l, _mm256_fmadd_ps(sb, i2f(_mm256_srli_epi32(q, 4)), mb));
            }
        }
    }
};

struct Q5_K : Prepared<Q5_K> {
    static constexpr int64_t QB = QK_K, BYTES = Q5_K_BYTES;
    static constexpr int PREP = 16;
    static inline void prepare(const uint8_t* b, float* p) { k_scales_f32(b, p); }
    template <class V>
    static inline void visit_prepared(const uint8_t* b, const float* p, V&& v) {
        for (int c = 0; c < 4; ++c) {
            const __m256 sa = _mm256_set1_ps(p[2 * c]), ma = _mm256_set1_ps(p[8 + 2 * c]);
            const __m256 sb = _mm256_set1_ps(p[2 * c + 1]), mb = _mm256_set1_ps(p[9 + 2 * c]);
            for (int l = 0; l < 32; l += 8) {
                const __m256i q = u8x8(b + 48 + 32 * c + l);
                const __m256i hb = _mm256_srli_epi32(u8x8(b + 16 + l), 2 * c);
                const __m256i qa = _mm256_or_si256(and_i(q, 15), _mm256_slli_epi32(and_i(hb, 1), 4));
                const __m256i qb = _mm256_or_si256(_mm256_srli_epi32(q, 4), _mm256_slli_epi32(and_i(hb, 2), 3));
                v(64 * c + l, _mm256_fmadd_ps(sa, i2f(qa), ma));
                v(64 * c + 32 + l, _mm256_fmadd_ps(sb, i2f(qb), mb));
            }
        }
    }
};

// Q6_K: p = d * scale_i (16 floats); w = p[k / 16] * (q - 32).
struct Q6_K : Prepared<Q6_K> {
    static constexpr int64_t QB = QK_K, BYTES = Q6_K_BYTES;
    static constexpr int PREP = 16;
    static inline void prepare(const uint8_t* b, float* p) {
        const __m128i sc = _mm_loadu_si128((const __m128i*)(b + 192));
        const __m256 d = _mm256_set1_ps(half_cvt(b + 208));
        _mm256_store_ps(p, _mm256_mul_ps(d, i2f(_mm256_cvtepi8_epi32(sc))));
        _mm256_store_ps(p + 8, _mm256_mul_ps(d, i2f(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    }
    template <class V>
    static inline void visit_prepared(const uint8_t* b, const float* p, V&& v) {
        const __m256i k32 = _mm256_set1_epi32(32);
        for (int h = 0; h < 2; ++h)
            for (int l = 0; l < 32; l += 8) {
                const __m256i la = u8x8(b + 64 * h + l), lb = u8x8(b + 64 * h + 32 + l);
                const __m256i qh = u8x8(b + 128 + 32 * h + l);
                const __m256i lo4[4] = {and_i(la, 15), and_i(lb, 15), _mm256_srli_epi32(la, 4), _mm256_srli_epi32(lb, 4)};
                for (int s4 = 0; s4 < 4; ++s4) {
                    const __m256i hi2 = _mm256_slli_epi32(and_i(_mm256_srli_epi32(qh, 2 * s4), 3), 4);
                    const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo4[s4], hi2), k32);
                    const int k = 128 * h + 32 * s4 + l;
                    v(k, _mm256_mul_ps(_mm256_set1_ps(p[k / 16]), i2f(q)));
                }
            }
    }
};

// IQ4_NL / IQ4_XS: the 32 values kv[nibble] of 16 quant bytes as int8 (two pshufb, iq4_bytes),
// widened 8 at a time, times the (sub-)block scale d (IQ4_XS: d * (ls - 32)).
template <class V>
inline void visit_iq4_32(const uint8_t* qs, __m256 d, int j0, V&& v) {
    __m128i lo, hi;
    iq4_bytes(qs, lo, hi);
    v(j0, _mm256_mul_ps(d, i2f(_mm256_cvtepi8_epi32(lo))));
    v(j0 + 8, _mm256_mul_ps(d, i2f(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
    v(j0 + 16, _mm256_mul_ps(d, i2f(_mm256_cvtepi8_epi32(hi))));
    v(j0 + 24, _mm256_mul_ps(d, i2f(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
}

struct IQ4_NL {
    static constexpr int64_t QB = 32, BYTES = IQ4_NL_BYTES;
    static constexpr int PREP = 0;
    template <class V>
    static inline void visit(const uint8_t* b, V&& v) { visit_iq4_32(b + 2, _mm256_set1_ps(half_at(b)), 0, v); }
};

// IQ4_XS: p = {d * (ls_i - 32), i < 8}; sub-block i = the 16 bytes qs[16i ..].
struct IQ4_XS : Prepared<IQ4_XS> {
    static constexpr int64_t QB = QK_K, BYTES = IQ4_XS_BYTES;
    static constexpr int PREP = 8;
    static inline void prepare(const uint8_t* b, float* p) { iq4_xs_scales_f32(b, p); }
    template <class V>
    static inline void visit_prepared(const uint8_t* b, const float* p, V&& v) {
        for (int i = 0; i < 8; ++i) visit_iq4_32(b + 8 + 16 * i, _mm256_set1_ps(p[i]), 32 * i, v);
    }
};

// =================================================================================
// Visitors, scalar: v(j, w) for each weight j
// =================================================================================

#else

template <void (*deq)(const uint8_t*, float*), int64_t QB_, int64_t BYTES_>
struct ScalarFormat {
    static constexpr int64_t QB = QB_, BYTES = BYTES_;
    static constexpr int PREP = 0;
    template <class V>
    static inline void visit(const uint8_t* b, V&& v) {
        alignas(16) float w[QB_];
        deq(b, w);
        for (int j = 0; j < QB_; j += VL) v(j, vload(w + j));   // VL floats at a time (NEON: 4, scalar: 1)
    }
};
using Q4_0 = ScalarFormat<scalar_q4_0, 32, Q4_0_BYTES>;
using Q5_0 = ScalarFormat<scalar_q5_0, 32, Q5_0_BYTES>;
using Q5_1 = ScalarFormat<scalar_q5_1, 32, Q5_1_BYTES>;
using Q2_K = ScalarFormat<scalar_q2_k, QK_K, Q2_K_BYTES>;
using Q3_K = ScalarFormat<scalar_q3_k, QK_K, Q3_K_BYTES>;
using Q4_K = ScalarFormat<scalar_q4_k, QK_K, Q4_K_BYTES>;
using Q5_K = ScalarFormat<scalar_q5_k, QK_K, Q5_K_BYTES>;
using Q6_K = ScalarFormat<scalar_q6_k, QK_K, Q6_K_BYTES>;
using IQ4_NL = ScalarFormat<scalar_iq4_nl, 32, IQ4_NL_BYTES>;
using IQ4_XS = ScalarFormat<scalar_iq4_xs, QK_K, IQ4_XS_BYTES>;

#endif

// =================================================================================
// Dequantization (rows, embedding, GEMM packing)
// =================================================================================

// out[0 .. F::QB) = the block at blk, dequantized.
template <class F>
inline void dequant_block_fmt(const uint8_t* blk, float* out) {
    F::visit(blk, [&](int j, vf w) { vstore(out + j, w); });
}

// A row of K weights (K / F::QB blocks).
template <class F>
inline void dequant_row_fmt(const uint8_t* row, float* out, int64_t K) {
    for (int64_t b = 0; b < K / F::QB; ++b) dequant_block_fmt<F>(row + b * F::BYTES, out + b * F::QB);
}

// Panel packer for linear_packed: P[k * PR + j] = W[j, k] for j < nr, 0 for nr <= j < PR,
// dequantized a block at a time into tmp[PR][QB] and transposed (as library.cpp pack_quant).
template <class F>
void pack_fmt(const uint8_t* w, int64_t row_bytes, int64_t K, int nr, float* P) {
    alignas(64) float tmp[PR][F::QB];
    for (int j = nr; j < PR; ++j)
        for (int t = 0; t < F::QB; ++t) tmp[j][t] = 0.0f;
    for (int64_t b = 0; b < K / F::QB; ++b) {
        for (int j = 0; j < nr; ++j) dequant_block_fmt<F>(w + j * row_bytes + b * F::BYTES, tmp[j]);
        for (int h = 0; h < 2; ++h)
            for (int t0 = 0; t0 < F::QB; t0 += VL) {
                const float* src[VL];
                for (int l = 0; l < VL; ++l) src[l] = tmp[h * VL + l] + t0;
                transpose_block(src, P + (b * F::QB + t0) * PR + h * VL, PR);
            }
    }
}

// =================================================================================
// GEMV: R weight rows at a time, each block decoded in registers by F::visit
// =================================================================================

// Software prefetch of the R rows' blocks [b0, b0 + n) (and the line after: blocks straddle
// lines), issued from the GEMV loops of the rows. Added to gemv_range's prefetch of whole row
// groups, it measured up to 1.5x the GB/s of cold weights for blocks whose size is no multiple
// of 4 bytes (Q4_0, Q5_0, Q3_K, Q6_K: 18, 22, 110, 210 bytes), whose strided loads the
// hardware prefetchers seem not to follow. Prefetches past the weight never fault.
constexpr int64_t PF_EVERY = 8, PF_AHEAD = 24;   // blocks of 32: every 8 blocks, 24 blocks ahead
template <class F, int R>
inline void prefetch_rows(const uint8_t* w, int64_t rb, int64_t b0, int64_t n) {
    for (int r = 0; r < R; ++r) prefetch_bytes(w + r * rb + b0 * F::BYTES, n * F::BYTES + 64);
}

// Whether F has its own GEMV block product (dot: x in registers, scales applied per block).
template <class F, class = void>
struct HasDot { static constexpr bool value = false; };
template <class F>
struct HasDot<F, decltype((void)&F::dot)> { static constexpr bool value = true; };

// Whether F is read in chunks (visit_chunk: the AVX-512 K-quants).
template <class F, class = void>
struct HasChunks { static constexpr bool value = false; };
template <class F>
struct HasChunks<F, decltype((void)F::CHUNKS)> { static constexpr bool value = true; };

// Whether a chunked F has its own GEMV chunk product (dot_chunk: scales applied per sub-block).
template <class F, class = void>
struct HasDotChunk { static constexpr bool value = false; };
template <class F>
struct HasDotChunk<F, decltype((void)&F::dot_chunk)> { static constexpr bool value = true; };

// GEMV of R rows of a chunked format: chunk by chunk (64 weights), each chunk's 4 x vectors in
// registers for all R rows and two accumulators per row, as the blocks of 32 are read; the
// rows' next blocks are prepared (scales decoded) while the current ones are read.
template <class F, int R>
inline void gemv_rows_chunked(const float* x, const uint8_t* w, int64_t rb, int64_t nb, const float* bias,
                              float* y) {
    vf acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
    alignas(64) float prep[2][R][F::PREP];
    F::template prepare_rows<R>(w, rb, prep[0][0]);
    for (int64_t b = 0; b < nb; ++b) {
        prefetch_rows<F, R>(w, rb, b + 2, 1);
        if (b + 1 < nb) F::template prepare_rows<R>(w + (b + 1) * F::BYTES, rb, prep[(b + 1) & 1][0]);
        YR_FROM_MEMORY(prep);
        const float* pb = prep[b & 1][0];
#pragma GCC unroll 4
        for (int c = 0; c < F::CHUNKS; ++c) {
            const float* xc = x + b * F::QB + c * 4 * VL;
            vf x0 = vload(xc), x1 = vload(xc + VL), x2 = vload(xc + 2 * VL), x3 = vload(xc + 3 * VL);
            YR_IN_REGISTER(x0);
            YR_IN_REGISTER(x1);
            YR_IN_REGISTER(x2);
            YR_IN_REGISTER(x3);
            if constexpr (HasDotChunk<F>::value) {
                vf xa = vadd(x0, x1), xb = vadd(x2, x3);
                YR_IN_REGISTER(xa);
                YR_IN_REGISTER(xb);
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) F::dot_chunk(pb + r * F::PREP, c, x0, x1, x2, x3, xa, xb, acc[r][0], acc[r][1]);
                continue;
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                vf a0 = acc[r][0], a1 = acc[r][1];
                F::visit_chunk(w + r * rb + b * F::BYTES, pb + r * F::PREP, c, [&](int i, vf wv) {
                    switch (i) {
                        case 0: a0 = vfma(x0, wv, a0); break;
                        case 1: a1 = vfma(x1, wv, a1); break;
                        case 2: a0 = vfma(x2, wv, a0); break;
                        default: a1 = vfma(x3, wv, a1);
                    }
                });
                acc[r][0] = a0;
                acc[r][1] = a1;
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = vsum(vadd(acc[r][0], acc[r][1]));
        y[r] = bias ? s + bias[r] : s;
    }
}

// y[r] = x . W[r, :] (+ bias[r]) for r < R; w: R rows of rb bytes, nb blocks each.
// Two accumulators per row (even and odd vectors) keep more FMA chains in flight; the
// visitor's lambda updates plain locals (a lambda writing into an array of vectors makes
// GCC keep the array in memory).
template <class F, int R>
inline void gemv_rows_fmt(const float* x, const uint8_t* w, int64_t rb, int64_t nb, const float* bias, float* y) {
    constexpr int NV = (int)(F::QB / VL);     // vectors per block
    if constexpr (NV <= 2) {
        // Blocks of 32 with AVX-512: block-major, so the block's two x vectors stay in
        // registers for all R rows (see library.cpp gemv_q4_1_rows).
        vf acc[R][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
        for (int64_t b = 0; b < nb; ++b) {
            vf x0 = vload(x + b * F::QB), x1 = vload(x + b * F::QB + (NV - 1) * VL);
            YR_IN_REGISTER(x0);
            YR_IN_REGISTER(x1);
            if (b % PF_EVERY == 0) prefetch_rows<F, R>(w, rb, b + PF_AHEAD, PF_EVERY);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                vf a0 = acc[r][0], a1 = acc[r][1];
                if constexpr (HasDot<F>::value) {
                    F::dot(w + r * rb + b * F::BYTES, x0, x1, a0);
                } else {
                    F::visit(w + r * rb + b * F::BYTES, [&](int j, vf wv) {
                        if (j < VL) a0 = vfma(x0, wv, a0);
                        else a1 = vfma(x1, wv, a1);
                    });
                }
                acc[r][0] = a0;
                acc[r][1] = a1;
            }
        }
        for (int r = 0; r < R; ++r) {
            const float s = vsum(vadd(acc[r][0], acc[r][1]));
            y[r] = bias ? s + bias[r] : s;
        }
    } else if constexpr (HasChunks<F>::value) {
        gemv_rows_chunked<F, R>(x, w, rb, nb, bias, y);
    } else {
        // Row-major: each row's blocks in order (x, 1 KB per super-block, is read from L1),
        // four accumulators (vector j % 4) so that the FMA latency does not bound a row.
        alignas(64) float prep[2][F::PREP > 0 ? F::PREP : 1];
        for (int r = 0; r < R; ++r) {
            vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
            const uint8_t* row = w + r * rb;
            for (int64_t b = 0; b < nb; ++b) {
                const float* xb = x + b * F::QB;
                const auto fma_x = [&](int j, vf wv) {
                    switch ((j / VL) & 3) {
                        case 0: a0 = vfma(vload(xb + j), wv, a0); break;
                        case 1: a1 = vfma(vload(xb + j), wv, a1); break;
                        case 2: a2 = vfma(vload(xb + j), wv, a2); break;
                        default: a3 = vfma(vload(xb + j), wv, a3);
                    }
                };
                if constexpr (F::PREP > 0) {
                    // block b + 1 prepared while block b is read (see Prepared)
                    if (b == 0) F::prepare(row, prep[0]);
                    if (b + 1 < nb) F::prepare(row + (b + 1) * F::BYTES, prep[(b + 1) & 1]);
                    YR_FROM_MEMORY(prep);
                    F::visit_prepared(row + b * F::BYTES, prep[b & 1], fma_x);
                } else {
                    F::visit(row + b * F::BYTES, fma_x);
                }
            }
            const float s = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
            y[r] = bias ? s + bias[r] : s;
        }
    }
}

// GEMV of M x rows over the row groups handed out by groups (see library.cpp gemv_q4_1).
template <class F, typename Groups>
void gemv_fmt(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
              Groups groups) {
    const int64_t nb = K / F::QB, rb = nb * F::BYTES;
#if defined(YR_KQ_LANES)
    if constexpr (std::is_same<F, Q3_K>::value || std::is_same<F, Q2_K>::value) {
        // x in quantize_x_lanes's lane order, once per call (read only by the row groups' threads)
        std::vector<int8_t> xq((size_t)(3 * M * K));
        std::vector<float> xs((size_t)(M * nb));
        std::vector<int32_t> xo((size_t)(M * nb * 16));
        for (int64_t m = 0; m < M; ++m) quantize_x_lanes(x + m * K, K, xq.data() + 3 * m * K, xs.data() + m * nb, xo.data() + m * nb * 16);
        groups(w, rb, [&](int64_t n0, int r) {
            for (int64_t m = 0; m < M; ++m) {
#define YR_CALL(R) (std::is_same<F, Q3_K>::value ? gemv_rows_q3k<R> : gemv_rows_q2k<R>)(xq.data() + 3 * m * K, xs.data() + m * nb, xo.data() + m * nb * 16, w + n0 * rb, rb, nb, bias ? bias + n0 : nullptr, y + m * N + n0)
                YR_DISPATCH_ROWS(r, YR_CALL)
#undef YR_CALL
            }
        });
        return;
    }
#endif
#if defined(YR_INT_GEMV)
    if constexpr (!std::is_void<typename IntOf<F>::type>::value) {
        using I = typename IntOf<F>::type;
        // x's int8 parts, once per call (the row groups may run on several threads: read only)
        std::vector<int8_t> xq((size_t)(3 * M * K));
        std::vector<float> xf((size_t)(M * (nb + K / 16)));
        for (int64_t m = 0; m < M; ++m) {
            int8_t* q = xq.data() + 3 * m * K;
            quantize_x_int(x + m * K, K, q, q + K, q + 2 * K, xf.data() + m * (nb + K / 16),
                           xf.data() + m * (nb + K / 16) + nb);
        }
        groups(w, rb, [&](int64_t n0, int r) {
            for (int64_t m = 0; m < M; ++m) {
                const int8_t* q = xq.data() + 3 * m * K;
                const float* f = xf.data() + m * (nb + K / 16);
#define YR_CALL(R) gemv_rows_int<I, R>(q, q + K, q + 2 * K, f, f + nb, w + n0 * rb, rb, nb, bias ? bias + n0 : nullptr, y + m * N + n0)
                YR_DISPATCH_ROWS(r, YR_CALL)
#undef YR_CALL
            }
        });
        return;
    }
#endif
    groups(w, rb, [&](int64_t n0, int r) {
        for (int64_t m = 0; m < M; ++m) {   // the group's weights stay in L1 across the x rows
#define YR_CALL(R) gemv_rows_fmt<F, R>(x + m * K, w + n0 * rb, rb, nb, bias ? bias + n0 : nullptr, y + m * N + n0)
            YR_DISPATCH_ROWS(r, YR_CALL)
#undef YR_CALL
        }
    });
}

// y[M, N] = x[M, K] @ W^T (+ bias): packed GEMM from GEMM_MIN_M rows of x, else GEMV.
template <class F>
void linear_fmt(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
    if (M <= 0 || N <= 0) return;
    const int64_t rb = K / F::QB * F::BYTES;
    if (M >= GEMM_MIN_M) {
        linear_packed(x, bias, y, M, N, K, [&](int64_t n0, int nr, float* P) {
            pack_fmt<F>(w + n0 * rb, rb, K, nr, P);
        });
        return;
    }
    gemv_fmt<F>(x, w, bias, y, M, N, K, YR_ALL_GROUPS);
}

// a = {x, w, bias|0, y, M, N, K, stride}; [lo, hi): weight rows (the persistent kernel's GEMV task;
// stride: library.cpp YR_TASK_GROUPS).
template <class F>
void task_linear_fmt(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t M = a[4], N = a[5], K = a[6];
    gemv_fmt<F>(reinterpret_cast<const float*>(a[0]), reinterpret_cast<const uint8_t*>(a[1]),
                reinterpret_cast<const float*>(a[2]), reinterpret_cast<float*>(a[3]), M, N, K, YR_TASK_GROUPS);
}

// out[t, :] = row ids[t] of table [V, D] (every id checked first, see embedding_rows).
template <class F>
void embedding_fmt(const int64_t* ids, const uint8_t* table, float* out, int64_t T, int64_t D, int64_t V,
                   int64_t* status) {
    const int64_t rb = D / F::QB * F::BYTES;
    embedding_rows(ids, out, T, D, V, status, [&](int64_t id, float* dst) {
        dequant_row_fmt<F>(table + id * rb, dst, D);
    });
}

// a = {ids, table, out, T, D, V, status, (format: unused)}; [lo, hi): tokens. An id outside
// [0, V) is reported and gives a row of zeros (as library.cpp yr_task_embedding).
template <class F>
void task_embedding_fmt(const int64_t* a, int64_t lo, int64_t hi) {
    const uint8_t* table = reinterpret_cast<const uint8_t*>(a[1]);
    const int64_t D = a[4], rb = D / F::QB * F::BYTES;
    task_embedding_rows(a, lo, hi, a[5], [&](int64_t id, float* dst) { dequant_row_fmt<F>(table + id * rb, dst, D); });
}

// dst[0 .. nblocks * QB) = nblocks consecutive blocks at src, dequantized.
template <class F>
void dequant_fmt(const uint8_t* src, float* dst, int64_t nblocks) {
    yr::parallel_for(nblocks, nblocks * F::QB >= PAR_MIN_ELEMS, [&](int64_t b) {
        dequant_block_fmt<F>(src + b * F::BYTES, dst + b * F::QB);
    });
}

}  // namespace

// The five entry points of a format (see the top of this file).
#define YR_GGML_FORMAT(T, F)                                                                               \
    void yr_linear_##T(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, \
                       int64_t K) {                                                                         \
        linear_fmt<F>(x, w, bias, y, M, N, K);                                                              \
    }                                                                                                       \
    void yr_embedding_##T(const int64_t* ids, const uint8_t* table, float* out, int64_t T, int64_t D,       \
                          int64_t V, int64_t* status) {                                                     \
        embedding_fmt<F>(ids, table, out, T, D, V, status);                                                 \
    }                                                                                                       \
    void yr_task_linear_##T(const int64_t* a, int64_t lo, int64_t hi) { task_linear_fmt<F>(a, lo, hi); }    \
    void yr_task_embedding_##T(const int64_t* a, int64_t lo, int64_t hi) { task_embedding_fmt<F>(a, lo, hi); } \
    void yr_dequant_##T(const uint8_t* src, float* dst, int64_t nblocks) { dequant_fmt<F>(src, dst, nblocks); }

extern "C" {
YR_GGML_FORMAT(q4_0, Q4_0)
YR_GGML_FORMAT(q5_0, Q5_0)
YR_GGML_FORMAT(q5_1, Q5_1)
YR_GGML_FORMAT(q2_k, Q2_K)
YR_GGML_FORMAT(q3_k, Q3_K)
YR_GGML_FORMAT(q4_k, Q4_K)
YR_GGML_FORMAT(q5_k, Q5_K)
YR_GGML_FORMAT(q6_k, Q6_K)
YR_GGML_FORMAT(iq4_nl, IQ4_NL)
YR_GGML_FORMAT(iq4_xs, IQ4_XS)
}  // extern "C"

#undef YR_GGML_FORMAT
