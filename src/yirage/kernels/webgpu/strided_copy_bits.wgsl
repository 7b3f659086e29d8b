// The raw-bits storage of strided_copy.wgsl (put in front of it by backends/webgpu/layout.py):
// elements move as raw bits, BITS wide (8: bool, int8; 16: float16, bfloat16; 32: float32,
// int32; 64: int64, two u32 words). Sub-word elements are read from their u32 word and written
// with atomicAnd / atomicOr on the element's own bits, so neighbouring threads (and neighbouring
// tensors in a shared arena buffer) never lose each other's writes.
//
// Template parameters: {{BITS}}: element width in bits (8, 16, 32 or 64). {{IN_ACCESS}}: the
// inputs' access mode, 'read', or 'read_write' when out lies in an input's buffer (WebGPU
// forbids one buffer bound read-only and writable in one dispatch).

const BITS: u32 = {{BITS}}u;
const SUB: u32 = min(BITS, 16u);   // sub-word width (unused for 32 and 64 bits)

@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<u32>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> IDX: array<u32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<atomic<u32>>;

alias Elem = vec2<u32>;   // (low word, high word)

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

// the pad value's bits (parameter words 5 and 6)
fn pad_value() -> Elem {
    return vec2<u32>(p(5u), p(6u));
}
