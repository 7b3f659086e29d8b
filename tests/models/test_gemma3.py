"""Gemma 3 text models (Gemma Team 2025, the Gemma 3 technical report; transformers'
``modeling_gemma3.py``, ``Gemma3ForCausalLM``, model_type ``gemma3_text``; GGUF architecture
``gemma3``): embeddings scaled by sqrt(hidden), RMSNorms scaling by ``1 + weight``, sandwich norms
around attention and MLP, a GELU-tanh gated MLP, per-head q/k norms, attention scale
``query_pre_attn_scalar ** -0.5``, and sliding / full attention layers with their own RoPE bases.

yirage's logits against transformers' through a prefill and decode steps (the PersistentKernel
decode and the launch-per-op one, a window wider than the test and a window of 3 tokens); the
``gelu_tanh`` op against torch; the config checks; a GGUF round trip with llama.cpp's names and
norm weights stored as ``1 + weight`` against transformers loading the same file; and the real
Gemma 3 270M GGUF: tests/models/test_gemma3_gguf.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import yirage as yr
from yirage.backends import get_backend_impl
from yirage.errors import ModelLoadError
from yirage.models.loading import gguf_to_hf_name, load_model
from yirage.transforms.fusion import FusedKernel, schedule

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
TINY_GEMMA3 = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                   rms_norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=64, layer_types=LAYER_TYPES,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                   eos_token_id=1, bos_token_id=2, pad_token_id=0)


def _gemma3(**changes):
    """A tiny random Gemma3ForCausalLM (head_dim 32 != hidden / heads = 16, GQA 4/2, query_pre_attn_scalar
    24 != head_dim, RoPE bases 1e6 / 1e4) with every weight random, the norms included: transformers
    initialises them to 0, where ``1 + weight`` would not be tested."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Gemma3TextConfig(**{**TINY_GEMMA3, **changes}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(0.5 * torch.randn_like(p))
    return hf.eval()


def _save_gemma3(directory, tiny_tokenizer, **changes):
    """The tiny model saved as safetensors with the word-level tokenizer; the reference model."""
    hf = _gemma3(**changes)
    hf.save_pretrained(directory, safe_serialization=True)
    tiny_tokenizer(TINY_GEMMA3["vocab_size"]).save_pretrained(directory)
    return hf


@pytest.mark.parametrize("window", [64, 3])
@pytest.mark.parametrize("persistent", [True, False])
def test_tiny_gemma3_matches_transformers_logits(tiny_tokenizer, tmp_path, persistent, window, matches_transformers):
    """Prefill of 7 tokens and 3 decode steps vs transformers' full-sequence logits; window 64 is
    wider than the 10 positions, window 3 makes the sliding layers see only the last 3."""
    hf = _save_gemma3(tmp_path, tiny_tokenizer, sliding_window=window)
    llm = yr.LLM(str(tmp_path), backend="cpu", max_seq_length=64, persistent=persistent, num_workers=2)
    cfg = llm.config
    assert (cfg.arch, cfg.head_dim, cfg.qk_norm, cfg.sandwich_norms, cfg.hidden_act) == (
        "gemma3_text", 32, True, True, "gelu_pytorch_tanh")
    assert cfg.layer_types == tuple(LAYER_TYPES) and cfg.sliding_window == window and cfg.tie_word_embeddings
    assert cfg.embed_scale == pytest.approx(8.0) and cfg.attention_scale == pytest.approx(24 ** -0.5)
    assert cfg.local_inv_freq[1] == pytest.approx(1e4 ** (-2 / 32)) and cfg.inv_freq[1] == pytest.approx(1e6 ** (-2 / 32))
    model = llm.steps.model
    assert [model.layer_window(i) for i in range(3)] == [window, None, window]
    assert [model.layer_uses_local_rope(i) for i in range(3)] == [True, False, True]
    matches_transformers(llm, hf)


