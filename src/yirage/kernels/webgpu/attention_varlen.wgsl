// Float32 multi-head attention for encoders and torch's scaled_dot_product_attention, with an
// online softmax (Milakov and Gimelshein 2018, as attention.wgsl): one kernel for three ops,
// their tensors described by element strides (backends/webgpu/encoder.py):
//
// - ``attention_varlen`` (mode 1): qkv [T, 3 * H * Dh] of sentences packed back to back; query
//   row t attends the keys of its own sentence [offsets[b], offsets[b + 1]), found by a binary
//   search of the int64 offsets (read as u32 word pairs). The offsets are never trusted: each
//   is clamped into [0, T] before it forms an address (offsets_check.wgsl reports bad ones), so
//   nothing outside the tensors is read or written whatever they hold. A row in no sentence
//   (bucket padding past offsets[B]) is written as zeros, as the reference does.
// - ``attention_bidir`` and ``sdpa`` (mode 0): query row s of batch b and head h attends keys
//   0 <= j < T (j <= s with ``causal``: torch's top-left aligned is_causal), each score plus an
//   optional additive mask (its strides 0 along broadcast dims); a mask value of -inf (tested
//   by its bits: WGSL need not keep infinities) drops the key. A row that keeps no key is NaN
//   with empty_nan (attention_bidir: its reference's torch.softmax makes it NaN), else zero
//   (sdpa: torch's scaled_dot_product_attention writes 0 for such a row, torch 2.13 here).
//
// Query head h reads key/value head h / grp (GQA: grp = H / Hk). q.k runs over D elements, the
// output has Dv (sdpa's v may be wider or narrower than q). score = scale * q.k (+ mask).
//
// Template parameters, substituted by backends/webgpu/encoder.py before compiling:
// {{QPT}} (ceil(D / NT): q staged in workgroup memory), {{DPT}} (ceil(Dv / NT): the output
// elements per thread) and {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write'
// when out lies in an input's buffer (WebGPU forbids one buffer bound read-only and writable in
// one dispatch).
//
// Bindings: 0 the parameters below; 1 q; 2 k; 3 v (the same qkv buffer three times for the
// packed ops); 4 the mask (any float buffer when has_mask == 0: never read); 5 the offsets
// (u32 words from word off_off; any buffer in mode 0: never read); 6 out. Buffers are bound
// whole: every index adds the tensor's element offset.
// Workgroups: one per query row and head, a 1-d count NB * H * S laid out x + y * num_workgroups.x
// (runtime.webgpu.grid); group g is (b, h, s) = (g / (H S), (g / S) % H, g % S). The extra
// groups of the last row return at once. Workgroup memory is written before it is read
// (lavapipe does not zero it).

const NT: u32 = 64u;
const QPT: u32 = {{QPT}}u;
const DPT: u32 = {{DPT}}u;
const QMAX: u32 = NT * QPT;
const NEG: f32 = -0x1.fffffep+127f;   // f32's lowest, at or below any score (no infinities in WGSL):
                                      // keys masked with torch.finfo(float32).min still weigh in
const NEG_INF_BITS: u32 = 0xff800000u;

