// q4_1 and q8_0 weights repacked in groups of 16 rows (the IR's DTypes q4_1r16 and q8_0r16;
// ir.ops.to_row_groups is the layouts' reference). Same blocks, same bytes per row, only
// reordered: a decode GEMV on them needs no horizontal sum and no per-row scale broadcast.
//
// Why. The q4_1 GEMV of library.cpp reads one row's block at a time: a vpdpbusd (or 32 FMAs) on
// 32 weights, then a broadcast of the block's scale and a scalar multiply-add for its offset, about
// 14 instructions per 20-byte block. On a 2-core Intel Xeon (family 6 model 207) that kernel ran at
// 26 GB/s with the weights in L2 and 16-24 GB/s streamed, against 50 GB/s for a plain read of the
// same bytes: bound by its own instructions. With 16 rows interleaved, one 64-byte load holds 4
// quant bytes of each of 16 rows, a vpdpbusd against x's 4 int8 values broadcast sums 4 products
// into each row's lane, and one vector of 16 fp16 scales scales 16 rows at once: about 1.8
// instructions per 20 bytes. The same GEMVs ran 59-83 GB/s in L2 and 45-51 GB/s streamed
// (2.1-3.2x). llama.cpp repacks its Q4_0 the same way for the GEMV (ggml-cpu repack.cpp,
// block_q4_0x8: rows interleaved so that lanes are rows); these are the q4_1 and q8_0 forms, 16
// rows for AVX-512's 16 lanes.
//
// Layout. Rows 16g .. 16g+15 form group g, stored as its blocks b = 0 .. nb-1 in order, each a
// unit of 16 blocks (nb = K / 32; group g's units start at byte 16 * g * nb * block bytes, where
// row 16g starts in the plain layout, so a range of whole groups covers the same bytes as those
// rows). A unit holds each 2-byte scale field of the 16 rows (32 bytes per field), then for j =
// 0, 1, ..: 64 bytes, the quant bytes qs[4j .. 4j+3] of rows 0..15 (4 bytes per row):
//   q4_1 (block {fp16 d; fp16 m; uint8 qs[16]}, 320-byte units): d[16], m[16], 4 x 64 bytes;
//        weight i < 16 is d * (qs[i] & 15) + m, weight 16 + i is d * (qs[i] >> 4) + m;
//   q8_0 (block {fp16 d; int8 qs[32]}, 544-byte units): d[16], 8 x 64 bytes; weight i is d * qs[i].
// N must be a multiple of 16 (the IR checks it).
//
// Kernels (AVX-512, with VNNI for int8 x; every other build runs the scalar forms on the rebuilt
// blocks, and yr_row_groups_native() tells the model not to repack there):
// - int8 x (compute_dtype='int8'): as library.cpp gemv_q8_act, x quantized per block of 32 (the
//   task forms read it from the buffer an op of its own fills, once per projection), the integer
//   sums exact: per unit and x row one vpdpbusd per 64 bytes of quants, each unit unpacked once per
//   8 x rows (q8_0: x + 128 as the unsigned operand, then 128 * sum(q) subtracted, summed by a
//   second vpdpbusd), one int->float conversion, the scale terms as 16-lane FMAs.
// - float32 x, 1 .. 16 rows of x (decode, continuous batching's steps): each quant converted in
//   place, 16 rows per vector, and multiplied by x[k] broadcast. q4_1: the nibbles masked ((v &
//   (15 << s)) = q * 2^s for s = 8t or 8t + 4, converted exactly by vcvtudq2ps) against x[k] * 2^-s
//   (x scaled once per call: exact, but for x below 2^-98, where the scaled value is subnormal);
//   per block sum_k x[k] q[k], then d * that + m * sum(x) (library.cpp gemv_q4_1_rows' algebra).
//   q8_0: the bytes sign-extended by shifts; d * sum_k x[k] q[k].
// - float32 x, more rows (prefill): library.cpp's packed GEMM, panels packed from each row's
//   dequantized blocks.
// - the embedding lookup of a q8_0r16 table (a tied LM head's): rows dequantized from their group.
//
// Rules: as library.cpp (no allocation of caller memory, run-time sizes never trusted: only whole
// groups inside [0, N) are read).

