// Float32 causal grouped-query attention over a KV cache (after kv_append.wgsl wrote this
// step's keys and values into it):
// out[t, h] = sum_j softmax_j(scale * q[t, h] . k_cache[slot, j, g]) v_cache[slot, j, g],
// g = h / (Hq / Hkv), over the keys j0 <= j <= p of the row's position p (j0 = 0, or with a
// sliding window W >= 1, j0 = max(0, p - W + 1)).
//
// q and out are [T, Hq, Dh]; the caches [n_slots, S, Hkv, Dh] (``attention``'s [S, Hkv, Dh]:
// n_slots == 1). ``attention`` (per_row == 0): slot 0, p = start + t, start the int64 pos[0],
// valid when 0 <= start <= S - T; ``attention_rows`` (per_row == 1): slot = slots[t],
// p = positions[t] (int64 [T] each), valid when slot < n_slots and p < S. int64 values are read
// as little-endian u32 word pairs. A row with an invalid index reads nothing and leaves its
// output as it was (index_check.wgsl records the violation in the op's status slot).
//
// One workgroup per (t, h) query row, NT threads: q is staged in workgroup memory; the keys
// are taken NT at a time (thread i scores key j0 + i, ...), with an online softmax (Milakov and
// Gimelshein 2018; flash attention's): the running maximum m and sum l, and each thread's DPT
// output elements d = i, i + NT, ... rescaled by exp(m_old - m_new) per tile. All in f32.
//
// Template parameters, substituted by backends/webgpu/ops.py before compiling:
// {{DPT}} (u32: ceil(Dh / NT), the output elements per thread) and {{IN_ACCESS}}: the
// inputs' access mode, 'read', or 'read_write' when out lies in an input's buffer (at other
// elements: WebGPU forbids one buffer bound read-only and writable in one dispatch).
//
// Bindings: 0 the parameters below; 1 q; 2 k_cache; 3 v_cache; 4 slots (u32 words, from word
// sl_off; any buffer when per_row == 0: never read); 5 the position(s) (u32 words, from word
// pos_off); 6 out. Buffers are bound whole: every index adds the tensor's element offset.
// Workgroups: a 1-d count T * Hq, laid out x + y * num_workgroups.x (runtime.webgpu.grid);
// the extra groups of the last row return at once.

const NT: u32 = 64u;
const DPT: u32 = {{DPT}}u;
const DMAX: u32 = NT * DPT;
const NEG: f32 = -3.0e38;   // below any score: exp(NEG - m) is 0 (no infinities in WGSL)

struct Params {
    T: u32, Hq: u32, Hkv: u32, Dh: u32,
    S: u32, n_slots: u32, q_off: u32, kc_off: u32,
    vc_off: u32, sl_off: u32, pos_off: u32, o_off: u32,
    per_row: u32, window: u32, scale: f32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> Q: array<f32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> KC: array<f32>;
@group(0) @binding(3) var<storage, {{IN_ACCESS}}> VC: array<f32>;
@group(0) @binding(4) var<storage, {{IN_ACCESS}}> SLOTS: array<u32>;
@group(0) @binding(5) var<storage, {{IN_ACCESS}}> POS: array<u32>;
@group(0) @binding(6) var<storage, read_write> OUT: array<f32>;

var<workgroup> qs: array<f32, DMAX>;
var<workgroup> sc: array<f32, NT>;   // the tile's scores, then their exp(score - m)
var<workgroup> row: vec3<u32>;       // (slot, p, valid): read by thread 0, shared uniformly

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    if (g >= P.T * P.Hq) {   // the same for the whole workgroup: barriers stay uniform
        return;
    }
    let t = g / P.Hq;
    let h = g % P.Hq;
    let kvh = h / (P.Hq / P.Hkv);
    let Dh = P.Dh;
    if (lid == 0u) {
        var slot = 0u;
        var p: u32;
        var ok: bool;
        if (P.per_row != 0u) {
            slot = SLOTS[P.sl_off + 2u * t];
            p = POS[P.pos_off + 2u * t];
            ok = SLOTS[P.sl_off + 2u * t + 1u] == 0u && POS[P.pos_off + 2u * t + 1u] == 0u
                 && slot < P.n_slots && p < P.S;
        } else {
            let start = POS[P.pos_off];
            ok = POS[P.pos_off + 1u] == 0u && P.S >= P.T && start <= P.S - P.T;
            p = start + t;
        }
        row = vec3<u32>(slot, p, select(0u, 1u, ok));
    }
    let r = workgroupUniformLoad(&row);
    if (r.z == 0u) {
        return;
    }
    let p = r.y;
    let qb = P.q_off + (t * P.Hq + h) * Dh;
    for (var d = lid; d < Dh; d += NT) {
        qs[d] = Q[qb + d];
    }
    workgroupBarrier();

    let j1 = p + 1u;   // keys j0 <= j < j1
    var j0 = 0u;
    if (P.window != 0u && j1 > P.window) {
        j0 = j1 - P.window;
    }
    let pitch = P.Hkv * Dh;                               // between positions
    let kvb = (r.x * P.S) * pitch + kvh * Dh;             // key 0 of this slot and head
    var m = NEG;
    var l = 0.0;
    var acc: array<f32, DPT>;
    for (var base = j0; base < j1; base += NT) {
        let j = base + lid;
        var s = NEG;
        if (j < j1) {
            let kb = P.kc_off + kvb + j * pitch;
            var dot = 0.0;
            for (var d = 0u; d < Dh; d++) {
                dot = fma(qs[d], KC[kb + d], dot);
            }
            s = dot * P.scale;
        }
        sc[lid] = s;
        workgroupBarrier();
        let cnt = min(NT, j1 - base);
        var tm = sc[0];
        for (var i = 1u; i < cnt; i++) {
            tm = max(tm, sc[i]);
        }
        let nm = max(m, tm);
        let alpha = exp(m - nm);
        workgroupBarrier();   // everyone has read the scores
        sc[lid] = select(0.0, exp(s - nm), j < j1);
        workgroupBarrier();
        var ts = 0.0;
        for (var i = 0u; i < cnt; i++) {
            ts += sc[i];
        }
        l = l * alpha + ts;
        for (var k = 0u; k < DPT; k++) {
            let d = lid + k * NT;
            if (d < Dh) {
                var a = acc[k] * alpha;
                let vb = P.vc_off + kvb + base * pitch + d;
                for (var i = 0u; i < cnt; i++) {
                    a = fma(sc[i], VC[vb + i * pitch], a);
                }
                acc[k] = a;
            }
        }
        m = nm;
        workgroupBarrier();   // everyone is done with this tile's weights
    }
    let ob = P.o_off + (t * P.Hq + h) * Dh;
    for (var k = 0u; k < DPT; k++) {
        let d = lid + k * NT;
        if (d < Dh) {
            OUT[ob + d] = acc[k] / l;
        }
    }
}
