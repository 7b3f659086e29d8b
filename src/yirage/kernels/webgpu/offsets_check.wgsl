// Run-time check of ``attention_varlen``'s offsets (int64 [B + 1], read as little-endian u32
// word pairs): they must start at 0, never decrease and end at most at T (``ir.ops.check_offsets``).
// The first bad one, offsets[i], is recorded in the op's status slot as the int64
// [1, offsets[i], offsets[i - 1] (0 for i = 0), T + 1] (u32 words [1, 0, value lo, value hi,
// prev lo, prev hi, hi lo, hi hi]), as the reference's IndexOutOfRangeError names it; word 0 is
// claimed with a compare-exchange from 0 to 1, so a slot already holding a violation keeps it.
// Nothing else is read or written (encoder attention clamps every offset it uses itself).
//
// Template parameters, substituted by backends/webgpu/encoder.py before compiling:
// {{IN_ACCESS}}: the offsets' access mode, 'read', or 'read_write' when they lie in the status
// buffer (WebGPU forbids one buffer bound read-only and writable in one dispatch).
//
// Bindings: 0 the parameters below; 1 the offsets (u32 words, from word off); 2 the status
// (atomic u32 words, the slot at word st_off). Buffers are bound whole.
// Workgroups: one, of NT threads: thread i checks positions i, i + NT, ...; a workgroup
// atomicMax of n - position finds the lowest bad one (0: none). Workgroup memory is zeroed
// here explicitly (lavapipe does not).

const NT: u32 = 256u;

struct Params {
    n: u32, off: u32, T: u32, st_off: u32,
    hi_lo: u32, hi_hi: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, {{IN_ACCESS}}> OFFS: array<u32>;
@group(0) @binding(2) var<storage, read_write> ST: array<atomic<u32>>;

var<workgroup> first: atomic<u32>;

fn value(i: u32) -> vec2<u32> {
    return vec2<u32>(OFFS[P.off + 2u * i], OFFS[P.off + 2u * i + 1u]);
}

fn previous(i: u32) -> vec2<u32> {
    if (i == 0u) {
        return vec2<u32>(0u, 0u);
    }
    return value(i - 1u);
}

// a < b as signed int64 (word pairs)
fn less(a: vec2<u32>, b: vec2<u32>) -> bool {
    let ah = bitcast<i32>(a.y);
    let bh = bitcast<i32>(b.y);
    return ah < bh || (ah == bh && a.x < b.x);
}

@compute @workgroup_size(NT)
fn main(@builtin(local_invocation_index) lid: u32) {
    if (lid == 0u) {
        atomicStore(&first, 0u);
    }
    workgroupBarrier();
    for (var i = lid; i < P.n; i += NT) {
        let o = value(i);
        let bad = (i == 0u && (o.x != 0u || o.y != 0u)) || less(o, previous(i))
                  || less(vec2<u32>(P.T, 0u), o);
        if (bad) {
            atomicMax(&first, P.n - i);
            break;
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
    let i = P.n - f;
    let v = value(i);
    let p = previous(i);
    let o = P.st_off;
    loop {
        let r = atomicCompareExchangeWeak(&ST[o], 0u, 1u);
        if (r.exchanged) {
            atomicStore(&ST[o + 1u], 0u);
            atomicStore(&ST[o + 2u], v.x);
            atomicStore(&ST[o + 3u], v.y);
            atomicStore(&ST[o + 4u], p.x);
            atomicStore(&ST[o + 5u], p.y);
            atomicStore(&ST[o + 6u], P.hi_lo);
            atomicStore(&ST[o + 7u], P.hi_hi);
            break;
        }
        if (r.old_value != 0u) {
            break;
        }
    }
}
