"""The Triton conv-net kernels (kernels/triton/conv.py) against torch.nn.functional in float32:
the implicit-GEMM convolution (grouped, strided, dilated, padded, 1x1 and 7x7), the direct
depthwise kernel, each with the epilogue (bias, BatchNorm scale/shift, residual, activation),
in NCHW and NHWC; max and average pooling. "cpu" runs them in Triton's interpreter."""
import pytest
import torch
import torch.nn.functional as F

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
ACTS = {None: lambda y: y, "relu": torch.relu, "hardtanh": lambda y: y.clamp(0, 6), "silu": F.silu,
        "sigmoid": torch.sigmoid, "tanh": torch.tanh}


def _to(t, nhwc, device):
    return (t.permute(0, 2, 3, 1) if nhwc else t).contiguous().to(device)


def _from(t, nhwc):
    return (t.permute(0, 3, 1, 2) if nhwc else t).cpu().float()


# (N, C, H, W, O, k, stride, padding, dilation, groups)
CONVS = {"1x1": (2, 8, 5, 7, 12, 1, 1, 0, 1, 1), "3x3 s2 p1": (1, 5, 9, 11, 7, 3, 2, 1, 1, 1),
         "7x7 s2 p3": (2, 3, 17, 13, 8, 7, 2, 3, 1, 1), "grouped g2": (1, 8, 7, 7, 6, 3, 1, 1, 1, 2),
         "dilated d2": (1, 4, 11, 12, 5, 3, 1, 2, 2, 1), "depthwise 3x3": (2, 12, 10, 9, 12, 3, 1, 1, 1, 12),
         "depthwise 5x5 s2": (1, 40, 9, 8, 40, 5, 2, 2, 1, 40)}


@pytest.mark.parametrize("name", list(CONVS))
@pytest.mark.parametrize("nhwc", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("epilogue", ["plain", "bias", "bn-residual-relu", "bias-hardtanh", "silu"])
def test_conv2d(K, device, name, nhwc, epilogue):
    N, C, H, W, O, k, s, p, d, g = CONVS[name]
    gen = torch.Generator().manual_seed(len(name))
    x, w = torch.randn(N, C, H, W, generator=gen), torch.randn(O, C // g, k, k, generator=gen) / k
    b = torch.randn(O, generator=gen) if "bias" in epilogue else None
    ref = F.conv2d(x, w, b, s, p, d, g)
    scale = shift = res = None
    act = {"bn-residual-relu": "relu", "bias-hardtanh": "hardtanh", "silu": "silu"}.get(epilogue)
    if "bn" in epilogue:
        scale, shift = torch.rand(O, generator=gen) + 0.5, torch.randn(O, generator=gen)
        ref = ref * scale.view(-1, 1, 1) + shift.view(-1, 1, 1)
    if "residual" in epilogue:
        res = torch.randn(ref.shape, generator=gen)
        ref = ref + res
    ref = ACTS[act](ref)
    out = torch.empty(ref.permute(0, 2, 3, 1).shape if nhwc else ref.shape, device=device)
    K.conv2d(_to(x, nhwc, device), w.to(device), None if b is None else b.to(device), out, (s, s), (p, p), (d, d), g,
             None if scale is None else scale.to(device), None if shift is None else shift.to(device),
             None if res is None else _to(res, nhwc, device), act, (0.0, 6.0), nhwc)
    torch.testing.assert_close(_from(out, nhwc), ref, **TOL[torch.float32])


def test_conv2d_bfloat16(K, device):
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 6, 9, 8, generator=gen), torch.randn(8, 6, 3, 3, generator=gen) / 3
    xb, wb = x.bfloat16(), w.bfloat16()
    ref = F.conv2d(xb.float(), wb.float(), None, 1, 1)
    out = torch.empty(1, 8, 9, 8, dtype=torch.bfloat16, device=device)
    K.conv2d(xb.to(device), wb.to(device), None, out, (1, 1), (1, 1), (1, 1), 1)
    torch.testing.assert_close(out.cpu().float(), ref, **TOL[torch.bfloat16])


@pytest.mark.parametrize("nhwc", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("case", [("max", 3, 2, 1, 1, True), ("max", 3, 1, 0, 2, True), ("avg", 3, 2, 1, 1, True),
                                  ("avg", 3, 2, 1, 1, False), ("avg", 2, 2, 0, 1, True)],
                         ids=["max 3x3 s2 p1", "max 3x3 d2", "avg 3x3 s2 p1", "avg no pad count", "avg 2x2"])
def test_pool2d(K, device, nhwc, case):
    kind, k, s, p, d, count = case
    x = torch.randn(2, 5, 11, 9, generator=torch.Generator().manual_seed(k + s))
    x[0, 1, 3, 4] = float("nan")   # a NaN in a max window wins
    if kind == "max":
        ref = F.max_pool2d(x, k, s, p, d)
    else:
        ref = F.avg_pool2d(x, k, s, p, count_include_pad=count)
    out = torch.empty(ref.permute(0, 2, 3, 1).shape if nhwc else ref.shape, device=device)
    K.pool2d(_to(x, nhwc, device), out, (k, k), (s, s), (p, p), (d, d), kind == "max", count, nhwc)
    torch.testing.assert_close(_from(out, nhwc), ref, equal_nan=True, **TOL[torch.float32])


def test_conv2d_errors(K):
    x, w = torch.randn(1, 4, 5, 5), torch.randn(6, 3, 3, 3)
    with pytest.raises(ValueError, match="do not fit together"):
        K.conv2d(x, w, None, torch.empty(1, 6, 3, 3), (1, 1), (0, 0), (1, 1), 1)
    with pytest.raises(ValueError, match="residual"):
        K.conv2d(x, torch.randn(6, 4, 3, 3), None, torch.empty(1, 6, 3, 3), (1, 1), (0, 0), (1, 1), 1,
                 residual=torch.empty(1, 6, 4, 4))
