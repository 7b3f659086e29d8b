"""The Triton attention kernel of the IR's sdpa (kernels/triton/sdpa.py) against torch's
F.scaled_dot_product_attention: masks of every broadcast shape, causal (also with more keys
than queries), GQA, a head dim that is not a power of two, a fully masked query (0, as torch's
fused kernel), bfloat16. "cpu" runs it in Triton's interpreter."""
import pytest
import torch
import torch.nn.functional as F

# (B, H, Hk, S, T, D, mask shape or None, causal, scale)
CASES = {"mask [B,1,1,T]": (2, 4, 4, 9, 11, 16, (2, 1, 1, 11), False, None),
         "mask [1,H,S,T], GQA": (2, 4, 2, 5, 6, 32, (1, 4, 5, 6), False, 0.3),
         "causal": (1, 2, 2, 70, 70, 64, None, True, None),
         "causal, T > S, mask [B,1,S,T]": (1, 3, 1, 7, 12, 24, (1, 1, 7, 12), True, None),
         "one query": (3, 2, 2, 1, 40, 16, None, False, None)}


def _inputs(B, H, Hk, S, T, D, mask_shape, dtype=torch.float32):
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, Hk, T, D), torch.randn(B, Hk, T, D)
    m = None if mask_shape is None else torch.randn(mask_shape)
    return [t if t is None else t.to(dtype) for t in (q, k, v, m)]


@pytest.mark.parametrize("name", list(CASES))
def test_sdpa(K, device, name):
    B, H, Hk, S, T, D, mask_shape, causal, scale = CASES[name]
    q, k, v, m = _inputs(B, H, Hk, S, T, D, mask_shape)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, scale=scale, enable_gqa=H != Hk)
    out = torch.empty(B, H, S, D, device=device)
    K.sdpa(*(t if t is None else t.to(device) for t in (q, k, v, m)), out, causal, scale)
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-4)


def test_sdpa_gives_zero_for_a_query_with_every_key_masked(K, device):
    q, k, v, m = _inputs(1, 2, 2, 4, 5, 16, (1, 1, 4, 5))
    m[0, 0, 2] = float("-inf")
    out = torch.full((1, 2, 4, 16), float("nan"), device=device)
    K.sdpa(q.to(device), k.to(device), v.to(device), m.to(device), out, False, None)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert (out[:, :, 2] == 0).all()
    torch.testing.assert_close(out.cpu()[:, :, [0, 1, 3]], want[:, :, [0, 1, 3]], atol=1e-4, rtol=1e-4)


def test_sdpa_bfloat16(K, device):
    q, k, v, m = _inputs(2, 2, 1, 9, 9, 32, (2, 1, 1, 9), torch.bfloat16)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m.float(), is_causal=True,
                                          enable_gqa=True)
    out = torch.empty(2, 2, 9, 32, dtype=torch.bfloat16, device=device)
    K.sdpa(q.to(device), k.to(device), v.to(device), m.to(device), out, True, None)
    torch.testing.assert_close(out.cpu().float(), want, atol=3e-2, rtol=3e-2)


def test_sdpa_refuses_a_value_head_dim_other_than_the_query_one(K, device):
    q, k, v = torch.randn(1, 1, 2, 16, device=device), torch.randn(1, 1, 3, 16, device=device), \
        torch.randn(1, 1, 3, 8, device=device)
    with pytest.raises(ValueError, match="head dim"):
        K.sdpa(q, k, v, None, torch.empty(1, 1, 2, 16, device=device), False, None)


@pytest.mark.parametrize("causal,Hk", [(False, 4), (True, 2)])
def test_sdpa_reads_and_writes_head_strided_views(K, device, causal, Hk):
    """q, k, v and out as the heads of [B, S, H, D] buffers (what the executor passes instead
    of permute copies): the same result as torch's on the views."""
    B, H, S, D = 2, 4, 19, 32
    q = torch.randn(B, S, H, D).transpose(1, 2)
    k, v = (torch.randn(B, S, Hk, D).transpose(1, 2) for _ in range(2))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=H != Hk)
    out_buf = torch.full((B, S, H, D), float("nan"), device=device)
    K.sdpa(*(t.to(device).transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)), None,
           out_buf.transpose(1, 2), causal, None)
    torch.testing.assert_close(out_buf.transpose(1, 2).cpu(), want, atol=1e-4, rtol=1e-4)
