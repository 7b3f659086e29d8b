// Float32 GEMV (the M = 1 rows of a decode step), batched:
// out[b, n] = sum_k x[b, k] * W(b, n, k) (+ bias[n]).
//
// x is [K] per batch; W is [N, K] row-major ("nk": a linear layer's weight, out = W x) or,
// with W_KN, [K, N] row-major ("kn", out = x W); out is [N] per batch. Batch b's operands
// start at off + b * bs (elements); a batch stride of 0 broadcasts an operand.
//
// One workgroup per block of ROWS output features of one batch: TPR threads per feature
// split K (thread t sums k = t, t + TPR, ...) in f32, then a tree reduction in workgroup
// memory adds their partial sums. The thread-to-(feature, k) map follows W's layout so that
// neighbouring threads read neighbouring elements: "nk" puts a feature's TPR threads side by
// side (along a row of W), "kn" puts the ROWS features side by side (along a row of W).
//
// Template parameters, substituted by backends/webgpu/library.py before compiling:
// {{ROWS}} and {{TPR}} (u32, TPR a power of two), {{W_KN}} (bool) and {{IN_ACCESS}}: the
// inputs' access mode, 'read', or 'read_write' when out lies in an input's buffer (at other
// elements: WebGPU forbids one buffer bound read-only and writable in one dispatch).
//
// Bindings: 0 the parameters below; 1 x; 2 W; 3 bias (any buffer when has_bias == 0: never
// read); 4 out. Buffers are bound whole: every index adds the tensor's element offset.
// Workgroups: a 1-d count batch * blocks, laid out x + y * num_workgroups.x
// (runtime.webgpu.grid); the extra groups of the last row return at once.

const ROWS: u32 = {{ROWS}}u;
const TPR: u32 = {{TPR}}u;
const W_KN: bool = {{W_KN}};
const NT: u32 = ROWS * TPR;

struct Params {
    N: u32, K: u32, batch: u32, blocks: u32,
    x_off: u32, w_off: u32, b_off: u32, o_off: u32,
    x_bs: u32, w_bs: u32, o_bs: u32, has_bias: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<f32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> W: array<f32>;
@group(0) @binding(3) var<storage, {{IN_ACCESS}}> BIAS: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;

var<workgroup> red: array<f32, NT>;   // [feature][thread]

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    if (g >= P.batch * P.blocks) {   // the same for the whole workgroup: barriers stay uniform
        return;
    }
    let bi = g / P.blocks;
    let n0 = (g % P.blocks) * ROWS;
    let N = P.N;
    let K = P.K;
    var r: u32;
    var t: u32;
    if (W_KN) {
        r = lid % ROWS;
        t = lid / ROWS;
    } else {
        r = lid / TPR;
        t = lid % TPR;
    }
    let n = n0 + r;
    let xb = P.x_off + bi * P.x_bs;
    let wb = P.w_off + bi * P.w_bs;

    var acc = 0.0;
    if (n < N) {
        if (W_KN) {
            for (var k = t; k < K; k += TPR) {
                acc = fma(X[xb + k], W[wb + k * N + n], acc);
            }
        } else {
            let row = wb + n * K;
            for (var k = t; k < K; k += TPR) {
                acc = fma(X[xb + k], W[row + k], acc);
            }
        }
    }
    red[r * TPR + t] = acc;
    workgroupBarrier();
    for (var s = TPR / 2u; s > 0u; s = s / 2u) {
        if (t < s) {
            red[r * TPR + t] += red[r * TPR + t + s];
        }
        workgroupBarrier();
    }
    if (t == 0u && n < N) {
        var v = red[r * TPR];
        if (P.has_bias != 0u) {
            v += BIAS[P.b_off + n];
        }
        OUT[P.o_off + bi * P.o_bs + n] = v;
    }
}
