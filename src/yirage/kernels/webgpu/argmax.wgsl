// Float32 argmax over the last dim: out[r] (int64) = the index of the largest of x[r, 0..D),
// as torch.argmax: the first of equal maxima, and a NaN counts as larger than any number
// (the first NaN wins). x is [R, D] row-major; out [R] int64, written as little-endian u32
// word pairs (the high word 0).
//
// One workgroup per row: thread i keeps the best of d = i, i + NT, ...; a tree reduction
// in workgroup memory combines them (ties to the lower index).
//
// Template parameters, substituted by backends/webgpu/ops.py before compiling:
// {{IN_ACCESS}}: x's access mode, 'read', or 'read_write' when out lies in x's buffer
// (WebGPU forbids one buffer bound read-only and writable in one dispatch).
//
// Bindings: 0 the parameters below; 1 x; 2 out (u32 words, from word o_off). Buffers are
// bound whole: every index adds the tensor's offset.
// Workgroups: a 1-d count R, laid out x + y * num_workgroups.x (runtime.webgpu.grid); the
// extra groups of the last row return at once.

const NT: u32 = 256u;

struct Params {
    R: u32, D: u32, x_off: u32, o_off: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<f32>;
@group(0) @binding(2) var<storage, read_write> OUT: array<u32>;

var<workgroup> vals: array<f32, NT>;
var<workgroup> idxs: array<u32, NT>;

fn is_nan(v: f32) -> bool {   // by the bits: a compiler may assume v == v
    return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
}

// is (a, ia) a better argmax candidate than (b, ib)? (ib == 0xffffffff: no candidate)
fn better(a: f32, ia: u32, b: f32, ib: u32) -> bool {
    if (ia == 0xffffffffu) {
        return false;
    }
    if (ib == 0xffffffffu) {
        return true;
    }
    let an = is_nan(a);
    let bn = is_nan(b);
    if (an || bn) {
        return an && (!bn || ia < ib);
    }
    return a > b || (a == b && ia < ib);
}

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= P.R) {   // the same for the whole workgroup: barriers stay uniform
        return;
    }
    let base = P.x_off + r * P.D;
    var bv = 0.0;
    var bi = 0xffffffffu;
    for (var d = lid; d < P.D; d += NT) {
        let v = X[base + d];
        if (better(v, d, bv, bi)) {
            bv = v;
            bi = d;
        }
    }
    vals[lid] = bv;
    idxs[lid] = bi;
    workgroupBarrier();
    for (var s = NT / 2u; s > 0u; s = s / 2u) {
        if (lid < s && better(vals[lid + s], idxs[lid + s], vals[lid], idxs[lid])) {
            vals[lid] = vals[lid + s];
            idxs[lid] = idxs[lid + s];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        OUT[P.o_off + 2u * r] = idxs[0];
        OUT[P.o_off + 2u * r + 1u] = 0u;
    }
}