#pragma once

namespace {

#if defined(YR_AVX512) && defined(__AVX512VNNI__)
#define YR_RG_VNNI 1   // the int8 GEMVs' vector form (vpdpbusd on 16 lanes)
#endif

constexpr int64_t RG_ROWS = 16;   // rows per group
// The kernels ask for the unit this many bytes ahead as they read each one (see rg_range).
constexpr int64_t RG_PREFETCH = 4096;

// The two formats: bytes per block, 2-byte scale fields per block, and the unit of 16 blocks.
struct RgQ4_1 {
    static constexpr int64_t BYTES = Q4_1_BYTES, FIELDS = 2, UNIT = RG_ROWS * BYTES;
};
struct RgQ8_0 {
    static constexpr int64_t BYTES = Q8_0_BYTES, FIELDS = 1, UNIT = RG_ROWS * BYTES;
};

// Byte offset in a unit of row r's quant bytes qs[4j .. 4j+3].
template <class F>
constexpr int64_t rg_qs(int j, int r) { return 32 * F::FIELDS + 64 * j + 4 * r; }

// The plain block (F::BYTES bytes) of row r (< 16) of a unit.
template <class F>
inline void rg_block(const uint8_t* unit, int r, uint8_t* blk) {
    for (int f = 0; f < F::FIELDS; ++f) std::memcpy(blk + 2 * f, unit + 32 * f + 2 * r, 2);
    for (int j = 0; j < (F::BYTES - 2 * F::FIELDS) / 4; ++j)
        std::memcpy(blk + 2 * F::FIELDS + 4 * j, unit + rg_qs<F>(j, r), 4);
}

// The 32 weights of row r's block in a unit, as dequant_block_q4_1 / _q8_0 decode them. AVX-512:
// the quant bytes gathered by 32-bit loads (rebuilding the block in memory and reading it back as
// one vector stalls store forwarding).
template <class F>
inline void rg_dequant_block(const uint8_t* unit, int r, float* out) {
#if defined(YR_AVX512)
    const float d = F16.v[load_u16(unit + 2 * r)];
    if constexpr (F::FIELDS == 2) {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 lut = _mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(F16.v[load_u16(unit + 32 + 2 * r)]));
        const uint8_t* qs = unit + rg_qs<F>(0, r);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_setr_epi32((int)load_u32(qs), (int)load_u32(qs + 64),
                                                              (int)load_u32(qs + 128), (int)load_u32(qs + 192)));
        _mm512_storeu_ps(out, _mm512_permutexvar_ps(q, lut));
        _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut));
    } else {
        const uint8_t* qs = unit + rg_qs<F>(0, r);
        for (int h = 0; h < 2; ++h) {
            const uint8_t* p = qs + 256 * h;
            const __m128i q = _mm_setr_epi32((int)load_u32(p), (int)load_u32(p + 64), (int)load_u32(p + 128),
                                             (int)load_u32(p + 192));
            _mm512_storeu_ps(out + 16 * h, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
        }
    }
#else
    uint8_t blk[F::BYTES];
    rg_block<F>(unit, r, blk);
    if constexpr (F::FIELDS == 2) dequant_block_q4_1(blk, out);
    else dequant_block_q8_0(blk, out);
#endif
}

// Rows [n0, n0 + 16) of group n0 / 16 (a whole group inside N) or nothing.
inline bool rg_whole_group(int64_t n0, int r) { return n0 % RG_ROWS == 0 && r == RG_ROWS; }

#if defined(YR_AVX512)
// y[i][0:16] = v[i] (+ bias[0:16]) for the MT x rows of a group (the kernels' last step).
template <int MT>
inline void rg_store_rows(const __m512* v, const float* bias, float* y, int64_t ldy) {
    for (int i = 0; i < MT; ++i)
        _mm512_storeu_ps(y + i * ldy, bias ? _mm512_add_ps(v[i], _mm512_loadu_ps(bias)) : v[i]);
}
#endif

