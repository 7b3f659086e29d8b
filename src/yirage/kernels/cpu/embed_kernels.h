// Kernels of the embedding engine's encoder (BERT family, engines/embed.py): float32 GEMM on
// weights packed once at load, bfloat16 GEMM with float32 sums on weights packed once
// (AVX512-BF16 vdpbf16ps; FMAs on the bf16 halves with AVX-512F alone; scalar), W8A8 int8 GEMM
// (per-token activations quantized at run time, per-channel int8 weights, integer dot
// products: AVX-512 VNNI vpdpbusd, AVX-VNNI vpdpbusd on ymm, AVX2 vpmaddubsw, scalar), and
// bidirectional attention over sentences packed back to back (varlen).
//
// Included by library_encoder.cpp (it uses library_core.h's vf/VL vector helpers, vexp and
// report()). Same rules as library.cpp: no allocation of caller memory (only thread_local
// scratch), no torch/Python. Every entry point checks its run-time sizes against the buffer
// lengths the caller passes and, on a bad one, writes status[4] = {1, value, lo, hi} (the
// value was outside [lo, hi)), touches no buffer and returns; the Python wrappers
// (backends/cpu/embed.py) raise the exception.
//
// Packed layouts (panel = 32 output columns, the last one zero-padded):
//   float32: P[p][k][32]        = W[p*32 + j, k]                      (W [N, K] row-major)
//   bf16:    P[p][kk][32][2]    = W[p*32 + j, 2*kk + r]               (W [N, K] bf16; K padded
//            to even)
//   int8:    P[p][t][32][4]     = Wt[g*G + (t % qg)*4 + r, p*32 + j]  (Wt [K, N]; quad t of
//            group g = t / qg; qg = ceil(G/4) quads per group of G activation features, the
//            tail of a group zero-padded), comp[g][n] = 128 * sum_{k in g} Wt[k, n] (int32;
//            the u8 offset of the VNNI path)
// GEMM loop order follows Goto & van de Geijn 2008 ("Anatomy of high-performance matrix
// multiplication"): a kc x 32 weight panel stays in cache while micro-tiles of MR x rows
// stream over it; the micro-tile keeps MR x 32 accumulators in registers (outer products,
// x broadcast from memory).

namespace {

// Blocking (the -D overrides are for tuning runs only).
#ifndef YR_EMB_KC
#define YR_EMB_KC 384
#endif
#ifndef YR_EMB_MC
#define YR_EMB_MC 192
#endif
#ifndef YR_EMB_TASKS
#define YR_EMB_TASKS 16
#endif
#ifndef YR_EMB_ATT_RB   // attention: query rows per register tile (x 2 vectors of keys / features)
#if defined(YR_AVX512)
#define YR_EMB_ATT_RB 12   // 24 of 32 zmm (1.3-1.6x faster than 4 rows for sentences of 20+ tokens)
#else
#define YR_EMB_ATT_RB 6    // 12 of 16 ymm (AVX2: 4 rows ran 1.4x slower at 128 tokens; NEON: 12 of 32)
#endif
#endif
#ifndef YR_EMB_MR512
// 11 rows, not 12: with 12 the tile's row pointers outgrow the general registers and GCC keeps
// three in vector registers, moving them back every k step (vmovq, on the FMA port 0); 11
// leaves one such move. C++ harness, 2 threads, Intel Xeon 6/207: 1.00-1.13x on BERT's and
// GPT-2's shapes at 128 and 1024 rows (1024 x 3072 x 768: 269-284 -> 298 GFLOP/s), 10 rows
// slower than 11.
#define YR_EMB_MR512 11
#endif
constexpr int64_t EMB_NR = 32;          // output columns per packed panel (every ISA)
constexpr int64_t EMB_KC = YR_EMB_KC;   // float32 GEMM: k-block (a 384 x 32 panel is 48 KiB)
constexpr int64_t EMB_MC = YR_EMB_MC;   // rows of x per cache block

#if defined(YR_AVX512)
constexpr int EMB_MR = YR_EMB_MR512;    // 11 x 2 vectors = 22 accumulators of 32 zmm
#elif defined(YR_AVX2)
// 6 rows x 2 vectors = 12 accumulators, 2 vectors of B and the broadcast: 15 of 16 ymm, the
// 32-column panel in two 16-column halves. 3 rows x 4 vectors had no register left for B: g++
// folded B's loads into every FMA, 15 loads per 12 FMAs (m1024 x 1536 x 384, 2 threads, AMD EPYC
// Zen 5 at YIRAGE_ISA=avx2: 184 GFLOP/s, oneDNN 232)
constexpr int EMB_MR = 6;
#elif defined(YR_NEON)
constexpr int EMB_MR = 6;           // 6 x 4 vectors = 24 accumulators of 32 q registers (two halves)
#else
constexpr int EMB_MR = 4;
#endif
// Rows per cache block of the float32 GEMM: a multiple of EMB_MR, so that only the GEMM's last
// tile is partial. With 11-row tiles, 220 rows (20 tiles) against EMB_MC's 192 (17 tiles and
// a 5-row one per block): C++ harness, 2 threads, Intel Xeon 6/207, 197 x 3072 x 768 (ViT's
// 197 tokens, one block instead of 192 + 5 rows) 264 -> 289-302 GFLOP/s, 1024 x 3072 x 768
// 286 -> 303-315, 1576 x 768 x 3072 307 -> 316-321; 176, 198, 264 and 352 rows measured
// between the two.
#ifndef YR_EMB_MC_F32
#if defined(YR_AVX512)
#define YR_EMB_MC_F32 (20 * YR_EMB_MR512)
#else
#define YR_EMB_MC_F32 YR_EMB_MC
#endif
#endif
constexpr int64_t EMB_MC_F32 = YR_EMB_MC_F32;
constexpr int EMB_NV = (int)(EMB_NR / VL);  // vectors per panel row
// vectors of a panel row per register tile: the whole row with AVX-512 (2 zmm), a 16-column half
// with AVX2 (2 ymm) and NEON (4 q), so that B's vectors of a k step stay in registers
#if defined(YR_AVX2) || defined(YR_NEON)
constexpr int EMB_NVT = (int)(16 / VL);
#else
constexpr int EMB_NVT = EMB_NV;
#endif
static_assert(EMB_NV % EMB_NVT == 0, "a register tile is a whole number of panel-row vectors");

// y[i, 0:nr] (+)= x[i, 0:kc] . B[0:kc, 0:32] for i < MR. acc starts from y (accumulate), the
// bias (if given) or zero; nr < 32 (last panel) goes through a local tile. pf, npf: npf <= kc
// cache lines from pf to prefetch into L2, one per k step (a share of the next weight block,
// see emb_gemm_f32_to).
template <int MR>
void emb_f32_tile(const float* x, int64_t ldx, const float* B, int64_t kc, float* y, int64_t ldy,
                  const float* bias, bool accumulate, int nr, const char* pf = nullptr, int64_t npf = 0) {
    alignas(64) float tmp[MR][EMB_NR];
    float* yt = y;
    int64_t ldt = ldy;
    if (nr < EMB_NR) {
        for (int i = 0; i < MR; ++i)
            for (int j = 0; j < EMB_NR; ++j)
                tmp[i][j] = (accumulate && j < nr) ? y[i * ldy + j] : 0.0f;
        yt = &tmp[0][0];
        ldt = EMB_NR;
    }
    // the panel's columns EMB_NVT vectors at a time (one pass with AVX-512); the prefetches of
    // the next block go with the first pass
    for (int v0 = 0; v0 < EMB_NV; v0 += EMB_NVT) {
        vf acc[MR][EMB_NVT];
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 32
            for (int v = 0; v < EMB_NVT; ++v)
                acc[i][v] = accumulate ? vload(yt + i * ldt + (v0 + v) * VL)
                                       : (bias ? vload(bias + (v0 + v) * VL) : vzero());
        for (int64_t k = 0; k < kc; ++k) {
#if (defined(YR_AVX512) || defined(YR_AVX2)) && !defined(YR_EMB_NO_PREFETCH)
            if (v0 == 0 && k < npf) _mm_prefetch(pf + k * 64, _MM_HINT_T1);
#endif
            vf b[EMB_NVT];
#pragma GCC unroll 32
            for (int v = 0; v < EMB_NVT; ++v) b[v] = vload(B + k * EMB_NR + (v0 + v) * VL);
#pragma GCC unroll 16
            for (int i = 0; i < MR; ++i) {
                const vf a = vbroadcast(x + i * ldx + k);
#pragma GCC unroll 32
                for (int v = 0; v < EMB_NVT; ++v) acc[i][v] = vfma(a, b[v], acc[i][v]);
            }
        }
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 32
            for (int v = 0; v < EMB_NVT; ++v) vstore(yt + i * ldt + (v0 + v) * VL, acc[i][v]);
    }
    if (nr < EMB_NR)
        for (int i = 0; i < MR; ++i)
            for (int j = 0; j < nr; ++j) y[i * ldy + j] = tmp[i][j];
}

template <int MR>
void emb_f32_rows(int mr, const float* x, int64_t ldx, const float* B, int64_t kc, float* y, int64_t ldy,
                  const float* bias, bool accumulate, int nr, const char* pf = nullptr, int64_t npf = 0) {
    if constexpr (MR > 0) {
        if (mr == MR) emb_f32_tile<MR>(x, ldx, B, kc, y, ldy, bias, accumulate, nr, pf, npf);
        else emb_f32_rows<MR - 1>(mr, x, ldx, B, kc, y, ldy, bias, accumulate, nr, pf, npf);
    }
}

// ---- bfloat16 -------------------------------------------------------------------------
// y = float32(bf16(sum_k bf16(x[m, k]) * w[n, k])) + bias[n]: x rounded to bf16 (round to
// nearest even, as torch's x.to(torch.bfloat16)) into a scratch A [M][Kp] (Kp = K rounded up
// to even, the pad zero), products summed in float32, the sum rounded to bf16 (what oneDNN's
// bf16 linear returns), then the bias added in float32. One 32-bit lane of A holds the pair
// (x[m, 2kk], x[m, 2kk+1]); the packed weight holds the same pairs per output column
// (P[p][kk][32][2] = W[p*32 + j, 2kk + r]), so that one vdpbf16ps adds both products of a pair
// to 16 columns. Without AVX512-BF16 the products are FMAs on the halves shifted to float32,
// the odd element of a pair first, as the SDM defines vdpbf16ps (so the sums are the same up
// to its flushing of denormals); the scalar path (also the AVX2 build's) does the same per column.
#ifndef YR_EMB_KC16
#define YR_EMB_KC16 1536
#endif
#ifndef YR_EMB_MR16
#define YR_EMB_MR16 12
#endif
constexpr int64_t EMB_KC16 = YR_EMB_KC16;   // bf16 GEMM: k-block, even (a 1536 x 32 panel is 96 KiB, in L2)
#if defined(YR_AVX512)
constexpr int EMB_MR16 = YR_EMB_MR16;       // 12 x 2 vectors = 24 accumulators of 32 zmm
#else
constexpr int EMB_MR16 = 4;
#endif

// bf16(f) in the high half of the float32 bits u, round to nearest even; NaN -> 0x7fc0 (c10's
// round_to_nearest_even).
inline uint32_t emb_bf16_rne(uint32_t u) {
    return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}
inline float emb_bits_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float emb_bf16_round(float f) {   // float32(bf16(f))
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return emb_bits_float(emb_bf16_rne(u));
}
#if defined(YR_AVX512)
inline __m512i emb_bf16_rne(__m512 v) {   // emb_bf16_rne of 16 lanes
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                       _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0x7fc00000), r);
}
#endif

