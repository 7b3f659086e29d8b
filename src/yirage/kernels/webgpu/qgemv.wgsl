// GEMV over a GGUF block-quantized weight, for a few rows at once (decode, and small M):
// out[m, n] = sum_k X[m, k] * W[n, k] (+ bias[n]), W dequantized in registers as it is read.
//
// X is [M, K] float32 row-major, W the [N, K] weight's block storage (qblocks.wgsl, which
// backends/webgpu/quant.py puts in front of this text: `unit`, `group`), out [M, N] float32.
// K is a multiple of the format's block (32 or 256 weights).
//
// One workgroup per block of ROWS output features and chunk of MR rows of X: TPR threads per
// feature split the row of W in units of 32 weights (thread t takes units t, t + TPR, ...:
// neighbouring threads read neighbouring blocks), decode each unit's scales once and its
// weights 8 at a time, and multiply them into MR accumulators (one per row of X: each weight
// is decoded once for the MR rows); a tree reduction in workgroup memory then adds the TPR
// partial sums of each (feature, row).
//
// Template parameters, substituted by backends/webgpu/quant.py before compiling: {{ROWS}},
// {{TPR}} (a power of two), {{MR}} (rows of X per workgroup), {{QTYPE}} (qblocks.wgsl) and
// {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write' when out lies in an input's
// buffer (at other elements: WebGPU forbids one buffer bound read-only and writable in one
// dispatch).
//
// Bindings: 0 the parameters below; 1 X; 2 W (bytes, as u32 words); 3 bias (any buffer when
// has_bias == 0: never read); 4 out. Buffers are bound whole: X's, bias's and out's element
// offsets and W's byte offset are parameters. Workgroups: a 1-d count chunks * blocks, laid out
// x + y * num_workgroups.x (runtime.webgpu.grid); the extra groups of the last row return.

const ROWS: u32 = {{ROWS}}u;
const TPR: u32 = {{TPR}}u;
const MR: u32 = {{MR}}u;
const NT: u32 = ROWS * TPR;

struct Params {
    M: u32, N: u32, K: u32, blocks: u32,
    chunks: u32, x_off: u32, w_off: u32, b_off: u32,
    o_off: u32, row_bytes: u32, units: u32, has_bias: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<f32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> W: array<u32>;
@group(0) @binding(3) var<storage, {{IN_ACCESS}}> BIAS: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;

var<workgroup> red: array<f32, NT * MR>;   // [row of X][feature][thread]

// X[row m, k .. k + 3] (any alignment: x's offset is any element)
fn x4(i: u32) -> vec4<f32> {
    return vec4<f32>(X[i], X[i + 1u], X[i + 2u], X[i + 3u]);
}

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    if (g >= P.chunks * P.blocks) {   // the same for the whole workgroup: barriers stay uniform
        return;
    }
    let m0 = (g / P.blocks) * MR;
    let r = lid / TPR;
    let t = lid % TPR;
    let n = (g % P.blocks) * ROWS + r;
    let K = P.K;
    let rows = min(MR, P.M - m0);

    var acc: array<f32, MR>;
    for (var i = 0u; i < MR; i++) {
        acc[i] = 0.0;
    }
    if (n < P.N) {
        let row = P.w_off + n * P.row_bytes;
        for (var u = t; u < P.units; u += TPR) {
            let un = unit(row, u);
            for (var j = 0u; j < 4u; j++) {
                let w = group(un, j);
                let k = P.x_off + m0 * K + u * 32u + j * 8u;
                for (var i = 0u; i < MR; i++) {
                    if (i < rows) {
                        let xi = k + i * K;
                        acc[i] += dot(w.a, x4(xi)) + dot(w.b, x4(xi + 4u));
                    }
                }
            }
        }
    }
    for (var i = 0u; i < MR; i++) {
        red[(i * ROWS + r) * TPR + t] = acc[i];
    }
    workgroupBarrier();
    for (var s = TPR / 2u; s > 0u; s = s / 2u) {
        if (t < s) {
            for (var i = 0u; i < MR; i++) {
                let at = (i * ROWS + r) * TPR + t;
                red[at] += red[at + s];
            }
        }
        workgroupBarrier();
    }
    if (t == 0u && n < P.N) {
        var b = 0.0;
        if (P.has_bias != 0u) {
            b = BIAS[P.b_off + n];
        }
        for (var i = 0u; i < rows; i++) {
            OUT[P.o_off + (m0 + i) * P.N + n] = red[(i * ROWS + r) * TPR] + b;
        }
    }
}
