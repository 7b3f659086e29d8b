// Float32 conv2d as an implicit GEMM, with the fused epilogue (bias, BatchNorm, residual,
// activation): per group g, out[m, g * OG + j] = sum_k patches[m, k] * w[g * OG + j, k] over
// the M = N * Ho * Wo output pixels, the OG output channels of the group and the
// KG = C / groups * KH * KW patch columns (as cuDNN's and CUTLASS's implicit-GEMM
// convolutions; kernels/triton/conv.py is the same kernel in Triton). The patch matrix is
// never built: each K step decodes its columns into (input channel, kernel row, kernel column)
// and loads the input pixels they cover, zero outside the image (the padding).
//
// Each workgroup computes one TILE_M pixels x TILE_N channels tile of one group, stepping over
// K TILE_K at a time: the patch and weight tiles are staged in workgroup memory (zero-filled
// outside M, OG and KG, so any positive sizes work), then each of the (TILE_M / REG_M) x
// (TILE_N / REG_N) threads accumulates a REG_M x REG_N block in registers, in f32, summing k
// in order. Every read checks its index: the pixel against M, the channel against OG, the
// column against KG and the input row and column against the image.
//
// Template parameters, substituted by backends/webgpu/conv.py before compiling: {{TILE_M}},
// {{TILE_N}}, {{TILE_K}}, {{REG_M}}, {{REG_N}} (u32; TILE_M % REG_M == 0, TILE_N % REG_N ==
// 0) and COMMON, the placeholder on a line of its own below (never named in braces in a
// comment, where the paste would land): conv_common.wgsl, with the parameters, the bindings
// and the epilogue.
//
// Workgroups: a 1-d count groups * tiles_m * tiles_n, laid out x + y * num_workgroups.x
// (runtime.webgpu.grid); the extra groups of the last row return at once.

{{COMMON}}

const TM: u32 = {{TILE_M}}u;
const TN: u32 = {{TILE_N}}u;
const TK: u32 = {{TILE_K}}u;
const RM: u32 = {{REG_M}}u;
const RN: u32 = {{REG_N}}u;
const TX: u32 = TN / RN;   // threads along the channels
const TY: u32 = TM / RM;   // threads along the pixels
const NT: u32 = TX * TY;   // threads per workgroup
// row pitches of the tiles in workgroup memory, one word of padding (bank conflicts)
const XP: u32 = TM + 1u;
const WP: u32 = TN + 1u;

var<workgroup> xs: array<f32, TK * XP>;   // patches [k][m], row pitch XP
var<workgroup> ws: array<f32, TK * WP>;   // weights [k][n], row pitch WP

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
    let tiles = P.tiles_m * P.tiles_n;
    let t = wid.x + wid.y * nwg.x;
    if (t >= P.groups * tiles) {   // the same for the whole workgroup: barriers stay uniform
        return;
    }
    let g = t / tiles;
    let r = t % tiles;
    let m0 = (r / P.tiles_n) * TM;
    let n0 = (r % P.tiles_n) * TN;
    let M = P.M;
    let OG = P.OG;
    let KG = P.KG;
    let c0 = g * P.CG;       // the group's first input channel
    let o0 = g * OG;         // and its first output channel (weight row)
    let tx = tid % TX;
    let ty = tid / TX;

    var acc: array<f32, RM * RN>;
    for (var i = 0u; i < RM * RN; i++) {
        acc[i] = 0.0;
    }
    var a: array<f32, RM>;
    var b: array<f32, RN>;

    for (var k0 = 0u; k0 < KG; k0 += TK) {
        // patch tile: column k of pixel m is x[n, c0 + c, ho * SH - PH + r * DH, wo * SW - PW + s * DW]
        for (var i = tid; i < TM * TK; i += NT) {
            let kk = i % TK;
            let mm = i / TK;
            let gm = m0 + mm;
            let gk = k0 + kk;
            var v = 0.0;
            if (gm < M && gk < KG) {
                let wo = gm % P.Wo;
                let q = gm / P.Wo;
                let ho = q % P.Ho;
                let n = q / P.Ho;
                let s = gk % P.KW;
                let q2 = gk / P.KW;
                let kr = q2 % P.KH;
                let c = c0 + q2 / P.KH;
                let hi = i32(ho * P.SH + kr * P.DH) - i32(P.PH);
                let wi = i32(wo * P.SW + s * P.DW) - i32(P.PW);
                if (hi >= 0 && hi < i32(P.H) && wi >= 0 && wi < i32(P.W)) {
                    v = X[P.x_off + n * P.sxn + c * P.sxc + u32(hi) * P.sxh + u32(wi) * P.sxw];
                }
            }
            xs[kk * XP + mm] = v;
        }
        // weight tile: consecutive threads read consecutive elements of a weight row
        for (var i = tid; i < TN * TK; i += NT) {
            let kk = i % TK;
            let nn = i / TK;
            let gn = n0 + nn;
            let gk = k0 + kk;
            var v = 0.0;
            if (gn < OG && gk < KG) {
                v = WT[P.w_off + (o0 + gn) * KG + gk];
            }
            ws[kk * WP + nn] = v;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            for (var i = 0u; i < RM; i++) {
                a[i] = xs[kk * XP + ty + i * TY];
            }
            for (var j = 0u; j < RN; j++) {
                b[j] = ws[kk * WP + tx + j * TX];
            }
            for (var i = 0u; i < RM; i++) {
                for (var j = 0u; j < RN; j++) {
                    acc[i * RN + j] = fma(a[i], b[j], acc[i * RN + j]);
                }
            }
        }
        workgroupBarrier();
    }

    for (var j = 0u; j < RN; j++) {
        let nn = n0 + tx + j * TX;
        if (nn >= OG) {
            continue;
        }
        let o = o0 + nn;
        for (var i = 0u; i < RM; i++) {
            let m = m0 + ty + i * TY;
            if (m < M) {
                let rel = out_rel(m, o);
                OUT[P.o_off + rel] = epilogue(acc[i * RN + j], o, rel);
            }
        }
    }
}
