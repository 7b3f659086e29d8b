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
// The storage is not in this file: backends/webgpu/layout.py puts one of two in front of it,
// each declaring the bindings 1-3 and ``Elem``, ``load(i) -> Elem``, ``store(i, v)`` and
// ``pad_value() -> Elem``:
// - strided_copy_bits.wgsl: raw bits, BITS wide, in u32 words (every dtype; sub-word elements
//   written with atomicAnd / atomicOr on their own bits);
// - strided_copy_f16.wgsl: float16 as array<f16> where the device has shader-f16 (plain loads
//   and stores, no atomics).
//
// Bindings: 0 the parameters (48 u32 words, layout below); 1 x; 2 the int64 index (u32 words;
// x bound again, never read, without one); 3 out.
// Buffers are bound whole: every index adds the tensor's element offset.
// Workgroups: a 1-d count ceil(n / NT), laid out x + y * num_workgroups.x
// (runtime.webgpu.grid); threads past n return at once.

const NT: u32 = 256u;
const NONE: u32 = 0xffffffffu;

// words: 0 n, 1 ndim, 2 in_off, 3 out_off, 4 has_pad, 5 pad_lo, 6 pad_hi, 7 gather_dim,
// 8 idx_off (u32 words), 9 bound, 10-11 unused, 12-17 size, 18-23 in_stride, 24-29 out_stride,
// 30-35 lo, 36-41 in_size, 42-47 idx_stride
struct Params {
    w: array<vec4<u32>, 12>,
};

@group(0) @binding(0) var<uniform> P: Params;

fn p(i: u32) -> u32 {
    return P.w[i / 4u][i % 4u];
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
    var v = pad_value();
    if (inside) {
        v = load(src);
    } else if (p(4u) == 0u) {
        return;
    }
    store(dst, v);
}
