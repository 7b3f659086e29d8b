// q4_1 weights repacked in groups of 16 rows (the IR's DType q4_1r16; ir.ops.to_row_groups is the
// layout's reference and repacker). Same blocks, same bytes per row, only reordered: a decode GEMV
// on them needs no horizontal sum and no per-row scale broadcast.
//
// Why. The q4_1 GEMV of library.cpp reads one row's block at a time: a vpdpbusd (or 32 FMAs) on
// 32 weights, then a broadcast of the block's scale and a scalar multiply-add for its offset, about
// 14 instructions per 20-byte block. On a 2-core Intel Xeon (family 6 model 207) that kernel ran at
// 26 GB/s with the weights in L2 and 16-24 GB/s streamed, against 50 GB/s for a plain read of the
// same bytes: bound by its own instructions. With 16 rows interleaved, one 64-byte load holds 4
// quant bytes of each of 16 rows, a vpdpbusd against x's 4 int8 values broadcast ({1to16}) sums
// 4 products into each row's lane, and one vector of 16 fp16 scales scales 16 rows at once: about
// 1.8 instructions per 20 bytes. The same GEMVs ran 59-83 GB/s in L2 and 45-51 GB/s streamed
// (2.1-3.2x). llama.cpp repacks its Q4_0 the same way for the GEMV (ggml-cpu repack.cpp,
// block_q4_0x8: rows interleaved so that lanes are rows); this is the q4_1 form, 16 rows for
// AVX-512's 16 lanes.
//
// Layout. Rows 16g .. 16g+15 form group g, stored as its blocks b = 0 .. nb-1 in order, each a
// 320-byte unit (nb = K / 32; group g's units start at byte 16 * g * nb * 20, where row 16g
// starts in the q4_1 layout, so a range of whole groups covers the same bytes as those rows):
//   bytes   0 ..  31: d of rows 0..15 (fp16)
//   bytes  32 ..  63: m of rows 0..15 (fp16)
//   bytes  64 .. 319: for j = 0..3, 64 bytes: qs[4j .. 4j+3] of rows 0..15 (4 bytes per row)
// where a q4_1 block is {fp16 d; fp16 m; uint8 qs[16]} and weight i < 16 of it is d * (qs[i] & 15)
// + m, weight 16 + i is d * (qs[i] >> 4) + m. N must be a multiple of 16 (the IR checks it).
//
// Kernels (AVX-512, with VNNI for int8 x; every other build runs the scalar forms on the rebuilt
// q4_1 blocks, and yr_row_groups_native() tells the model not to repack there):
// - int8 x (compute_dtype='int8'): as library.cpp gemv_q8_act, x quantized per block of 32, the
//   integer sums exact; per unit 8 vpdpbusd (AVX512-VNNI), one int->float conversion, the d * dx
//   and m * sum(xq) * dx terms as 16-lane FMAs.
// - float32 x, 1 .. 16 rows of x (decode, continuous batching's steps): the quants are masked in
//   place ((v & (15 << s)) = q * 2^s for s = 8t or 8t + 4, converted exactly by vcvtudq2ps) and
//   multiplied by x[k] * 2^-s (x scaled once per call: exact, but for x below 2^-98, where the
//   scaled value is subnormal); per block sum_k x[k] q[k] then d * that + m * sum(x): the algebra of
//   library.cpp gemv_q4_1_rows, here 16 rows per vector and up to 8 x rows per pass.
// - float32 x, more rows (prefill): library.cpp's packed GEMM, panels packed from the rebuilt
//   blocks (rg_block + dequant_block_q4_1).
//
// Rules: as library.cpp (no allocation of caller memory, run-time sizes never trusted: only whole
// groups inside [0, N) are read).

#pragma once

