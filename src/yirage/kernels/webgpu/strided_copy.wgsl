// Strided copy of raw elements: the layout ops (permute, expand, slice, select, cat, pad) and the
// indexing ops (index_select, gather) of backends/webgpu/layout.py.
//
// The copy walks a logical index space of ``ndim`` (<= 6) dims of sizes ``size``; logical
// element e, at coordinates c, is written to out element out_off + sum(c[d] * out_stride[d]) and
// read from x element in_off + sum((c[d] - lo[d]) * in_stride[d]). A coordinate outside
// [lo[d], lo[d] + in_size[d]) of some dim reads nothing: the pad value (bits pad_lo, pad_hi) is
// written instead (``pad``; the other ops pass lo 0 and in_size 2^32 - 1). With gather_dim < ndim,
// that dim's coordinate of x is not c[gather_dim] but the int64 index at word idx_off + 2 *
// sum(c[d] * idx_stride[d]) (``index_select``: idx_stride 1 along its dim and 0 elsewhere;
// ``gather``: the index's contiguous strides); an index outside [0, bound) is skipped (its
// output element left as it was: index_check.wgsl, run before, records it in the op's status).
//
// Elements are moved as raw bits, BITS wide (8: bool, int8; 16: float16, bfloat16; 32:
// float32, int32; 64: int64, two u32 words). Sub-word elements are read from their u32 word
// and written with atomicAnd / atomicOr on the element's own bits, so neighbouring threads (and
// neighbouring tensors in a shared arena buffer) never lose each other's writes.
//
// Template parameters, substituted by backends/webgpu/layout.py before compiling:
// {{BITS}}: element width in bits (8, 16, 32 or 64).
// {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write' when out lies in an input's
// buffer (WebGPU forbids one buffer bound read-only and writable in one dispatch).
//
// Bindings: 0 the parameters (48 u32 words, layout below); 1 x (u32 words); 2 the int64 index
// (u32 words; x bound again, never read, without one); 3 out (atomic u32 words).
// Buffers are bound whole: every index adds the tensor's element offset.
// Workgroups: a 1-d count ceil(n / NT), laid out x + y * num_workgroups.x
// (runtime.webgpu.grid); threads past n return at once.

const NT: u32 = 256u;
const BITS: u32 = {{BITS}}u;
const NONE: u32 = 0xffffffffu;
const SUB: u32 = min(BITS, 16u);   // sub-word width (unused for 32 and 64 bits)

// words: 0 n, 1 ndim, 2 in_off, 3 out_off, 4 has_pad, 5 pad_lo, 6 pad_hi, 7 gather_dim,
// 8 idx_off (u32 words), 9 bound, 10-11 unused, 12-17 size, 18-23 in_stride, 24-29 out_stride,
// 30-35 lo, 36-41 in_size, 42-47 idx_stride
struct Params {
    w: array<vec4<u32>, 12>,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<u32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> IDX: array<u32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<atomic<u32>>;

fn p(i: u32) -> u32 {
    return P.w[i / 4u][i % 4u];
}

// element i of x as (low word, high word); sub-word elements zero-extended
fn load(i: u32) -> vec2<u32> {
    if (BITS == 64u) {
        return vec2<u32>(X[2u * i], X[2u * i + 1u]);
    }
    if (BITS == 32u) {
        return vec2<u32>(X[i], 0u);
    }
    let per = 32u / SUB;
    let sh = (i % per) * SUB;
    let mask = (1u << SUB) - 1u;
    return vec2<u32>((X[i / per] >> sh) & mask, 0u);
}

fn store(i: u32, v: vec2<u32>) {
    if (BITS == 64u) {
        atomicStore(&OUT[2u * i], v.x);
        atomicStore(&OUT[2u * i + 1u], v.y);
        return;
    }
    if (BITS == 32u) {
        atomicStore(&OUT[i], v.x);
        return;
    }
    let per = 32u / SUB;
    let sh = (i % per) * SUB;
    let mask = (1u << SUB) - 1u;
    atomicAnd(&OUT[i / per], ~(mask << sh));
    atomicOr(&OUT[i / per], (v.x & mask) << sh);
}

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let e = (wid.x + wid.y * nwg.x) * NT + lid;
    if (e >= p(0u)) {
        return;
    }
    let nd = p(1u);
    let gd = p(7u);
    var rem = e;
    var src = p(2u);
    var dst = p(3u);
    var ipos = 0u;
    var inside = true;
    for (var k = nd; k > 0u; k -= 1u) {
        let d = k - 1u;
        let s = p(12u + d);
        let c = rem % s;
        rem = rem / s;
        dst += c * p(24u + d);
        ipos += c * p(42u + d);
        if (d != gd) {
            let lo = p(30u + d);
            if (c < lo || c - lo >= p(36u + d)) {
                inside = false;
            }
            src += (c - lo) * p(18u + d);   // wraps when outside: then never read
        }
    }
    if (gd != NONE) {
        let w = p(8u) + 2u * ipos;
        let lo_word = IDX[w];
        let hi_word = IDX[w + 1u];
        if (hi_word != 0u || lo_word >= p(9u)) {
            return;   // out of range: recorded by index_check.wgsl, nothing read or written
        }
        src += lo_word * p(18u + gd);
    }
    var v = vec2<u32>(p(5u), p(6u));
    if (inside) {
        v = load(src);
    } else if (p(4u) == 0u) {
        return;
    }
    store(dst, v);
}
