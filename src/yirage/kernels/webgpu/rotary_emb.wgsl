// Float32 rotate-half RoPE with per-element tables (transformers' apply_rotary_pos_emb):
// out = x * cos + rotate_half(x) * sin, rotate_half(x)[..., d] = -x[..., d + D/2] for
// d < D/2 and x[..., d - D/2] after.
//
// x and out are contiguous [d0, d1, d2, d3] (the shape left-padded with 1s to 4 dims; D = d3);
// cos and sin are read through the strides of their broadcast to that shape (cs*, ss*: 0
// along a broadcast dim), in elements.
//
// One thread per element of out (n of them).
//
// Template parameters, substituted by backends/webgpu/ops.py before compiling:
// {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write' when out lies in an input's
// buffer (WebGPU forbids one buffer bound read-only and writable in one dispatch).
//
// Bindings: 0 the parameters below; 1 x; 2 cos; 3 sin; 4 out. Buffers are bound whole: every
// index adds the tensor's element offset.
// Workgroups: a 1-d count ceil(n / NT), laid out x + y * num_workgroups.x
// (runtime.webgpu.grid); threads past n return at once.

const NT: u32 = 256u;

struct Params {
    n: u32, d1: u32, d2: u32, d3: u32,
    x_off: u32, c_off: u32, s_off: u32, o_off: u32,
    cs0: u32, cs1: u32, cs2: u32, cs3: u32,
    ss0: u32, ss1: u32, ss2: u32, ss3: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<f32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> COS: array<f32>;
@group(0) @binding(3) var<storage, {{IN_ACCESS}}> SIN: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let e = (wid.x + wid.y * nwg.x) * NT + lid;
    if (e >= P.n) {
        return;
    }
    let i3 = e % P.d3;
    var r = e / P.d3;
    let i2 = r % P.d2;
    r = r / P.d2;
    let i1 = r % P.d1;
    let i0 = r / P.d1;
    let half = P.d3 / 2u;
    var rot: f32;
    if (i3 < half) {
        rot = -X[P.x_off + e + half];
    } else {
        rot = X[P.x_off + e - half];
    }
    let c = COS[P.c_off + i0 * P.cs0 + i1 * P.cs1 + i2 * P.cs2 + i3 * P.cs3];
    let s = SIN[P.s_off + i0 * P.ss0 + i1 * P.ss1 + i2 * P.ss2 + i3 * P.ss3];
    OUT[P.o_off + e] = X[P.x_off + e] * c + rot * s;
}
