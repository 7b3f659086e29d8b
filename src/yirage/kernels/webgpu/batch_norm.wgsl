// Float32 inference BatchNorm over channel dim 1 of x [N, C, ...] (contiguous), one element
// per invocation, as torch's CPU kernel computes it: alpha = weight[c] / sqrt(var[c] + eps),
// beta = bias[c] - mean[c] * alpha, out = x * alpha + beta (weight 1 and bias 0 without
// ``affine``). Element i's channel is (i / inner) % C, inner = the product of the dims after
// C; every index stays below total = N * C * inner.
//
// Template parameters, substituted by backends/webgpu/conv.py before compiling: {{WG}} (the
// workgroup size) and {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write' when out
// lies in an input's buffer (x's own elements included: each invocation reads x[i] before it
// writes out[i], so it may run in place).
//
// Bindings: 0 the parameters below; 1 x; 2 running_mean; 3 running_var; 4 weight; 5 bias (any
// buffer when affine == 0: never read); 6 out. Buffers are bound whole: every index adds the
// tensor's element offset. Workgroups: ceil(total / WG) as a 1-d count laid out
// x + y * num_workgroups.x (runtime.webgpu.grid); invocations past the end return.

const WG: u32 = {{WG}}u;

struct Params {
    total: u32, C: u32, inner: u32,
    x_off: u32, mean_off: u32, var_off: u32, w_off: u32, b_off: u32, o_off: u32,
    affine: u32,
    eps: u32,   // f32 bits
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<f32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> MEAN: array<f32>;
@group(0) @binding(3) var<storage, {{IN_ACCESS}}> VAR: array<f32>;
@group(0) @binding(4) var<storage, {{IN_ACCESS}}> BW: array<f32>;
@group(0) @binding(5) var<storage, {{IN_ACCESS}}> BB: array<f32>;
@group(0) @binding(6) var<storage, read_write> OUT: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    if (i >= P.total) {
        return;
    }
    let c = (i / P.inner) % P.C;
    var alpha = 1.0 / sqrt(VAR[P.var_off + c] + bitcast<f32>(P.eps));
    var beta = 0.0;
    if (P.affine != 0u) {
        alpha *= BW[P.w_off + c];
        beta = BB[P.b_off + c];
    }
    beta -= MEAN[P.mean_off + c] * alpha;
    OUT[P.o_off + i] = X[P.x_off + i] * alpha + beta;
}
