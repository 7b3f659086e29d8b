// GGUF block-quantized weights read in place: helpers shared by qgemv.wgsl and qmatmul.wgsl
// (backends/webgpu/quant.py puts this text in front of theirs).
//
// The weight W is the raw bytes of a [N, K] block-quantized tensor (yirage's uint8 storage:
// each row K / per blocks of `bytes` bytes, llama.cpp ggml-common.h layouts; dtypes.py), bound
// as array<u32> (little-endian words). A block may start at any byte (q4_0's are 18 bytes,
// q6_K's 210), so bytes, halves and words are read through `wbyte`, `whalf` and `wword`,
// which work at any byte address.
//
// Every format is read in units of 32 consecutive weights of a row (a q4_0 / q4_1 / q8_0 block,
// or one of a K-quant super-block's 8 sub-blocks of 32), each unit in 4 groups of 8 weights:
// `unit(row, u)` decodes unit u's scales once (`Unit`), `group(un, j)` the 8 weights
// 8j .. 8j + 7 of it as two vec4<f32>, each d * (q - offset) + m in f32, the way gguf-py's
// ``dequantize`` computes them (``ir.ops.dequantize``, the reference):
//
//   q4_0 (32 weights, 18 bytes): f16 d, 16 bytes of nibbles (byte i: weight i low, i + 16
//        high); w = d * (q - 8).
//   q4_1 (32, 20): f16 d, f16 m, nibbles as q4_0; w = d * q + m.
//   q8_0 (32, 34): f16 d, 32 int8 q; w = d * q.
//   q4_K (256, 144): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins (8 of each, packed:
//        ``get_scale_min_k4``), 128 bytes of nibbles (32-byte chunk c: sub-block 2c low,
//        2c + 1 high); w = (d * sc[s]) * q - dmin * mn[s].
//   q5_K (256, 176): d, dmin, scales as q4_K, 32 bytes qh (bit s of byte l: the fifth bit of
//        weight l of sub-block s), 128 bytes of nibbles as q4_K; w as q4_K with 5-bit q.
//   q6_K (256, 210): 128 bytes ql (half h: 64 bytes, the low nibbles weights 0..63 of the
//        half, the high 64..127), 64 bytes qh (half h: 32 bytes, bits 2i..2i+1 of byte l are
//        the high 2 bits of weight 32i + l of the half), 16 int8 scales (one per 16 weights),
//        f16 d; w = (d * sc[i / 16]) * (q - 32).
//   q5_0 (32, 22): f16 d, u32 qh (bit i: the fifth bit of weight i), nibbles as q4_0;
//        w = d * (q - 16).
//   q5_1 (32, 24): f16 d, f16 m, qh and nibbles as q5_0; w = d * q + m.
//   q2_K (256, 84): 16 bytes of scales (one per 16 weights: low nibble the scale, high the
//        min), 64 bytes of 2-bit q (half h: 32 bytes, bits 2i..2i+1 of byte l are weight
//        32i + l of the half), f16 d, f16 dmin; w = (d * sc) * q - dmin * mn.
//   q3_K (256, 110): 32 bytes hmask (bit s of byte l: the third bit of weight l of sub-block
//        s), 64 bytes of 2-bit q as q2_K, 12 bytes of 16 packed 6-bit scales (low 4 bits:
//        byte i % 8's nibble i / 8; high 2: bits 2(i / 4).. of byte 8 + i % 4), f16 d;
//        w = (d * (sc[i / 16] - 32)) * (q - 4), q the 3-bit value.
//
// Template parameter: {{QTYPE}} (u32): 0 q4_0, 1 q4_1, 2 q8_0, 3 q4_K, 4 q5_K, 5 q6_K,
// 6 q5_0, 7 q5_1, 8 q2_K, 9 q3_K; the branches on it fold away when the shader compiles.
// The including shader declares W.

const QTYPE: u32 = {{QTYPE}}u;
const Q4_0: u32 = 0u;
const Q4_1: u32 = 1u;
const Q8_0: u32 = 2u;
const Q4_K: u32 = 3u;
const Q5_K: u32 = 4u;
const Q6_K: u32 = 5u;
const Q5_0: u32 = 6u;
const Q5_1: u32 = 7u;
const Q2_K: u32 = 8u;
const Q3_K: u32 = 9u;
// bytes per block, and units of 32 weights per block
const BLOCK_BYTES: u32 = select(select(select(select(select(select(select(select(select(
    110u, 84u, QTYPE == Q2_K), 24u, QTYPE == Q5_1), 22u, QTYPE == Q5_0), 210u, QTYPE == Q6_K), 176u, QTYPE == Q5_K),
    144u, QTYPE == Q4_K), 34u, QTYPE == Q8_0), 20u, QTYPE == Q4_1), 18u, QTYPE == Q4_0);
const K_QUANT: bool = QTYPE == Q4_K || QTYPE == Q5_K || QTYPE == Q6_K || QTYPE == Q2_K || QTYPE == Q3_K;
const UNITS: u32 = select(1u, 8u, K_QUANT);
// q2_K / q3_K: 2-bit low parts of q
const LOW2: bool = QTYPE == Q2_K || QTYPE == Q3_K;