struct Params {
    NB: u32, H: u32, S: u32, grp: u32,
    D: u32, Dv: u32, T: u32, mode: u32,
    q_off: u32, q_sb: u32, q_sh: u32, q_ss: u32,
    k_off: u32, k_sb: u32, k_sh: u32, k_sj: u32,
    v_off: u32, v_sb: u32, v_sh: u32, v_sj: u32,
    o_off: u32, o_sb: u32, o_sh: u32, o_ss: u32,
    m_off: u32, m_sb: u32, m_sh: u32, m_ss: u32,
    has_mask: u32, causal: u32, off_off: u32, nsent: u32,
    empty_nan: u32, scale: f32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> Q: array<f32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> K: array<f32>;
@group(0) @binding(3) var<storage, {{IN_ACCESS}}> V: array<f32>;
@group(0) @binding(4) var<storage, {{IN_ACCESS}}> MASK: array<f32>;
@group(0) @binding(5) var<storage, {{IN_ACCESS}}> OFFS: array<u32>;
@group(0) @binding(6) var<storage, read_write> OUT: array<f32>;

var<workgroup> qs: array<f32, QMAX>;
var<workgroup> sc: array<f32, NT>;    // the tile's scores, then their weights
var<workgroup> rng: vec3<u32>;        // (first key, end key, 1 when the row attends): from thread 0

// offsets[i] clamped into [0, T] (a negative int64 as 0, one past 2^32 as T)
fn offset_at(i: u32) -> u32 {
    let lo = OFFS[P.off_off + 2u * i];
    let hi = OFFS[P.off_off + 2u * i + 1u];
    if (hi != 0u) {
        return select(P.T, 0u, (hi & 0x80000000u) != 0u);
    }
    return min(lo, P.T);
}

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    if (g >= P.NB * P.H * P.S) {   // uniform over the workgroup
        return;
    }
    let s = g % P.S;
    let h = (g / P.S) % P.H;
    let b = g / (P.S * P.H);
    let kvh = h / P.grp;
    if (lid == 0u) {
        var j0 = 0u;
        var j1 = P.T;
        var ok = 1u;
        if (P.mode == 1u) {   // the sentence of row s: the last b with offsets[b] <= s
            var lo = 0u;
            var hi = P.nsent - 1u;
            while (lo < hi) {
                let mid = (lo + hi + 1u) / 2u;
                if (offset_at(mid) <= s) {
                    lo = mid;
                } else {
                    hi = mid - 1u;
                }
            }
            j0 = offset_at(lo);
            j1 = max(offset_at(lo + 1u), j0);
            ok = select(0u, 1u, j0 <= s && s < j1);
        } else if (P.causal != 0u) {
            j1 = min(P.T, s + 1u);
        }
        rng = vec3<u32>(j0, j1, ok);
    }
    let r = workgroupUniformLoad(&rng);
    let ob = P.o_off + b * P.o_sb + h * P.o_sh + s * P.o_ss;
    if (r.z == 0u) {   // a row in no sentence: zeros
        for (var d = lid; d < P.Dv; d += NT) {
            OUT[ob + d] = 0.0;
        }
        return;
    }
    let j0 = r.x;
    let j1 = r.y;
    let D = P.D;
    let qb = P.q_off + b * P.q_sb + h * P.q_sh + s * P.q_ss;
    for (var d = lid; d < D; d += NT) {
        qs[d] = Q[qb + d];
    }
    workgroupBarrier();

    let kb0 = P.k_off + b * P.k_sb + kvh * P.k_sh;
    let vb0 = P.v_off + b * P.v_sb + kvh * P.v_sh;
    let mb = P.m_off + b * P.m_sb + h * P.m_sh + s * P.m_ss;
    var m = NEG;
    var l = 0.0;
    var acc: array<f32, DPT>;
    for (var k = 0u; k < DPT; k++) {
        acc[k] = 0.0;
    }
    for (var base = j0; base < j1; base += NT) {
        let j = base + lid;
        var sj = NEG;
        var keep = false;
        if (j < j1) {
            let kb = kb0 + j * P.k_sj;
            var dot = 0.0;
            for (var d = 0u; d < D; d++) {
                dot = fma(qs[d], K[kb + d], dot);
            }
            sj = dot * P.scale;
            keep = true;
            if (P.has_mask != 0u) {
                let mv = MASK[mb + j];
                if (bitcast<u32>(mv) == NEG_INF_BITS) {
                    keep = false;
                    sj = NEG;
                } else {
                    sj = sj + mv;
                }
            }
        }
        sc[lid] = sj;
        workgroupBarrier();
        let cnt = min(NT, j1 - base);
        var tm = sc[0];
        for (var i = 1u; i < cnt; i++) {
            tm = max(tm, sc[i]);
        }
        let nm = max(m, tm);
        let alpha = exp(m - nm);
        workgroupBarrier();   // everyone has read the scores
        sc[lid] = select(0.0, exp(sj - nm), keep);
        workgroupBarrier();
        var ts = 0.0;
        for (var i = 0u; i < cnt; i++) {
            ts += sc[i];
        }
        l = l * alpha + ts;
        for (var k = 0u; k < DPT; k++) {
            let d = lid + k * NT;
            if (d < P.Dv) {
                var a = acc[k] * alpha;
                let vb = vb0 + base * P.v_sj + d;
                for (var i = 0u; i < cnt; i++) {
                    a = fma(sc[i], V[vb + i * P.v_sj], a);
                }
                acc[k] = a;
            }
        }
        m = nm;
        workgroupBarrier();   // everyone is done with this tile's weights
    }
    let empty = select(0.0, bitcast<f32>(0x7fc00000u), P.empty_nan != 0u);
    for (var k = 0u; k < DPT; k++) {
        let d = lid + k * NT;
        if (d < P.Dv) {
            OUT[ob + d] = select(empty, acc[k] / l, l > 0.0);
        }
    }
}