namespace {

#if defined(YR_AVX512) && defined(__AVX512VNNI__)
#define YR_RG_VNNI 1   // the int8 GEMV's vector form (vpdpbusd on 16 lanes)
#endif

constexpr int64_t RG_ROWS = 16;                    // rows per group
constexpr int64_t RG_UNIT = RG_ROWS * Q4_1_BYTES;   // bytes of one block of a group's 16 rows
// The kernels ask for the unit this many bytes ahead as they read each one (see rg_range).
constexpr int64_t RG_PREFETCH = 4096;

// The q4_1 block (20 bytes) of row r (< 16) of a unit.
inline void rg_block(const uint8_t* unit, int r, uint8_t* blk) {
    std::memcpy(blk, unit + 2 * r, 2);
    std::memcpy(blk + 2, unit + 32 + 2 * r, 2);
    for (int j = 0; j < 4; ++j) std::memcpy(blk + 4 + 4 * j, unit + 64 + 64 * j + 4 * r, 4);
}

// The 32 weights of row r's block in a unit, as dequant_block_q4_1 decodes them. AVX-512: the
// quant bytes gathered with four 32-bit loads (rebuilding the block in memory first and reading it
// back as one vector stalls store forwarding: 2.6x slower).
inline void rg_dequant_block(const uint8_t* unit, int r, float* out) {
#if defined(YR_AVX512)
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 lut = _mm512_fmadd_ps(_mm512_set1_ps(F16.v[load_u16(unit + 2 * r)]), iota,
                                       _mm512_set1_ps(F16.v[load_u16(unit + 32 + 2 * r)]));
    const uint8_t* qs = unit + 64 + 4 * r;
    const __m512i q = _mm512_cvtepu8_epi32(_mm_setr_epi32((int)load_u32(qs), (int)load_u32(qs + 64),
                                                          (int)load_u32(qs + 128), (int)load_u32(qs + 192)));
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(q, lut));
    _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut));
#else
    uint8_t blk[Q4_1_BYTES];
    rg_block(unit, r, blk);
    dequant_block_q4_1(blk, out);
#endif
}

// Rows [n0, n0 + 16) of group n0 / 16 (a whole group inside N) or nothing.
inline bool rg_whole_group(int64_t n0, int r) { return n0 % RG_ROWS == 0 && r == RG_ROWS; }

// ---- int8 x -------------------------------------------------------------------------------
// y[16 rows] (+ bias) of the group at u (its first unit) for one x row quantized by
// quantize_blocks_q8 (xq: nb * 32 int8, dx, sxq: nb floats).
inline void rg_gemv_q8(const int8_t* xq, const float* dx, const float* sxq, const uint8_t* u, int64_t nb,
                       const float* bias, float* y) {
#if defined(YR_RG_VNNI)
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int32_t* xd = reinterpret_cast<const int32_t*>(xq);
    __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, u += RG_UNIT) {
        for (int l = 0; l < RG_UNIT; l += 64) _mm_prefetch(reinterpret_cast<const char*>(u) + RG_PREFETCH + l, _MM_HINT_T0);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        int32_t xw[8];
        std::memcpy(xw, xd + 8 * b, 32);
        for (int j = 0; j < 4; ++j) {
            const __m512i v = _mm512_loadu_si512(u + 64 + 64 * j);
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            const __m512i xl = _mm512_set1_epi32(xw[j]), xh = _mm512_set1_epi32(xw[4 + j]);
            s0 = _mm512_dpbusd_epi32(s0, lo, xl);   // quants 4j..4j+3 of each row
            s1 = _mm512_dpbusd_epi32(s1, hi, xh);   // quants 16+4j..
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32)));
        acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[b])),
                              _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc);
        macc = _mm512_fmadd_ps(m, _mm512_set1_ps(sxq[b]), macc);
    }
    __m512 s = _mm512_add_ps(acc, macc);
    if (bias) s = _mm512_add_ps(s, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(y, s);
#else
    float s[RG_ROWS] = {};
    for (int64_t b = 0; b < nb; ++b, u += RG_UNIT)
        for (int r = 0; r < RG_ROWS; ++r) {
            uint8_t blk[Q4_1_BYTES];
            rg_block(u, r, blk);
            const int8_t* xb = xq + b * QK;
            int t = 0;
            for (int j = 0; j < 16; ++j) t += (blk[4 + j] & 15) * xb[j] + (blk[4 + j] >> 4) * xb[j + 16];
            s[r] += fp16_to_fp32(load_u16(blk)) * dx[b] * (float)t + fp16_to_fp32(load_u16(blk + 2)) * sxq[b];
        }
    for (int r = 0; r < RG_ROWS; ++r) y[r] = bias ? s[r] + bias[r] : s[r];
#endif
}