// a[0:Kp] = bf16 bits of x[0:K], then zeros. vcvtne2ps2bf16 (AVX512-BF16) rounds the same but
// flushes denormals to zero and keeps NaN payloads, which changes no product of vdpbf16ps
// (it reads denormals as zero, and a NaN is a NaN); 5% faster than the integer rounding on
// M = 2048, K = 1536, where x's conversion takes ~7% of the GEMM's time.
inline void emb_bf16_row(const float* x, int64_t K, uint16_t* a, int64_t Kp) {
    int64_t k = 0;
#if defined(YR_AVX512) && defined(__AVX512BF16__)
    for (; k + 32 <= K; k += 32)
        _mm512_storeu_si512(a + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k)));
#endif
#if defined(YR_AVX512)
    for (; k + 16 <= K; k += 16)
        _mm256_storeu_si256((__m256i*)(a + k),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(emb_bf16_rne(_mm512_loadu_ps(x + k)), 16)));
#endif
    for (; k < K; ++k) {
        uint32_t u;
        std::memcpy(&u, x + k, 4);
        a[k] = (uint16_t)(emb_bf16_rne(u) >> 16);
    }
    for (; k < Kp; ++k) a[k] = 0;
}

// y[i, 0:nr] = A[i, 0:2kp] . B[0:2kp, 0:32] for i < MR (B: kp pairs of the packed layout),
// added to y when accumulate (an earlier k-block's float32 sums). On the last k-block the sums
// are rounded to bf16 and the bias (if given) added; nr < 32 (last panel) goes through a
// local tile, its bias added on the way out.
#if defined(YR_AVX512)
template <int MR>
void emb_bf16_tile(const uint16_t* a, int64_t lda, const uint16_t* B, int64_t kp, float* y, int64_t ldy,
                   const float* bias, bool accumulate, bool last, int nr, const char* pf, int64_t npf) {
    alignas(64) float tmp[MR][EMB_NR];
    float* yt = y;
    int64_t ldt = ldy;
    if (nr < EMB_NR) {
        for (int i = 0; i < MR; ++i)
            for (int j = 0; j < EMB_NR; ++j) tmp[i][j] = (accumulate && j < nr) ? y[i * ldy + j] : 0.0f;
        yt = &tmp[0][0];
        ldt = EMB_NR;
    }
    __m512 acc[MR][2];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
        for (int v = 0; v < 2; ++v)
            acc[i][v] = accumulate ? _mm512_loadu_ps(yt + i * ldt + 16 * v) : _mm512_setzero_ps();
    for (int64_t kk = 0; kk < kp; ++kk) {
#if !defined(YR_EMB_NO_PREFETCH)
        if (kk < npf) _mm_prefetch(pf + kk * 64, _MM_HINT_T1);   // see EmbPrefetch
#endif
        const __m512i b0 = _mm512_loadu_si512(B + kk * 64), b1 = _mm512_loadu_si512(B + kk * 64 + 32);
#if defined(__AVX512BF16__)
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
            const __m512i x2 = _mm512_set1_epi32(*(const int32_t*)(a + i * lda + 2 * kk));
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], (__m512bh)x2, (__m512bh)b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], (__m512bh)x2, (__m512bh)b1);
        }
#else
        const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
        const auto even = [](__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); };
        const auto odd = [&](__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, hi)); };
        const __m512 b0e = even(b0), b0o = odd(b0), b1e = even(b1), b1o = odd(b1);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
            const __m512i x2 = _mm512_set1_epi32(*(const int32_t*)(a + i * lda + 2 * kk));
            const __m512 xe = even(x2), xo = odd(x2);
            acc[i][0] = _mm512_fmadd_ps(xe, b0e, _mm512_fmadd_ps(xo, b0o, acc[i][0]));
            acc[i][1] = _mm512_fmadd_ps(xe, b1e, _mm512_fmadd_ps(xo, b1o, acc[i][1]));
        }
#endif
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
        for (int v = 0; v < 2; ++v) {
            __m512 r = acc[i][v];
            if (last) {
                r = _mm512_castsi512_ps(emb_bf16_rne(r));
                if (bias && nr == EMB_NR) r = _mm512_add_ps(r, _mm512_loadu_ps(bias + 16 * v));
            }
            _mm512_storeu_ps(yt + i * ldt + 16 * v, r);
        }
    if (nr < EMB_NR)
        for (int i = 0; i < MR; ++i)
            for (int j = 0; j < nr; ++j) y[i * ldy + j] = tmp[i][j] + (last && bias ? bias[j] : 0.0f);
}
#else
template <int MR>
void emb_bf16_tile(const uint16_t* a, int64_t lda, const uint16_t* B, int64_t kp, float* y, int64_t ldy,
                   const float* bias, bool accumulate, bool last, int nr, const char*, int64_t) {
    float acc[MR][EMB_NR], be[EMB_NR], bo[EMB_NR];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < EMB_NR; ++j) acc[i][j] = (accumulate && j < nr) ? y[i * ldy + j] : 0.0f;
    for (int64_t kk = 0; kk < kp; ++kk) {
        for (int j = 0; j < EMB_NR; ++j) {
            be[j] = emb_bits_float((uint32_t)B[kk * 64 + 2 * j] << 16);
            bo[j] = emb_bits_float((uint32_t)B[kk * 64 + 2 * j + 1] << 16);
        }
        for (int i = 0; i < MR; ++i) {
            const float xe = emb_bits_float((uint32_t)a[i * lda + 2 * kk] << 16);
            const float xo = emb_bits_float((uint32_t)a[i * lda + 2 * kk + 1] << 16);
            for (int j = 0; j < EMB_NR; ++j) {   // exact products: an FMA rounds the same
                acc[i][j] += xo * bo[j];
                acc[i][j] += xe * be[j];
            }
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < nr; ++j)
            y[i * ldy + j] = last ? emb_bf16_round(acc[i][j]) + (bias ? bias[j] : 0.0f) : acc[i][j];
}
#endif

template <int MR>
void emb_bf16_rows(int mr, const uint16_t* a, int64_t lda, const uint16_t* B, int64_t kp, float* y, int64_t ldy,
                   const float* bias, bool accumulate, bool last, int nr, const char* pf, int64_t npf) {
    if constexpr (MR > 0) {
        if (mr == MR) emb_bf16_tile<MR>(a, lda, B, kp, y, ldy, bias, accumulate, last, nr, pf, npf);
        else emb_bf16_rows<MR - 1>(mr, a, lda, B, kp, y, ldy, bias, accumulate, last, nr, pf, npf);
    }
}

// Scratch of the calling thread for A (bf16 rows of x), n elements.
inline uint16_t* emb_bf16_scratch(int64_t n) {
    static thread_local std::vector<uint16_t> buf;
    if ((int64_t)buf.size() < n) buf.resize((size_t)n);
    return buf.data();
}

// Work items of a GEMM: (block of mc rows) x (group of panels), so that 2+ threads have work
// also when M is small.
struct EmbTiles {
    int64_t mblocks, pgroups, per_group, npanels, mc;
};
// Threads a parallel region here gets (yr_threads.h).
inline int emb_threads() { return yr::max_threads(); }
// Panels are split into the fewest power-of-two groups that give YR_EMB_TASKS tasks per
// thread, of ceil(npanels / pgroups) panels each (an even split into more, smaller tasks
// measured up to 13% slower for the float32 GEMM with M <= 128; 2, 4 or 8 tasks per thread
// instead of 16 no faster for the bf16 GEMM on the MiniLM shapes).
// mc: rows per block, a multiple of the GEMM's register tile rows (one partial tile per GEMM,
// not one per block).
inline EmbTiles emb_tiles(int64_t M, int64_t N, int64_t mc = EMB_MC) {
    EmbTiles t;
    t.mc = mc;
    t.npanels = (N + EMB_NR - 1) / EMB_NR;
    t.mblocks = (M + mc - 1) / mc;
    const int threads = emb_threads();
    t.pgroups = 1;
    while (t.mblocks * t.pgroups < YR_EMB_TASKS * threads && t.pgroups * 2 <= t.npanels) t.pgroups *= 2;
    t.per_group = (t.npanels + t.pgroups - 1) / t.pgroups;
    return t;
}

