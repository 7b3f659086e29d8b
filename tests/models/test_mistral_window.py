"""Sliding-window attention (issue 8): Mistral's window in every layer, with no cap on the context.

The window's meaning is transformers' (``masking_utils.sliding_window_causal_mask_function``):
the query at position p attends keys ``p - W < j <= p``. Checked here: the kernel-graph op with
``window`` on every backend this machine runs (cpu; 'triton-interpret' under TRITON_INTERPRET=1)
against the torch reference for prefill (T > 1: the CPU's tiled prefill runs for every T > 1)
and decode; and a tiny random MistralForCausalLM (``sliding_window`` = 4, eager attention so that
transformers applies the window) whose logits yirage matches through a prefill longer than the
window and decode steps, with the PersistentKernel decode and the launch-per-op plan, while
``max_seq_length`` is no longer capped at the window; and a tiny Qwen2 with
``use_sliding_window`` whose window applies only to the layers transformers' ``layer_types``
mark 'sliding_attention' (from ``max_window_layers`` on).
"""
from __future__ import annotations

import pytest
import torch

import yirage as yr
from yirage.backends import get_backend_impl
from yirage.errors import GraphError

WINDOW = 4
TINY_MISTRAL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=WINDOW, eos_token_id=1,
                    bos_token_id=2, tie_word_embeddings=False)


# ---------------------------------------------------------------- the kernel-graph op

def _graph(T, S, Hq, Hkv, Dh, window):
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((T, Hq, Dh)), g.new_input((T, Hkv, Dh)), g.new_input((T, Hkv, Dh))
    kc, vc, pos = g.new_input((S, Hkv, Dh)), g.new_input((S, Hkv, Dh)), g.new_input((1,), yr.int64)
    g.mark_output(g.attention(q, k, v, kc, vc, pos, window=window))
    return g


def _masked_sdpa(q, k_all, v_all, p0, window):
    """q [T, Hq, Dh] at positions p0.., k_all/v_all [p0+T, Hkv, Dh]: SDPA in float64 with the
    boolean mask (j <= p) & (j > p - W)."""
    T, L, rep = q.shape[0], k_all.shape[0], q.shape[1] // k_all.shape[1]
    j, p = torch.arange(L)[None, :], (p0 + torch.arange(T))[:, None]
    mask = (j <= p) & (j > p - window) if window else j <= p
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k_all.repeat_interleave(rep, 1).transpose(0, 1).double(),
        v_all.repeat_interleave(rep, 1).transpose(0, 1).double(), attn_mask=mask, scale=q.shape[-1] ** -0.5)
    return out.transpose(0, 1).float()


@pytest.mark.parametrize("window", [None, 0, 1, 3, 16, 40, 100])
@pytest.mark.parametrize("Hq,Hkv,Dh", [(4, 2, 16), (3, 3, 24), (8, 2, 64)])
def test_window_op_prefill_then_decode_on_every_backend(backend, window, Hq, Hkv, Dh):
    """Prefill 37 tokens, a chunk of 5, then 3 decode steps into one KV cache on ``backend``:
    each step equals the op's torch reference and a masked SDPA over the whole sequence; the
    cache holds every position. Windows below, at and above the 45-token context, W = 1."""
    S = 64
    dev = get_backend_impl(backend).torch_device
    kc, vc = torch.zeros(S, Hkv, Dh, device=dev), torch.zeros(S, Hkv, Dh, device=dev)
    kc_ref, vc_ref = torch.zeros(S, Hkv, Dh), torch.zeros(S, Hkv, Dh)
    n = 45
    q_all, k_all, v_all = torch.randn(n, Hq, Dh) * 2, torch.randn(n, Hkv, Dh) * 2, torch.randn(n, Hkv, Dh)
    p0 = 0
    for T in (37, 5, 1, 1, 1):
        g = _graph(T, S, Hq, Hkv, Dh, window)
        sl = slice(p0, p0 + T)
        pos = torch.tensor([p0])
        ref = g.interpret([q_all[sl], k_all[sl], v_all[sl], kc_ref, vc_ref, pos])[0]
        torch.testing.assert_close(ref, _masked_sdpa(q_all[sl], k_all[:p0 + T], v_all[:p0 + T], p0, window),
                                   atol=2e-5, rtol=1e-4)
        got = g(inputs=[q_all[sl].to(dev), k_all[sl].to(dev), v_all[sl].to(dev), kc, vc, pos.to(dev)],
                backend=backend)[0].cpu()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kc.cpu(), kc_ref)
        torch.testing.assert_close(vc.cpu(), vc_ref)
        p0 += T


