// A conv2d's inference BatchNorm (ir/conv.py's ``bn`` attribute) as a per-channel scale and
// shift for the convolution's epilogue (conv_common.wgsl): out[c] = alpha = weight[c] /
// sqrt(var[c] + eps) and out[C + c] = beta = bias[c] - mean[c] * alpha (weight 1 and bias 0
// without ``affine``), computed as batch_norm.wgsl computes them, one channel per invocation.
// It runs before each convolution, so statistics written between runs are seen.
//
// Template parameters, substituted by backends/webgpu/conv.py before compiling: {{WG}} (the
// workgroup size) and {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write' when out
// lies in an input's buffer (at other elements).
//
// Bindings: 0 the parameters below; 1 running_mean; 2 running_var; 3 weight; 4 bias (any
// buffer when affine == 0: never read); 5 out [2 * C]. Buffers are bound whole: every index
// adds the tensor's element offset. Workgroups: ceil(C / WG), 1-d (runtime.webgpu.grid).

const WG: u32 = {{WG}}u;

struct Params {
    C: u32, mean_off: u32, var_off: u32, w_off: u32, b_off: u32, o_off: u32,
    affine: u32,
    eps: u32,   // f32 bits
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> MEAN: array<f32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> VAR: array<f32>;
@group(0) @binding(3) var<storage, {{IN_ACCESS}}> BW: array<f32>;
@group(0) @binding(4) var<storage, {{IN_ACCESS}}> BB: array<f32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let c = (wid.x + wid.y * nwg.x) * WG + lid;
    if (c >= P.C) {
        return;
    }
    var alpha = 1.0 / sqrt(VAR[P.var_off + c] + bitcast<f32>(P.eps));
    var beta = 0.0;
    if (P.affine != 0u) {
        alpha *= BW[P.w_off + c];
        beta = BB[P.b_off + c];
    }
    OUT[P.o_off + c] = alpha;
    OUT[P.o_off + P.C + c] = beta - MEAN[P.mean_off + c] * alpha;
}
