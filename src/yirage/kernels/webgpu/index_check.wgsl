// Run-time index check of an op with an ``index_input`` (ir/ops.py: embedding's ids, RoPE's
// and attention's start_pos, rope_rows' and attention_rows' positions, attention_rows' slots).
//
// n integers (int64 read as little-endian u32 word pairs, wide == 2; or int32, wide == 1,
// sign-extended) must each lie in [0, bound). The first that does not (the lowest position,
// as the references report it) is recorded in the op's status slot, the int64 [1, value, 0,
// hi] (u32 words [1, 0, value lo, value hi, 0, 0, hi lo, hi hi]): word 0 is claimed with a
// compare-exchange from 0 to 1, so a slot already holding a violation (an earlier check of the
// same op: attention_rows checks its slots, then its positions) keeps it. ``hi`` is passed as
// its two words (it may be negative: start_pos's range [0, rows - T + 1) with T > rows).
// Nothing else is read or written: the op's own kernels guard every access they make, and
// those that must write nothing after a violation (attention_rows' KV append) read word 0.
//
// Template parameters, substituted by backends/webgpu/ops.py before compiling:
// {{IN_ACCESS}}: the values' access mode, 'read', or 'read_write' when they lie in the status
// buffer (WebGPU forbids one buffer bound read-only and writable in one dispatch).
//
// Bindings: 0 the parameters below; 1 the values (u32 words, from word off); 2 the status
// (atomic u32 words, the slot at word st_off). Buffers are bound whole.
// Workgroups: one, of NT threads: thread i scans positions i, i + NT, ...; a workgroup
// atomicMax of n - position finds the lowest bad one (0: none). Workgroup memory is zeroed
// here explicitly: wgpu-native (0.32 here) does not zero-initialize it on every driver.

const NT: u32 = 256u;

struct Params {
    n: u32, off: u32, wide: u32, bound: u32,
    st_off: u32, hi_lo: u32, hi_hi: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> IDX: array<u32>;
@group(0) @binding(2) var<storage, read_write> ST: array<atomic<u32>>;

var<workgroup> first: atomic<u32>;   // n - (lowest bad position), 0 when none

// the value at position i as (low word, high word) of its int64
fn value(i: u32) -> vec2<u32> {
    let lo = IDX[P.off + i * P.wide];
    if (P.wide == 2u) {
        return vec2<u32>(lo, IDX[P.off + i * 2u + 1u]);
    }
    return vec2<u32>(lo, select(0u, 0xffffffffu, (lo & 0x80000000u) != 0u));
}

@compute @workgroup_size(NT)
fn main(@builtin(local_invocation_index) lid: u32) {
    if (lid == 0u) {
        atomicStore(&first, 0u);
    }
    workgroupBarrier();
    for (var i = lid; i < P.n; i += NT) {
        let v = value(i);
        if (v.y != 0u || v.x >= P.bound) {
            atomicMax(&first, P.n - i);
            break;   // later positions of this thread cannot be lower
        }
    }
    workgroupBarrier();
    if (lid != 0u) {
        return;
    }
    let f = atomicLoad(&first);
    if (f == 0u) {
        return;
    }
    let v = value(P.n - f);
    let o = P.st_off;
    loop {   // a weak compare-exchange may fail spuriously: retry while word 0 is still 0
        let r = atomicCompareExchangeWeak(&ST[o], 0u, 1u);
        if (r.exchanged) {
            atomicStore(&ST[o + 1u], 0u);
            atomicStore(&ST[o + 2u], v.x);
            atomicStore(&ST[o + 3u], v.y);
            atomicStore(&ST[o + 4u], 0u);
            atomicStore(&ST[o + 5u], 0u);
            atomicStore(&ST[o + 6u], P.hi_lo);
            atomicStore(&ST[o + 7u], P.hi_hi);
            break;
        }
        if (r.old_value != 0u) {
            break;
        }
    }
}
