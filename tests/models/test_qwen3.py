"""Qwen3 (Yang et al. 2025, the Qwen3 technical report; transformers' modeling_qwen3.py): Qwen2
without q/k/v biases (``attention_bias`` = true, which biases o_proj too, is refused), a per-head
RMSNorm on q and k after the projections and before RoPE (``self_attn.q_norm``/``k_norm``
[head_dim]), and an explicit ``head_dim`` (32 here, where hidden / heads = 16). yirage's logits
against transformers' through a prefill and decode steps, with the PersistentKernel decode and the
launch-per-op one; the loader's checks of the q/k norm and bias tensors; the GGUF name mapping and
a GGUF round trip."""
from __future__ import annotations

import json

import pytest
import torch

import yirage as yr
from yirage.errors import ModelLoadError
from yirage.models.loading import gguf_to_hf_name, load_model

TINY_QWEN3 = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, eos_token_id=1, bos_token_id=2)


def _save_qwen3(directory, tiny_tokenizer, **changes):
    """A tiny random Qwen3 saved as safetensors with the word-level tokenizer; the reference model.
    The q/k norm weights are randomised (transformers initialises them to ones, which would not
    test that they are applied)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Qwen3Config(**{**TINY_QWEN3, "tie_word_embeddings": True, **changes}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    hf.eval().save_pretrained(directory)
    tiny_tokenizer(TINY_QWEN3["vocab_size"]).save_pretrained(directory)
    return hf


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("persistent", [True, False])
def test_tiny_qwen3_matches_transformers_logits(tiny_tokenizer, tmp_path, tied, persistent, matches_transformers):
    """Prefill of 7 tokens and 3 decode steps vs transformers' full-sequence logits."""
    hf = _save_qwen3(tmp_path, tiny_tokenizer, tie_word_embeddings=tied)
    llm = yr.LLM(str(tmp_path), backend="cpu", max_seq_length=64, persistent=persistent, num_workers=2)
    cfg = llm.config
    assert (cfg.arch, cfg.head_dim, cfg.qk_norm, cfg.attention_bias) == ("qwen3", 32, True, False)
    assert cfg.tie_word_embeddings == tied and llm.persistent == persistent
    matches_transformers(llm, hf)


def test_qwen3_with_attention_bias_is_refused(tiny_tokenizer, tmp_path):
    """attention_bias = true biases o_proj too in transformers' Qwen3Attention: one clear error."""
    _save_qwen3(tmp_path, tiny_tokenizer, attention_bias=True)
    with pytest.raises(ModelLoadError, match=r"attention_bias = true is not supported for qwen3 .*o_proj"):
        load_model(str(tmp_path), progress=False)


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


def test_qwen3_missing_k_norm(tiny_tokenizer, tmp_path):
    _save_qwen3(tmp_path, tiny_tokenizer)
    _rewrite(tmp_path, drop=["model.layers.1.self_attn.k_norm.weight"])
    with pytest.raises(ModelLoadError, match=r"missing tensors.*layers\.1\.self_attn\.k_norm\.weight"):
        load_model(str(tmp_path), progress=False)


def test_qwen3_q_norm_of_the_wrong_shape(tiny_tokenizer, tmp_path):
    _save_qwen3(tmp_path, tiny_tokenizer)
    _rewrite(tmp_path, add={"model.layers.0.self_attn.q_norm.weight": torch.ones(16)})
    with pytest.raises(ModelLoadError, match=r"q_norm\.weight has shape \(16,\), the config implies \(32,\) "
                                             r"\(head dim 32 \(head_dim\)\)"):
        load_model(str(tmp_path), progress=False)


def test_qwen3_biases_without_attention_bias(tiny_tokenizer, tmp_path):
    _save_qwen3(tmp_path, tiny_tokenizer)
    _rewrite(tmp_path, add={f"model.layers.{i}.self_attn.{x}_proj.bias": torch.zeros(128 if x == "q" else 64)
                            for i in range(2) for x in "qkv"})
    with pytest.raises(ModelLoadError, match=r"unsupported tensors.*q_proj\.bias.*attention_bias = false"):
        load_model(str(tmp_path), progress=False)


