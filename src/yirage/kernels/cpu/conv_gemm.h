// Convolution as an implicit GEMM on the packed float32 GEMM of embed_kernels.h (included
// after it by library_encoder.cpp; it uses its micro-tiles, task loop and size checks).
//
// An ungrouped NHWC convolution y[n, oy, ox, o] = sum_{ky, kx, c} x[n, iy, ix, c] * w[o, c, ky, kx]
// (iy = oy*sh - ph + ky*dh, ix = ox*sw - pw + kx*dw) is the GEMM Y[M, O] = A[M, K] . W'[K, O]
// with M = N*Ho*Wo output pixels and K = kh*kw*C, A's row m the pixel's receptive field in
// (ky, kx, c) order (zero outside the image) and W'[(ky*kw + kx)*C + c, o] = w[o, c, ky, kx]
// (backends/cpu/conv.py packs it with yr_emb_pack_f32 from [O, kh, kw, C]). A is never
// materialised whole: each task gathers the rows of its block of `mc` pixels into thread-local
// scratch (the "im2col" of Chellapilla et al. 2006, one cache block at a time, as oneDNN's and
// XNNPACK's GEMM convolutions do) and runs the GEMM's register tiles over it, so the gathered
// block is read from cache by every panel of its task. The row epilogue (residual add and
// activation, conv.cpp's yr_conv_epilogue) runs on each block of finished rows as in
// yr_emb_gemm_f32.
//
// Blocking: `mc` (pixels per block, the tile size the caller's measurement picks) and the
// GEMM's k-blocks of EMB_KC; panels of a block are split into groups of at least 4 so that the
// gather (K copies per pixel) stays small against the GEMM (K x 32 FMAs per pixel and panel).

namespace {

// A[0:rows, 0:K] = the receptive fields of pixels m0 .. m0+rows (see above); K = kh*kw*C.
inline void conv_gather_rows(const float* x, int64_t m0, int64_t rows, float* A, int64_t H, int64_t W,
                             int64_t C, int64_t Ho, int64_t Wo, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                             int64_t ph, int64_t pw, int64_t dh, int64_t dw) {
    const int64_t K = kh * kw * C;
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t m = m0 + i, n = m / (Ho * Wo), oy = (m / Wo) % Ho, ox = m % Wo;
        float* a = A + i * K;
        for (int64_t ky = 0; ky < kh; ++ky) {
            const int64_t iy = oy * sh - ph + ky * dh, ix0 = ox * sw - pw;
            if (dw == 1 && iy >= 0 && iy < H && ix0 >= 0 && ix0 + kw <= W) {   // the row's taps are contiguous
                std::memcpy(a, x + ((n * H + iy) * W + ix0) * C, (size_t)(kw * C) * sizeof(float));
                a += kw * C;
                continue;
            }
            for (int64_t kx = 0; kx < kw; ++kx, a += C) {
                const int64_t ix = ox * sw - pw + kx * dw;
                if (iy < 0 || iy >= H || ix < 0 || ix >= W) std::memset(a, 0, (size_t)C * sizeof(float));
                else std::memcpy(a, x + ((n * H + iy) * W + ix) * C, (size_t)C * sizeof(float));
            }
        }
    }
}

inline float* conv_gather_scratch(int64_t n) {
    static thread_local std::vector<float> buf;
    if ((int64_t)buf.size() < n) buf.resize((size_t)n);
    return buf.data();
}

}  // namespace

