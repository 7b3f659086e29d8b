// Convolutional-network kernels over NCHW tensors: max / average / adaptive average pooling and
// inference BatchNorm (the IR ops of yirage/ir/conv.py; bound by backends/cpu/conv.py).
//
// Every entry takes its element type as a code (0 float32, 1 float16, 2 bfloat16), computes in
// float32 and stores in that type, with torch's semantics (F.max_pool2d: padding is -inf and a
// NaN in a window wins; F.avg_pool2d with count_include_pad; F.adaptive_avg_pool2d's windows
// floor(i*H/o) .. ceil((i+1)*H/o)). Sizes come from the graph's static shapes; each entry still
// returns without touching memory when they are inconsistent (a non-positive size, an output
// that does not match the window formula). Work is split over the N*C planes on threads (yr_threads.h).
#include "yirage_prelude.h"

#include "yr_threads.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace {

template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<yr_f16>(const yr_f16* p, int64_t i) { return (float)p[i]; }
template <> inline float load<uint16_t>(const uint16_t* p, int64_t i) { return yr_bf16_to_f32(p[i]); }

template <typename T> inline void store(T* p, int64_t i, float v);
template <> inline void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store<yr_f16>(yr_f16* p, int64_t i, float v) { p[i] = (yr_f16)v; }
template <> inline void store<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = yr_f32_to_bf16(v); }

// Calls fn.template operator()<T>() with the element type of `code`; false for an unknown code.
template <typename F> bool dispatch(int64_t code, F fn) {
    switch (code) {
        case 0: fn((float*)nullptr); return true;
        case 1: fn((yr_f16*)nullptr); return true;
        case 2: fn((uint16_t*)nullptr); return true;
        default: return false;
    }
}

inline int64_t window_out(int64_t n, int64_t k, int64_t s, int64_t p, int64_t d) {
    return (n + 2 * p - d * (k - 1) - 1) / s + 1;
}

struct Window {
    int64_t N, C, H, W, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo;
    bool ok() const {
        return N > 0 && C > 0 && H > 0 && W > 0 && kh > 0 && kw > 0 && sh > 0 && sw > 0 && ph >= 0 && pw >= 0 &&
               dh > 0 && dw > 0 && Ho == window_out(H, kh, sh, ph, dh) && Wo == window_out(W, kw, sw, pw, dw) &&
               Ho > 0 && Wo > 0;
    }
};

template <typename T> void max_pool(const T* x, T* y, const Window& w) {
    yr::parallel_for(w.N * w.C, w.N * w.C * w.Ho * w.Wo * w.kh * w.kw >= 65536, [&](int64_t plane) {
        const T* xp = x + plane * w.H * w.W;
        T* yp = y + plane * w.Ho * w.Wo;
        for (int64_t oy = 0; oy < w.Ho; ++oy)
            for (int64_t ox = 0; ox < w.Wo; ++ox) {
                float m = -std::numeric_limits<float>::infinity();
                bool nan = false;
                for (int64_t ky = 0; ky < w.kh; ++ky) {
                    const int64_t iy = oy * w.sh - w.ph + ky * w.dh;
                    if (iy < 0 || iy >= w.H) continue;
                    for (int64_t kx = 0; kx < w.kw; ++kx) {
                        const int64_t ix = ox * w.sw - w.pw + kx * w.dw;
                        if (ix < 0 || ix >= w.W) continue;
                        const float v = load(xp, iy * w.W + ix);
                        nan |= v != v;
                        m = std::max(m, v);
                    }
                }
                store(yp, oy * w.Wo + ox, nan ? std::numeric_limits<float>::quiet_NaN() : m);
            }
    });
}

