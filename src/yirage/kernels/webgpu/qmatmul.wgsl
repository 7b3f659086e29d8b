// Tiled GEMM over a GGUF block-quantized weight (prefill, larger M):
// out[m, n] = sum_k X[m, k] * W[n, k] (+ bias[n]), W's tiles dequantized into workgroup memory.
//
// X is [M, K] float32 row-major, W the [N, K] weight's block storage (qblocks.wgsl, which
// backends/webgpu/quant.py puts in front of this text: `unit`, `group`), out [M, N] float32.
// K is a multiple of the format's block (32 or 256 weights), so K steps are 32 deep: one unit
// of each of the tile's TN rows of W.
//
// Each workgroup computes one TM x TN tile of out. Per step of 32 along K, its threads decode
// the tile's TN units of W (each thread some groups of 8 weights: `group`) and copy the TM x 32
// block of X into workgroup memory (zeros outside M and N), then each of the
// (TM / RM) x (TN / RN) threads accumulates an RM x RN block of the tile in registers, in f32:
// thread (ty, tx) owns rows ty + i * TY and columns tx + j * TX.
//
// Template parameters, substituted by backends/webgpu/quant.py before compiling: {{TILE_M}},
// {{TILE_N}}, {{REG_M}}, {{REG_N}} (TILE_M % REG_M == 0, TILE_N % REG_N == 0), {{QTYPE}}
// (qblocks.wgsl) and {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write' when out
// lies in an input's buffer (at other elements: WebGPU forbids one buffer bound read-only and
// writable in one dispatch).
//
// Bindings: 0 the parameters below; 1 X; 2 W (bytes, as u32 words); 3 bias (any buffer when
// has_bias == 0: never read); 4 out. Buffers are bound whole: X's, bias's and out's element
// offsets and W's byte offset are parameters. Workgroups: a 1-d count tiles_m * tiles_n, laid
// out x + y * num_workgroups.x (runtime.webgpu.grid); the extra groups of the last row return.

const TM: u32 = {{TILE_M}}u;
const TN: u32 = {{TILE_N}}u;
const RM: u32 = {{REG_M}}u;
const RN: u32 = {{REG_N}}u;
const TK: u32 = 32u;        // one unit of W per row per step
const TX: u32 = TN / RN;    // threads along n
const TY: u32 = TM / RM;    // threads along m
const NT: u32 = TX * TY;    // threads per workgroup
// row pitches of the tiles in workgroup memory: one word of padding against bank conflicts
const XP: u32 = TM + 1u;
const WP: u32 = TN + 1u;

struct Params {
    M: u32, N: u32, K: u32, tiles_m: u32,
    tiles_n: u32, x_off: u32, w_off: u32, b_off: u32,
    o_off: u32, row_bytes: u32, units: u32, has_bias: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<f32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> W: array<u32>;
@group(0) @binding(3) var<storage, {{IN_ACCESS}}> BIAS: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;

var<workgroup> xs: array<f32, TK * XP>;   // [k][m], row pitch XP
var<workgroup> ws: array<f32, TK * WP>;   // [k][n], row pitch WP

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
    let g = wid.x + wid.y * nwg.x;
    if (g >= P.tiles_m * P.tiles_n) {   // the same for the whole workgroup: barriers stay uniform
        return;
    }
    let m0 = (g / P.tiles_n) * TM;
    let n0 = (g % P.tiles_n) * TN;
    let tx = tid % TX;
    let ty = tid / TX;
    let M = P.M;
    let N = P.N;
    let K = P.K;

    var acc: array<array<f32, RN>, RM>;
    for (var i = 0u; i < RM; i++) {
        for (var j = 0u; j < RN; j++) {
            acc[i][j] = 0.0;
        }
    }
    for (var u = 0u; u < P.units; u++) {
        // W: the tile's TN rows, unit u of each: TN * 4 groups of 8 weights
        for (var q = tid; q < TN * 4u; q += NT) {
            let nl = q % TN;
            let j = q / TN;
            let n = n0 + nl;
            var w: Group;
            if (n < N) {
                w = group(unit(P.w_off + n * P.row_bytes, u), j);
            } else {
                w.a = vec4<f32>(0.0);
                w.b = vec4<f32>(0.0);
            }
            let at = 8u * j * WP + nl;
            ws[at] = w.a.x;
            ws[at + WP] = w.a.y;
            ws[at + 2u * WP] = w.a.z;
            ws[at + 3u * WP] = w.a.w;
            ws[at + 4u * WP] = w.b.x;
            ws[at + 5u * WP] = w.b.y;
            ws[at + 6u * WP] = w.b.z;
            ws[at + 7u * WP] = w.b.w;
        }
        // X: rows m0 .. m0 + TM, columns 32u .. 32u + 31
        for (var q = tid; q < TM * TK; q += NT) {
            let ml = q / TK;
            let kk = q % TK;
            let m = m0 + ml;
            var v = 0.0;
            if (m < M) {
                v = X[P.x_off + m * K + u * TK + kk];
            }
            xs[kk * XP + ml] = v;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            var a: array<f32, RM>;
            var b: array<f32, RN>;
            for (var i = 0u; i < RM; i++) {
                a[i] = xs[kk * XP + ty + i * TY];
            }
            for (var j = 0u; j < RN; j++) {
                b[j] = ws[kk * WP + tx + j * TX];
            }
            for (var i = 0u; i < RM; i++) {
                for (var j = 0u; j < RN; j++) {
                    acc[i][j] = fma(a[i], b[j], acc[i][j]);
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < RM; i++) {
        let m = m0 + ty + i * TY;
        if (m < M) {
            for (var j = 0u; j < RN; j++) {
                let n = n0 + tx + j * TX;
                if (n < N) {
                    var v = acc[i][j];
                    if (P.has_bias != 0u) {
                        v += BIAS[P.b_off + n];
                    }
                    OUT[P.o_off + m * N + n] = v;
                }
            }
        }
    }
}
