"""WebGPU ``embedding`` over a GGUF block-quantized table (backends/webgpu/qembed.py,
kernels/webgpu/qembedding.wgsl with qblocks.wgsl's decoders): every conformance case of op
``embedding`` passes on webgpu, the quantized types the kernel reads (q4_0, q4_1, q8_0, q4_K,
q5_K, q6_K, q5_0, q5_1, q2_K, q3_K) bound to it rather than run as the torch reference on the host; int32 and int64
ids of any shape; an id out of range raising IndexOutOfRangeError.

``qembed.bind`` is spied on through the module attribute the backend's entry calls. Without
wgpu or a WebGPU adapter the module is skipped. On Mesa's lavapipe it runs in seconds."""
import pytest
import torch

import yirage as yr
from yirage.backends import get_backend_info

if not yr.is_backend_available("webgpu"):
    pytest.skip(f"webgpu unavailable: {get_backend_info('webgpu').reason}", allow_module_level=True)

from yirage.backends.webgpu import qembed  # noqa: E402
from yirage.dtypes import DType  # noqa: E402
from yirage.tools.conformance import CASES, quantized, run_case  # noqa: E402

SUPPORTED = {DType.q4_0, DType.q4_1, DType.q8_0, DType.q4_k, DType.q5_k, DType.q6_k, DType.q5_0, DType.q5_1,
             DType.q2_k, DType.q3_k}
EMBEDDING_CASES = [c for c in CASES if c.op == "embedding"]


@pytest.fixture
def bound(monkeypatch):
    """The w_dtype of each node bound to qembed.bind."""
    calls = []
    original = qembed.bind

    def spy(node, graph, args, out, status):
        calls.append(node.attrs.get("w_dtype"))
        return original(node, graph, args, out, status)

    monkeypatch.setattr(qembed, "bind", spy)
    return calls


def test_there_are_embedding_cases():
    names = {c.name for c in EMBEDDING_CASES}
    assert {d.value for d in SUPPORTED} <= names


@pytest.mark.parametrize("case", EMBEDDING_CASES, ids=[c.name for c in EMBEDDING_CASES])
def test_conformance_embedding(case, bound):
    result = run_case(case, "webgpu")
    assert result.status == "PASS", result.message
    if case.name in {d.value for d in SUPPORTED}:
        assert bound == [case.name]
        assert result.fallback == ()   # nothing ran as a torch reference on the host
    else:
        assert bound == []


def _graph(ids_shape, V, H, qtype, ids_dtype=yr.int64):
    g = yr.new_kernel_graph()
    g.mark_output(g.embedding(g.new_input(ids_shape, ids_dtype), g.new_input((V, H), qtype)))
    return g


@pytest.mark.parametrize("ids_dtype", [yr.int64, yr.int32])
@pytest.mark.parametrize("qtype", [DType.q4_0, DType.q4_k, DType.q6_k])
def test_ids_of_any_shape_and_width(qtype, ids_dtype, bound):
    V, H = 13, 512
    storage, values = quantized((V, H), qtype)
    g = _graph((2, 3), V, H, qtype, ids_dtype)
    ids = torch.tensor([[12, 0, 5], [5, 7, 1]], dtype=ids_dtype.torch_dtype)
    (out,) = g(inputs=[ids, storage], backend="webgpu")
    assert out.dtype == torch.float32 and out.shape == (2, 3, H)
    torch.testing.assert_close(out, values[ids.long()], atol=0.0, rtol=0.0)
    assert bound == [qtype.value]


@pytest.mark.parametrize("ids_dtype,bad", [(yr.int64, 9), (yr.int64, -1), (yr.int64, 2**62),
                                           (yr.int32, 9), (yr.int32, -2**31)])
@pytest.mark.parametrize("qtype", [DType.q8_0, DType.q5_k])
def test_bad_id_raises_and_the_plan_recovers(qtype, ids_dtype, bad, bound):
    V, H = 9, 256
    storage, values = quantized((V, H), qtype)
    g = _graph((3,), V, H, qtype, ids_dtype)
    td = ids_dtype.torch_dtype
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"embedding: token id {bad} is out of range \[0, {V}\)"):
        g(inputs=[torch.tensor([0, bad, 1], dtype=td), storage], backend="webgpu")
    ids = torch.tensor([8, 0, 1], dtype=td)
    (out,) = g(inputs=[ids, storage], backend="webgpu")
    torch.testing.assert_close(out, values[ids.long()], atol=0.0, rtol=0.0)
    assert bound and set(bound) == {qtype.value}


def test_first_bad_id_is_reported():
    V, H = 9, 64
    storage, _ = quantized((V, H), DType.q4_1)
    g = _graph((600,), V, H, DType.q4_1)
    ids = torch.randint(0, V, (600,))
    ids[[300, 450, 599]] = torch.tensor([-5, 77, 12])
    with pytest.raises(yr.IndexOutOfRangeError, match=r"token id -5 is out of range"):
        g(inputs=[ids, storage], backend="webgpu")


@pytest.mark.parametrize("qtype", [DType.iq4_nl, DType.iq4_xs, DType.q8_0r16])
def test_other_types_are_not_ours(qtype):
    V = 48 if qtype == DType.q8_0r16 else 9
    g = _graph((3,), V, 256, qtype)
    (node,) = [n for n in g.ops if n.op == "embedding"]
    assert not qembed.supports(node, g)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED, key=lambda d: d.value))
def test_supported_types_are_ours(qtype):
    g = _graph((3,), 9, 256, qtype, yr.int32)
    (node,) = [n for n in g.ops if n.op == "embedding"]
    assert qembed.supports(node, g)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED, key=lambda d: d.value))
def test_bound_directly_at_offsets(qtype):
    """The table at byte offsets 0..3 of a larger buffer (unaligned blocks), the ids at an odd
    element offset, out inside a larger buffer: the rows land where they should and nothing
    around them is written; a bad id leaves its row as it was and is recorded in the status."""
    from yirage.runtime import webgpu as wg

    V, H = 5, qtype.block[0] * (2 if qtype.block[0] == 32 else 1)
    storage, values = quantized((V, H), qtype)
    g = _graph((4,), V, H, qtype)
    (node,) = [n for n in g.ops if n.op == "embedding"]
    ids = torch.tensor([4, 0, 7, 2])
    ids_d = wg.DeviceTensor.from_host(torch.tensor([99, 99, 99, *ids.tolist(), 99]))[3:7]
    for woff in range(4):
        raw = torch.randint(0, 256, (storage.numel() + 8,), dtype=torch.uint8)
        raw[woff:woff + storage.numel()] = storage.view(-1)
        wd = wg.DeviceTensor.from_host(raw)[woff:woff + storage.numel()].view(storage.shape)
        fill = torch.full((3 + 4 * H + 5,), -7.0)
        arena = wg.DeviceTensor.from_host(fill)
        od = arena[3:3 + 4 * H].view(4, H)
        status = wg.DeviceTensor.from_host(torch.zeros(4, dtype=torch.int64))
        qembed.bind(node, g, [ids_d, wd], od, status)()
        got = arena.to_host()
        assert got[:3].eq(-7).all() and got[3 + 4 * H:].eq(-7).all()
        rows = got[3:3 + 4 * H].view(4, H)
        torch.testing.assert_close(rows[[0, 1, 3]], values[ids[[0, 1, 3]]], atol=0.0, rtol=0.0)
        assert rows[2].eq(-7).all()
        assert status.to_host().tolist() == [1, 7, 0, V]
