// Float32 2-d pooling, one output element per invocation: max_pool2d (mode 0), avg_pool2d
// (mode 1) and adaptive_avg_pool2d (mode 2), as torch.nn.functional computes them (floor
// mode).
//
// x is [N, C, H, W] and out [N, C, Ho, Wo], each NCHW or NHWC: the element strides sx*, so* in
// logical (n, c, h, w) order say which. Invocation i owns out element i in out's memory order
// (NHWC with o_nhwc), so neighbouring invocations write neighbouring elements.
//
// - max: the window's taps at (ho * SH - PH + r * DH, wo * SW - PW + s * DW) inside the image
//   (padding never wins: it is -inf), in f32; a NaN in the window wins, as in torch.
// - avg: the sum of the taps inside the image over the divisor: with count_pad, the window
//   clipped to the padded image ((min(h0 + KH, H + PH) - h0) x the same for w: padding zeros
//   count), else the taps inside the image (at least 1).
// - adaptive avg: output cell (ho, wo) averages rows floor(ho * H / Ho) .. ceil((ho + 1) * H /
//   Ho) and the same for columns (the window attributes are unused).
// Every read is checked against the image.
//
// Template parameters, substituted by backends/webgpu/conv.py before compiling: {{WG}} (the
// workgroup size) and {{IN_ACCESS}}: x's access mode, 'read', or 'read_write' when out lies in
// x's buffer (at other elements: WebGPU forbids one buffer bound read-only and writable in one
// dispatch, but allows it writable twice).
//
// Bindings: 0 the parameters below; 1 x; 2 out. Buffers are bound whole: every index adds the
// tensor's element offset. Workgroups: ceil(total / WG) as a 1-d count laid out
// x + y * num_workgroups.x (runtime.webgpu.grid); invocations past the last element return.

const WG: u32 = {{WG}}u;

struct Params {
    total: u32, C: u32, H: u32, W: u32, Ho: u32, Wo: u32,
    KH: u32, KW: u32, SH: u32, SW: u32, PH: u32, PW: u32, DH: u32, DW: u32,
    x_off: u32, o_off: u32,
    sxn: u32, sxc: u32, sxh: u32, sxw: u32,   // x's strides, logical (n, c, h, w) order
    son: u32, soc: u32, soh: u32, sow: u32,   // out's
    mode: u32, count_pad: u32, o_nhwc: u32,
    neg_inf: u32,                             // -inf as f32 bits (0xff800000)
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<f32>;
@group(0) @binding(2) var<storage, read_write> OUT: array<f32>;

// x != x may be folded away by a compiler that assumes no NaN; the bits say it for sure
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let idx = (wid.x + wid.y * nwg.x) * WG + lid;
    if (idx >= P.total) {
        return;
    }
    var c: u32;
    var m: u32;   // the output pixel, n * Ho * Wo + ho * Wo + wo
    if (P.o_nhwc != 0u) {
        c = idx % P.C;
        m = idx / P.C;
    } else {
        let hw = P.Ho * P.Wo;
        let q = idx / hw;
        c = q % P.C;
        m = (q / P.C) * hw + idx % hw;
    }
    let wo = m % P.Wo;
    let q = m / P.Wo;
    let ho = q % P.Ho;
    let n = q / P.Ho;
    let xc = P.x_off + n * P.sxn + c * P.sxc;
    let H = i32(P.H);
    let W = i32(P.W);
    var v: f32;

    if (P.mode == 2u) {
        let hs = (ho * P.H) / P.Ho;
        let he = ((ho + 1u) * P.H + P.Ho - 1u) / P.Ho;
        let ws = (wo * P.W) / P.Wo;
        let we = ((wo + 1u) * P.W + P.Wo - 1u) / P.Wo;
        var sum = 0.0;
        for (var h = hs; h < he && h < P.H; h++) {
            for (var w = ws; w < we && w < P.W; w++) {
                sum += X[xc + h * P.sxh + w * P.sxw];
            }
        }
        v = sum / f32(max((he - hs) * (we - ws), 1u));
    } else {
        let h0 = i32(ho * P.SH) - i32(P.PH);
        let w0 = i32(wo * P.SW) - i32(P.PW);
        let is_max = P.mode == 0u;
        var acc = 0.0;
        if (is_max) {
            acc = bitcast<f32>(P.neg_inf);
        }
        var inside = 0u;
        var nan = false;
        for (var kr = 0u; kr < P.KH; kr++) {
            let hi = h0 + i32(kr * P.DH);
            if (hi < 0 || hi >= H) {
                continue;
            }
            for (var s = 0u; s < P.KW; s++) {
                let wi = w0 + i32(s * P.DW);
                if (wi < 0 || wi >= W) {
                    continue;
                }
                let x = X[xc + u32(hi) * P.sxh + u32(wi) * P.sxw];
                if (is_max) {
                    if (is_nan(x)) {   // a NaN wins, and stays
                        acc = x;
                        nan = true;
                    } else if (!nan && x > acc) {
                        acc = x;
                    }
                } else {
                    acc += x;
                }
                inside += 1u;
            }
        }
        if (is_max) {
            v = acc;
        } else {
            var count = inside;
            if (P.count_pad != 0u) {
                let hh = min(h0 + i32(P.KH), H + i32(P.PH)) - h0;
                let ww = min(w0 + i32(P.KW), W + i32(P.PW)) - w0;
                count = u32(max(hh * ww, 1));
            }
            v = acc / f32(max(count, 1u));
        }
    }
    OUT[P.o_off + n * P.son + c * P.soc + ho * P.soh + wo * P.sow] = v;
}
