// Embedding lookup over a GGUF block-quantized table: out[t, c] = dequantize(table)[ids[t], c].
//
// ids are T integers (int64 read as little-endian u32 word pairs, wide == 2; or int32,
// wide == 1); the table is the [V, H] tensor's block storage (yirage's uint8 bytes, each row
// H / per blocks: qblocks.wgsl, which backends/webgpu/qembed.py puts in front of this text:
// `unit`, `group`), bound as array<u32>; out is [T, H] float32. An id outside [0, V) is never
// read through: its output row is left as it was (index_check.wgsl, run before this kernel,
// records the violation in the op's status slot). The weights are decoded as qblocks.wgsl
// decodes them (gguf-py's ``dequantize``, ``ir.ops.dequantize``).
//
// One thread per 8 output weights (one `group` of a unit of 32): n = T * H / 8 threads, the
// neighbouring threads along a row.
//
// Template parameters, substituted by backends/webgpu/qembed.py before compiling: {{QTYPE}}
// (qblocks.wgsl) and {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write' when out
// lies in an input's buffer (at other bytes: WebGPU forbids one buffer bound read-only and
// writable in one dispatch).
//
// Bindings: 0 the parameters below; 1 ids (u32 words, from word ids_off); 2 W (the table's
// bytes as u32 words, from byte w_off); 3 out (from element o_off). Buffers are bound whole.
// Workgroups: a 1-d count ceil(n / NT), laid out x + y * num_workgroups.x (runtime.webgpu.grid);
// threads past n return at once.

const NT: u32 = 256u;

struct Params {
    n: u32, H: u32, V: u32, wide: u32,
    ids_off: u32, w_off: u32, o_off: u32, row_bytes: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> IDS: array<u32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> W: array<u32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let e = (wid.x + wid.y * nwg.x) * NT + lid;
    if (e >= P.n) {
        return;
    }
    let per_row = P.H / 8u;          // groups of 8 weights per row
    let t = e / per_row;
    let r = e % per_row;
    let lo = IDS[P.ids_off + t * P.wide];
    var neg = (lo & 0x80000000u) != 0u;
    if (P.wide == 2u) {
        neg = IDS[P.ids_off + t * 2u + 1u] != 0u;
    }
    if (neg || lo >= P.V) {
        return;
    }
    let un = unit(P.w_off + lo * P.row_bytes, r / 4u);
    let g = group(un, r % 4u);
    let o = P.o_off + t * P.H + 8u * r;
    OUT[o] = g.a.x;
    OUT[o + 1u] = g.a.y;
    OUT[o + 2u] = g.a.z;
    OUT[o + 3u] = g.a.w;
    OUT[o + 4u] = g.b.x;
    OUT[o + 5u] = g.b.y;
    OUT[o + 6u] = g.b.z;
    OUT[o + 7u] = g.b.w;
}