@pytest.mark.parametrize("bad", [-1, 2.0, 4.5, True, "4", float("nan")])
def test_window_must_be_a_non_negative_integer(bad):
    g = yr.new_kernel_graph()
    q, kv = g.new_input((1, 2, 8)), g.new_input((1, 2, 8))
    cache, pos = g.new_input((8, 2, 8)), g.new_input((1,), yr.int64)
    with pytest.raises(GraphError, match="attention: window"):
        g.attention(q, kv, kv, cache, cache, pos, window=bad)
    assert g.attention(q, kv, kv, cache, cache, pos, window=torch.tensor(3)) is not None   # integer scalars


# ---------------------------------------------------------------- a tiny Mistral

def _save_mistral(directory, tiny_tokenizer, sliding_window=WINDOW):
    """A tiny random MistralForCausalLM (eager attention, so transformers applies the window)
    saved as safetensors with the word-level tokenizer; returns the reference model."""
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    cfg = MistralConfig(**{**TINY_MISTRAL, "sliding_window": sliding_window})
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    hf.save_pretrained(directory, safe_serialization=True)
    tiny_tokenizer(TINY_MISTRAL["vocab_size"]).save_pretrained(directory)
    return hf


PROMPT = (5, 17, 299, 42, 8, 100, 3, 250, 61, 7, 33)   # 11 tokens, longer than the window of 4


@pytest.mark.parametrize("persistent", [True, False])
def test_tiny_mistral_matches_transformers_beyond_its_window(tiny_tokenizer, tmp_path, persistent,
                                                             matches_transformers):
    """An 11-token prefill and 6 decode steps (17 positions, 4x the window) equal transformers'
    full-sequence logits (atol/rtol 1e-4); max_seq_length 64 is kept (not capped at 4)."""
    hf = _save_mistral(tmp_path, tiny_tokenizer)
    assert hf.config.sliding_window == WINDOW and hf.config._attn_implementation == "eager"
    llm = yr.LLM(str(tmp_path), backend="cpu", max_seq_length=64, persistent=persistent, num_workers=2)
    assert (llm.config.arch, llm.config.sliding_window, llm.max_seq_length) == ("mistral", WINDOW, 64)
    assert [llm.model.layer_window(i) for i in range(llm.config.num_layers)] == [WINDOW, WINDOW]
    matches_transformers(llm, hf, ids=PROMPT, steps=6)


def test_the_window_matters_here(tiny_tokenizer, tmp_path):
    """The same weights without a window (full causal) give other logits past the window, so
    the test above would catch attention that ignores the window."""
    hf = _save_mistral(tmp_path, tiny_tokenizer)
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(str(tmp_path), sliding_window=None,
                                                attn_implementation="eager").eval()
    with torch.inference_mode():
        a, b = hf(torch.tensor([PROMPT])).logits[0], full(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(a[:WINDOW], b[:WINDOW], atol=1e-5, rtol=1e-5)   # inside the window: equal
    assert (a[-1] - b[-1]).abs().max() > 1e-2


def test_tiny_mistral_generates_past_its_window(tiny_tokenizer, tmp_path):
    """generate() runs past the window (no cap) and its greedy tokens equal transformers'."""
    hf = _save_mistral(tmp_path, tiny_tokenizer)
    llm = yr.LLM(str(tmp_path), backend="cpu", max_seq_length=40, num_workers=2)
    prompt = " ".join(f"w{i}" for i in PROMPT)
    ids = llm.encode_prompt(prompt, chat=False)
    assert len(ids) > WINDOW
    result = llm.generate(prompt, max_new_tokens=10, temperature=0.0, chat=False)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
    n = len(result.token_ids)
    assert result.token_ids == ref[:n] and (n == 10 or ref[n] == 1)


@pytest.mark.parametrize("persistent", [True, False])
def test_tiny_qwen2_sliding_layers_match_transformers(tiny_tokenizer, tmp_path, persistent, matches_transformers):
    """Qwen2 with ``use_sliding_window``: transformers windows only the layers from
    ``max_window_layers`` on (its ``layer_types``); ``layer_window`` follows them (None, 4, 4)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    common = {k: v for k, v in TINY_MISTRAL.items() if k not in ("sliding_window", "num_hidden_layers")}
    cfg = Qwen2Config(**common, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=1)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tiny_tokenizer(TINY_MISTRAL["vocab_size"]).save_pretrained(tmp_path)
    llm = yr.LLM(str(tmp_path), backend="cpu", max_seq_length=64, persistent=persistent, num_workers=2)
    assert [llm.model.layer_window(i) for i in range(3)] == [None, WINDOW, WINDOW]
    matches_transformers(llm, hf, ids=PROMPT, steps=5)
