// Tiled float32 GEMM, batched: out[b, m, n] = sum_k X[b, m, k] * W(b, n, k) (+ bias[n]).
//
// X is [M, K] row-major per batch; W is [N, K] row-major ("nk", out = X @ W^T, a linear
// layer's weight) or, with W_KN, [K, N] row-major ("kn", out = X @ W: torch.matmul's second
// operand); out is [M, N] row-major per batch. Batch b's operands start at off + b * bs
// (elements); a batch stride of 0 broadcasts an operand over the batch.
//
// Each workgroup computes one TILE_M x TILE_N tile of one batch's output, stepping over K
// TILE_K at a time: the X and W tiles are staged in workgroup memory (zero-filled outside
// M, N and K, so any positive sizes work), then each of the (TILE_M / REG_M) x
// (TILE_N / REG_N) threads accumulates a REG_M x REG_N block of the tile in registers, in
// f32. Thread (ty, tx) owns rows ty + i * TY and columns tx + j * TX, so that neighbouring
// threads write neighbouring columns.
//
// Template parameters, substituted by backends/webgpu/library.py before compiling:
// {{TILE_M}}, {{TILE_N}}, {{TILE_K}}, {{REG_M}}, {{REG_N}} (u32; TILE_M % REG_M == 0,
// TILE_N % REG_N == 0), {{W_KN}} (bool) and {{IN_ACCESS}}: the inputs' access mode, 'read',
// or 'read_write' when out lies in an input's buffer (at other elements: WebGPU forbids one
// buffer bound read-only and writable in one dispatch, but allows it writable twice).
//
// Bindings: 0 the parameters below; 1 X; 2 W; 3 bias (any buffer when has_bias == 0: never
// read); 4 out. Buffers are bound whole: every index adds the tensor's element offset.
// Workgroups: a 1-d count batch * tiles_m * tiles_n, laid out x + y * num_workgroups.x
// (runtime.webgpu.grid); the extra groups of the last row return at once.

const TM: u32 = {{TILE_M}}u;
const TN: u32 = {{TILE_N}}u;
const TK: u32 = {{TILE_K}}u;
const RM: u32 = {{REG_M}}u;
const RN: u32 = {{REG_N}}u;
const W_KN: bool = {{W_KN}};
const TX: u32 = TN / RN;   // threads along n
const TY: u32 = TM / RM;   // threads along m
const NT: u32 = TX * TY;   // threads per workgroup
// row pitches of the tiles in workgroup memory: one word of padding, so that the loaders'
// stores down a column (consecutive k) fall in different banks
const XP: u32 = TM + 1u;
const WP: u32 = TN + 1u;

struct Params {
    M: u32, N: u32, K: u32, batch: u32,
    x_off: u32, w_off: u32, b_off: u32, o_off: u32,
    x_bs: u32, w_bs: u32, o_bs: u32, has_bias: u32,
    tiles_m: u32, tiles_n: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<f32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> W: array<f32>;
@group(0) @binding(3) var<storage, {{IN_ACCESS}}> BIAS: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;

var<workgroup> xs: array<f32, TK * XP>;   // [k][m], row pitch XP
var<workgroup> ws: array<f32, TK * WP>;   // [k][n], row pitch WP

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
    let tiles = P.tiles_m * P.tiles_n;
    let g = wid.x + wid.y * nwg.x;
    if (g >= P.batch * tiles) {   // the same for the whole workgroup: barriers stay uniform
        return;
    }
    let bi = g / tiles;
    let r = g % tiles;
    let m0 = (r / P.tiles_n) * TM;
    let n0 = (r % P.tiles_n) * TN;
    let M = P.M;
    let N = P.N;
    let K = P.K;
    let xb = P.x_off + bi * P.x_bs;
    let wb = P.w_off + bi * P.w_bs;
    let ob = P.o_off + bi * P.o_bs;
    let tx = tid % TX;
    let ty = tid / TX;

    var acc: array<f32, RM * RN>;
    for (var i = 0u; i < RM * RN; i++) {
        acc[i] = 0.0;
    }
    var a: array<f32, RM>;
    var b: array<f32, RN>;

    for (var k0 = 0u; k0 < K; k0 += TK) {
        // X tile: consecutive threads read consecutive k of a row
        for (var i = tid; i < TM * TK; i += NT) {
            let kk = i % TK;
            let mm = i / TK;
            let gm = m0 + mm;
            let gk = k0 + kk;
            var v = 0.0;
            if (gm < M && gk < K) {
                v = X[xb + gm * K + gk];
            }
            xs[kk * XP + mm] = v;
        }
        // W tile: consecutive threads read consecutive elements of W's rows
        for (var i = tid; i < TN * TK; i += NT) {
            var kk: u32;
            var nn: u32;
            if (W_KN) {
                nn = i % TN;
                kk = i / TN;
            } else {
                kk = i % TK;
                nn = i / TK;
            }
            let gn = n0 + nn;
            let gk = k0 + kk;
            var v = 0.0;
            if (gn < N && gk < K) {
                if (W_KN) {
                    v = W[wb + gk * N + gn];
                } else {
                    v = W[wb + gn * K + gk];
                }
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
        let n = n0 + tx + j * TX;
        if (n >= N) {
            continue;
        }
        var bias = 0.0;
        if (P.has_bias != 0u) {
            bias = BIAS[P.b_off + n];
        }
        for (var i = 0u; i < RM; i++) {
            let m = m0 + ty + i * TY;
            if (m < M) {
                OUT[ob + m * N + n] = acc[i * RN + j] + bias;
            }
        }
    }
}
