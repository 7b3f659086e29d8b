// The KV-cache append of float32 attention: k_cache[slot, p] = k[t] and v_cache[slot, p] = v[t]
// for each row t of k, v [T, Hkv, Dh], the caches [n_slots, S, Hkv, Dh] (``attention``'s
// [S, Hkv, Dh]: n_slots == 1).
//
// ``attention`` (per_row == 0): slot 0, p = start + t, start the int64 pos[0], valid when
// 0 <= start <= S - T. ``attention_rows`` (per_row == 1): slot = slots[t], p = positions[t]
// (int64 [T] each), valid when slot < n_slots and p < S; rows are written in order, so when
// two rows name one place only the later row writes it. int64 values are read as little-endian
// u32 word pairs.
//
// Nothing is written when the op's status slot holds a violation (word st_off != 0:
// index_check.wgsl ran over every slot and position before this kernel), so a bad index
// leaves the caches as they were; each row's own indices are checked again before its writes.
//
// One workgroup per row: its threads scan the later rows for one naming the same place (then
// this row writes nothing), then copy the row's Hkv * Dh elements, NT at a time.
//
// Template parameters, substituted by backends/webgpu/ops.py before compiling:
// {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write' when a written buffer (a
// cache, the status) holds an input too (WebGPU forbids one buffer bound read-only and
// writable in one dispatch).
//
// Bindings: 0 the parameters below; 1 k; 2 v; 3 slots (u32 words, from word sl_off; any
// buffer when per_row == 0: never read); 4 the position(s) (u32 words, from word pos_off);
// 5 k_cache; 6 v_cache; 7 the status (atomic u32 words). Buffers are bound whole: every
// index adds the tensor's element offset.
// Workgroups: a 1-d count T, laid out x + y * num_workgroups.x (runtime.webgpu.grid); the
// extra groups of the last row return at once.

const NT: u32 = 64u;

struct Params {
    T: u32, Hkv: u32, Dh: u32, S: u32,
    n_slots: u32, k_off: u32, v_off: u32, kc_off: u32,
    vc_off: u32, sl_off: u32, pos_off: u32, per_row: u32,
    st_off: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> K: array<f32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> V: array<f32>;
@group(0) @binding(3) var<storage, {{IN_ACCESS}}> SLOTS: array<u32>;
@group(0) @binding(4) var<storage, {{IN_ACCESS}}> POS: array<u32>;
@group(0) @binding(5) var<storage, read_write> KC: array<f32>;
@group(0) @binding(6) var<storage, read_write> VC: array<f32>;
@group(0) @binding(7) var<storage, read_write> ST: array<atomic<u32>>;

var<workgroup> later: atomic<u32>;   // 1 when a later row names this row's place

// (slot lo, slot hi, position lo, position hi) of row t (per_row == 1)
fn place(t: u32) -> vec4<u32> {
    return vec4<u32>(SLOTS[P.sl_off + 2u * t], SLOTS[P.sl_off + 2u * t + 1u],
                     POS[P.pos_off + 2u * t], POS[P.pos_off + 2u * t + 1u]);
}

@compute @workgroup_size(NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let t = wid.x + wid.y * nwg.x;
    if (t >= P.T) {   // the same for the whole workgroup: the barrier stays uniform
        return;
    }
    if (lid == 0u) {   // workgroup memory is not zeroed on every driver (wgpu-native 0.32)
        atomicStore(&later, 0u);
    }
    workgroupBarrier();
    var slot = 0u;
    var p: u32;
    var ok: bool;
    if (P.per_row != 0u) {
        let me = place(t);
        slot = me.x;
        p = me.z;
        ok = me.y == 0u && me.w == 0u && slot < P.n_slots && p < P.S;
        for (var u = t + 1u + lid; u < P.T; u += NT) {
            if (all(place(u) == me)) {
                atomicStore(&later, 1u);
            }
        }
    } else {
        let start = POS[P.pos_off];
        ok = POS[P.pos_off + 1u] == 0u && P.S >= P.T && start <= P.S - P.T;
        p = start + t;
    }
    workgroupBarrier();
    if (!ok || atomicLoad(&later) != 0u || atomicLoad(&ST[P.st_off]) != 0u) {
        return;
    }
    let width = P.Hkv * P.Dh;
    let src = t * width;
    let dst = (slot * P.S + p) * width;
    for (var e = lid; e < width; e += NT) {
        KC[P.kc_off + dst + e] = K[P.k_off + src + e];
        VC[P.vc_off + dst + e] = V[P.v_off + src + e];
    }
}