// ---- float32 x ----------------------------------------------------------------------------
// x[K] -> xs[K]: x[k] * 2^-s(k), s(k) = 8 * (k % 4) + 4 * (k % 32 >= 16): the power of two by
// which the masked quant of weight k of a block stands above q (see the header); sx[b] = sum of
// x over block b. The scalar build reads quants as numbers and keeps xs = x.
inline void rg_prescale(const float* x, int64_t K, float* xs, float* sx) {
    for (int64_t b = 0; b < K / QK; ++b) {
        float s = 0.0f;
        for (int k = 0; k < QK; ++k) {
            const float v = x[b * QK + k];
            s += v;
#if defined(YR_AVX512)
            xs[b * QK + k] = v * (1.0f / (float)(1u << (8 * (k % 4) + 4 * (k >= 16))));   // an exact power of two
#else
            xs[b * QK + k] = v;
#endif
        }
        sx[b] = s;
    }
}

// y[m][16 rows] (+ bias) for MT (<= 8) x rows (xs, sx from rg_prescale; row m at xs + m * K,
// sx + m * nb) on the group at u.
template <int MT>
inline void rg_rows_f32(const float* xs, const float* sx, int64_t K, const uint8_t* u, int64_t nb,
                        const float* bias, float* y, int64_t ldy) {
#if defined(YR_AVX512)
    // C independent sums per x row and block (the 32 FMAs of a block are a dependent chain
    // otherwise: 4 cycles each, which bound one x row to ~2.5 bytes per cycle)
    constexpr int C = MT >= 4 ? 1 : (MT >= 2 ? 2 : 4);
    __m512 tot[MT];
    for (int i = 0; i < MT; ++i) tot[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, u += RG_UNIT) {
        for (int l = 0; l < RG_UNIT; l += 64) _mm_prefetch(reinterpret_cast<const char*>(u) + RG_PREFETCH + l, _MM_HINT_T0);
        __m512 acc[MT][C];
        for (int i = 0; i < MT; ++i)
            for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
        const float* xb = xs + b * QK;
        for (int j = 0; j < 4; ++j) {
            const __m512i v = _mm512_loadu_si512(u + 64 + 64 * j);
            for (int t = 0; t < 4; ++t) {
                const __m512 wl = _mm512_cvtepu32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F << (8 * t))));
                const __m512 wh = _mm512_cvtepu32_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)(0xF0u << (8 * t)))));
                for (int i = 0; i < MT; ++i) {
                    __m512& a = acc[i][j % C];
                    a = _mm512_fmadd_ps(wl, _mm512_set1_ps(xb[i * K + 4 * j + t]), a);
                    a = _mm512_fmadd_ps(wh, _mm512_set1_ps(xb[i * K + 16 + 4 * j + t]), a);
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32)));
        for (int i = 0; i < MT; ++i) {
            __m512 a = acc[i][0];
            for (int c = 1; c < C; ++c) a = _mm512_add_ps(a, acc[i][c]);
            tot[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i * nb + b]), _mm512_fmadd_ps(d, a, tot[i]));
        }
    }
    for (int i = 0; i < MT; ++i) {
        __m512 s = tot[i];
        if (bias) s = _mm512_add_ps(s, _mm512_loadu_ps(bias));
        _mm512_storeu_ps(y + i * ldy, s);
    }
#else
    float s[MT][RG_ROWS] = {};
    for (int64_t b = 0; b < nb; ++b, u += RG_UNIT)
        for (int r = 0; r < RG_ROWS; ++r) {
            uint8_t blk[Q4_1_BYTES];
            rg_block(u, r, blk);
            const float d = fp16_to_fp32(load_u16(blk)), m = fp16_to_fp32(load_u16(blk + 2));
            for (int i = 0; i < MT; ++i) {
                const float* xb = xs + i * K + b * QK;
                float t = 0.0f;
                for (int j = 0; j < 16; ++j) t += (float)(blk[4 + j] & 15) * xb[j] + (float)(blk[4 + j] >> 4) * xb[j + 16];
                s[i][r] += d * t + m * sx[i * nb + b];
            }
        }
    for (int i = 0; i < MT; ++i)
        for (int r = 0; r < RG_ROWS; ++r) y[i * ldy + r] = bias ? s[i][r] + bias[r] : s[i][r];
#endif
}

// Calls rg_rows_f32<R> for R = r (1..8).
#define YR_RG_ROWS(r, CALL) \
    switch (r) { case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break; \
                 case 5: CALL(5); break; case 4: CALL(4); break; case 3: CALL(3); break; \
                 case 2: CALL(2); break; default: CALL(1); }

// The most x rows of the float32 form; more take the packed GEMM.
constexpr int64_t RG_MAX_M = 16;

