// Reductions and softmax over dims that are not the last: x viewed as [outer, n, inner]
// (row-major; n the product of the reduced, adjacent dims), one thread per (o, i) column,
// computing in float32 and writing x's dtype (float32, float16 or bfloat16).
//
// OP 0 sum and 1 mean write out[o, i] (the keepdim shape [outer, 1, inner]); 2 amax and 3
// amin too, a NaN winning (tested on its bits); 4 var: the sum of squared deviations from the
// mean divided by max(0, n - correction) (two passes); 5 softmax and 6 log_softmax write
// out[o, j, i] for every j (max, then the sum of exp(x - max), then each value).
//
// Template parameters, substituted by backends/webgpu/layout.py before compiling:
// {{KIND}}: 0 float32, 1 float16, 2 bfloat16 (x and out).
// {{OP}}: the operation, numbered above.
// {{IN_ACCESS}}: x's access mode, 'read', or 'read_write' when out lies in x's buffer.
//
// Bindings: 0 the parameters below (corr: correction's float32 bits); 1 x (u32 words); 2 out
// (atomic u32 words: 16-bit outputs are written with atomicAnd / atomicOr on their half).
// Workgroups: a 1-d count ceil(cols / NT), laid out x + y * num_workgroups.x.

const NT: u32 = 256u;
const KIND: u32 = {{KIND}}u;
const OP: u32 = {{OP}}u;

struct Params {
    cols: u32, n: u32, inner: u32, in_off: u32,
    out_off: u32, corr: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<u32>;
@group(0) @binding(2) var<storage, read_write> OUT: array<atomic<u32>>;

fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn load(i: u32) -> f32 {
    if (KIND == 0u) {
        return bitcast<f32>(X[i]);
    }
    let b = (X[i / 2u] >> ((i % 2u) * 16u)) & 0xffffu;
    if (KIND == 1u) {
        return unpack2x16float(b).x;
    }
    return bitcast<f32>(b << 16u);
}

fn store(i: u32, v: f32) {
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
    let col = (wid.x + wid.y * nwg.x) * NT + lid;
    if (col >= P.cols) {
        return;
    }
    let o = col / P.inner;
    let i = col % P.inner;
    let base = P.in_off + o * P.n * P.inner + i;
    let n = P.n;
    let nan = bitcast<f32>(0x7fc00000u);
    if (OP <= 1u || OP == 4u) {
        var s = 0.0;
        for (var j = 0u; j < n; j += 1u) {
            s += load(base + j * P.inner);
        }
        if (OP == 0u) {
            store(P.out_off + col, s);
            return;
        }
        let mean = s / f32(n);
        if (OP == 1u) {
            store(P.out_off + col, mean);
            return;
        }
        var q = 0.0;
        for (var j = 0u; j < n; j += 1u) {
            let d = load(base + j * P.inner) - mean;
            q += d * d;
        }
        store(P.out_off + col, q / max(0.0, f32(n) - bitcast<f32>(P.corr)));
        return;
    }
    if (OP == 2u || OP == 3u) {
        var m = load(base);
        var has_nan = is_nan(m);
        for (var j = 1u; j < n; j += 1u) {
            let v = load(base + j * P.inner);
            has_nan = has_nan || is_nan(v);
            m = select(min(m, v), max(m, v), OP == 2u);
        }
        store(P.out_off + col, select(m, nan, has_nan));
        return;
    }
    // softmax (5), log_softmax (6)
    var m = load(base);
    var has_nan = is_nan(m);
    for (var j = 1u; j < n; j += 1u) {
        let v = load(base + j * P.inner);
        has_nan = has_nan || is_nan(v);
        m = max(m, v);
    }
    var s = 0.0;
    for (var j = 0u; j < n; j += 1u) {
        s += exp(load(base + j * P.inner) - m);
    }
    let ls = log(s);
    let obase = P.out_off + o * n * P.inner + i;
    for (var j = 0u; j < n; j += 1u) {
        let d = load(base + j * P.inner) - m;
        var r = select(exp(d) / s, d - ls, OP == 6u);
        if (has_nan) {
            r = nan;
        }
        store(obase + j * P.inner, r);
    }
}