// the byte at byte address a
fn wbyte(a: u32) -> u32 {
    return (W[a >> 2u] >> ((a & 3u) * 8u)) & 0xffu;
}

// the 4 bytes at byte address a (any alignment) as a little-endian word. A misaligned read
// touches the next word, which holds the last of the 4 bytes: never past the buffer.
fn wword(a: u32) -> u32 {
    let s = (a & 3u) * 8u;
    let lo = W[a >> 2u];
    if (s == 0u) {
        return lo;
    }
    return (lo >> s) | (W[(a >> 2u) + 1u] << (32u - s));
}

// the f16 at byte address a (any alignment), as f32
fn whalf(a: u32) -> f32 {
    let s = (a & 3u) * 8u;
    var v = W[a >> 2u] >> s;
    if (s == 24u) {
        v |= W[(a >> 2u) + 1u] << 8u;
    }
    return unpack2x16float(v & 0xffffu).x;
}

// the int8 at byte address a
fn wi8(a: u32) -> i32 {
    return (bitcast<i32>(wbyte(a)) << 24u) >> 24u;
}

// the 4 bytes of word w, each shifted right by s and masked with mask
fn fields4(w: u32, s: u32, mask: u32) -> vec4<u32> {
    return (vec4<u32>(w) >> vec4<u32>(s, s + 8u, s + 16u, s + 24u)) & vec4<u32>(mask);
}

// q4_K / q5_K: the 6-bit scale (.x) and min (.y) of sub-block s, from the 12 bytes at a
fn scale_min_k4(a: u32, s: u32) -> vec2<u32> {
    if (s < 4u) {
        return vec2<u32>(wbyte(a + s) & 63u, wbyte(a + s + 4u) & 63u);
    }
    let hi = wbyte(a + s + 4u);
    return vec2<u32>((hi & 0xfu) | ((wbyte(a + s - 4u) >> 6u) << 4u), (hi >> 4u) | ((wbyte(a + s) >> 6u) << 4u));
}

// q3_K: the 6-bit scale i (0..15), less 32, from the 12 bytes at a
fn scale_q3k(a: u32, i: u32) -> i32 {
    let lo = (wbyte(a + (i % 8u)) >> (4u * (i / 8u))) & 0xfu;
    let hi = (wbyte(a + 8u + (i % 4u)) >> (2u * (i / 4u))) & 3u;
    return i32(lo | (hi << 4u)) - 32;
}

// one unit of 32 weights, its scales decoded
struct Unit {
    qa: u32,   // byte address of its low bits (nibbles, or q8_0's bytes)
    qs: u32,   // their shift in a byte (K-quants: 0 or 4)
    ha: u32,   // byte address of its high bits (q5_K, q6_K, q5_0, q5_1, q3_K)
    hs: u32,   // their shift in a byte
    d0: f32,   // scale of weights 0..15
    d1: f32,   // scale of weights 16..31 (q6_K's, q2_K's, q3_K's second scale; d0 elsewhere)
    m: f32,    // added to weights 0..15 (q4_1's / q5_1's m, the K-quants' -dmin * mn)
    m1: f32,   // added to weights 16..31 (q2_K's second min; m elsewhere)
};

// unit u of the row whose first block is at byte address row
fn unit(row: u32, u: u32) -> Unit {
    var un: Unit;
    let base = row + (u / UNITS) * BLOCK_BYTES;
    let s = u % UNITS;
    un.m = 0.0;
    un.qs = 0u;
    un.ha = 0u;
    un.hs = 0u;
    if (QTYPE == Q4_0 || QTYPE == Q8_0) {
        un.d0 = whalf(base);
        un.qa = base + 2u;
    } else if (QTYPE == Q4_1) {
        let dm = unpack2x16float(wword(base));
        un.d0 = dm.x;
        un.m = dm.y;
        un.qa = base + 4u;
    } else if (QTYPE == Q4_K || QTYPE == Q5_K) {
        let dm = unpack2x16float(wword(base));
        let sm = scale_min_k4(base + 4u, s);
        un.d0 = dm.x * f32(sm.x);
        un.m = -(dm.y * f32(sm.y));
        un.qs = 4u * (s & 1u);
        if (QTYPE == Q4_K) {
            un.qa = base + 16u + 32u * (s / 2u);
        } else {
            un.qa = base + 48u + 32u * (s / 2u);
            un.ha = base + 16u;
            un.hs = s;
        }
    } else if (QTYPE == Q5_0) {
        un.d0 = whalf(base);
        un.ha = base + 2u;
        un.qa = base + 6u;
    } else if (QTYPE == Q5_1) {
        let dm = unpack2x16float(wword(base));
        un.d0 = dm.x;
        un.m = dm.y;
        un.ha = base + 4u;
        un.qa = base + 8u;
    } else if (QTYPE == Q2_K) {
        let dm = unpack2x16float(wword(base + 80u));
        let sc0 = wbyte(base + 2u * s);
        let sc1 = wbyte(base + 2u * s + 1u);
        un.qa = base + 16u + 32u * (s / 4u);
        un.qs = 2u * (s % 4u);
        un.d0 = dm.x * f32(sc0 & 0xfu);
        un.d1 = dm.x * f32(sc1 & 0xfu);
        un.m = -(dm.y * f32(sc0 >> 4u));
        un.m1 = -(dm.y * f32(sc1 >> 4u));
    } else if (QTYPE == Q3_K) {
        let d = whalf(base + 108u);
        un.qa = base + 32u + 32u * (s / 4u);
        un.qs = 2u * (s % 4u);
        un.ha = base;
        un.hs = s;
        un.d0 = d * f32(scale_q3k(base + 96u, 2u * s));
        un.d1 = d * f32(scale_q3k(base + 96u, 2u * s + 1u));
    } else {   // Q6_K
        let h = s / 4u;
        let quarter = s % 4u;
        let d = whalf(base + 208u);
        un.qa = base + 64u * h + 32u * (quarter & 1u);
        un.qs = 4u * (quarter >> 1u);
        un.ha = base + 128u + 32u * h;
        un.hs = 2u * quarter;
        un.d0 = d * f32(wi8(base + 192u + 2u * s));
        un.d1 = d * f32(wi8(base + 193u + 2u * s));
    }
    if (QTYPE != Q6_K && QTYPE != Q2_K && QTYPE != Q3_K) {
        un.d1 = un.d0;
    }
    if (QTYPE != Q2_K) {
        un.m1 = un.m;
    }
    return un;
}