// ---- int8 x -------------------------------------------------------------------------------
// y[i][16 rows] (+ bias) of the group at u (its first unit) for MT (<= 8) x rows quantized by
// quantize_blocks_q8 (row i: xq + i * K, dx and sxq + i * nb): each unit's quants are loaded and
// unpacked once for the MT rows (continuous batching's decode steps). q8_0 with VNNI: xq holds
// x + 128 as unsigned bytes (rg_vnni_operand), vpdpbusd's unsigned operand.
template <class F, int MT>
inline void rg_rows_q8(const int8_t* xq, const float* dx, const float* sxq, int64_t K, const uint8_t* u, int64_t nb,
                       const float* bias, float* y, int64_t ldy) {
#if defined(YR_RG_VNNI)
    const __m512i low4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(1);
    // S integer sums per x row and unit: with fewer than 8 rows one chain of vpdpbusd per row
    // would wait on its latency (the sums are exact, so any S gives the same results)
    constexpr int S = MT >= 8 ? 1 : 2;
    __m512 acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, u += F::UNIT) {
        for (int l = 0; l < F::UNIT; l += 64) _mm_prefetch(reinterpret_cast<const char*>(u) + RG_PREFETCH + l, _MM_HINT_T0);
        __m512i s[MT][S];
        for (int i = 0; i < MT; ++i)
            for (int c = 0; c < S; ++c) s[i][c] = _mm512_setzero_si512();
        // x's 4-byte groups, each broadcast straight from memory: a load-port uop, where a
        // broadcast from a general register takes the vector port vpdpbusd needs (M = 4 / 16
        // rows: 1.4x / 1.15x)
        const auto x4 = [&](int i, int j) { return _mm512_broadcastd_epi32(_mm_loadu_si32(xq + i * K + b * QK + 4 * j)); };
        __m512i sq = _mm512_setzero_si512();   // q8_0: sum of each row's quants
        if constexpr (F::FIELDS == 2) {   // q4_1: unsigned nibbles times signed x
            for (int j = 0; j < 4; ++j) {
                const __m512i v = _mm512_loadu_si512(u + rg_qs<F>(j, 0));
                const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                for (int i = 0; i < MT; ++i) {
                    s[i][0] = _mm512_dpbusd_epi32(s[i][0], lo, x4(i, j));           // quants 4j..
                    s[i][S - 1] = _mm512_dpbusd_epi32(s[i][S - 1], hi, x4(i, 4 + j));   // 16+4j..
                }
            }
        } else {   // q8_0: (x + 128) unsigned times signed q, minus 128 * sum(q)
            for (int j = 0; j < 8; ++j) {
                const __m512i v = _mm512_loadu_si512(u + rg_qs<F>(j, 0));
                sq = _mm512_dpbusd_epi32(sq, ones, v);
                for (int i = 0; i < MT; ++i) s[i][j % S] = _mm512_dpbusd_epi32(s[i][j % S], x4(i, j), v);
            }
            sq = _mm512_slli_epi32(sq, 7);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
        for (int i = 0; i < MT; ++i) {
            __m512i si = S == 2 ? _mm512_add_epi32(s[i][0], s[i][S - 1]) : s[i][0];
            if constexpr (F::FIELDS == 1) si = _mm512_sub_epi32(si, sq);
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[i * nb + b])), _mm512_cvtepi32_ps(si), acc[i]);
            if constexpr (F::FIELDS == 2) {
                const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32)));
                acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sxq[i * nb + b]), acc[i]);
            }
        }
    }
    rg_store_rows<MT>(acc, bias, y, ldy);
