// Float32 embedding lookup: out[t, c] = table[ids[t], c].
//
// ids are T integers (int64 read as little-endian u32 word pairs, wide == 2; or int32,
// wide == 1); table is [V, H] float32 row-major; out is [T, H] float32. An id outside
// [0, V) is never read through: its output row is left as it was (index_check.wgsl, run
// before this kernel, records the violation in the op's status slot).
//
// One thread per output element (n = T * H of them), neighbouring threads along a row.
//
// Template parameters, substituted by backends/webgpu/ops.py before compiling:
// {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write' when out lies in an input's
// buffer (at other elements: WebGPU forbids one buffer bound read-only and writable in one
// dispatch).
//
// Bindings: 0 the parameters below; 1 ids (u32 words, from word ids_off); 2 table; 3 out.
// Buffers are bound whole: every index adds the tensor's element offset.
// Workgroups: a 1-d count ceil(n / NT), laid out x + y * num_workgroups.x
// (runtime.webgpu.grid); threads past n return at once.

const NT: u32 = 256u;

struct Params {
    n: u32, H: u32, V: u32, wide: u32,
    ids_off: u32, t_off: u32, o_off: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> IDS: array<u32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> TABLE: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let e = (wid.x + wid.y * nwg.x) * NT + lid;
    if (e >= P.n) {
        return;
    }
    let t = e / P.H;
    let c = e % P.H;
    let lo = IDS[P.ids_off + t * P.wide];
    var neg = (lo & 0x80000000u) != 0u;
    if (P.wide == 2u) {
        neg = IDS[P.ids_off + t * 2u + 1u] != 0u;
    }
    if (neg || lo >= P.V) {
        return;
    }
    OUT[P.o_off + e] = TABLE[P.t_off + lo * P.H + c];
}
