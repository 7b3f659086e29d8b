"""Architectures beyond issue 19's model suite through ``yr.compile`` against torch eager.

Each is built from a tiny transformers config with random weights (no network) and called at
two input shapes, so a recompile is checked too; its output must match eager in float32, and
yirage partitions must have run (``yr.explain``), so none passes by an all-eager fallback. They
were picked for what the suite lacks: DeBERTa-v2's disentangled relative attention, BART's
encoder-decoder with cross-attention, Mistral's sliding-window GQA, BLOOM's ALiBi, Falcon's
parallel attention and MLP, GPT-J's interleaved RoPE, CLIP's causal text encoder with QuickGELU,
Swin's shifted windows, and Segformer's sequence-reduction attention between strided
convolutions (whose stacked k/v projection once made the executor free a buffer twice).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import yirage as yr

tf = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
#: (batch, sequence length) of the two calls; images: (batch, side)
SHAPES = ((2, 16), (1, 24))


def _text(cls, config, decoder=False):
    def inputs(b, s):
        d = {"input_ids": torch.randint(3, 100, (b, s))}
        if decoder:
            d["decoder_input_ids"] = torch.randint(3, 100, (b, 5))
        return d
    return lambda: cls(config), inputs


def _image(cls, config, side):
    return lambda: cls(config), lambda b, s: {"pixel_values": torch.randn(b, 3, side, side)}


MODELS = {
    "deberta-v2": _text(tf.DebertaV2Model, tf.DebertaV2Config(**TINY)),
    "bart": _text(tf.BartModel, tf.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                              decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128),
                  decoder=True),
    "mistral": _text(tf.MistralModel, tf.MistralConfig(num_key_value_heads=2, sliding_window=8, **TINY)),
    "bloom": _text(tf.BloomModel, tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4)),
    "falcon": _text(tf.FalconModel, tf.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),
    "gptj": _text(tf.GPTJModel, tf.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8)),
    "clip-text": _text(tf.CLIPTextModel, tf.CLIPTextConfig(**TINY)),
    "swin": _image(tf.SwinModel, tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                               num_heads=[2, 2], window_size=4), 32),
    "segformer": _image(tf.SegformerModel, tf.SegformerConfig(hidden_sizes=[8, 16, 32, 64],
                                                              num_attention_heads=[1, 2, 2, 4], depths=[1, 1, 1, 1]), 64),
}


def _first(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_eager_at_two_shapes(name, tmp_path):
    make, inputs = MODELS[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # transformers' config warnings
        model = make().eval()
    compiled = yr.compile(model, options={"cache_dir": str(tmp_path)})   # compiled here, never loaded
    with torch.no_grad():
        for b, s in SHAPES:
            kw = inputs(b, s)
            want, got = _first(model(**kw)), _first(compiled(**kw))
            assert got.shape == want.shape
            err = (got - want).abs().max().item()
            assert err <= 1e-4 * max(1.0, want.abs().max().item()), f"{name} at {b}x{s}: max abs error {err:.3g}"
    ran = [p for r in compiled._yirage_backend.reports for p in r.partitions if p.runs_in == "yirage"]
    assert ran, f"{name}: nothing ran in yirage"