#else
    for (int i = 0; i < MT; ++i) {
        float s[RG_ROWS] = {};
        const uint8_t* ub = u;
        for (int64_t b = 0; b < nb; ++b, ub += F::UNIT)
            for (int r = 0; r < RG_ROWS; ++r) {
                uint8_t blk[F::BYTES];
                rg_block<F>(ub, r, blk);
                const int8_t* xb = xq + i * K + b * QK;
                int t = 0;
                if constexpr (F::FIELDS == 2) {
                    for (int j = 0; j < 16; ++j) t += (blk[4 + j] & 15) * xb[j] + (blk[4 + j] >> 4) * xb[j + 16];
                    s[r] += fp16_to_fp32(load_u16(blk)) * dx[i * nb + b] * (float)t
                            + fp16_to_fp32(load_u16(blk + 2)) * sxq[i * nb + b];
                } else {
                    for (int j = 0; j < QK; ++j) t += (int8_t)blk[2 + j] * xb[j];
                    s[r] += fp16_to_fp32(load_u16(blk)) * dx[i * nb + b] * (float)t;
                }
            }
        for (int r = 0; r < RG_ROWS; ++r) y[i * ldy + r] = bias ? s[r] + bias[r] : s[r];
    }
#endif
}

// ---- float32 x ----------------------------------------------------------------------------
// x[K] -> block b's 32 values at xs + b * ld and their sum at sx[b * ld / 32] (ld: 32 * the rows
// interleaved block by block, so that a kernel addresses every x row of a block from one
// pointer). q4_1 with AVX-512: the values are x[k] * 2^-s(k), s(k) = 8 * (k % 4) + 4 * (k % 32 >=
// 16), the power of two by which the masked quant of weight k of a block stands above q (see the
// header); otherwise x.
template <class F>
inline void rg_prescale(const float* x, int64_t K, float* xs, float* sx, int64_t ld) {
    const int64_t lds = ld / QK;
#if defined(YR_AVX512)
    // 2^-s(k) for k = 0..31 (exact powers of two), made once
    struct Scales {
        alignas(64) float v[QK];
        Scales() {
            for (int k = 0; k < QK; ++k) v[k] = F::FIELDS == 2 ? 1.0f / (float)(1u << (8 * (k % 4) + 4 * (k >= 16))) : 1.0f;
        }
    };
    static const Scales sc;
    const __m512 s0 = _mm512_load_ps(sc.v), s1 = _mm512_load_ps(sc.v + 16);
    for (int64_t b = 0; b < K / QK; ++b) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        _mm512_storeu_ps(xs + b * ld, _mm512_mul_ps(v0, s0));
        _mm512_storeu_ps(xs + b * ld + 16, _mm512_mul_ps(v1, s1));
        sx[b * lds] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    }
#else
    for (int64_t b = 0; b < K / QK; ++b) {
        float s = 0.0f;
        for (int k = 0; k < QK; ++k) {
            xs[b * ld + k] = x[b * QK + k];
            s += x[b * QK + k];
        }
        sx[b * lds] = s;
    }
#endif
}

#if defined(YR_AVX512)
// Weights 4j + t (hi: 16 + 4j + t) of the 16 rows of a q4_1 unit (v: its j-th 64 bytes), times 2^s.
inline __m512 rg_q4_1_weights(__m512i v, int t, bool hi) {
    return _mm512_cvtepu32_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)((hi ? 0xF0u : 0x0Fu) << (8 * t)))));
}
// Weight 4j + t of the 16 rows of a q8_0 unit (v: its j-th 64 bytes), sign-extended.
inline __m512 rg_q8_0_weights(__m512i v, int t) {
    const __m512i b = t == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * t);
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(b, 24));
}
#endif

