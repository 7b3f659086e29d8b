"""Phi-3 (Abdin et al. 2024, the Phi-3 technical report; transformers' modeling_phi3.py): a Llama
decoder whose attention input projection is one fused ``self_attn.qkv_proj.weight``
[(heads + 2 KV heads) × head dim, hidden] (q, then k, then v rows) and whose MLP input projection
is one fused ``mlp.gate_up_proj.weight`` [2 × intermediate, hidden] (gate rows, then up rows).
The loader checks the fused shapes and splits them into the Llama names as row views (no copy).
yirage's logits against transformers' through a prefill and decode steps, with the PersistentKernel
decode and the launch-per-op one; a fused tensor of the wrong shape; the views; longrope and GGUF
Phi-3 refused."""
from __future__ import annotations

import json

import pytest
import torch

import yirage as yr
from yirage.errors import ModelLoadError
from yirage.models.loading import load_model

TINY_PHI3 = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 rms_norm_eps=1e-5, rope_theta=10000.0, eos_token_id=1, bos_token_id=2, pad_token_id=0)


def _save_phi3(directory, tiny_tokenizer, **changes):
    """A tiny random Phi-3 saved as safetensors with the word-level tokenizer; the reference model.
    The RMSNorm weights are randomised (transformers initialises them to ones)."""
    from transformers import AutoModelForCausalLM, Phi3Config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Phi3Config(**{**TINY_PHI3, "tie_word_embeddings": False, **changes}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    hf.eval().save_pretrained(directory)
    tiny_tokenizer(TINY_PHI3["vocab_size"]).save_pretrained(directory)
    return hf


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("persistent", [True, False])
def test_tiny_phi3_matches_transformers_logits(tiny_tokenizer, tmp_path, tied, persistent, matches_transformers):
    """Prefill of 7 tokens and 3 decode steps vs transformers' full-sequence logits."""
    hf = _save_phi3(tmp_path, tiny_tokenizer, tie_word_embeddings=tied)
    llm = yr.LLM(str(tmp_path), backend="cpu", max_seq_length=64, persistent=persistent, num_workers=2)
    cfg = llm.config
    assert (cfg.arch, cfg.head_dim, cfg.qk_norm, cfg.attention_bias) == ("phi3", 16, False, False)
    assert cfg.tie_word_embeddings == tied and llm.persistent == persistent
    matches_transformers(llm, hf)


def test_phi3_split_weights_are_views(tiny_tokenizer, tmp_path):
    """q/k/v_proj and gate/up_proj are row slices of the fused tensors' storage, equal to the
    fused rows transformers slices; the fused names are gone."""
    hf = _save_phi3(tmp_path, tiny_tokenizer)
    model = load_model(str(tmp_path), progress=False)
    w = model.weights
    assert not any(k.endswith(("qkv_proj.weight", "gate_up_proj.weight")) for k in w)
    sd = hf.state_dict()
    for i in range(2):
        p = f"model.layers.{i}."
        qkv, gate_up = sd[p + "self_attn.qkv_proj.weight"], sd[p + "mlp.gate_up_proj.weight"]
        q, k, v = (w[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        gate, up = w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]
        assert (q.shape, k.shape, v.shape, gate.shape, up.shape) == ((64, 64), (32, 64), (32, 64), (96, 64), (96, 64))
        torch.testing.assert_close(torch.cat([q.data, k.data, v.data]), qkv, atol=0, rtol=0)
        torch.testing.assert_close(torch.cat([gate.data, up.data]), gate_up, atol=0, rtol=0)
        for fused, parts in ((q, (k, v)), (gate, (up,))):
            base = fused.data.untyped_storage()
            lo, hi = base.data_ptr(), base.data_ptr() + base.nbytes()
            for t in (fused, *parts):
                assert t.data.untyped_storage().data_ptr() == base.data_ptr()
                assert lo <= t.data.data_ptr() and t.data.data_ptr() + t.data.nbytes <= hi
        assert k.data.data_ptr() == q.data.data_ptr() + q.data.nbytes  # rows follow each other: no copy
        assert up.data.data_ptr() == gate.data.data_ptr() + gate.data.nbytes


def _rewrite(directory, drop=(), add=None, config=None):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if config:
        path = directory / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))


def test_phi3_qkv_of_the_wrong_shape(tiny_tokenizer, tmp_path):
    _save_phi3(tmp_path, tiny_tokenizer)
    _rewrite(tmp_path, add={"model.layers.1.self_attn.qkv_proj.weight": torch.zeros(96, 64)})
    with pytest.raises(ModelLoadError, match=r"tensor model\.layers\.1\.self_attn\.qkv_proj\.weight has shape "
                                             r"\(96, 64\), the config implies \(128, 64\) \(\(num_attention_heads = "
                                             r"4 \+ 2 × num_key_value_heads = 2\) × head dim 16"):
        load_model(str(tmp_path), progress=False)


def test_phi3_gate_up_of_the_wrong_shape(tiny_tokenizer, tmp_path):
    _save_phi3(tmp_path, tiny_tokenizer)
    _rewrite(tmp_path, add={"model.layers.0.mlp.gate_up_proj.weight": torch.zeros(96, 64)})
    with pytest.raises(ModelLoadError, match=r"tensor model\.layers\.0\.mlp\.gate_up_proj\.weight has shape "
                                             r"\(96, 64\), the config implies \(192, 64\) "
                                             r"\(2 × intermediate_size = 96"):
        load_model(str(tmp_path), progress=False)


def test_phi3_with_separate_projections_is_refused(tiny_tokenizer, tmp_path):
    """Llama-style q/k/v_proj under model_type phi3: refused, not ignored."""
    _save_phi3(tmp_path, tiny_tokenizer)
    _rewrite(tmp_path, add={"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(ModelLoadError, match=r"unsupported tensors.*q_proj\.weight.*fused self_attn\.qkv_proj"):
        load_model(str(tmp_path), progress=False)


def test_phi3_missing_gate_up(tiny_tokenizer, tmp_path):
    _save_phi3(tmp_path, tiny_tokenizer)
    _rewrite(tmp_path, drop=["model.layers.1.mlp.gate_up_proj.weight"])
    with pytest.raises(ModelLoadError, match=r"missing tensors.*layers\.1\.mlp\.gate_up_proj\.weight"):
        load_model(str(tmp_path), progress=False)


def test_phi3_longrope_is_refused(tiny_tokenizer, tmp_path):
    """longrope ("su") switches to the long factors past original_max_position_embeddings: refused."""
    _save_phi3(tmp_path, tiny_tokenizer)
    _rewrite(tmp_path, config={"original_max_position_embeddings": 64,
                               "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                                "original_max_position_embeddings": 64},
                               "rope_parameters": None})
    with pytest.raises(ModelLoadError, match=r"RoPE type 'longrope' is not supported for phi3"):
        load_model(str(tmp_path), progress=False)


def test_phi3_partial_rotary_is_refused(tiny_tokenizer, tmp_path):
    _save_phi3(tmp_path, tiny_tokenizer, partial_rotary_factor=0.5)
    with pytest.raises(ModelLoadError, match=r"partial rotary embeddings are not supported"):
        load_model(str(tmp_path), progress=False)


def test_phi3_gguf_is_refused(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"architecture phi3 is not supported in GGUF files yet"):
        load_model(str(tmp_path / "phi3.gguf"), progress=False)
    assert "phi3" in yr.models.loading.SUPPORTED_ARCHS