def test_q_norm_in_a_qwen2_model_is_refused(tiny_tokenizer, tmp_path):
    """The same tensors under model_type qwen2 (no q/k norms there): refused, not ignored."""
    _save_qwen3(tmp_path, tiny_tokenizer)
    _rewrite(tmp_path, config={"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    with pytest.raises(ModelLoadError, match=r"unsupported tensors.*k_norm.*per-head q/k norms belong to qwen3, "
                                             r"(gemma3_text, )?not to architecture 'qwen2'"):
        load_model(str(tmp_path), progress=False)


def test_qwen3_gguf_names():
    assert gguf_to_hf_name("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert gguf_to_hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert "qwen3" in yr.models.loading.SUPPORTED_ARCHS


def test_qwen3_gguf_round_trip(tiny_tokenizer, tmp_path, monkeypatch):
    """The tiny Qwen3's float32 tensors written as a GGUF file (llama.cpp's names and ``qwen3``
    metadata, ``attention.key_length`` = 32 for the head dim): the same prefill logits as
    transformers' model (q/k norms mapped, no q/k row permutation for qwen3)."""
    import string

    import gguf

    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    hf = _save_qwen3(tmp_path / "hf", tiny_tokenizer)
    V, a, c = gguf.GGUFValueType, "qwen3", TINY_QWEN3
    vocab = c["vocab_size"]
    tokens = (["<|endoftext|>"] + list(string.ascii_lowercase) + ["ab"] + [f"x{i}" for i in range(vocab)])[:vocab]
    writer = gguf.GGUFWriter(str(tmp_path / "qwen3.gguf"), a)
    for key, value, vtype, sub in [
            (f"{a}.block_count", c["num_hidden_layers"], V.UINT32, None),
            (f"{a}.context_length", c["max_position_embeddings"], V.UINT32, None),
            (f"{a}.embedding_length", c["hidden_size"], V.UINT32, None),
            (f"{a}.feed_forward_length", c["intermediate_size"], V.UINT32, None),
            (f"{a}.attention.head_count", c["num_attention_heads"], V.UINT32, None),
            (f"{a}.attention.head_count_kv", c["num_key_value_heads"], V.UINT32, None),
            (f"{a}.attention.key_length", c["head_dim"], V.UINT32, None),
            (f"{a}.attention.value_length", c["head_dim"], V.UINT32, None),
            (f"{a}.rope.freq_base", c["rope_theta"], V.FLOAT32, None),
            (f"{a}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"], V.FLOAT32, None),
            ("tokenizer.ggml.model", "gpt2", V.STRING, None),
            ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
            ("tokenizer.ggml.token_type", [3] + [1] * (vocab - 1), V.ARRAY, V.INT32),
            ("tokenizer.ggml.merges", ["a b"], V.ARRAY, V.STRING),
            ("tokenizer.ggml.bos_token_id", 2, V.UINT32, None), ("tokenizer.ggml.eos_token_id", 1, V.UINT32, None)]:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    gguf_name = {hf_name: gguf_name for gguf_name, hf_name in
                 [("token_embd", "model.embed_tokens"), ("output_norm", "model.norm"), ("attn_norm", "input_layernorm"),
                  ("ffn_norm", "post_attention_layernorm"), ("attn_q", "self_attn.q_proj"),
                  ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                  ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                  ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        stem, kind = name.rsplit(".", 1)
        parts = stem.split(".")
        if parts[1] == "layers":
            out = f"blk.{parts[2]}.{gguf_name['.'.join(parts[3:])]}.{kind}"
        else:
            out = f"{gguf_name[stem]}.{kind}"
        writer.add_tensor(out, t.detach().float().numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    llm = yr.LLM(str(tmp_path / "qwen3.gguf"), backend="cpu", max_seq_length=32, persistent=False)
    assert (llm.config.arch, llm.config.head_dim, llm.config.qk_norm) == ("qwen3", 32, True)
    ids = [5, 17, 299, 42, 8]
    logits, _ = llm.steps.run(ids, 0)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0].to("cpu"), ref, atol=1e-4, rtol=1e-4)