def test_gemma3_config_of_transformers_4(tiny_tokenizer, tmp_path, matches_transformers):
    """A config.json as the Gemma 3 checkpoints on the Hub have it (transformers 4.5x): no
    ``layer_types`` or ``rope_parameters`` but ``sliding_window_pattern`` (2 here: layers 0 and 2
    sliding, 1 full), ``rope_theta``, ``rope_local_base_freq`` and a linear ``rope_scaling`` (as
    Gemma 3 4B's, for the full layers only); the reference is transformers loading that directory."""
    from transformers import AutoModelForCausalLM

    _save_gemma3(tmp_path, tiny_tokenizer)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for key in ("layer_types", "rope_parameters"):
        del config[key]
    config.update(sliding_window_pattern=2, rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=3,
                  rope_scaling={"rope_type": "linear", "factor": 4.0}, eos_token_id=[1, 106])
    path.write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    llm = yr.LLM(str(tmp_path), backend="cpu", max_seq_length=64, num_workers=2)
    cfg = llm.config
    assert cfg.layer_types == tuple(LAYER_TYPES) and cfg.rope_type == "linear" and set(cfg.eos_token_ids) == {1, 106}
    assert cfg.inv_freq[1] == pytest.approx(1e6 ** (-2 / 32) / 4) and cfg.local_inv_freq[1] == pytest.approx(
        1e4 ** (-2 / 32))
    matches_transformers(llm, hf)


def test_tiny_gemma3_small_window_changes_the_reference(tiny_tokenizer, tmp_path):
    """The window-3 case above tests the window: transformers' logits differ from the wide window's."""
    ids = torch.tensor([[5, 17, 299, 42, 8, 100, 3]])
    with torch.inference_mode():
        wide, narrow = (_gemma3(sliding_window=w)(ids).logits[0, -1] for w in (64, 3))
    assert (wide - narrow).abs().max() > 1e-2


def test_gemma3_decode_step_fuses_sandwich_norms(tiny_tokenizer, tmp_path):
    """Per layer the residual add, the post-attention norm and the pre-feedforward norm are one row
    kernel, gelu_tanh(gate) * up another, the post-feedforward norm, the residual add and the next
    input norm a third."""
    from yirage.backends import Backend
    from yirage.models.llama import LlamaModel

    _save_gemma3(tmp_path, tiny_tokenizer)
    model = LlamaModel(load_model(str(tmp_path), progress=False), Backend.CPU, max_seq_length=32)
    g, _ = model.build_graph(1)
    fused = [s for s in schedule(g) if isinstance(s, FusedKernel)]
    ops_per_kernel = {tuple(n.op for n in k.ops) for k in fused}
    assert ("gelu_tanh", "mul") in ops_per_kernel
    assert any(ops.count("rms_norm") == 2 and "add" in ops for ops in ops_per_kernel)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # Triton's interpreter on 1e20
@pytest.mark.parametrize("shape", [(1, 7), (5, 300), (3, 1025)])
def test_gelu_tanh_matches_torch(backend, shape):
    """The tanh GELU op, alone and fused with a product, against F.gelu(x, approximate='tanh'), on
    every backend (the CPU and triton-interpret here), large and non-finite inputs included."""
    g = yr.new_kernel_graph(backend=backend)
    X, Y = g.new_input(shape, yr.float32), g.new_input(shape, yr.float32)
    g.mark_output(g.gelu(X, approximate="tanh"))
    g.mark_output(g.mul(g.gelu_tanh(X), Y))
    x, y = torch.randn(shape) * 4, torch.randn(shape)
    special = torch.tensor([0.0, -30.0, 30.0, 1e20, -1e20, float("inf"), -5.0])
    x.view(-1)[: min(x.numel(), special.numel())] = special[: x.numel()]
    dev = get_backend_impl(backend).torch_device
    out, prod = (t.cpu() for t in g(inputs=[x.to(dev), y.to(dev)]))
    ref = F.gelu(x, approximate="tanh")
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(prod, ref * y, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g.interpret([x, y])[0], ref)


def test_gelu_approximate_is_checked():
    g = yr.new_kernel_graph(backend="cpu")
    with pytest.raises(yr.GraphError, match="approximate"):
        g.gelu(g.new_input((2, 4)), approximate="sigmoid")