// y[m][16 rows] (+ bias) for MT (<= 8) x rows (xs, sx from rg_prescale with the stride ld: row
// m's block b at xs + b * ld + 32 * m, its sum at sx[b * ld / 32 + m]) on the group at u.
template <class F, int MT>
inline void rg_rows_f32(const float* xs, const float* sx, int64_t ld, const uint8_t* u, int64_t nb,
                        const float* bias, float* y, int64_t ldy) {
    const int64_t lds = ld / QK;
#if defined(YR_AVX512)
    // C independent sums per x row and block (the 32 FMAs of a block are a dependent chain
    // otherwise: 4 cycles each, which bound one x row to ~2.5 bytes per cycle)
    constexpr int C = MT >= 4 ? 1 : (MT >= 2 ? 2 : 4);
    __m512 tot[MT];
    for (int i = 0; i < MT; ++i) tot[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, u += F::UNIT) {
        for (int l = 0; l < F::UNIT; l += 64) _mm_prefetch(reinterpret_cast<const char*>(u) + RG_PREFETCH + l, _MM_HINT_T0);
        __m512 acc[MT][C];
        for (int i = 0; i < MT; ++i)
            for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
        const float* xb = xs + b * ld;   // row i's block: xb + 32 * i (one base register for all)
        constexpr int J = F::FIELDS == 2 ? 4 : 8;   // 64-byte rows of quants per unit
        for (int j = 0; j < J; ++j) {
            const __m512i v = _mm512_loadu_si512(u + rg_qs<F>(j, 0));
            // unrolled, so that the masks and shifts are constants (a mask made in a general
            // register and broadcast took 2 vector-port uops per 16 FMAs; 16 rows 1.13x)
#pragma GCC unroll 4
            for (int t = 0; t < 4; ++t) {
                if constexpr (F::FIELDS == 2) {
                    const __m512 wl = rg_q4_1_weights(v, t, false), wh = rg_q4_1_weights(v, t, true);
                    for (int i = 0; i < MT; ++i) {
                        __m512& a = acc[i][j % C];
                        a = _mm512_fmadd_ps(wl, _mm512_set1_ps(xb[i * QK + 4 * j + t]), a);
                        a = _mm512_fmadd_ps(wh, _mm512_set1_ps(xb[i * QK + 16 + 4 * j + t]), a);
                    }
                } else {
                    const __m512 w = rg_q8_0_weights(v, t);
                    for (int i = 0; i < MT; ++i) {
                        __m512& a = acc[i][j % C];
                        a = _mm512_fmadd_ps(w, _mm512_set1_ps(xb[i * QK + 4 * j + t]), a);
                    }
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
        for (int i = 0; i < MT; ++i) {
            __m512 a = acc[i][0];
            for (int c = 1; c < C; ++c) a = _mm512_add_ps(a, acc[i][c]);
            tot[i] = _mm512_fmadd_ps(d, a, tot[i]);
            if constexpr (F::FIELDS == 2) {
                const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32)));
                tot[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[b * lds + i]), tot[i]);
            }
        }
    }
    rg_store_rows<MT>(tot, bias, y, ldy);
#else
    float s[MT][RG_ROWS] = {};
    for (int64_t b = 0; b < nb; ++b, u += F::UNIT)
        for (int r = 0; r < RG_ROWS; ++r) {
            float w[QK];
            rg_dequant_block<F>(u, r, w);
            for (int i = 0; i < MT; ++i) {
                const float* xb = xs + b * ld + i * QK;
                float t = 0.0f;
                for (int k = 0; k < QK; ++k) t += w[k] * xb[k];
                s[i][r] += t;
            }
        }
    for (int i = 0; i < MT; ++i)
        for (int r = 0; r < RG_ROWS; ++r) y[i * ldy + r] = bias ? s[i][r] + bias[r] : s[i][r];
#endif
}

// Calls CALL(R) for R = r (1..8): rg_rows_f32 / rg_rows_q8 on R x rows.
#define YR_RG_ROWS(r, CALL) \
    switch (r) { case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break; \
                 case 5: CALL(5); break; case 4: CALL(4); break; case 3: CALL(3); break; \
                 case 2: CALL(2); break; default: CALL(1); }

// The most x rows of the float32 form; more take the packed GEMM.
constexpr int64_t RG_MAX_M = 16;

// y[M, N] (+ bias) for M <= RG_MAX_M x rows on the groups that groups(w, row_bytes, rows) hands
// to rows(n0, 16) (YR_RG_ALL_GROUPS / YR_RG_TASK_GROUPS).
template <class F, typename Groups>
void rg_linear_f32(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                   Groups groups) {
    const int64_t nb = K / QK, rb = nb * F::BYTES;
    static thread_local std::vector<float> buf;
    float* xs = scratch(buf, (size_t)(M * (K + nb) + 1));
    float* sx = xs + M * K;
    for (int64_t m = 0; m < M; ++m) rg_prescale<F>(x + m * K, K, xs + m * QK, sx + m, M * QK);
    groups(w, rb, [&](int64_t n0, int r) {
        if (!rg_whole_group(n0, r)) return;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {   // the group's bytes stay in L1 across the passes
#define YR_CALL(R) rg_rows_f32<F, R>(xs + m0 * QK, sx + m0, M * QK, w + n0 * rb, nb, bias ? bias + n0 : nullptr, \
                                     y + m0 * N + n0, N)
            YR_RG_ROWS((int)std::min<int64_t>(8, M - m0), YR_CALL)
#undef YR_CALL
        }
    });
}