// Software prefetch of the packed weights (float32 and bfloat16 GEMMs). A task runs its weight
// blocks (kc x 32 of one panel) in order: panels p0 .. p1 - 1 of one k-block, then of the next;
// the first tile of a block needs its 128 bytes per k step (per 24 FMAs) at once, more than a
// core gets from DRAM, while the block's other tiles read it from cache. So the tiles of each
// block prefetch the next block into L2, its lines shared out among them (one per k step),
// and the last block of a task prefetches the first block of the task this thread likely runs
// next (tasks go out in order, one per thread in turn; a wrong guess costs only bandwidth).
// Measured (C++ harness, 40 weights streamed from DRAM, 2 threads, Intel Xeon 6/207): 1.2x at
// M = 128 (221 -> 270 GFLOP/s on 512 x 512, 228 -> 276 on 3072 x 768), 1.1x at M = 1024.

// Threads of the enclosing parallel region (1 outside one).
inline int64_t emb_team() { return yr::team_size(); }

// The first panel of the task after the one at (m0, p0) that this thread likely runs, or -1.
inline int64_t emb_guess_next_p0(const EmbTiles& t, int64_t m0, int64_t p0) {
    const int64_t next = (m0 / t.mc) * t.pgroups + p0 / t.per_group + emb_team();
    const int64_t np0 = (next % t.pgroups) * t.per_group;   // past the panels for an empty group
    return next < t.mblocks * t.pgroups && np0 < t.npanels ? np0 : -1;
}

// The lines of the block after (p, k0) for a task of panels [p0, p1) and k-blocks of kc_max
// over K (k0 counts units of K: floats, or bfloat16 elements); base(panel, k0): a block's
// address; lines_per_unit: the 64-byte lines one unit of K takes in a panel.
struct EmbPrefetch {
    const char* next = nullptr;
    int64_t lines = 0, share = 0;   // the block's lines, and each tile's share of them

    template <typename Base>
    EmbPrefetch(int64_t p, int64_t k0, int64_t p0, int64_t p1, int64_t K, int64_t kc_max, int64_t guess_p0,
                int64_t tiles, int64_t lines_per_unit, const Base& base) {
        int64_t np = p + 1 < p1 ? p + 1 : p0, nk0 = p + 1 < p1 ? k0 : k0 + kc_max;
        if (nk0 >= K) {
            if (guess_p0 < 0) return;
            np = guess_p0, nk0 = 0;
        }
        next = reinterpret_cast<const char*>(base(np, nk0));
        lines = std::min(kc_max, K - nk0) * lines_per_unit;
        share = (lines + tiles - 1) / tiles;
    }
    // Tile i's lines: from *pf, *n of them (at most cap: one per k step of the tile).
    void tile(int64_t i, int64_t cap, const char** pf, int64_t* n) const {
        const int64_t lo = std::min(lines, i * share);
        *pf = next + lo * 64;
        *n = std::min({cap, share, lines - lo});
    }
};

// Row epilogue of a GEMM: a fused row program (codegen/cpp.py's NAME_task entry) run on
// rows [lo, hi) of the output once every task of that row block has finished, while the rows
// are still in cache (the residual + LayerNorm or the GELU after a linear layer).
typedef void (*EmbEpilogue)(const int64_t* args, int64_t lo, int64_t hi);

// The row epilogue of a GEMM's tasks (tiling t over M rows). Block mb's rows go to epi once
// every task of the block has finished, in pieces (two per thread of the team) that the task
// finishing the block and the threads out of tasks claim one at a time. Before the pieces, the
// task finishing a block ran its whole epilogue while the other threads waited at the region's
// barrier: with one block (M <= mc, e.g. BERT at batch 1) the GEMMs took 4.6 ms longer per
// forward with their GELU and residual + LayerNorm epilogues fused than those cost (2.1 ms) as
// their own parallel kernels. Built outside the parallel region (its counters are the calling
// thread's scratch); without epi it does nothing.
struct EmbRowEpilogue {
    EmbEpilogue epi;
    const int64_t* args;
    const EmbTiles& t;
    int64_t M;
    int64_t* done = nullptr;      // [mblocks] tasks finished per block
    int64_t* claimed = nullptr;   // [mblocks] pieces handed out per block

    EmbRowEpilogue(EmbEpilogue epi_, const int64_t* args_, const EmbTiles& t_, int64_t M_)
        : epi(epi_), args(args_), t(t_), M(M_) {
        if (!epi) return;
        static thread_local std::vector<int64_t> counters;
        counters.assign((size_t)(2 * t.mblocks), 0);
        done = counters.data();
        claimed = done + t.mblocks;
    }
    // Claims and runs pieces of block mb until none is left (its tasks must all be done).
    void run_pieces(int64_t mb) const {
        const int64_t m0 = mb * t.mc, m1 = std::min(M, m0 + t.mc), pieces = 2 * emb_team();
        const int64_t step = (m1 - m0 + pieces - 1) / pieces;
        for (int64_t j; (j = __atomic_fetch_add(claimed + mb, 1, __ATOMIC_RELAXED)) < pieces;) {
            const int64_t lo = m0 + j * step, hi = std::min(m1, lo + step);
            if (lo < hi) epi(args, lo, hi);
        }
    }
    // A task of block mb finished; the last one starts on the block's pieces.
    void task_done(int64_t mb) const {
        if (epi && __atomic_add_fetch(done + mb, 1, __ATOMIC_ACQ_REL) == t.pgroups) run_pieces(mb);
    }
    // A thread out of tasks: takes the pieces left, waiting for blocks whose last task still runs.
    void help() const {
        if (!epi) return;
        const int64_t pieces = 2 * emb_team();
        for (int64_t mb = 0; mb < t.mblocks; ++mb) {
            if (__atomic_load_n(claimed + mb, __ATOMIC_RELAXED) >= pieces) continue;
            while (__atomic_load_n(done + mb, __ATOMIC_ACQUIRE) < t.pgroups) {
#if defined(__x86_64__)
                __builtin_ia32_pause();
#endif
            }
            run_pieces(mb);
        }
    }
};

// Runs body(m0, m1, p0, p1) for every task of the tiling t (rows [m0, m1) x panels [p0, p1))
// as a dynamic loop without a barrier (yr::for_dynamic_nowait: shared by the team of the
// enclosing parallel region, or run by the calling thread alone), and the row epilogue ep on
// each block of rows once it is done.
template <typename Body>
void emb_for_tasks(const EmbTiles& t, int64_t M, const EmbRowEpilogue& ep, const Body& body) {
    yr::for_dynamic_nowait(t.mblocks * t.pgroups, [&](int64_t task) {
        const int64_t mb = task / t.pgroups, pg = task % t.pgroups;
        const int64_t m0 = mb * t.mc, m1 = std::min(M, m0 + t.mc);
        const int64_t p0 = pg * t.per_group, p1 = std::min(t.npanels, p0 + t.per_group);
        body(m0, m1, p0, p1);
        ep.task_done(mb);
    });
    ep.help();
}

// a * b * ..., saturated at INT64_MAX (size checks stay correct for absurd sizes).
inline int64_t emb_mul(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}
template <typename... T>
inline int64_t emb_mul(int64_t a, int64_t b, T... rest) { return emb_mul(emb_mul(a, b), rest...); }

// a + b + ..., saturated at INT64_MAX (for non-negative terms: a reach past any buffer stays so).
inline int64_t emb_add(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_add_overflow(a, b, &r) ? INT64_MAX : r;
}
template <typename... T>
inline int64_t emb_add(int64_t a, int64_t b, T... rest) { return emb_add(emb_add(a, b), rest...); }

// status = {1, value, lo, hi} and false unless lo <= value < hi.
inline bool emb_check(int64_t* status, int64_t value, int64_t lo, int64_t hi) {
    if (value >= lo && value < hi) return true;
    report(status, value, lo, hi);
    return false;
}

// ---- int8 -----------------------------------------------------------------------------
// Activations are quantized per token and per group of G consecutive features (G = K when
// the op has no group size): scale s[m, g] = max|x| / 127 over the group (1 for a zero group),
// q = round-half-even(x / s) clamped to [-127, 127] (ir.ops.quantize_rows_int8, same float
// ops). The VNNI path stores u8 q + 128 (vpdpbusd multiplies unsigned x bytes by signed w
// bytes) and starts each group's int32 sums at -comp[g][n] = -128 * sum_{k in g} w[k, n];
// so does the AVX-VNNI path (the same instruction on ymm); the other paths store s8 q.
// y[m, n] = (sum_g acc[m, g, n] * s[m, g]) * ws[n] + bias[n].
#if defined(__AVX512VNNI__) && defined(YR_AVX512)
#define YR_EMB_VNNI 1
#ifndef YR_EMB_MR8
#define YR_EMB_MR8 6
#endif
constexpr int EMB_MR8 = YR_EMB_MR8;    // 6 rows x 2 zmm: 12 int32 + 12 float accumulators
constexpr int EMB_ZP = 128;
#elif defined(__AVXVNNI__) && defined(YR_AVX2)
#define YR_EMB_AVXVNNI 1                // AVX-VNNI: VEX vpdpbusd on ymm (no AVX-512)
constexpr int EMB_MR8 = 4;
constexpr int EMB_ZP = 128;
#else
constexpr int EMB_MR8 = 4;
constexpr int EMB_ZP = 0;
#endif

// Group layout of a W8A8 call: ng groups of qg 4-byte quads each (the last quads of a
// whole-row group are zero padding), Kp = ng * qg * 4 bytes per quantized row.
struct EmbGroups {
    int64_t G, ng, qg, Kp;
};
inline EmbGroups emb_groups(int64_t K, int64_t group) {
    EmbGroups r;
    r.G = group > 0 ? group : K;
    r.ng = K / r.G;
    r.qg = (r.G + 3) / 4;
    r.Kp = r.ng * r.qg * 4;
    return r;
}

