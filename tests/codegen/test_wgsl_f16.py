"""codegen/wgsl.py's two float16 storages, rendered only (no device): with ``f16=True`` a fused
kernel with float16 tensors declares ``enable f16;``, binds them as ``array<f16>`` and stores
them without atomics; with ``f16=False`` (an adapter without ``shader-f16``) they stay packed
in ``u32`` words; a kernel without float16 tensors is the same text either way. The device side
(both paths on lavapipe against torch) is tests/backends/test_webgpu_f16.py."""
import yirage as yr
from yirage.codegen import wgsl
from yirage.transforms.fusion import FusedKernel, schedule


def _fused(build) -> FusedKernel:
    g = yr.new_kernel_graph()
    build(g)
    kernels = [s for s in schedule(g) if isinstance(s, FusedKernel)]
    assert len(kernels) == 1
    return kernels[0]


def _half_rows(g):
    x = g.new_input((5, 33), dtype=yr.float16)
    w = g.new_input((33,), dtype=yr.float16)
    g.mark_output(g.mul(g.rms_norm(x, [33]), w))        # a row kernel: a float16 vec output
    g.mark_output(g.amax(x, -1, keepdim=True))          # and a float16 row-value output


def _half_elementwise(g):
    x = g.new_input((7, 9), dtype=yr.float16)
    y = g.new_input((7, 9))
    g.mark_output(g.cast(g.add(g.cast(g.silu(x), yr.float32), y), yr.float16))


def test_the_native_variant_declares_f16_and_stores_without_atomics():
    for build in (_half_rows, _half_elementwise):
        k = _fused(build)
        src = wgsl.render_kernel(k, f16=True)
        assert src.startswith("enable f16;\n") and wgsl.F16_HEADER in src
        assert "atomic" not in src and "pack2x16float" not in src
        assert "array<f16>" in src and "= yr_f16(" in src
        assert wgsl.kernel_name(k, True) == wgsl.kernel_name(k) + "_f16"


def test_without_shader_f16_float16_stays_packed_with_atomic_stores():
    k = _fused(_half_rows)
    src = wgsl.render_kernel(k, f16=False)
    assert src == wgsl.render_kernel(k)
    assert "enable f16" not in src and "array<f16>" not in src
    assert "unpack2x16float" in src and "atomicOr" in src
    assert wgsl.kernel_name(k, False) == wgsl.kernel_name(k)


def test_a_kernel_without_float16_renders_the_same_either_way():
    def f32_only(g):
        x = g.new_input((4, 10))
        g.mark_output(g.softmax(x, -1))
    k = _fused(f32_only)
    assert not wgsl.uses_float16(k)
    assert wgsl.render_kernel(k, f16=True) == wgsl.render_kernel(k, f16=False)
    assert wgsl.kernel_name(k, True) == wgsl.kernel_name(k)


def test_only_float16_tensors_change_storage():
    """bfloat16 and bool keep their packed words (and atomic stores) in the native variant."""
    def mixed(g):
        x = g.new_input((3, 5), dtype=yr.float16)
        g.mark_output(g.cast(x, yr.bfloat16))
        g.mark_output(g.gt(x, g.neg(x)))
        g.mark_output(g.cast(x, yr.float16))
    src = wgsl.render_kernel(_fused(mixed), f16=True)
    assert "var<storage, read> in0: array<f16>;" in src
    assert src.count("array<atomic<u32>>") == 2 and src.count("array<f16>") == 2