template <typename T> void avg_pool(const T* x, T* y, const Window& w, bool count_pad) {
    yr::parallel_for(w.N * w.C, w.N * w.C * w.Ho * w.Wo * w.kh * w.kw >= 65536, [&](int64_t plane) {
        const T* xp = x + plane * w.H * w.W;
        T* yp = y + plane * w.Ho * w.Wo;
        for (int64_t oy = 0; oy < w.Ho; ++oy)
            for (int64_t ox = 0; ox < w.Wo; ++ox) {
                const int64_t y0 = oy * w.sh - w.ph, x0 = ox * w.sw - w.pw;
                // torch: the divisor counts the window clipped to the padded input
                const int64_t y1 = std::min(y0 + w.kh, w.H + w.ph), x1 = std::min(x0 + w.kw, w.W + w.pw);
                const int64_t padded = (y1 - y0) * (x1 - x0);
                const int64_t ys = std::max<int64_t>(y0, 0), xs = std::max<int64_t>(x0, 0);
                const int64_t ye = std::min(y1, w.H), xe = std::min(x1, w.W);
                float s = 0.0f;
                for (int64_t iy = ys; iy < ye; ++iy)
                    for (int64_t ix = xs; ix < xe; ++ix) s += load(xp, iy * w.W + ix);
                const int64_t div = count_pad ? padded : std::max<int64_t>((ye - ys) * (xe - xs), 1);
                store(yp, oy * w.Wo + ox, s / (float)div);
            }
    });
}

template <typename T> void adaptive_avg(const T* x, T* y, int64_t planes, int64_t H, int64_t W, int64_t oh,
                                        int64_t ow) {
    yr::parallel_for(planes, planes * H * W >= 65536, [&](int64_t plane) {
        const T* xp = x + plane * H * W;
        T* yp = y + plane * oh * ow;
        for (int64_t i = 0; i < oh; ++i) {
            const int64_t ys = i * H / oh, ye = ((i + 1) * H + oh - 1) / oh;
            for (int64_t j = 0; j < ow; ++j) {
                const int64_t xs = j * W / ow, xe = ((j + 1) * W + ow - 1) / ow;
                float s = 0.0f;
                for (int64_t iy = ys; iy < ye; ++iy)
                    for (int64_t ix = xs; ix < xe; ++ix) s += load(xp, iy * W + ix);
                store(yp, i * ow + j, s / (float)((ye - ys) * (xe - xs)));
            }
        }
    });
}

template <typename T> void batch_norm(const T* x, T* y, const float* mean, const float* var, const float* w,
                                      const float* b, int64_t N, int64_t C, int64_t S, float eps) {
    yr::parallel_for(N * C, N * C * S >= 65536, [&](int64_t plane) {
        const int64_t c = plane % C;
        const float scale = (w ? w[c] : 1.0f) / std::sqrt(var[c] + eps);
        const float shift = (b ? b[c] : 0.0f) - mean[c] * scale;
        const T* xp = x + plane * S;
        T* yp = y + plane * S;
        #pragma omp simd
        for (int64_t i = 0; i < S; ++i) store(yp, i, load(xp, i) * scale + shift);
    });
}

// The activations of the convolution epilogues (codes as yr_conv_epilogue's), a template
// parameter so that each inner loop is one straight-line vectorizable body.
template <int ACT> static inline float conv_act(float v, float a, float b) {
    if constexpr (ACT == 1) return v > 0.0f ? v : 0.0f;
    else if constexpr (ACT == 2) return std::min(std::max(v, a), b);
    else if constexpr (ACT == 3) return v / (1.0f + yr_exp(-v));
    else if constexpr (ACT == 4) return 1.0f / (1.0f + yr_exp(-v));
    else if constexpr (ACT == 5) return yr_tanh(v);
    else return v;
}

// Calls fn.template operator()<ACT>() for an activation code (0 none, 1 relu, 2 clamp,
// 3 silu, 4 sigmoid, 5 tanh); false for an unknown code.
template <typename F> static bool dispatch_act(int64_t act, F fn) {
    switch (act) {
        case 0: fn(std::integral_constant<int, 0>{}); return true;
        case 1: fn(std::integral_constant<int, 1>{}); return true;
        case 2: fn(std::integral_constant<int, 2>{}); return true;
        case 3: fn(std::integral_constant<int, 3>{}); return true;
        case 4: fn(std::integral_constant<int, 4>{}); return true;
        case 5: fn(std::integral_constant<int, 5>{}); return true;
        default: return false;
    }
}