// One row x[0:K] (K = ng * G) quantized into q[0:Kp] (u8 or s8, see above) and s[0:ng].
inline void emb_quantize_row(const float* x, const EmbGroups& gr, uint8_t* q, float* scale) {
    for (int64_t g = 0; g < gr.ng; ++g) {
        const float* xg = x + g * gr.G;
        uint8_t* qg = q + g * gr.qg * 4;
        float amax = 0.0f;
        int64_t k = 0;
#if defined(YR_AVX512)
        __m512 vm = _mm512_setzero_ps();
        for (; k + 16 <= gr.G; k += 16) vm = _mm512_max_ps(vm, _mm512_abs_ps(_mm512_loadu_ps(xg + k)));
        amax = _mm512_reduce_max_ps(vm);
#endif
        for (; k < gr.G; ++k) amax = std::max(amax, std::fabs(xg[k]));
        float s = amax / 127.0f;
        if (!(s > 0.0f)) s = 1.0f;
        scale[g] = s;
        k = 0;
#if defined(YR_AVX512)
        const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
        const __m512i voff = _mm512_set1_epi32(EMB_ZP);
        for (; k + 16 <= gr.G; k += 16) {
            __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xg + k), vs),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm512_min_ps(hi, _mm512_max_ps(lo, r));
            _mm_storeu_si128((__m128i*)(qg + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(r), voff)));
        }
#endif
        for (; k < gr.G; ++k) {
            const float r = std::min(127.0f, std::max(-127.0f, std::nearbyint(xg[k] / s)));
            qg[k] = (uint8_t)((int)r + EMB_ZP);   // s8 q as its two's complement byte when EMB_ZP == 0
        }
        for (; k < gr.qg * 4; ++k) qg[k] = (uint8_t)EMB_ZP;
    }
}

// f[i][0:32] = sum_g (int32 dot products of group g) * sx[i * ng + g] for i < MR: one tile
// of 32 output columns over packed quads B (group g starts at quad g * qg).
#if defined(YR_EMB_VNNI)
template <int MR>
__attribute__((noinline)) void emb_s8_core(const uint8_t* q, int64_t ldq, const float* sx, const EmbGroups& gr,
                                           const uint8_t* B, const int32_t* comp, int64_t ldc, float* f) {
    __m512 f0[MR], f1[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) f0[i] = f1[i] = _mm512_setzero_ps();
    const __m512i z = _mm512_setzero_si512();
    for (int64_t g = 0; g < gr.ng; ++g) {
        const __m512i c0 = _mm512_sub_epi32(z, _mm512_loadu_si512(comp + g * ldc));      // starts at -comp
        const __m512i c1 = _mm512_sub_epi32(z, _mm512_loadu_si512(comp + g * ldc + 16));
        __m512i a0[MR], a1[MR];
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) { a0[i] = c0; a1[i] = c1; }
        const uint8_t* Bg = B + g * gr.qg * 128;
        const uint8_t* qg = q + g * gr.qg * 4;
        for (int64_t t = 0; t < gr.qg; ++t) {
            const __m512i b0 = _mm512_loadu_si512(Bg + t * 128), b1 = _mm512_loadu_si512(Bg + t * 128 + 64);
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
                const __m512i a = _mm512_set1_epi32(*(const int32_t*)(qg + i * ldq + t * 4));
                a0[i] = _mm512_dpbusd_epi32(a0[i], a, b0);
                a1[i] = _mm512_dpbusd_epi32(a1[i], a, b1);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const __m512 s = _mm512_set1_ps(sx[i * gr.ng + g]);
            f0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[i]), s, f0[i]);
            f1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[i]), s, f1[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
        _mm512_storeu_ps(f + i * EMB_NR, f0[i]);
        _mm512_storeu_ps(f + i * EMB_NR + 16, f1[i]);
    }
}
#elif defined(YR_EMB_AVXVNNI)
// Two rows at a time: 2 x 4 ymm int32 accumulators over the 32 columns of a tile, the
// float sums of the groups in f (kept in L1).
template <int MR>
void emb_s8_core(const uint8_t* q, int64_t ldq, const float* sx, const EmbGroups& gr, const uint8_t* B,
                 const int32_t* comp, int64_t ldc, float* f) {
    for (int i = 0; i < MR * (int)EMB_NR; ++i) f[i] = 0.0f;
    const __m256i z = _mm256_setzero_si256();
    for (int64_t g = 0; g < gr.ng; ++g) {
        __m256i c[4];
        for (int v = 0; v < 4; ++v) c[v] = _mm256_sub_epi32(z, _mm256_loadu_si256((const __m256i*)(comp + g * ldc + 8 * v)));
        const uint8_t* Bg = B + g * gr.qg * 128;
        const uint8_t* qg = q + g * gr.qg * 4;
        for (int i0 = 0; i0 < MR; i0 += 2) {
            constexpr int R = 2;
            const int rows = std::min(R, MR - i0);
            __m256i a[R][4];
            for (int r = 0; r < R; ++r)
                for (int v = 0; v < 4; ++v) a[r][v] = c[v];
            for (int64_t t = 0; t < gr.qg; ++t) {
                const uint8_t* bt = Bg + t * 128;
                __m256i b[4];
                for (int v = 0; v < 4; ++v) b[v] = _mm256_loadu_si256((const __m256i*)(bt + 32 * v));
                for (int r = 0; r < R; ++r) {
                    if (r >= rows) break;
                    const __m256i x = _mm256_set1_epi32(*(const int32_t*)(qg + (i0 + r) * ldq + t * 4));
                    for (int v = 0; v < 4; ++v) a[r][v] = _mm256_dpbusd_avx_epi32(a[r][v], x, b[v]);
                }
            }
            for (int r = 0; r < rows; ++r) {
                const __m256 s = _mm256_set1_ps(sx[(i0 + r) * gr.ng + g]);
                float* fr = f + (i0 + r) * EMB_NR;
                for (int v = 0; v < 4; ++v)
                    _mm256_storeu_ps(fr + 8 * v, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][v]), s, _mm256_loadu_ps(fr + 8 * v)));
            }
        }
    }
}
#else
template <int MR>
void emb_s8_core(const uint8_t* q, int64_t ldq, const float* sx, const EmbGroups& gr, const uint8_t* B,
                 const int32_t* comp, int64_t ldc, float* f) {
    (void)comp;
    (void)ldc;
    alignas(32) int32_t acc[MR][EMB_NR];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < EMB_NR; ++j) f[i * EMB_NR + j] = 0.0f;
    for (int64_t g = 0; g < gr.ng; ++g) {
        const uint8_t* Bg = B + g * gr.qg * 128;
        const uint8_t* qg = q + g * gr.qg * 4;
#if defined(__AVX2__)
        // |a| (u8) times sign(a) * w (s8): pairs sum to at most 2 * 127 * 127 < 32767, so
        // vpmaddubsw never saturates; vpmaddwd by ones widens the pairs to int32.
        const __m256i ones = _mm256_set1_epi16(1);
        for (int i = 0; i < MR; ++i) {
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t t = 0; t < gr.qg; ++t) {
                const __m256i a = _mm256_set1_epi32(*(const int32_t*)(qg + i * ldq + t * 4));
                const __m256i au = _mm256_abs_epi8(a);
                const uint8_t* bt = Bg + t * 128;
                const auto dp = [&](int v) {
                    const __m256i w = _mm256_loadu_si256((const __m256i*)(bt + 32 * v));
                    return _mm256_madd_epi16(_mm256_maddubs_epi16(au, _mm256_sign_epi8(w, a)), ones);
                };
                a0 = _mm256_add_epi32(a0, dp(0));
                a1 = _mm256_add_epi32(a1, dp(1));
                a2 = _mm256_add_epi32(a2, dp(2));
                a3 = _mm256_add_epi32(a3, dp(3));
            }
            _mm256_store_si256((__m256i*)(acc[i]), a0);
            _mm256_store_si256((__m256i*)(acc[i] + 8), a1);
            _mm256_store_si256((__m256i*)(acc[i] + 16), a2);
            _mm256_store_si256((__m256i*)(acc[i] + 24), a3);
        }
#else
        for (int i = 0; i < MR; ++i)
            for (int j = 0; j < EMB_NR; ++j) acc[i][j] = 0;
        for (int64_t t = 0; t < gr.qg; ++t)
            for (int i = 0; i < MR; ++i) {
                const int8_t* a = (const int8_t*)(qg + i * ldq + t * 4);
                for (int j = 0; j < EMB_NR; ++j) {
                    const int8_t* w = (const int8_t*)(Bg + t * 128 + j * 4);
                    acc[i][j] += a[0] * w[0] + a[1] * w[1] + a[2] * w[2] + a[3] * w[3];
                }
            }
#endif
        for (int i = 0; i < MR; ++i) {
            const float s = sx[i * gr.ng + g];
            for (int j = 0; j < EMB_NR; ++j) f[i * EMB_NR + j] += (float)acc[i][j] * s;
        }
    }
}
#endif

// y[i, n0:n0+nr] = f[i] * ws[n] + bias[n] for the rows i < MR of one tile.
template <int MR>
void emb_s8_tile(const uint8_t* q, int64_t ldq, const float* sx, const EmbGroups& gr, const uint8_t* B,
                 const int32_t* comp, int64_t ldc, const float* ws, const float* bias, float* y, int64_t ldy, int nr) {
    alignas(64) float f[MR * EMB_NR];
    emb_s8_core<MR>(q, ldq, sx, gr, B, comp, ldc, f);
    for (int i = 0; i < MR; ++i) {
        float* yi = y + i * ldy;
        const float* fi = f + i * EMB_NR;
        if (bias)
            for (int j = 0; j < nr; ++j) yi[j] = fi[j] * ws[j] + bias[j];
        else
            for (int j = 0; j < nr; ++j) yi[j] = fi[j] * ws[j];
    }
}