// x's quants as rg_rows_q8 reads them: q4_1 (and every scalar build) xq itself; q8_0 with VNNI
// x + 128 (xq ^ 0x80) in the calling thread's scratch, made once per call.
template <class F>
inline const int8_t* rg_vnni_operand(const int8_t* xq, int64_t n) {
#if defined(YR_RG_VNNI)
    if constexpr (F::FIELDS == 1) {
        static thread_local std::vector<float> buf;
        int8_t* out = reinterpret_cast<int8_t*>(scratch(buf, (size_t)(n / 4 + 16)));
        int64_t i = 0;
        for (; i + 64 <= n; i += 64)
            _mm512_storeu_si512(out + i, _mm512_xor_si512(_mm512_loadu_si512(xq + i), _mm512_set1_epi8((char)0x80)));
        for (; i < n; ++i) out[i] = (int8_t)(xq[i] ^ 0x80);
        return out;
    }
#endif
    (void)n;
    return xq;
}

// The same with x quantized to int8 per block of 32 (compute_dtype='int8'; q: quantize_rows_q8
// or q8_rows_in), any M.
template <class F, typename Groups>
void rg_linear_q8(const QuantizedRows& q, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                  int64_t K, Groups groups) {
    const int64_t nb = K / QK, rb = nb * F::BYTES;
    const int8_t* xq = rg_vnni_operand<F>(q.xq, M * K);
    groups(w, rb, [&](int64_t n0, int r) {
        if (!rg_whole_group(n0, r)) return;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {   // 8 x rows per pass over the group (in L1 after the first)
#define YR_CALL(R) rg_rows_q8<F, R>(xq + m0 * K, q.dx + m0 * nb, q.sxq + m0 * nb, K, w + n0 * rb, nb, \
                                    bias ? bias + n0 : nullptr, y + m0 * N + n0, N)
            YR_RG_ROWS((int)std::min<int64_t>(8, M - m0), YR_CALL)
#undef YR_CALL
        }
    });
}

// Row n's 32 * nb weights of a repacked weight (nb blocks per row) into out.
template <class F>
inline void rg_dequant_row(const uint8_t* w, int64_t nb, int64_t n, float* out) {
    const uint8_t* g = w + (n / RG_ROWS) * RG_ROWS * nb * F::BYTES;
    for (int64_t b = 0; b < nb; ++b) rg_dequant_block<F>(g + b * F::UNIT, (int)(n % RG_ROWS), out + b * QK);
}

// Panel of rows n0 .. n0+nr-1 (n0 a multiple of PR) for library.cpp's packed GEMM.
template <class F>
void rg_pack(const uint8_t* w, int64_t K, int64_t n0, int nr, float* P) {
    const int64_t nb = K / QK;
    pack_blocks(K, nr, P, [&](int j, int64_t b, float* out) {
        const int64_t n = n0 + j;
        rg_dequant_block<F>(w + (n / RG_ROWS) * RG_ROWS * nb * F::BYTES + b * F::UNIT, (int)(n % RG_ROWS), out);
    });
}

// Runs rows(n0, 16) over the groups of rows [lo, hi) (multiples of 16), the range's first
// RG_PREFETCH bytes asked for up front; the kernels prefetch the rest unit by unit. (library.cpp's
// gemv_range, which asks for a whole group's bytes at each group, measured 0.8x of this.)
template <typename RowsFn>
inline void rg_range(int64_t lo, int64_t hi, const void* w, int64_t rb, RowsFn rows) {
    prefetch_span(w, lo * rb, lo * rb + RG_PREFETCH, hi * rb);
    for (int64_t n0 = lo; n0 + RG_ROWS <= hi; n0 += RG_ROWS) rows(n0, (int)RG_ROWS);
}