// 8 weights of a unit
struct Group {
    a: vec4<f32>,   // weights 8j .. 8j + 3
    b: vec4<f32>,   // weights 8j + 4 .. 8j + 7
};

// weights 8j .. 8j + 7 of unit un (j in 0..3)
fn group(un: Unit, j: u32) -> Group {
    var g: Group;
    if (QTYPE == Q8_0) {
        let lo = bitcast<vec4<i32>>(fields4(wword(un.qa + 8u * j), 0u, 0xffu) << vec4<u32>(24u)) >> vec4<u32>(24u);
        let hi = bitcast<vec4<i32>>(fields4(wword(un.qa + 8u * j + 4u), 0u, 0xffu) << vec4<u32>(24u)) >> vec4<u32>(24u);
        g.a = un.d0 * vec4<f32>(lo);
        g.b = un.d0 * vec4<f32>(hi);
        return g;
    }
    var qa: u32;
    var qs: u32;
    if (QTYPE == Q4_0 || QTYPE == Q4_1 || QTYPE == Q5_0 || QTYPE == Q5_1) {   // weights 0..15 the low nibbles of 16 bytes, 16..31 the high
        qa = un.qa + 8u * (j & 1u);
        qs = 4u * (j >> 1u);
    } else {
        qa = un.qa + 8u * j;
        qs = un.qs;
    }
    let mask = select(0xfu, 3u, LOW2);
    var lo = fields4(wword(qa), qs, mask);
    var hi = fields4(wword(qa + 4u), qs, mask);
    if (QTYPE == Q5_0 || QTYPE == Q5_1) {   // bits 8j .. 8j + 7 of the qh word
        let h = vec4<u32>(wword(un.ha) >> (8u * j));
        lo |= ((h >> vec4<u32>(0u, 1u, 2u, 3u)) & vec4<u32>(1u)) << vec4<u32>(4u);
        hi |= ((h >> vec4<u32>(4u, 5u, 6u, 7u)) & vec4<u32>(1u)) << vec4<u32>(4u);
    } else if (QTYPE == Q3_K) {
        lo |= fields4(wword(un.ha + 8u * j), un.hs, 1u) << vec4<u32>(2u);
        hi |= fields4(wword(un.ha + 8u * j + 4u), un.hs, 1u) << vec4<u32>(2u);
    } else if (QTYPE == Q5_K) {
        lo |= fields4(wword(un.ha + 8u * j), un.hs, 1u) << vec4<u32>(4u);
        hi |= fields4(wword(un.ha + 8u * j + 4u), un.hs, 1u) << vec4<u32>(4u);
    } else if (QTYPE == Q6_K) {
        lo |= fields4(wword(un.ha + 8u * j), un.hs, 3u) << vec4<u32>(4u);
        hi |= fields4(wword(un.ha + 8u * j + 4u), un.hs, 3u) << vec4<u32>(4u);
    }
    var off = 0.0;
    if (QTYPE == Q4_0) {
        off = 8.0;
    } else if (QTYPE == Q6_K) {
        off = 32.0;
    } else if (QTYPE == Q5_0) {
        off = 16.0;
    } else if (QTYPE == Q3_K) {
        off = 4.0;
    }
    let d = select(un.d0, un.d1, j >= 2u);
    let m = select(un.m, un.m1, j >= 2u);
    g.a = d * (vec4<f32>(lo) - off) + m;
    g.b = d * (vec4<f32>(hi) - off) + m;
    return g;
}