template <int MR>
void emb_s8_rows(int mr, const uint8_t* q, int64_t ldq, const float* sx, const EmbGroups& gr, const uint8_t* B,
                 const int32_t* comp, int64_t ldc, const float* ws, const float* bias, float* y, int64_t ldy, int nr) {
    if constexpr (MR > 0) {
        if (mr == MR) emb_s8_tile<MR>(q, ldq, sx, gr, B, comp, ldc, ws, bias, y, ldy, nr);
        else emb_s8_rows<MR - 1>(mr, q, ldq, sx, gr, B, comp, ldc, ws, bias, y, ldy, nr);
    }
}

// ---- attention over packed sentences (vmax, vhmax: library.cpp's vector helpers) ---------------

// One head of attention: O[i] = softmax(scale * Q[i] . K^T + bias[i]) V for the queries i < Tq
// over the keys j < Tk, the rows of Q, K, V, O at strides ldq, ldk, ldv, ldo floats (head dim
// Dh for all four). bias[i][j]: mask[(qoff + i) * mask_ld + j] when mask is given (mask_ld 0:
// one row for every query), and -inf for j > qoff + i when causal (torch's is_causal, aligned
// top left); qoff is the first query's row in the whole head (a chunk of queries). A query whose
// every score is -inf gets 0 (what torch's fused kernel's safe softmax gives).
struct AttnHead {
    const float *q, *k, *v;
    float* o;
    int64_t ldq, ldk, ldv, ldo, Tq, Tk, Dh;
    float scale;
    const float* mask;
    int64_t mask_ld, qoff;
    bool causal;
};

// Adds query row i's bias into its scores s[0:Tk]; returns their max (-inf: every key masked).
inline float attn_bias_row(const AttnHead& a, int64_t i, float* s) {
    if (a.mask) {
        const float* m = a.mask + (a.qoff + i) * a.mask_ld;
        for (int64_t j = 0; j < a.Tk; ++j) s[j] += m[j];
    }
    if (a.causal)
        for (int64_t j = std::max<int64_t>(a.qoff + i + 1, 0); j < a.Tk; ++j) s[j] = -INFINITY;
    // in vectors: GCC leaves the scalar max unvectorized, a chain of dependent maxss, about 4
    // cycles a key (masked or causal heads only; 8 x 8 heads of 128 queries and keys with
    // T5's bias mask, 2 threads, Intel Xeon 6/207: 2.55-2.80 -> 1.57-1.61 ms)
    const float ninf = -INFINITY;
    vf m = vbroadcast(&ninf);
    int64_t j = 0;
    for (; j + VL <= a.Tk; j += VL) m = vmax(m, vload(s + j));
    float mx = vhmax(m);
    for (; j < a.Tk; ++j) mx = std::max(mx, s[j]);
    return mx;
}

// Any Dh: K is transposed into scratch kt[Dh][Lp] so that the scores of one query are FMAs
// over VL keys at a time.
void attention_head_any(const AttnHead& a) {
    static thread_local std::vector<float> kbuf, sbuf, obuf;
    const int64_t L = a.Tk, Dh = a.Dh;
    const int64_t Lp = (L + VL - 1) / VL * VL;
    float* kt = scratch(kbuf, (size_t)(Dh * Lp));
    float* sc = scratch(sbuf, (size_t)Lp);
    float* o = scratch(obuf, (size_t)Dh);
    for (int64_t j = 0; j < L; ++j) {
        const float* kj = a.k + j * a.ldk;
        for (int64_t d = 0; d < Dh; ++d) kt[d * Lp + j] = kj[d];
    }
    for (int64_t d = 0; d < Dh; ++d)
        for (int64_t j = L; j < Lp; ++j) kt[d * Lp + j] = 0.0f;
    const vf vsc = vbroadcast(&a.scale);
    for (int64_t i = 0; i < a.Tq; ++i) {
        const float* qi = a.q + i * a.ldq;
        for (int64_t j0 = 0; j0 < Lp; j0 += VL) {
            vf acc = vzero();
            for (int64_t d = 0; d < Dh; ++d) acc = vfma(vbroadcast(qi + d), vload(kt + d * Lp + j0), acc);
            vstore(sc + j0, vmul(acc, vsc));
        }
        const float mx = attn_bias_row(a, i, sc);
        float* oi = a.o + i * a.ldo;
        if (mx == -INFINITY) {
            std::fill(oi, oi + Dh, 0.0f);
            continue;
        }
        const float inv = 1.0f / exp_shifted_sum(sc, L, mx);
        for (int64_t d = 0; d < Dh; ++d) o[d] = 0.0f;
        for (int64_t j = 0; j < L; ++j) axpy(sc[j], a.v + j * a.ldv, o, Dh);
        for (int64_t d = 0; d < Dh; ++d) oi[d] = o[d] * inv;
    }
}

// s[0:L] = exp(s - max(s)) in place, where s[L:Lp] hold -inf (Lp a multiple of VL; they
// come out 0 and are never read); returns the sum over j < L (to float precision).
inline float emb_softmax_row(float* s, int64_t Lp) {
    const float ninf = -INFINITY;
    vf m = vbroadcast(&ninf);
    for (int64_t j = 0; j < Lp; j += VL) m = vmax(m, vload(s + j));
    const float mx = vhmax(m);
    const float neg = -mx;
    const vf vneg = vbroadcast(&neg);
    vf sum = vzero();
    for (int64_t j = 0; j < Lp; j += VL) {
        const vf e = vexp(vadd(vload(s + j), vneg));
        vstore(s + j, e);
        sum = vadd(sum, e);
    }
    return vsum(sum);
}

// The same for Dh a multiple of 2 * VL, register-blocked: K^T by VL x VL transposes, then
// S = Q K^T and O = P V in tiles of RB query rows x 2 vectors.
void attention_head_blocked(const AttnHead& a) {
    static thread_local std::vector<float> kbuf, sbuf;
    static const float zeros[VL] = {};
    constexpr int RB = YR_EMB_ATT_RB;
    const int64_t L = a.Tk, Dh = a.Dh;
    const int64_t Lp = (L + 2 * VL - 1) / (2 * VL) * (2 * VL);
    const int64_t Lr = (a.Tq + RB - 1) / RB * RB;
    float* kt = scratch(kbuf, (size_t)(Dh * Lp));
    float* S = scratch(sbuf, (size_t)(Lr * Lp + Lp));
    float* pad = S + Lr * Lp;                 // 0 for real keys, -inf for the padding columns
    for (int64_t j = 0; j < Lp; ++j) pad[j] = j < L ? 0.0f : -INFINITY;
    for (int64_t j0 = 0; j0 < Lp; j0 += VL)
        for (int64_t d0 = 0; d0 < Dh; d0 += VL) {
            const float* src[VL];
            for (int l = 0; l < VL; ++l) src[l] = j0 + l < L ? a.k + (j0 + l) * a.ldk + d0 : zeros;
            transpose_block(src, kt + d0 * Lp + j0, Lp);
        }
    // causal: the keys a block of RB queries sees end at its last query's position; the
    // columns past that (whole 2 * VL tiles) are neither computed nor read
    const auto keys_end = [&](int64_t i0) {
        return a.causal ? std::min(Lp, (a.qoff + i0 + RB + 2 * VL - 1) / (2 * VL) * (2 * VL)) : Lp;
    };
    const vf vsc = vbroadcast(&a.scale);
    for (int64_t i0 = 0; i0 < a.Tq; i0 += RB) {
        const float* q[RB];
        for (int r = 0; r < RB; ++r) q[r] = a.q + std::min(i0 + r, a.Tq - 1) * a.ldq;
        for (int64_t j0 = 0, jend = keys_end(i0); j0 < jend; j0 += 2 * VL) {
            vf a0[RB], a1[RB];
#pragma GCC unroll 16
            for (int r = 0; r < RB; ++r) a0[r] = a1[r] = vzero();
            for (int64_t d = 0; d < Dh; ++d) {
                const vf b0 = vload(kt + d * Lp + j0), b1 = vload(kt + d * Lp + j0 + VL);
#pragma GCC unroll 16
                for (int r = 0; r < RB; ++r) {
                    const vf x = vbroadcast(q[r] + d);
                    a0[r] = vfma(x, b0, a0[r]);
                    a1[r] = vfma(x, b1, a1[r]);
                }
            }
#pragma GCC unroll 16
            for (int r = 0; r < RB; ++r) {
                vstore(S + (i0 + r) * Lp + j0, vfma(a0[r], vsc, vload(pad + j0)));
                vstore(S + (i0 + r) * Lp + j0 + VL, vfma(a1[r], vsc, vload(pad + j0 + VL)));
            }
        }
    }
    const bool biased = a.mask || a.causal;
    float inv[RB];
    for (int64_t i0 = 0; i0 < a.Tq; i0 += RB) {
        const int rows = (int)std::min<int64_t>(RB, a.Tq - i0);
        const int64_t jend = keys_end(i0), Lb = std::min(L, jend);
        for (int r = 0; r < RB; ++r) {
            float* si = S + (i0 + r) * Lp;
            // (causal: the bias row sets -inf past the query's position, uncomputed columns too)
            if (r >= rows || (biased && attn_bias_row(a, i0 + r, si) == -INFINITY)) {
                std::fill(si, si + L, 0.0f);   // no query, or every key masked: 0
                inv[r] = 0.0f;
                continue;
            }
            inv[r] = 1.0f / emb_softmax_row(si, jend);
        }
        for (int64_t d0 = 0; d0 < Dh; d0 += 2 * VL) {
            vf a0[RB], a1[RB];
#pragma GCC unroll 16
            for (int r = 0; r < RB; ++r) a0[r] = a1[r] = vzero();
            for (int64_t j = 0; j < Lb; ++j) {
                const float* vj = a.v + j * a.ldv + d0;
                const vf b0 = vload(vj), b1 = vload(vj + VL);
#pragma GCC unroll 16
                for (int r = 0; r < RB; ++r) {
                    const vf p = vbroadcast(S + (i0 + r) * Lp + j);
                    a0[r] = vfma(p, b0, a0[r]);
                    a1[r] = vfma(p, b1, a1[r]);
                }
            }
            // every r < RB unrolled (a runtime bound made GCC keep a0/a1 in memory, storing all
            // 2 * RB accumulators to the stack at every key of the loop above)
#pragma GCC unroll 16
            for (int r = 0; r < RB; ++r) {
                if (r >= rows) break;
                float* o = a.o + (i0 + r) * a.ldo + d0;
                const vf vi = vbroadcast(&inv[r]);
                vstore(o, vmul(a0[r], vi));
                vstore(o + VL, vmul(a1[r], vi));
            }
        }
    }
}