// All of N's groups over the threads, an equal contiguous slice each.
template <typename RowsFn>
void rg_all_groups(int64_t N, int64_t macs, const void* w, int64_t rb, RowsFn rows) {
    parallel_slices(N / RG_ROWS, macs, [&](int64_t g0, int64_t g1) { rg_range(g0 * RG_ROWS, g1 * RG_ROWS, w, rb, rows); });
}

// Hands out whole 16-row groups: all of N over the threads, or one task's [lo, hi).
#define YR_RG_ALL_GROUPS [&](const void* wp, int64_t rowb, auto rows) { rg_all_groups(N, M * N * K, wp, rowb, rows); }
#define YR_RG_TASK_GROUPS [&](const void* wp, int64_t rowb, auto rows) { rg_range(lo, hi, wp, rowb, rows); }

// The launch and task forms of a format (see the entry points below).
template <class F>
void rg_linear(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
    if (M <= 0 || N <= 0) return;
    N -= N % RG_ROWS;
    if (M > RG_MAX_M) {
        linear_packed(x, bias, y, M, N, K, [&](int64_t n0, int nr, float* P) { rg_pack<F>(w, K, n0, nr, P); });
        return;
    }
    rg_linear_f32<F>(x, w, bias, y, M, N, K, YR_RG_ALL_GROUPS);
}

template <class F>
void rg_linear_launch_q8(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
    if (M <= 0 || N <= 0) return;
    N -= N % RG_ROWS;
    rg_linear_q8<F>(quantize_rows_q8(x, M, K), w, bias, y, M, N, K, YR_RG_ALL_GROUPS);
}

template <class F>
void rg_task_linear(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t M = std::min<int64_t>(a[4], RG_MAX_M), N = a[5] - a[5] % RG_ROWS, K = a[6];
    hi = std::min(hi, N);
    rg_linear_f32<F>(reinterpret_cast<const float*>(a[0]), reinterpret_cast<const uint8_t*>(a[1]),
                     reinterpret_cast<const float*>(a[2]), reinterpret_cast<float*>(a[3]), M, N, K, YR_RG_TASK_GROUPS);
}

template <class F>
void rg_task_linear_q8(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t M = a[4], N = a[5] - a[5] % RG_ROWS, K = a[6];
    hi = std::min(hi, N);
    rg_linear_q8<F>(q8_rows_in(reinterpret_cast<const uint8_t*>(a[0]), M, K), reinterpret_cast<const uint8_t*>(a[1]),
                    reinterpret_cast<const float*>(a[2]), reinterpret_cast<float*>(a[3]), M, N, K, YR_RG_TASK_GROUPS);
}

template <class F>
void rg_repack(const uint8_t* src, uint8_t* dst, int64_t N, int64_t nb) {
    if (N <= 0 || nb <= 0) return;
    const int64_t groups = N / RG_ROWS, rb = nb * F::BYTES;
    yr::parallel_for(groups, groups * rb * RG_ROWS >= (1 << 20), [&](int64_t g) {
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* u = dst + (g * nb + b) * F::UNIT;
            for (int r = 0; r < RG_ROWS; ++r) {
                const uint8_t* blk = src + (g * RG_ROWS + r) * rb + b * F::BYTES;
                for (int f = 0; f < F::FIELDS; ++f) std::memcpy(u + 32 * f + 2 * r, blk + 2 * f, 2);
                for (int j = 0; j < (F::BYTES - 2 * F::FIELDS) / 4; ++j)
                    std::memcpy(u + rg_qs<F>(j, r), blk + 2 * F::FIELDS + 4 * j, 4);
            }
        }
    });
}

template <class F>
void rg_dequant(const uint8_t* src, float* dst, int64_t nblocks, int64_t nb) {
    if (nb <= 0 || nblocks <= 0) return;
    const int64_t rows = nblocks / nb / RG_ROWS * RG_ROWS;
    yr::parallel_for(rows, rows * nb * QK >= PAR_MIN_ELEMS, [&](int64_t n) {
        rg_dequant_row<F>(src, nb, n, dst + n * nb * QK);   // dst in order
    });
}

}  // namespace