extern "C" {

// y [N*Ho*Wo, O] (NHWC) = conv(x [N, H, W, C] NHWC, w) + bias [O] (bias may be null), with w
// packed by yr_emb_pack_f32 from [O, kh*kw*C] ((ky, kx, c) order; p_len floats). geo: {N, H,
// W, C, O, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw, mc, kc}. status: a geometry that is not a
// convolution's (a non-positive size, an output size that does not follow from the window,
// mc or kc outside [1, 4096]) or buffers shorter than it needs (x_len, y_len, p_len elements); then
// nothing is written. epi, epi_args: a row epilogue as in yr_emb_gemm_f32.
void yr_conv_igemm_f32(const float* x, const float* P, const float* bias, float* y, const int64_t* geo,
                       int64_t x_len, int64_t p_len, int64_t y_len, EmbEpilogue epi, const int64_t* epi_args,
                       int64_t* status) {
    const int64_t N = geo[0], H = geo[1], W = geo[2], C = geo[3], O = geo[4], Ho = geo[5], Wo = geo[6], kh = geo[7],
                  kw = geo[8], sh = geo[9], sw = geo[10], ph = geo[11], pw = geo[12], dh = geo[13], dw = geo[14],
                  mc = geo[15], kcb = geo[16];
    for (int64_t v : {N, H, W, C, O, kh, kw, sh, sw, dh, dw})
        if (!emb_check(status, v, 1, INT64_MAX)) return;
    if (!emb_check(status, ph, 0, INT64_MAX) || !emb_check(status, pw, 0, INT64_MAX) ||
        !emb_check(status, mc, 1, 4097) || !emb_check(status, kcb, 1, 4097))
        return;
    // the output size the window gives (sizes below 2^31 keep every product in range)
    for (int64_t v : {H, W, C, O, kh, kw, sh, sw, ph, pw, dh, dw})
        if (!emb_check(status, v, 0, INT32_MAX)) return;
    const int64_t ho = (H + 2 * ph - dh * (kh - 1) - 1) / sh + 1, wo = (W + 2 * pw - dw * (kw - 1) - 1) / sw + 1;
    if (!emb_check(status, Ho, ho, ho + 1) || !emb_check(status, Wo, wo, wo + 1) || !emb_check(status, Ho, 1, INT32_MAX) ||
        !emb_check(status, Wo, 1, INT32_MAX))
        return;
    const int64_t M = emb_mul(N, Ho, Wo), K = emb_mul(kh, kw, C);
    const int64_t npanels = (O + EMB_NR - 1) / EMB_NR;
    if (!emb_check(status, emb_mul(N, H, W, C), 0, x_len + 1) || !emb_check(status, emb_mul(M, O), 0, y_len + 1) ||
        !emb_check(status, emb_mul(npanels, EMB_NR, K), 0, p_len + 1) || !emb_check(status, emb_mul(mc, K), 0, INT32_MAX))
        return;
    // tasks: blocks of mc pixels x groups of >= 4 panels, YR_EMB_TASKS per thread where they fit
    EmbTiles t;
    t.mc = mc;
    t.npanels = npanels;
    t.mblocks = (M + mc - 1) / mc;
    t.pgroups = 1;
    while (t.mblocks * t.pgroups < YR_EMB_TASKS * emb_threads() && t.pgroups * 8 <= npanels) t.pgroups *= 2;
    t.per_group = (npanels + t.pgroups - 1) / t.pgroups;
    const EmbRowEpilogue ep(epi, epi_args, t, M);
    yr::parallel(emb_mul(M, O, K) >= PAR_MIN_MACS, [&] {
        float* A = conv_gather_scratch(mc * K);
        yr::for_dynamic_nowait(t.mblocks * t.pgroups, [&](int64_t task) {
            const int64_t mb = task / t.pgroups, pg = task % t.pgroups;
            const int64_t m0 = mb * mc, m1 = std::min(M, m0 + mc), rows = m1 - m0;
            const int64_t p0 = pg * t.per_group, p1 = std::min(t.npanels, p0 + t.per_group);
            conv_gather_rows(x, m0, rows, A, H, W, C, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw);
            for (int64_t k0 = 0; k0 < K; k0 += kcb) {
                const int64_t kc = std::min(kcb, K - k0);
                for (int64_t p = p0; p < p1; ++p) {
                    const int64_t n0 = p * EMB_NR;
                    const int nr = (int)std::min<int64_t>(EMB_NR, O - n0);
                    const float* B = P + (p * K + k0) * EMB_NR;
                    const float* bp = (bias && k0 == 0 && nr == EMB_NR) ? bias + n0 : nullptr;
                    for (int64_t i = 0; i < rows; i += EMB_MR) {
                        const int mr = (int)std::min<int64_t>(EMB_MR, rows - i);
                        emb_f32_rows<EMB_MR>(mr, A + i * K + k0, K, B, kc, y + (m0 + i) * O + n0, O, bp, k0 > 0, nr);
                    }
                    if (bias && k0 == 0 && nr < EMB_NR)   // last partial panel: bias added here
                        for (int64_t m = m0; m < m1; ++m)
                            for (int j = 0; j < nr; ++j) y[m * O + n0 + j] += bias[n0 + j];
                }
            }
            ep.task_done(mb);
        });
        ep.help();
    });
}

}  // extern "C"