// y[M, N] (+ bias) for M <= RG_MAX_M x rows on the groups that groups(w, row_bytes, rows) hands
// to rows(n0, 16) (YR_RG_ALL_GROUPS / YR_RG_TASK_GROUPS).
template <typename Groups>
void rg_linear_f32(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                   Groups groups) {
    const int64_t nb = K / QK, rb = nb * Q4_1_BYTES;
    static thread_local std::vector<float> buf;
    float* xs = scratch(buf, (size_t)(M * (K + nb) + 1));
    float* sx = xs + M * K;
    for (int64_t m = 0; m < M; ++m) rg_prescale(x + m * K, K, xs + m * K, sx + m * nb);
    groups(w, rb, [&](int64_t n0, int r) {
        if (!rg_whole_group(n0, r)) return;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {   // the group's bytes stay in L1 across the passes
#define YR_CALL(R) rg_rows_f32<R>(xs + m0 * K, sx + m0 * nb, K, w + n0 * rb, nb, bias ? bias + n0 : nullptr, \
                                  y + m0 * N + n0, N)
            YR_RG_ROWS((int)std::min<int64_t>(8, M - m0), YR_CALL)
#undef YR_CALL
        }
    });
}

// The same with x quantized to int8 per block of 32 (compute_dtype='int8'), any M.
template <typename Groups>
void rg_linear_q8(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                  Groups groups) {
    const int64_t nb = K / QK, rb = nb * Q4_1_BYTES;
    const QuantizedRows q = quantize_rows_q8(x, M, K);
    groups(w, rb, [&](int64_t n0, int r) {
        if (!rg_whole_group(n0, r)) return;
        for (int64_t m = 0; m < M; ++m)
            rg_gemv_q8(q.xq + m * K, q.dx + m * nb, q.sxq + m * nb, w + n0 * rb, nb, bias ? bias + n0 : nullptr,
                       y + m * N + n0);
    });
}

// Panel of rows n0 .. n0+nr-1 (n0 a multiple of PR) for library.cpp's packed GEMM.
void rg_pack(const uint8_t* w, int64_t K, int64_t n0, int nr, float* P) {
    const int64_t nb = K / QK, rb = nb * Q4_1_BYTES;
    alignas(64) float tmp[PR][QK];
    for (int j = nr; j < PR; ++j)
        for (int t = 0; t < QK; ++t) tmp[j][t] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        for (int j = 0; j < nr; ++j) {
            const int64_t n = n0 + j;
            rg_dequant_block(w + (n / RG_ROWS) * RG_ROWS * rb + b * RG_UNIT, (int)(n % RG_ROWS), tmp[j]);
        }
        for (int h = 0; h < 2; ++h)
            for (int t0 = 0; t0 < QK; t0 += VL) {
                const float* src[VL];
                for (int l = 0; l < VL; ++l) src[l] = tmp[h * VL + l] + t0;
                transpose_block(src, P + (b * QK + t0) * PR + h * VL, PR);
            }
    }
}

}  // namespace

namespace {
// Runs rows(n0, 16) over the groups of rows [lo, hi) (multiples of 16), the range's first
// RG_PREFETCH bytes asked for up front; the kernels prefetch the rest unit by unit. (library.cpp's
// gemv_range, which asks for a whole group's bytes at each group, measured 0.8x of this.)
template <typename RowsFn>
inline void rg_range(int64_t lo, int64_t hi, const void* w, int64_t rb, RowsFn rows) {
    prefetch_span(w, lo * rb, lo * rb + RG_PREFETCH, hi * rb);
    for (int64_t n0 = lo; n0 + RG_ROWS <= hi; n0 += RG_ROWS) rows(n0, (int)RG_ROWS);
}

// All of N's groups over the OpenMP threads, an equal contiguous slice each.
template <typename RowsFn>
void rg_all_groups(int64_t N, int64_t macs, const void* w, int64_t rb, RowsFn rows) {
    const int64_t groups = N / RG_ROWS;
#pragma omp parallel if (macs >= PAR_MIN_MACS)
    {
#if defined(_OPENMP)
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
        const int64_t nt = 1, t = 0;
#endif
        rg_range(groups * t / nt * RG_ROWS, groups * (t + 1) / nt * RG_ROWS, w, rb, rows);
    }
}
}  // namespace

// Hands out whole 16-row groups: all of N over OpenMP threads, or one task's [lo, hi).
#define YR_RG_ALL_GROUPS [&](const void* wp, int64_t rowb, auto rows) { rg_all_groups(N, M * N * K, wp, rowb, rows); }
#define YR_RG_TASK_GROUPS [&](const void* wp, int64_t rowb, auto rows) { rg_range(lo, hi, wp, rowb, rows); }

