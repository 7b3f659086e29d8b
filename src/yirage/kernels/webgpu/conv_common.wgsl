// The part conv2d.wgsl (the implicit GEMM) and conv2d_direct.wgsl (one output per invocation)
// share: their parameters, their bindings and the epilogue. backends/webgpu/conv.py fills in
// {{IN_ACCESS}} here, then pastes the result at their COMMON placeholder (substituted once:
// placeholders in the pasted text stay as they are, so none may be left in it).
//
// Tensors, all float32: x [N, C, H, W] and out, residual [N, O, Ho, Wo] in NCHW or NHWC (the
// element strides sx*, so* in logical (n, c, h, w) order say which: the residual has out's
// shape and layout, so out's strides index it too); w [O, C / groups, KH, KW] contiguous (group
// g's rows g * OG .. of the [O, KG] matrix, KG = C / groups * KH * KW); bias [O]; SS [2 * O]:
// an inference BatchNorm as a per-channel scale (elements 0 .. O) and shift (O .. 2 * O),
// made by bn_fold.wgsl.
//
// {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write' when out lies in an input's
// buffer (at other elements: WebGPU forbids one buffer bound read-only and writable in one
// dispatch, but allows it writable twice).
//
// Bindings: 0 the parameters below; 1 x; 2 w; 3 bias; 4 SS; 5 residual (an absent one is any
// buffer, never read: has_bias, has_bn, has_res say which are there); 6 out. Buffers are bound
// whole: every index adds the tensor's element offset.

struct Params {
    M: u32,                                  // output pixels, N * Ho * Wo
    O: u32, OG: u32, CG: u32, KG: u32, groups: u32,
    H: u32, W: u32, Ho: u32, Wo: u32,
    KH: u32, KW: u32, SH: u32, SW: u32, PH: u32, PW: u32, DH: u32, DW: u32,
    x_off: u32, w_off: u32, b_off: u32, ss_off: u32, r_off: u32, o_off: u32,
    sxn: u32, sxc: u32, sxh: u32, sxw: u32,  // x's strides, logical (n, c, h, w) order
    son: u32, soc: u32, soh: u32, sow: u32,  // out's (and the residual's)
    has_bias: u32, has_bn: u32, has_res: u32,
    act: u32,                                // 0 none, 1 relu, 2 hardtanh, 3 silu, 4 sigmoid, 5 tanh
    act_lo: u32, act_hi: u32,                // hardtanh's bounds, f32 bits
    tiles_m: u32, tiles_n: u32,              // conv2d.wgsl: tiles over M and over OG
    o_nhwc: u32,                             // conv2d_direct.wgsl: out's memory order is NHWC
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<f32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> WT: array<f32>;
@group(0) @binding(3) var<storage, {{IN_ACCESS}}> BIAS: array<f32>;
@group(0) @binding(4) var<storage, {{IN_ACCESS}}> SS: array<f32>;
@group(0) @binding(5) var<storage, {{IN_ACCESS}}> RES: array<f32>;
@group(0) @binding(6) var<storage, read_write> OUT: array<f32>;

// The activation, as torch computes it: ReLU and hardtanh pass a NaN through (torch.relu,
// torch.clamp); tanh's argument is clamped to [-10, 10], where it is +-1 in f32 already (an
// exp-based tanh would give inf / inf there).
fn activate(v: f32) -> f32 {
    switch P.act {
        case 1u: {
            return select(v, 0.0, v < 0.0);
        }
        case 2u: {
            let lo = bitcast<f32>(P.act_lo);
            let hi = bitcast<f32>(P.act_hi);
            if (v < lo) {
                return lo;
            }
            if (v > hi) {
                return hi;
            }
            return v;
        }
        case 3u: {
            return v / (1.0 + exp(-v));
        }
        case 4u: {
            return 1.0 / (1.0 + exp(-v));
        }
        case 5u: {
            return tanh(clamp(v, -10.0, 10.0));
        }
        default: {
            return v;
        }
    }
}

// Output channel o's value at out element P.o_off + rel (and residual element P.r_off + rel)
// from the convolution's sum acc: + bias, * scale + shift (BatchNorm), + residual, activation
// (ir/conv.py's conv2d_epilogue, in that order).
fn epilogue(acc: f32, o: u32, rel: u32) -> f32 {
    var v = acc;
    if (P.has_bias != 0u) {
        v += BIAS[P.b_off + o];
    }
    if (P.has_bn != 0u) {
        v = v * SS[P.ss_off + o] + SS[P.ss_off + P.O + o];
    }
    if (P.has_res != 0u) {
        v += RES[P.r_off + rel];
    }
    return activate(v);
}

// out's element (relative to P.o_off) of output pixel m (n * Ho * Wo + ho * Wo + wo), channel o.
fn out_rel(m: u32, o: u32) -> u32 {
    let wo = m % P.Wo;
    let q = m / P.Wo;
    return (q / P.Ho) * P.son + o * P.soc + (q % P.Ho) * P.soh + wo * P.sow;
}