template <int ACT>
static void depthwise_nhwc(const float* x, const float* wt, const float* bias, const float* res, float* y,
                           int64_t N, int64_t H, int64_t W, int64_t C, int64_t Ho, int64_t Wo, int64_t kh,
                           int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                           float a, float b) {
    constexpr int64_t CB = 64;
    yr::parallel_for(N * Ho, N * Ho * Wo * C * kh * kw >= 65536, [&](int64_t row) {
        const int64_t n = row / Ho, ho = row % Ho;
        for (int64_t wo = 0; wo < Wo; ++wo) {
            float* yp = y + ((n * Ho + ho) * Wo + wo) * C;
            const float* rp = res ? res + ((n * Ho + ho) * Wo + wo) * C : nullptr;
            for (int64_t c0 = 0; c0 < C; c0 += CB) {
                const int64_t cn = std::min(CB, C - c0);
                float acc[CB];
                for (int64_t j = 0; j < CB; ++j) acc[j] = (bias && j < cn) ? bias[c0 + j] : 0.0f;
                for (int64_t r = 0; r < kh; ++r) {
                    const int64_t hi = ho * sh - ph + r * dh;
                    if (hi < 0 || hi >= H) continue;
                    for (int64_t s = 0; s < kw; ++s) {
                        const int64_t wi = wo * sw - pw + s * dw;
                        if (wi < 0 || wi >= W) continue;
                        const float* xp = x + ((n * H + hi) * W + wi) * C + c0;
                        const float* wp = wt + (r * kw + s) * C + c0;
                        if (cn == CB) {
                            #pragma omp simd
                            for (int64_t j = 0; j < CB; ++j) acc[j] += xp[j] * wp[j];
                        } else {
                            #pragma omp simd
                            for (int64_t j = 0; j < cn; ++j) acc[j] += xp[j] * wp[j];
                        }
                    }
                }
                if (rp) {
                    #pragma omp simd
                    for (int64_t j = 0; j < cn; ++j) yp[c0 + j] = conv_act<ACT>(acc[j] + rp[c0 + j], a, b);
                } else {
                    #pragma omp simd
                    for (int64_t j = 0; j < cn; ++j) yp[c0 + j] = conv_act<ACT>(acc[j], a, b);
                }
            }
        }
    });
}

template <int ACT> static void epilogue_rows(float* y, const float* r, int64_t cols, int64_t lo, int64_t hi,
                                             float a, float b) {
    for (int64_t i = lo; i < hi; ++i) {
        float* yr = y + i * cols;
        if (r) {
            const float* rr = r + i * cols;
            #pragma omp simd
            for (int64_t j = 0; j < cols; ++j) yr[j] = conv_act<ACT>(yr[j] + rr[j], a, b);
        } else {
            #pragma omp simd
            for (int64_t j = 0; j < cols; ++j) yr[j] = conv_act<ACT>(yr[j], a, b);
        }
    }
}

}  // namespace