void attention_head(const AttnHead& a) {
    if (a.Dh % (2 * VL) == 0) attention_head_blocked(a);
    else attention_head_any(a);
}

// out rows of sentence [s, s+L), head h, of the packed qkv [T, 3 * H * Dh]: softmax(q k^T * scale) v.
void emb_attention_head(const float* qkv, float* out, int64_t s, int64_t L, int64_t h, int64_t H,
                        int64_t Dh, float scale) {
    const int64_t ld = 3 * H * Dh, HD = H * Dh;
    const float* base = qkv + s * ld + h * Dh;
    attention_head({base, base + HD, base + 2 * HD, out + s * HD + h * Dh, ld, ld, ld, HD, L, L, Dh, scale,
                    nullptr, 0, 0, false});
}

}  // namespace

extern "C" {

// Packs W [N, K] float32 (row-major: out x in features) into P (see the layout above);
// P holds ceil(N / 32) * 32 * K floats (p_len). status as in the header comment.
void yr_emb_pack_f32(const float* w, float* P, int64_t N, int64_t K, int64_t p_len, int64_t* status) {
    if (!emb_check(status, N, 1, INT64_MAX) || !emb_check(status, K, 1, INT64_MAX)) return;
    const int64_t np = (N + EMB_NR - 1) / EMB_NR;
    if (!emb_check(status, emb_mul(np, EMB_NR, K), 0, p_len + 1)) return;
    // Each panel's k-blocks of 64 are transposed through L1 (64 x 32 floats written, 32 rows of
    // 64 contiguous floats read), panels in parallel: packing is a one-time copy, but of every
    // weight of the model (BERT-base: 340 MB), and a model's first call waits for it.
    constexpr int64_t KB = 64;
    yr::parallel_for(np, emb_mul(np, EMB_NR, K) >= (int64_t)1 << 18, [&](int64_t p) {
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t k1 = std::min(K, k0 + KB);
            for (int64_t j = 0; j < EMB_NR; ++j) {
                const int64_t n = p * EMB_NR + j;
                float* dst = P + (p * K) * EMB_NR + j;
                if (n < N) {
                    const float* src = w + n * K;
                    for (int64_t k = k0; k < k1; ++k) dst[k * EMB_NR] = src[k];
                } else {
                    for (int64_t k = k0; k < k1; ++k) dst[k * EMB_NR] = 0.0f;
                }
            }
        }
    });
}

}  // extern "C"

namespace {
// Where a panel's columns go: column n0's place in row 0 (yp), the row stride (ld) and the
// panel's real columns (nr <= EMB_NR).
struct EmbPanelOut {
    float* yp;
    int64_t ld;
    int nr;
};

// The float32 GEMM of yr_emb_gemm_f32, yr_emb_gemm_f32_planes and yr_emb_gemm_f32_parts: y = x
// @ W^T + bias over N packed columns, panel n0's output placed by out(n0) (EmbPanelOut). Sizes
// checked by the caller.
template <typename Out>
void emb_gemm_f32_to(const float* x, const float* P, const float* bias, int64_t M, int64_t N, int64_t K,
                     const Out& out, EmbEpilogue epi, const int64_t* epi_args) {
    const EmbTiles t = emb_tiles(M, N, EMB_MC_F32);
    const EmbRowEpilogue ep(epi, epi_args, t, M);
    yr::parallel(emb_mul(M, N, K) >= PAR_MIN_MACS, [&] {
        emb_for_tasks(t, M, ep, [&](int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
            const int64_t tiles = (m1 - m0 + EMB_MR - 1) / EMB_MR, guess_p0 = emb_guess_next_p0(t, m0, p0);
            const auto base = [&](int64_t q, int64_t q0) { return P + (q * K + q0) * EMB_NR; };
            for (int64_t k0 = 0; k0 < K; k0 += EMB_KC) {
                const int64_t kc = std::min(EMB_KC, K - k0);
                for (int64_t p = p0; p < p1; ++p) {
                    const int64_t n0 = p * EMB_NR;
                    const EmbPanelOut o = out(n0);
                    const float* B = P + (p * K + k0) * EMB_NR;
                    const float* bp = (bias && k0 == 0 && o.nr == EMB_NR) ? bias + n0 : nullptr;
                    const EmbPrefetch pf(p, k0, p0, p1, K, EMB_KC, guess_p0, tiles, 2, base);   // 2 lines per k
                    for (int64_t m = m0, i = 0; m < m1; m += EMB_MR, ++i) {
                        const int mr = (int)std::min<int64_t>(EMB_MR, m1 - m);
                        const char* pfp;
                        int64_t npf;
                        pf.tile(i, kc, &pfp, &npf);
                        emb_f32_rows<EMB_MR>(mr, x + m * K + k0, K, B, kc, o.yp + m * o.ld, o.ld, bp, k0 > 0, o.nr,
                                             pfp, npf);
                    }
                    if (bias && k0 == 0 && o.nr < EMB_NR)   // partial panel: bias added here
                        for (int64_t m = m0; m < m1; ++m)
                            for (int j = 0; j < o.nr; ++j) o.yp[m * o.ld + j] += bias[n0 + j];
                }
            }
        });
    });
}

// Output column n of row m at y[(n / Np) * M * Np + m * Np + n % Np] (Np == N: the plain [M, N]
// layout; Np a multiple of the 32-column panel otherwise, so no panel straddles two planes).
void emb_gemm_f32(const float* x, const float* P, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                  int64_t Np, EmbEpilogue epi, const int64_t* epi_args) {
    emb_gemm_f32_to(x, P, bias, M, N, K, [&](int64_t n0) {
        const int64_t plane = n0 / Np;
        return EmbPanelOut{y + plane * M * Np + (n0 - plane * Np), Np, (int)std::min<int64_t>(EMB_NR, N - n0)};
    }, epi, epi_args);
}
}  // namespace