extern "C" {

// out[0] = 1 where the kernels above have their vector forms (AVX-512 with VNNI), else 0: the
// model repacks q4_1 weights only there.
void yr_row_groups_native(int64_t* out) {
#if defined(YR_RG_VNNI)
    out[0] = 1;
#else
    out[0] = 0;
#endif
}

// y[M, N] = x[M, K] @ W^T (+ bias), W q4_1r16 [N, K] (N a multiple of 16, K of 32).
void yr_linear_q4_1r16(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                       int64_t K) {
    if (M <= 0 || N <= 0) return;
    N -= N % RG_ROWS;
    if (M > RG_MAX_M) {
        linear_packed(x, bias, y, M, N, K, [&](int64_t n0, int nr, float* P) { rg_pack(w, K, n0, nr, P); });
        return;
    }
    rg_linear_f32(x, w, bias, y, M, N, K, YR_RG_ALL_GROUPS);
}

// The same with x quantized to int8 per block of 32 (compute_dtype='int8').
void yr_linear_q4_1r16_q8(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                          int64_t K) {
    if (M <= 0 || N <= 0) return;
    N -= N % RG_ROWS;
    rg_linear_q8(x, w, bias, y, M, N, K, YR_RG_ALL_GROUPS);
}

// a = {x, w, bias|0, y, M, N, K, stride}; [lo, hi): weight rows, whole groups (M <= 16).
void yr_task_linear_q4_1r16(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t M = std::min<int64_t>(a[4], RG_MAX_M), N = a[5] - a[5] % RG_ROWS, K = a[6];
    hi = std::min(hi, N);
    rg_linear_f32(reinterpret_cast<const float*>(a[0]), reinterpret_cast<const uint8_t*>(a[1]),
                  reinterpret_cast<const float*>(a[2]), reinterpret_cast<float*>(a[3]), M, N, K, YR_RG_TASK_GROUPS);
}

void yr_task_linear_q4_1r16_q8(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t M = a[4], N = a[5] - a[5] % RG_ROWS, K = a[6];
    hi = std::min(hi, N);
    rg_linear_q8(reinterpret_cast<const float*>(a[0]), reinterpret_cast<const uint8_t*>(a[1]),
                 reinterpret_cast<const float*>(a[2]), reinterpret_cast<float*>(a[3]), M, N, K, YR_RG_TASK_GROUPS);
}

// q4_1 storage [N, nb * 20] -> q4_1r16 (ir.ops.to_row_groups is the reference): whole groups of
// rows only, the rest of dst not written; src and dst must not overlap.
void yr_repack_q4_1r16(const uint8_t* src, uint8_t* dst, int64_t N, int64_t nb) {
    if (N <= 0 || nb <= 0) return;
    const int64_t groups = N / RG_ROWS, rb = nb * Q4_1_BYTES;
#pragma omp parallel for schedule(static) if (groups * rb * RG_ROWS >= (1 << 20))
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* u = dst + (g * nb + b) * RG_UNIT;
            for (int r = 0; r < RG_ROWS; ++r) {
                const uint8_t* blk = src + (g * RG_ROWS + r) * rb + b * Q4_1_BYTES;
                std::memcpy(u + 2 * r, blk, 2);
                std::memcpy(u + 32 + 2 * r, blk + 2, 2);
                for (int j = 0; j < 4; ++j) std::memcpy(u + 64 + 64 * j + 4 * r, blk + 4 + 4 * j, 4);
            }
        }
}

// rows [0, R) of a q4_1r16 weight with nb blocks per row -> dst [R, nb * 32] floats; R = nblocks / nb,
// whole groups only (the rest is not written).
void yr_dequant_q4_1r16(const uint8_t* src, float* dst, int64_t nblocks, int64_t nb) {
    if (nb <= 0 || nblocks <= 0) return;
    const int64_t groups = nblocks / nb / RG_ROWS, K = nb * QK;
#pragma omp parallel for schedule(static) if (groups * RG_ROWS * K >= PAR_MIN_ELEMS)
    for (int64_t g = 0; g < groups; ++g)
        for (int r = 0; r < RG_ROWS; ++r)   // row by row: dst written in order
            for (int64_t b = 0; b < nb; ++b)
                rg_dequant_block(src + (g * nb + b) * RG_UNIT, r, dst + (g * RG_ROWS + r) * K + b * QK);
}

}  // extern "C"