extern "C" {

void yr_max_pool2d(const void* x, void* y, int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                   int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t Ho, int64_t Wo,
                   int64_t dtype) {
    const Window w{N, C, H, W, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo};
    if (!w.ok()) return;
    dispatch(dtype, [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        max_pool((const T*)x, (T*)y, w);
    });
}

void yr_avg_pool2d(const void* x, void* y, int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                   int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t Ho, int64_t Wo, int64_t count_pad,
                   int64_t dtype) {
    const Window w{N, C, H, W, kh, kw, sh, sw, ph, pw, 1, 1, Ho, Wo};
    if (!w.ok()) return;
    dispatch(dtype, [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        avg_pool((const T*)x, (T*)y, w, count_pad != 0);
    });
}

void yr_adaptive_avg_pool2d(const void* x, void* y, int64_t N, int64_t C, int64_t H, int64_t W, int64_t oh,
                            int64_t ow, int64_t dtype) {
    if (N <= 0 || C <= 0 || H <= 0 || W <= 0 || oh <= 0 || ow <= 0) return;
    dispatch(dtype, [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        adaptive_avg((const T*)x, (T*)y, N * C, H, W, oh, ow);
    });
}

// mean, var [C] float32; w, b [C] float32 or both null; S = the product of the dims after C.
void yr_batch_norm(const void* x, void* y, const float* mean, const float* var, const float* w, const float* b,
                   int64_t N, int64_t C, int64_t S, float eps, int64_t dtype) {
    if (N <= 0 || C <= 0 || S <= 0 || !mean || !var || (w == nullptr) != (b == nullptr)) return;
    dispatch(dtype, [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        batch_norm((const T*)x, (T*)y, mean, var, w, b, N, C, S, eps);
    });
}

// Depthwise convolution over NHWC float32 tensors, one output pixel at a time with its channels
// in blocks of 64 (four AVX-512 vectors of accumulators), the window summed directly:
// y[n, ho, wo, c] = act(bias[c] + sum_{r,s} x[n, hi, wi, c] * wt[r * kw + s, c] + res[n, ho, wo, c]),
// hi = ho*sh - ph + r*dh, wi = wo*sw - pw + s*dw (outside the image: 0). wt is the weight
// transposed to [kh*kw, C] (channels contiguous); bias [C] or null; res like y or null; act
// as yr_conv_epilogue's. Returns without touching memory when the sizes are inconsistent.
void yr_depthwise_nhwc_f32(const float* x, const float* wt, const float* bias, const float* res, float* y,
                           int64_t N, int64_t H, int64_t W, int64_t C, int64_t Ho, int64_t Wo, int64_t kh,
                           int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                           int64_t act, float a, float b) {
    if (N <= 0 || H <= 0 || W <= 0 || C <= 0 || kh <= 0 || kw <= 0 || sh <= 0 || sw <= 0 || dh <= 0 || dw <= 0 ||
        ph < 0 || pw < 0 || Ho != window_out(H, kh, sh, ph, dh) || Wo != window_out(W, kw, sw, pw, dw) || Ho <= 0 ||
        Wo <= 0 || !x || !wt || !y)
        return;
    dispatch_act(act, [&](auto A) {
        depthwise_nhwc<decltype(A)::value>(x, wt, bias, res, y, N, H, W, C, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw,
                                           a, b);
    });
}

// Row epilogue of a convolution run as a GEMM (backends/cpu/conv.py's 1x1 convolutions on
// the packed GEMM; called by the GEMM on each block of finished rows [lo, hi), see
// embed_kernels.h's EmbEpilogue): y[i, :] = act(y[i, :] + r[i, :]) over float32 rows of
// `cols` values. args: {y, r or 0, rows, cols, act, lo, hi} with act 0 none, 1 relu,
// 2 clamp(lo, hi) (ReLU6), 3 silu, 4 sigmoid, 5 tanh, and lo/hi float32 bit patterns. Rows
// outside [0, rows) are never touched.
void yr_conv_epilogue(const int64_t* args, int64_t lo, int64_t hi) {
    float* y = (float*)args[0];
    const float* r = (const float*)args[1];
    const int64_t rows = args[2], cols = args[3], act = args[4];
    float a, b;
    const int32_t abits = (int32_t)args[5], bbits = (int32_t)args[6];
    std::memcpy(&a, &abits, 4);
    std::memcpy(&b, &bbits, 4);
    lo = std::max<int64_t>(lo, 0);
    hi = std::min(hi, rows);
    if (!y || cols <= 0 || lo >= hi) return;
    dispatch_act(act, [&](auto A) { epilogue_rows<decltype(A)::value>(y, r, cols, lo, hi, a, b); });
}

// The row epilogues of a merged GEMM's parts (yr_emb_gemm_f32_parts): args = {count, then
// yr_conv_epilogue's 7 words for each part}, each run on rows [lo, hi) of its part; count
// outside [0, 64] runs none.
void yr_conv_epilogue_parts(const int64_t* args, int64_t lo, int64_t hi) {
    const int64_t count = args[0];
    if (count < 0 || count > 64) return;
    for (int64_t i = 0; i < count; ++i) yr_conv_epilogue(args + 1 + 7 * i, lo, hi);
}

}  // extern "C"