def _edit_config(directory, **fields):
    path = Path(directory) / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize("fields, message", [
    ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping = 30\.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping = 50\.0 is not supported"),
    ({"hidden_activation": "gelu"}, r"hidden_activation = 'gelu' is not supported"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention = True is not supported"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, r"layer_types must be a list of 3 entries"),
    ({"layer_types": ["sliding_attention", "full", "full_attention"]}, r"layer_types\[1\] = 'full' must be one of"),
    ({"query_pre_attn_scalar": -1}, r"query_pre_attn_scalar = -1 must be a finite number > 0"),
])
def test_gemma3_config_checks(tiny_tokenizer, tmp_path, fields, message):
    _save_gemma3(tmp_path, tiny_tokenizer)
    _edit_config(tmp_path, **fields)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(tmp_path), progress=False)


def test_gemma3_missing_feedforward_norm(tiny_tokenizer, tmp_path):
    from safetensors.torch import load_file, save_file

    _save_gemma3(tmp_path, tiny_tokenizer)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.post_feedforward_layernorm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensors.*layers\.2\.post_feedforward_layernorm"):
        load_model(str(tmp_path), progress=False)


def test_multimodal_gemma3_and_unknown_architectures_are_named(tiny_tokenizer, tmp_path):
    _save_gemma3(tmp_path, tiny_tokenizer)
    _edit_config(tmp_path, model_type="gemma3")
    with pytest.raises(ModelLoadError, match=r"architecture 'gemma3' is not supported \(Gemma 3's multimodal.*"
                                             r"supported architectures: .*gemma3_text"):
        load_model(str(tmp_path), progress=False)
    _edit_config(tmp_path, model_type="gemma2")
    with pytest.raises(ModelLoadError, match=r"architecture 'gemma2' is not supported; supported architectures: "
                                             r"llama, .*gemma3_text"):
        load_model(str(tmp_path), progress=False)


def test_gemma3_gguf_names():
    assert gguf_to_hf_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.0.post_attention_norm.weight", "gemma3") == \
        "model.layers.0.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.1.post_ffw_norm.weight", "gemma3") == "model.layers.1.post_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.1.attn_q_norm.weight", "gemma3") == "model.layers.1.self_attn.q_norm.weight"
    assert "gemma3_text" in yr.models.loading.SUPPORTED_ARCHS


