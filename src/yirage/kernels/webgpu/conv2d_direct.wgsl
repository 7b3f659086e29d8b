// Float32 conv2d computed directly, one output element per invocation, with the fused
// epilogue (bias, BatchNorm, residual, activation): the kernel for depthwise and other
// convolutions with few output channels per group (OG), where a GEMM tile over the channels
// would be mostly empty. Invocation i owns out element i in out's memory order (NCHW, or NHWC
// with o_nhwc), so neighbouring invocations write neighbouring elements, and sums
// x[n, c0 + c, ho * SH - PH + r * DH, wo * SW - PW + s * DW] * w[o, c, r, s] over the group's
// CG input channels and the KH x KW window in f32, in (c, r, s) order (the implicit GEMM's
// k order), taps outside the image skipped (the zero padding).
//
// Template parameters, substituted by backends/webgpu/conv.py before compiling: {{WG}} (the
// workgroup size) and COMMON, the placeholder on a line of its own below (never named in
// braces in a comment, where the paste would land): conv_common.wgsl, with the parameters,
// the bindings and the epilogue.
//
// Workgroups: ceil(M * O / WG) as a 1-d count laid out x + y * num_workgroups.x
// (runtime.webgpu.grid); invocations past the last element return at once.

{{COMMON}}

const WG: u32 = {{WG}}u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let idx = (wid.x + wid.y * nwg.x) * WG + lid;
    if (idx >= P.M * P.O) {
        return;
    }
    var o: u32;
    var m: u32;   // the output pixel, n * Ho * Wo + ho * Wo + wo
    if (P.o_nhwc != 0u) {
        o = idx % P.O;
        m = idx / P.O;
    } else {
        let hw = P.Ho * P.Wo;
        let q = idx / hw;
        o = q % P.O;
        m = (q / P.O) * hw + idx % hw;
    }
    let wo = m % P.Wo;
    let q = m / P.Wo;
    let ho = q % P.Ho;
    let n = q / P.Ho;
    let c0 = (o / P.OG) * P.CG;
    let h0 = i32(ho * P.SH) - i32(P.PH);
    let w0 = i32(wo * P.SW) - i32(P.PW);
    let xn = P.x_off + n * P.sxn;
    let wrow = P.w_off + o * P.KG;

    var acc = 0.0;
    for (var c = 0u; c < P.CG; c++) {
        let xc = xn + (c0 + c) * P.sxc;
        for (var kr = 0u; kr < P.KH; kr++) {
            let hi = h0 + i32(kr * P.DH);
            if (hi < 0 || hi >= i32(P.H)) {
                continue;
            }
            let xr = xc + u32(hi) * P.sxh;
            let wr = wrow + (c * P.KH + kr) * P.KW;
            for (var s = 0u; s < P.KW; s++) {
                let wi = w0 + i32(s * P.DW);
                if (wi >= 0 && wi < i32(P.W)) {
                    acc = fma(X[xr + u32(wi) * P.sxw], WT[wr + s], acc);
                }
            }
        }
    }
    let rel = out_rel(m, o);
    OUT[P.o_off + rel] = epilogue(acc, o, rel);
}