extern "C" {

// out[0] = 1 where the kernels above have their vector forms (AVX-512 with VNNI), else 0: the
// model repacks weights only there.
void yr_row_groups_native(int64_t* out) {
#if defined(YR_RG_VNNI)
    out[0] = 1;
#else
    out[0] = 0;
#endif
}

// For T = q4_1r16, q8_0r16 (N a multiple of 16, K of 32; only whole groups inside N are read):
//   yr_linear_T(x, w, bias|0, y, M, N, K)       y[M, N] = x[M, K] @ W^T (+ bias), float32 x
//   yr_linear_T_q8(...)                          the same with x quantized to int8 per block of 32
//   yr_task_linear_T(a = {x, w, bias|0, y, M, N, K, stride}, lo, hi)   rows [lo, hi), whole groups
//                                                (M <= 16)
//   yr_task_linear_T_q8(a = {buf, w, ...}, lo, hi)  the int8 form on x quantized into buf by
//                                                library.cpp's yr_task_quantize_rows_q8
//   yr_repack_T(src, dst, N, nb)                 plain q4_1 / q8_0 [N, nb blocks] -> T (whole groups;
//                                                src and dst must not overlap)
//   yr_dequant_T(src, dst, nblocks, nb)          rows [0, nblocks / nb) -> floats (whole groups)
#define YR_RG_ENTRY_POINTS(T, F)                                                                          \
    void yr_linear_##T(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, \
                       int64_t K) { rg_linear<F>(x, w, bias, y, M, N, K); }                               \
    void yr_linear_##T##_q8(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M,     \
                            int64_t N, int64_t K) { rg_linear_launch_q8<F>(x, w, bias, y, M, N, K); }     \
    void yr_task_linear_##T(const int64_t* a, int64_t lo, int64_t hi) { rg_task_linear<F>(a, lo, hi); }    \
    void yr_task_linear_##T##_q8(const int64_t* a, int64_t lo, int64_t hi) { rg_task_linear_q8<F>(a, lo, hi); } \
    void yr_repack_##T(const uint8_t* src, uint8_t* dst, int64_t N, int64_t nb) { rg_repack<F>(src, dst, N, nb); } \
    void yr_dequant_##T(const uint8_t* src, float* dst, int64_t nblocks, int64_t nb) {                   \
        rg_dequant<F>(src, dst, nblocks, nb);                                                             \
    }
YR_RG_ENTRY_POINTS(q4_1r16, RgQ4_1)
YR_RG_ENTRY_POINTS(q8_0r16, RgQ8_0)
#undef YR_RG_ENTRY_POINTS

// out[t, :] = row ids[t] of a q8_0r16 table [V, D] (V a multiple of 16; every id checked first,
// see embedding_rows: an id outside [0, V - V % 16) gives zeros and is reported).
void yr_embedding_q8_0r16(const int64_t* ids, const uint8_t* table, float* out, int64_t T, int64_t D, int64_t V,
                          int64_t* status) {
    V -= V % RG_ROWS;
    embedding_rows(ids, out, T, D, V, status,
                   [&](int64_t id, float* dst) { rg_dequant_row<RgQ8_0>(table, D / QK, id, dst); });
}

// a = {ids, table, out, T, D, V, status, (format: unused)}; [lo, hi): tokens. An id outside
// [0, V - V % 16) is reported and gives zeros (as yr_task_embedding).
void yr_task_embedding_q8_0r16(const int64_t* a, int64_t lo, int64_t hi) {
    const uint8_t* table = reinterpret_cast<const uint8_t*>(a[1]);
    const int64_t D = a[4];
    task_embedding_rows(a, lo, hi, a[5] - a[5] % RG_ROWS,
                        [&](int64_t id, float* dst) { rg_dequant_row<RgQ8_0>(table, D / QK, id, dst); });
}

}  // extern "C"