# llama.cpp's GGUF names of the Hugging Face names of a Gemma 3 block
_GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _write_gemma3_gguf(hf, path, arch: str = "gemma3"):
    """``hf``'s tensors as llama.cpp's converter writes a Gemma 3 GGUF: its names, float32, every norm
    weight stored as ``1 + weight`` (convert_hf_to_gguf.py's ``norm_shift``), a SentencePiece-style
    vocabulary (``tokenizer.ggml.model`` llama, no merges, as Gemma files have)."""
    import string

    import gguf

    c, V, a = hf.config, gguf.GGUFValueType, arch
    vocab = c.vocab_size
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581"] + list(string.ascii_lowercase) + \
        ["\u2581" + ch for ch in "tacfqbo"] + ["th", "he", "\u2581the", "ca", "\u2581ca", "\u2581cat"]
    tokens = (pieces + [f"<unused{i}>" for i in range(vocab)])[:vocab]
    types = [3, 3, 3, 2] + [1] * (len(pieces) - 4) + [4] * (vocab - len(pieces))
    writer = gguf.GGUFWriter(str(path), a)
    for key, value, vtype, sub in [
            (f"{a}.block_count", c.num_hidden_layers, V.UINT32, None),
            (f"{a}.context_length", c.max_position_embeddings, V.UINT32, None),
            (f"{a}.embedding_length", c.hidden_size, V.UINT32, None),
            (f"{a}.feed_forward_length", c.intermediate_size, V.UINT32, None),
            (f"{a}.attention.head_count", c.num_attention_heads, V.UINT32, None),
            (f"{a}.attention.head_count_kv", c.num_key_value_heads, V.UINT32, None),
            (f"{a}.attention.key_length", c.head_dim, V.UINT32, None),
            (f"{a}.attention.value_length", c.head_dim, V.UINT32, None),
            (f"{a}.attention.sliding_window", c.sliding_window, V.UINT32, None),
            (f"{a}.rope.freq_base", c.rope_parameters["full_attention"]["rope_theta"], V.FLOAT32, None),
            (f"{a}.attention.layer_norm_rms_epsilon", c.rms_norm_eps, V.FLOAT32, None),
            ("tokenizer.ggml.model", "llama", V.STRING, None),
            ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
            ("tokenizer.ggml.scores", [0.0] * vocab, V.ARRAY, V.FLOAT32),
            ("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32),
            ("tokenizer.ggml.bos_token_id", 2, V.UINT32, None), ("tokenizer.ggml.eos_token_id", 1, V.UINT32, None),
            ("tokenizer.ggml.unknown_token_id", 3, V.UINT32, None),
            ("tokenizer.ggml.padding_token_id", 0, V.UINT32, None),
            ("tokenizer.ggml.add_bos_token", True, V.BOOL, None)]:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        stem, kind = name.rsplit(".", 1)
        parts = stem.split(".")
        out = (f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:])]}" if parts[1] == "layers" else _GGUF_NAMES[stem])
        data = t.detach().float()
        if name.endswith("norm.weight"):
            data = data + 1.0
        writer.add_tensor(f"{out}.{kind}", data.numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_gemma3_gguf_round_trip(tmp_path, monkeypatch, persistent):
    """A tiny Gemma 3 written as llama.cpp writes one (6 layers: GGUF files carry no layer types, so
    transformers derives sliding_window_pattern 6, layers 0-4 sliding and 5 full; query_pre_attn_scalar
    and the local RoPE base take Gemma3TextConfig's defaults, 256 and 1e4): yirage's tokenizer and
    logits (prefill and decode) equal transformers' loading the same file (``gguf_file=``: norm weights
    minus 1, then ``1 + weight`` at run time), and the original model's within float32 rounding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    hf = _gemma3(num_hidden_layers=6, layer_types=None, sliding_window=4, query_pre_attn_scalar=256,
                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    _write_gemma3_gguf(hf, tmp_path / "gemma3.gguf")
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="gemma3.gguf", dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="gemma3.gguf")
    for _ in range(2):  # the second load reads the config and tokenizer caches
        llm = yr.LLM(str(tmp_path / "gemma3.gguf"), backend="cpu", max_seq_length=32, persistent=persistent,
                     num_workers=2)
        cfg = llm.config
        assert (cfg.arch, cfg.head_dim, cfg.sliding_window, cfg.attention_scale) == ("gemma3_text", 32, 4, 1 / 16)
        assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
        for text in ("the cat", "a the cab"):
            assert llm.encode_prompt(text) == ref_tok(text).input_ids
    norm = llm.steps.model.weights["model.layers.0.post_attention_layernorm.weight"][0]
    torch.testing.assert_close(norm, ref.model.layers[0].post_attention_layernorm.weight.detach() + 1.0,
                               atol=0, rtol=0)
    ids = [2, 5, 17, 299, 42, 8, 100, 3]
    seq = list(ids)
    logits, _ = llm.steps.run(ids, 0)
    got = [logits[0].clone()]
    for _ in range(3):
        seq.append(int(got[-1].argmax()))
        logits, _ = llm.steps.run(seq[-1:], len(seq) - 1)
        got.append(logits[0].clone())
    with torch.inference_mode():
        expect, original = ref(torch.tensor([seq])).logits[0], hf(torch.tensor([seq])).logits[0]
    for i, g in enumerate(got):
        torch.testing.assert_close(g, expect[len(ids) - 1 + i], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g, original[len(ids) - 1 + i], atol=1e-4, rtol=1e-4)


def test_unknown_gguf_architecture_is_named(tmp_path):
    """A GGUF architecture yirage does not know: one error naming it and the supported GGUF names."""
    _write_gemma3_gguf(_gemma3(), tmp_path / "gemma2.gguf", arch="gemma2")
    with pytest.raises(ModelLoadError, match=r"architecture 'gemma2' is not supported; supported architectures: "
                                             r"llama, qwen2, mistral, qwen3, phi3, gemma3$"):
        load_model(str(tmp_path / "gemma2.gguf"), progress=False)
