// Float32 rotate-half RoPE (Su et al. 2021, as transformers' Llama) of x [T, H, Dh] with
// tables cos, sin [S, Dh/2]: for i < Dh/2, with x1 = x[t, h, i], x2 = x[t, h, i + Dh/2] and
// row p of the tables, out[t, h, i] = x1 c - x2 s and out[t, h, i + Dh/2] = x2 c + x1 s.
//
// The table row: ``rope`` (per_row == 0) p = start + t, start the int64 pos[0], valid when
// 0 <= start <= S - T; ``rope_rows`` (per_row == 1) p = positions[t], int64 [T], valid when
// 0 <= p < S. int64 values are read as little-endian u32 word pairs. An invalid row is never
// read through: its output is left as it was (index_check.wgsl, run before this kernel,
// records the violation in the op's status slot).
//
// One thread per (t, h, i) pair (n = T * H * Dh/2 of them): it reads both halves, then
// writes both.
//
// Template parameters, substituted by backends/webgpu/ops.py before compiling:
// {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write' when out lies in an input's
// buffer (WebGPU forbids one buffer bound read-only and writable in one dispatch).
//
// Bindings: 0 the parameters below; 1 x; 2 cos; 3 sin; 4 the position(s) (u32 words, from
// word pos_off); 5 out. Buffers are bound whole: every index adds the tensor's element offset.
// Workgroups: a 1-d count ceil(n / NT), laid out x + y * num_workgroups.x
// (runtime.webgpu.grid); threads past n return at once.

const NT: u32 = 256u;

struct Params {
    n: u32, T: u32, H: u32, half: u32,
    S: u32, x_off: u32, c_off: u32, s_off: u32,
    pos_off: u32, o_off: u32, per_row: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<f32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> COS: array<f32>;
@group(0) @binding(3) var<storage, {{IN_ACCESS}}> SIN: array<f32>;
@group(0) @binding(4) var<storage, {{IN_ACCESS}}> POS: array<u32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let e = (wid.x + wid.y * nwg.x) * NT + lid;
    if (e >= P.n) {
        return;
    }
    let half = P.half;
    let i = e % half;
    let th = e / half;            // t * H + h
    let t = th / P.H;
    var p: u32;
    var ok: bool;
    if (P.per_row != 0u) {
        p = POS[P.pos_off + 2u * t];
        ok = POS[P.pos_off + 2u * t + 1u] == 0u && p < P.S;
    } else {
        let start = POS[P.pos_off];
        ok = POS[P.pos_off + 1u] == 0u && P.S >= P.T && start <= P.S - P.T;
        p = start + t;
    }
    if (!ok) {
        return;
    }
    let xb = P.x_off + th * 2u * half;
    let x1 = X[xb + i];
    let x2 = X[xb + i + half];
    let c = COS[P.c_off + p * half + i];
    let s = SIN[P.s_off + p * half + i];
    let ob = P.o_off + th * 2u * half;
    OUT[ob + i] = x1 * c - x2 * s;
    OUT[ob + i + half] = x2 * c + x1 * s;
}
