// cumsum along one dim of x viewed as [outer, n, inner] (row-major): out[o, j, i] =
// sum(x[o, 0..j, i]). Float inputs (float32, float16, bfloat16) sum in float32 and write x's
// dtype (each prefix rounded once); bool, int32 and int64 sum in int64 (two's complement,
// wrapping as torch's) and write int64.
//
// One thread per (o, i) line (lines = outer * inner of them), scanning its n elements in order.
//
// Template parameters, substituted by backends/webgpu/layout.py before compiling:
// {{KIND}}: x's element kind: 0 float32, 1 float16, 2 bfloat16, 3 bool (one byte), 4 int32,
// 5 int64.
// {{IN_ACCESS}}: x's access mode, 'read', or 'read_write' when out lies in x's buffer.
//
// Bindings: 0 the parameters below; 1 x (u32 words); 2 out (atomic u32 words: float16 and
// bfloat16 outputs are written as 16-bit halves of words with atomicAnd / atomicOr).
// Offsets are in elements of each tensor's own dtype.
// Workgroups: a 1-d count ceil(lines / NT), laid out x + y * num_workgroups.x.

const NT: u32 = 256u;
const KIND: u32 = {{KIND}}u;

struct Params {
    lines: u32, n: u32, inner: u32, in_off: u32,
    out_off: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<u32>;
@group(0) @binding(2) var<storage, read_write> OUT: array<atomic<u32>>;

fn bits16(i: u32) -> u32 {
    return (X[i / 2u] >> ((i % 2u) * 16u)) & 0xffffu;
}

fn load_f(i: u32) -> f32 {
    if (KIND == 1u) {
        return unpack2x16float(bits16(i)).x;
    }
    if (KIND == 2u) {
        return bitcast<f32>(bits16(i) << 16u);
    }
    return bitcast<f32>(X[i]);
}

// an integer element as the words of its int64 (sign-extended)
fn load_i(i: u32) -> vec2<u32> {
    if (KIND == 5u) {
        return vec2<u32>(X[2u * i], X[2u * i + 1u]);
    }
    if (KIND == 3u) {
        return vec2<u32>((X[i / 4u] >> ((i % 4u) * 8u)) & 0xffu, 0u);
    }
    let v = X[i];
    return vec2<u32>(v, select(0u, 0xffffffffu, (v & 0x80000000u) != 0u));
}

fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn store_f(i: u32, v: f32) {
    if (KIND == 0u) {
        atomicStore(&OUT[i], bitcast<u32>(v));
        return;
    }
    var b: u32;
    if (KIND == 1u) {
        b = pack2x16float(vec2<f32>(v, 0.0)) & 0xffffu;
    } else {
        let u = bitcast<u32>(v);
        b = select((u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u, (u >> 16u) | 0x40u, is_nan(v));
    }
    let sh = (i % 2u) * 16u;
    atomicAnd(&OUT[i / 2u], ~(0xffffu << sh));
    atomicOr(&OUT[i / 2u], b << sh);
}

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let line = (wid.x + wid.y * nwg.x) * NT + lid;
    if (line >= P.lines) {
        return;
    }
    let o = line / P.inner;
    let i = line % P.inner;
    let base = o * P.n * P.inner + i;
    if (KIND <= 2u) {
        var acc = 0.0;
        for (var j = 0u; j < P.n; j += 1u) {
            let at = base + j * P.inner;
            acc += load_f(P.in_off + at);
            store_f(P.out_off + at, acc);
        }
    } else {
        var lo = 0u;
        var hi = 0u;
        for (var j = 0u; j < P.n; j += 1u) {
            let at = base + j * P.inner;
            let v = load_i(P.in_off + at);
            let s = lo + v.x;
            hi = hi + v.y + select(0u, 1u, s < lo);
            lo = s;
            let w = 2u * (P.out_off + at);
            atomicStore(&OUT[w], lo);
            atomicStore(&OUT[w + 1u], hi);
        }
    }
}