extern "C" {

// y[M, N] = x[M, K] @ W^T + bias (bias may be null), W packed by yr_emb_pack_f32 (p_len
// floats). Float32 FMAs, k in order within each 384-wide block. status: sizes outside their
// buffers (x_len, y_len elements) or a packed length that does not fit N, K. epi (may be
// null): a row epilogue run with epi_args on each block of finished rows (EmbEpilogue).
void yr_emb_gemm_f32(const float* x, const float* P, const float* bias, float* y, int64_t M, int64_t N,
                     int64_t K, int64_t x_len, int64_t p_len, int64_t y_len, EmbEpilogue epi,
                     const int64_t* epi_args, int64_t* status) {
    if (!emb_check(status, M, 0, INT64_MAX) || !emb_check(status, N, 1, INT64_MAX) ||
        !emb_check(status, K, 1, INT64_MAX)) return;
    const int64_t npanels = (N + EMB_NR - 1) / EMB_NR;
    if (!emb_check(status, emb_mul(M, K), 0, x_len + 1) || !emb_check(status, emb_mul(M, N), 0, y_len + 1) ||
        !emb_check(status, emb_mul(npanels, EMB_NR, K), 0, p_len + 1)) return;
    if (M == 0) return;
    emb_gemm_f32(x, P, bias, y, M, N, K, N, epi, epi_args);
}

// The GEMM of `planes` linear layers of the same x, their weights packed as one [planes * Np,
// K] (yr_emb_pack_f32 of the stacked W_i), each layer's output in a plane of its own: y
// [planes, M, Np] with y[i] = x @ W_i^T + bias[i * Np : (i + 1) * Np] (bias may be null).
// Np must be a multiple of 32 (a panel never straddles two planes). status: as in
// yr_emb_gemm_f32, or an Np that is not a positive multiple of 32.
void yr_emb_gemm_f32_planes(const float* x, const float* P, const float* bias, float* y, int64_t M,
                            int64_t planes, int64_t Np, int64_t K, int64_t x_len, int64_t p_len, int64_t y_len,
                            int64_t* status) {
    if (!emb_check(status, M, 0, INT64_MAX) || !emb_check(status, planes, 1, INT64_MAX) ||
        !emb_check(status, Np, 1, INT64_MAX) || !emb_check(status, Np % EMB_NR, 0, 1) ||
        !emb_check(status, K, 1, INT64_MAX)) return;
    const int64_t N = emb_mul(planes, Np);
    if (!emb_check(status, N, 1, INT64_MAX / EMB_NR) || !emb_check(status, emb_mul(M, K), 0, x_len + 1) ||
        !emb_check(status, emb_mul(M, N), 0, y_len + 1) || !emb_check(status, emb_mul(N, K), 0, p_len + 1)) return;
    if (M == 0) return;
    emb_gemm_f32(x, P, bias, y, M, N, K, Np, nullptr, nullptr);
}

// The GEMM of `parts` layers of the same x with different widths (parallel 1x1 convolutions'
// merged GEMM, backends/cpu/conv.py): widths[i] output columns each, every part's weight packed
// by yr_emb_pack_f32 into ceil(widths[i] / 32) panels and the packs concatenated (P, p_len
// floats), bias null or the parts' biases each zero-padded to its panels (the same column
// index as P). Part i's output is y[M, widths[i]] at element offset M * sum(widths[:i]) of y
// (its own contiguous rows, ld widths[i]). epi, epi_args: a row epilogue as in
// yr_emb_gemm_f32 (yr_conv_epilogue_parts runs one per part). status: as in yr_emb_gemm_f32,
// or a part count outside [1, 64] or a width < 1.
void yr_emb_gemm_f32_parts(const float* x, const float* P, const float* bias, float* y, int64_t M, int64_t K,
                           int64_t parts, const int64_t* widths, int64_t x_len, int64_t p_len, int64_t y_len,
                           EmbEpilogue epi, const int64_t* epi_args, int64_t* status) {
    constexpr int64_t MAX_PARTS = 64;
    if (!emb_check(status, M, 0, INT64_MAX) || !emb_check(status, K, 1, INT64_MAX) ||
        !emb_check(status, parts, 1, MAX_PARTS + 1)) return;
    int64_t first_panel[MAX_PARTS + 1], y_off[MAX_PARTS + 1];   // per part: its first panel, its output offset
    first_panel[0] = y_off[0] = 0;
    for (int64_t i = 0; i < parts; ++i) {
        if (!emb_check(status, widths[i], 1, INT64_MAX / EMB_NR)) return;
        const int64_t rows = emb_mul(M, widths[i]);   // part i's output elements, saturated
        if (!emb_check(status, rows, 0, INT64_MAX - y_off[i])) return;
        first_panel[i + 1] = first_panel[i] + (widths[i] + EMB_NR - 1) / EMB_NR;   // < 64 * INT64_MAX / 1024
        if (!emb_check(status, first_panel[i + 1], 1, INT64_MAX / EMB_NR)) return;   // N below fits
        y_off[i + 1] = y_off[i] + rows;
    }
    const int64_t N = first_panel[parts] * EMB_NR;
    if (!emb_check(status, emb_mul(M, K), 0, x_len + 1) || !emb_check(status, y_off[parts], 0, y_len + 1) ||
        !emb_check(status, emb_mul(N, K), 0, p_len + 1)) return;
    if (M == 0) return;
    emb_gemm_f32_to(x, P, bias, M, N, K, [&](int64_t n0) {
        const int64_t p = n0 / EMB_NR;
        int64_t i = 0;
        while (first_panel[i + 1] <= p) ++i;   // parts are few: a scan
        const int64_t col = n0 - first_panel[i] * EMB_NR;
        return EmbPanelOut{y + y_off[i] + col, widths[i], (int)std::min<int64_t>(EMB_NR, widths[i] - col)};
    }, epi, epi_args);
}

// Packs W [N, K] bfloat16 (uint16 bits, row-major: out x in features) into P for
// yr_emb_gemm_bf16: ceil(N / 32) panels of Kp / 2 pairs x 32 columns x 2 (Kp = K rounded up to
// even; the pad column and the pad k are zero), p_len uint16 elements. status as above.
void yr_emb_pack_bf16(const uint16_t* w, uint16_t* P, int64_t N, int64_t K, int64_t p_len, int64_t* status) {
    if (!emb_check(status, N, 1, INT64_MAX) || !emb_check(status, K, 1, INT64_MAX)) return;
    const int64_t np = (N + EMB_NR - 1) / EMB_NR, Kp = K + (K & 1);
    if (!emb_check(status, emb_mul(np, EMB_NR, Kp), 0, p_len + 1)) return;
    for (int64_t p = 0; p < np; ++p)
        for (int64_t k = 0; k < Kp; ++k)
            for (int64_t j = 0; j < EMB_NR; ++j) {
                const int64_t n = p * EMB_NR + j;
                P[((p * Kp + (k & ~int64_t(1))) * EMB_NR) + 2 * j + (k & 1)] = (n < N && k < K) ? w[n * K + k] : 0;
            }
}

// y[M, N] = float32(bf16(bf16(x[M, K]) @ W^T)) + bias (bias may be null; the layout and the
// rounding in the bfloat16 section above), W packed by yr_emb_pack_bf16 (p_len uint16
// elements). x is rounded into the calling thread's scratch first (M * Kp uint16), then the
// tiles of yr_emb_gemm_f32 (k-blocks of 1536, 12 x 32 register tiles with AVX-512) run on the
// pairs. status: sizes outside their buffers (x_len, y_len elements) or a packed length that
// does not fit N, K. epi, epi_args: as in yr_emb_gemm_f32.
void yr_emb_gemm_bf16(const float* x, const uint16_t* P, const float* bias, float* y, int64_t M, int64_t N,
                      int64_t K, int64_t x_len, int64_t p_len, int64_t y_len, EmbEpilogue epi,
                      const int64_t* epi_args, int64_t* status) {
    if (!emb_check(status, M, 0, INT64_MAX) || !emb_check(status, N, 1, INT64_MAX) ||
        !emb_check(status, K, 1, INT64_MAX)) return;
    const EmbTiles t = emb_tiles(M, N);
    const int64_t Kp = K + (K & 1);
    if (!emb_check(status, emb_mul(M, K), 0, x_len + 1) || !emb_check(status, emb_mul(M, N), 0, y_len + 1) ||
        !emb_check(status, emb_mul(t.npanels, EMB_NR, Kp), 0, p_len + 1)) return;
    if (M == 0) return;
    uint16_t* A = emb_bf16_scratch(M * Kp);
    const EmbRowEpilogue ep(epi, epi_args, t, M);
    yr::parallel(emb_mul(M, N, K) >= PAR_MIN_MACS, [&] {
        yr::for_static(M, [&](int64_t m) { emb_bf16_row(x + m * K, K, A + m * Kp, Kp); });
        emb_for_tasks(t, M, ep, [&](int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
            const int64_t tiles = (m1 - m0 + EMB_MR16 - 1) / EMB_MR16, guess_p0 = emb_guess_next_p0(t, m0, p0);
            const auto base = [&](int64_t q, int64_t q0) { return P + (q * Kp + q0) * EMB_NR; };
            for (int64_t k0 = 0; k0 < Kp; k0 += EMB_KC16) {
                const int64_t kc = std::min(EMB_KC16, Kp - k0);
                const bool last = k0 + kc == Kp;
                for (int64_t p = p0; p < p1; ++p) {
                    const int64_t n0 = p * EMB_NR;
                    const int nr = (int)std::min<int64_t>(EMB_NR, N - n0);
                    const uint16_t* B = P + (p * Kp + k0) * EMB_NR;
                    const EmbPrefetch pf(p, k0, p0, p1, Kp, EMB_KC16, guess_p0, tiles, 1, base);   // 1 line per k
                    for (int64_t m = m0, i = 0; m < m1; m += EMB_MR16, ++i) {
                        const int mr = (int)std::min<int64_t>(EMB_MR16, m1 - m);
                        const char* pfp;
                        int64_t npf;
                        pf.tile(i, kc / 2, &pfp, &npf);
                        emb_bf16_rows<EMB_MR16>(mr, A + m * Kp + k0, Kp, B, kc / 2, y + m * N + n0, N,
                                                bias ? bias + n0 : nullptr, k0 > 0, last, nr, pfp, npf);
                    }
                }
            }
        });
    });
}

// Packs Wt [K, N] int8 (in x out features) for activation groups of `group` features (0: the
// whole row; else K % group == 0 and group % 4 == 0) into P (ceil(N/32) panels of Kp/4 quads
// x 32 columns x 4 bytes, p_len bytes; Kp as in EmbGroups) and comp [ng, ceil(N/32) * 32]
// int32 = 128 * column sums over each group (comp_len).
void yr_emb_pack_s8(const int8_t* wt, uint8_t* P, int32_t* comp, int64_t K, int64_t N, int64_t group,
                    int64_t p_len, int64_t comp_len, int64_t* status) {
    if (!emb_check(status, N, 1, INT64_MAX) || !emb_check(status, K, 1, INT64_MAX) ||
        !emb_check(status, group, 0, K + 1)) return;
    if (group > 0 && (K % group != 0 || group % 4 != 0)) { report(status, group, 0, 0); return; }
    const EmbGroups gr = emb_groups(K, group);
    const int64_t np = (N + EMB_NR - 1) / EMB_NR, kq = gr.Kp / 4, Np = np * EMB_NR;
    if (!emb_check(status, emb_mul(Np, gr.Kp), 0, p_len + 1) || !emb_check(status, emb_mul(gr.ng, Np), 0, comp_len + 1))
        return;
    for (int64_t p = 0; p < np; ++p)
        for (int64_t t = 0; t < kq; ++t)
            for (int64_t j = 0; j < EMB_NR; ++j)
                for (int64_t r = 0; r < 4; ++r) {
                    const int64_t n = p * EMB_NR + j, g = t / gr.qg, kk = (t % gr.qg) * 4 + r, k = g * gr.G + kk;
                    const bool real = n < N && kk < gr.G && k < K;
                    P[((p * kq + t) * EMB_NR + j) * 4 + r] = real ? (uint8_t)wt[k * N + n] : 0;
                }
    for (int64_t g = 0; g < gr.ng; ++g)
        for (int64_t n = 0; n < Np; ++n) {
            int32_t s = 0;
            if (n < N)
                for (int64_t k = g * gr.G; k < std::min(K, (g + 1) * gr.G); ++k) s += wt[k * N + n];
            comp[g * Np + n] = 128 * s;
        }
}

// W8A8 linear (ir.ops.linear_w8a8_reference): x [M, K] float32 quantized per row and group
// (`group` features, 0: whole row) into qbuf (M * Kp bytes, q_len) and sbuf (M * ng floats,
// s_len), then y [M, N] = sum over groups of the int32 dot products with the weight packed by
// yr_emb_pack_s8 for the same group (P, comp) times the x scale, times ws[n], plus bias[n]
// (bias may be null). Exact integer sums within a group. epi, epi_args: as in yr_emb_gemm_f32.
void yr_emb_linear_w8a8(const float* x, uint8_t* qbuf, float* sbuf, const uint8_t* P, const int32_t* comp,
                        const float* ws, const float* bias, float* y, int64_t M, int64_t N, int64_t K, int64_t group,
                        int64_t x_len, int64_t q_len, int64_t s_len, int64_t p_len, int64_t comp_len, int64_t y_len,
                        EmbEpilogue epi, const int64_t* epi_args, int64_t* status) {
    if (!emb_check(status, M, 0, INT64_MAX) || !emb_check(status, N, 1, INT64_MAX) ||
        !emb_check(status, K, 1, INT64_MAX) || !emb_check(status, group, 0, K + 1)) return;
    if (group > 0 && (K % group != 0 || group % 4 != 0)) { report(status, group, 0, 0); return; }
    const EmbGroups gr = emb_groups(K, group);
    // int32 sums of one group: |sum| <= 255 * 127 * 4 * qg, below 2^31 for groups of < 66000
    if (!emb_check(status, gr.qg * 4, 4, 65537)) return;
    const EmbTiles t = emb_tiles(M, N);
    const int64_t Np = t.npanels * EMB_NR;
    if (!emb_check(status, emb_mul(M, K), 0, x_len + 1) || !emb_check(status, emb_mul(M, gr.Kp), 0, q_len + 1) ||
        !emb_check(status, emb_mul(M, gr.ng), 0, s_len + 1) || !emb_check(status, emb_mul(Np, gr.Kp), 0, p_len + 1) ||
        !emb_check(status, emb_mul(gr.ng, Np), 0, comp_len + 1) || !emb_check(status, emb_mul(M, N), 0, y_len + 1))
        return;
    if (M == 0) return;
    const int64_t kq = gr.Kp / 4;
    const EmbRowEpilogue ep(epi, epi_args, t, M);
    yr::parallel(emb_mul(M, N, K) >= PAR_MIN_MACS, [&] {
        yr::for_static(M, [&](int64_t m) { emb_quantize_row(x + m * K, gr, qbuf + m * gr.Kp, sbuf + m * gr.ng); });
        emb_for_tasks(t, M, ep, [&](int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
            for (int64_t p = p0; p < p1; ++p) {
                const int64_t n0 = p * EMB_NR;
                const int nr = (int)std::min<int64_t>(EMB_NR, N - n0);
                const uint8_t* B = P + p * kq * 4 * EMB_NR;
                for (int64_t m = m0; m < m1; m += EMB_MR8) {
                    const int mr = (int)std::min<int64_t>(EMB_MR8, m1 - m);
                    emb_s8_rows<EMB_MR8>(mr, qbuf + m * gr.Kp, gr.Kp, sbuf + m * gr.ng, gr, B, comp + n0, Np,
                                         ws + n0, bias ? bias + n0 : nullptr, y + m * N + n0, N, nr);
                }
            }
        });
    });
}

// Bidirectional attention over B sentences packed back to back in qkv [T, 3 * H * Dh]
// (q, k, v along the last dim; sentence b is rows offsets[b] .. offsets[b+1]-1): out [T, H * Dh]
// = softmax(q k^T * scale) v per sentence and head, rows past offsets[B] zero
// (ir.ops.attention_varlen_reference). offsets must start at 0, never decrease and end at
// most at T: else status = {1, offset, previous offset, T + 1} and nothing is written.
void yr_emb_attention_varlen(const float* qkv, const int64_t* offsets, float* out, int64_t T, int64_t B,
                             int64_t H, int64_t Dh, float scale, int64_t qkv_len, int64_t out_len,
                             int64_t* status) {
    if (!emb_check(status, T, 0, INT64_MAX) || !emb_check(status, B, 0, INT64_MAX) ||
        !emb_check(status, H, 1, INT64_MAX) || !emb_check(status, Dh, 1, INT64_MAX) ||
        !emb_check(status, emb_mul(T, 3, H, Dh), 0, qkv_len + 1) || !emb_check(status, emb_mul(T, H, Dh), 0, out_len + 1))
        return;
    int64_t prev = 0;
    for (int64_t b = 0; b <= B; ++b) {
        const int64_t o = offsets[b];
        if (o < prev || o > T || (b == 0 && o != 0)) { report(status, o, prev, T + 1); return; }
        prev = o;
    }
    const int64_t HD = H * Dh;
    std::fill(out + offsets[B] * HD, out + T * HD, 0.0f);
    double work = 0.0;   // multiply-adds, roughly
    int64_t sentences = 0;   // non-empty ones: a plan's unused sentences are empty
    for (int64_t b = 0; b < B; ++b) {
        const int64_t L = offsets[b + 1] - offsets[b];
        work += (double)L * L;
        sentences += L > 0;
    }
    // A task is one sentence and a group of its heads, so one core reads a sentence's qkv rows
    // (contiguous) instead of two cores taking turns on its heads (attention ~5% faster in an
    // encode here). Heads are split into groups only when there are too few sentences for
    // every thread.
    const int threads = emb_threads();
    const int64_t groups = sentences >= 4 * threads ? 1
        : std::min<int64_t>(H, (4 * threads + sentences - 1) / std::max<int64_t>(sentences, 1));
    yr::parallel_for_dynamic(B * groups, work * HD >= (double)PAR_MIN_MACS, [&](int64_t task) {
        const int64_t b = task / groups, g = task % groups;
        const int64_t s = offsets[b], L = offsets[b + 1] - s;
        for (int64_t h = g * H / groups; h < (g + 1) * H / groups && L > 0; ++h)
            emb_attention_head(qkv, out, s, L, h, H, Dh, scale);
    });
}

// Scaled dot-product attention (the IR's sdpa; torch's F.scaled_dot_product_attention):
// out [B, Hq, Tq, Dh] = softmax(scale * q k^T + mask (+ causal -inf above the diagonal)) v for
// float32 q [B, Hq, Tq, Dh] and k, v [B, Hkv, Tk, Dh], query head h reading key/value head
// h / (Hq / Hkv) (GQA). Each of q, k, v, out is strided over its first three dims (a head
// dim row is contiguous): a [B, T, H, Dh] buffer read as [B, H, T, Dh] needs no copy.
// geo (geo_len >= 22 values): {B, Hq, Hkv, Tq, Tk, Dh, causal, mask_sb, mask_sh, mask_si,
// q_sb, q_sh, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st, o_sb, o_sh, o_st}: the mask (may be
// null) is additive float32, mask[b*sb + h*sh + i*si + j] (a stride 0 broadcasts that dim;
// rows contiguous over Tk). A query whose every key is masked gets 0. Causal queries read
// only the keys up to their chunk's last one (top-left aligned, as torch's is_causal).
// status: a size outside [1, ...), Hq not a multiple of Hkv, a negative stride, or a buffer
// shorter than its strides reach (q_len, kv_len for each of k and v, mask_len, out_len
// elements); then nothing is written. Tasks: a head and a chunk of at most 256 queries.
void yr_sdpa_f32(const float* q, const float* k, const float* v, const float* mask, float* out, const int64_t* geo,
                 int64_t geo_len, float scale, int64_t q_len, int64_t kv_len, int64_t mask_len, int64_t out_len,
                 int64_t* status) {
    if (!emb_check(status, geo_len, 22, INT64_MAX)) return;
    const int64_t B = geo[0], Hq = geo[1], Hkv = geo[2], Tq = geo[3], Tk = geo[4], Dh = geo[5];
    const bool causal = geo[6] != 0;
    const int64_t sb = geo[7], sh = geo[8], si = geo[9];
    const int64_t* qs = geo + 10;   // {sb, sh, st} of q, k, v, out
    const int64_t* ks = geo + 13;
    const int64_t* vs = geo + 16;
    const int64_t* os = geo + 19;
    for (int64_t n : {B, Hq, Hkv, Tq, Tk, Dh})
        if (!emb_check(status, n, 1, INT32_MAX)) return;
    for (int64_t i = 10; i < 22; ++i)
        if (!emb_check(status, geo[i], 0, INT32_MAX)) return;
    // one past the last element each strided tensor reaches (saturated)
    auto reach = [&](const int64_t* s, int64_t H, int64_t T) {
        return emb_add(emb_mul(B - 1, s[0]), emb_mul(H - 1, s[1]), emb_mul(T - 1, s[2]), Dh);
    };
    if (!emb_check(status, Hq % Hkv, 0, 1) || !emb_check(status, reach(qs, Hq, Tq), 0, q_len + 1) ||
        !emb_check(status, reach(ks, Hkv, Tk), 0, kv_len + 1) || !emb_check(status, reach(vs, Hkv, Tk), 0, kv_len + 1) ||
        !emb_check(status, reach(os, Hq, Tq), 0, out_len + 1))
        return;
    if (mask) {
        for (int64_t st : {sb, sh, si})
            if (!emb_check(status, st, 0, INT32_MAX)) return;
        const int64_t last = emb_add(emb_mul(B - 1, sb), emb_mul(Hq - 1, sh), emb_mul(Tq - 1, si), Tk);
        if (!emb_check(status, last, 0, mask_len + 1)) return;
    }
    const int threads = emb_threads();
    int64_t chunk = std::min<int64_t>(Tq, 256);
    while (chunk > YR_EMB_ATT_RB && B * Hq * ((Tq + chunk - 1) / chunk) < 4 * threads) chunk = (chunk + 1) / 2;
    const int64_t chunks = (Tq + chunk - 1) / chunk, G = Hq / Hkv;
    yr::parallel_for_dynamic(B * Hq * chunks, emb_mul(B, Hq, Tq, Tk, Dh) >= PAR_MIN_MACS, [&](int64_t task) {
        const int64_t b = task / (Hq * chunks), h = task / chunks % Hq, c = task % chunks;
        const int64_t i0 = c * chunk, n = std::min(chunk, Tq - i0);
        const int64_t keys = causal ? std::min(Tk, i0 + n) : Tk;   // causal: the later keys are all masked
        const float* qh = q + b * qs[0] + h * qs[1] + i0 * qs[2];
        const int64_t hk = h / G;
        attention_head({qh, k + b * ks[0] + hk * ks[1], v + b * vs[0] + hk * vs[1], out + b * os[0] + h * os[1] + i0 * os[2],
                        qs[2], ks[2], vs[2], os[2], n, keys, Dh, scale, mask ? mask + b * sb + h * sh : nullptr, si, i0,
                        causal});
    });
}

}  // extern "C"
