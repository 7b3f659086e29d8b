// The float16 storage of strided_copy.wgsl where the device has shader-f16 (put in front of it
// by backends/webgpu/layout.py instead of strided_copy_bits.wgsl): x and out as array<f16>, a
// plain load and a plain store per element, no atomics (two float16 elements of one u32 word
// are separate memory locations). Element offsets and strides are in float16 elements, as in
// the bits storage.
//
// Template parameter: {{IN_ACCESS}}: the inputs' access mode, 'read', or 'read_write' when out
// lies in an input's buffer.
enable f16;

@group(0) @binding(1) var<storage, {{IN_ACCESS}}> X: array<f16>;
@group(0) @binding(2) var<storage, {{IN_ACCESS}}> IDX: array<u32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f16>;

alias Elem = f16;

fn load(i: u32) -> Elem {
    return X[i];
}

fn store(i: u32, v: Elem) {
    OUT[i] = v;
}

// the pad value: float16 bits in the low half of parameter word 5
fn pad_value() -> Elem {
    return f16(unpack2x16float(p(5u)).x);
}
