"""The model suite of issue 19 through ``torch.compile(backend="yirage")`` against torch eager.

transformers' BERT, GPT-2, Llama, ViT, DistilBERT and T5's encoder are built from tiny configs
(hidden 64, 2 layers) with random weights, sentence-transformers' all-MiniLM-L6-v2 is the
shipped copy; no network. Each runs in eval mode under ``torch.no_grad()`` with static shapes:
``yr.explain`` compiles and runs it once, and its output must match eager in float32 (max
absolute error and cosine), and all of its ATen ops must have run inside one yirage partition
(``coverage``, printed: ops in yirage partitions over those plus the ops left in torch,
getitems excluded on both sides as they only unpack tuples). The coverage of each model, and
what stayed in torch with the reason, is printed (``pytest -s``). transformers' ResNet must run
correctly (its convolutions, batch norms and pooling stay torch ops).
"""
from __future__ import annotations

import collections
import warnings

import pytest
import torch

import yirage as yr

transformers = pytest.importorskip("transformers")

#: max abs error, scaled by the output's largest magnitude when that is above 1: folding
#: BatchNorm into convolution weights rounds differently, and error grows with the values
MAX_ABS_ERROR = 1e-4
MIN_COSINE = 0.99999
B, S = 2, 12


def _ids(vocab=100):
    return torch.randint(0, vocab, (B, S))


def _mask():
    mask = torch.ones(B, S, dtype=torch.int64)
    mask[1, 9:] = 0  # the second sequence is padded
    return mask


def bert():
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=32)
    return transformers.BertModel(config), dict(input_ids=_ids(), attention_mask=_mask())


def gpt2():
    config = transformers.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=2, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Model(config), dict(input_ids=_ids(), use_cache=False)


def llama():
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=32)
    return transformers.LlamaModel(config), dict(input_ids=_ids(), use_cache=False)


def vit():
    config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=128, image_size=32, patch_size=8)
    return transformers.ViTModel(config), dict(pixel_values=torch.randn(B, 3, 32, 32))


def distilbert():
    config = transformers.DistilBertConfig(vocab_size=100, dim=64, n_layers=2, n_heads=2, hidden_dim=128,
                                           max_position_embeddings=32)
    return transformers.DistilBertModel(config), dict(input_ids=_ids(), attention_mask=_mask())


def t5_encoder():
    config = transformers.T5Config(vocab_size=100, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2)
    return transformers.T5EncoderModel(config), dict(input_ids=_ids(), attention_mask=_mask())


class _SentenceEmbedding(torch.nn.Module):
    """A SentenceTransformer as a module of tensors: (input_ids, attention_mask) -> the
    normalized sentence embeddings [B, 384]."""

    def __init__(self, st):
        super().__init__()
        self.st = st

    def forward(self, input_ids, attention_mask):
        return self.st({"input_ids": input_ids, "attention_mask": attention_mask})["sentence_embedding"]


def minilm():
    st_module = pytest.importorskip("sentence_transformers")
    from yirage.models.registry import resolve_embedding_model
    st = st_module.SentenceTransformer(str(resolve_embedding_model("all-minilm-l6-v2")), device="cpu")
    batch = st.tokenize(["yirage compiles torch models", "a second, longer sentence with some padding at the end"])
    return _SentenceEmbedding(st), dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def resnet():
    config = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                       layer_type="basic")
    return transformers.ResNetModel(config), dict(pixel_values=torch.randn(B, 3, 32, 32))


def _calibrated(model):
    """A conv net whose activations neither vanish nor turn denormal (transformers' random init
    does that to some): Kaiming convolutions, BatchNorm affine reset, BatchNorm statistics
    from a few random batches in train mode."""
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, torch.nn.BatchNorm2d):
            torch.nn.init.ones_(m.weight), torch.nn.init.zeros_(m.bias)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(pixel_values=torch.randn(4, 3, 32, 32))
    return model.eval()


def mobilenetv2():
    """TensorFlow-style "same" padding (constant_pad_nd) and ReLU6 (hardtanh)."""
    config = transformers.MobileNetV2Config(depth_multiplier=0.25, image_size=32, num_channels=3)
    return _calibrated(transformers.MobileNetV2Model(config)), dict(pixel_values=torch.randn(B, 3, 32, 32))


def convnext():
    """Depthwise 7x7 convolutions, LayerNorm over channels (permutes), GELU."""
    config = transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32)
    return _calibrated(transformers.ConvNextModel(config)), dict(pixel_values=torch.randn(B, 3, 32, 32))


#: model -> the least coverage it must reach (what these tiny configs reach today, less a margin)
SUITE = [bert, gpt2, llama, vit, distilbert, t5_encoder, minilm]


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "last_hidden_state"):
        return out["last_hidden_state"]
    return out[0]


def coverage(report) -> tuple[float, int, int]:
    """(share of ATen ops in yirage partitions, ops in yirage, ops in torch), getitems excluded."""
    in_yirage = sum(1 for p in report.yirage_partitions for op in p.ops if op != "getitem")
    in_torch = sum(1 for t in report.torch_ops if t.op != "getitem")
    return in_yirage / max(1, in_yirage + in_torch), in_yirage, in_torch


def run_model(make):
    """Build the model, run it eager and through ``yr.explain``; returns (report, eager, compiled)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config warnings
        model, kwargs = make()
    model.eval()
    with torch.no_grad():
        expected = _first_tensor(model(**kwargs))
    report = yr.explain(model, **kwargs)
    return report, expected, _first_tensor(report.outputs)


def _check_close(name, got, expected):
    assert got.shape == expected.shape and got.dtype == expected.dtype == torch.float32
    err = (got - expected).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(got.flatten().double(), expected.flatten().double(), dim=0).item()
    assert err <= MAX_ABS_ERROR * max(1.0, expected.abs().max().item()) and cos >= MIN_COSINE, f"{name}: max abs error {err:.3g}, cosine {cos:.8f}"
    return err, cos


def _describe(name, report, err, cos) -> str:
    share, n_yirage, n_torch = coverage(report)
    left = collections.Counter(f"{t.op} ({t.reason})" for t in report.torch_ops if t.op != "getitem")
    lines = [f"{name}: coverage {share:.1%} ({n_yirage} ops in {len(report.yirage_partitions)} yirage partition(s), "
             f"{n_torch} in torch), max abs error {err:.2e}, cosine {cos:.8f}"]
    lines += [f"    torch: {n} x {what}" for what, n in left.most_common()]
    return "\n".join(lines)


@pytest.mark.parametrize("make", SUITE, ids=lambda f: f.__name__)
def test_model_matches_eager_wholly_in_yirage(make):
    report, expected, got = run_model(make)
    err, cos = _check_close(make.__name__, got, expected)
    print("\n" + _describe(make.__name__, report, err, cos))
    assert not [p for p in report.partitions if p.runs_in != "yirage"], "a partition fell back"
    assert len(report.yirage_partitions) == 1 and not report.torch_ops, [
        (t.op, t.reason) for t in report.torch_ops]


@pytest.mark.parametrize("make", [mobilenetv2, convnext], ids=lambda f: f.__name__)
def test_conv_nets_compile_whole_into_yirage(make):
    report, expected, got = run_model(make)
    err, cos = _check_close(make.__name__, got, expected)
    print("\n" + _describe(make.__name__, report, err, cos))
    assert len(report.yirage_partitions) == 1 and not report.torch_ops, [
        (t.op, t.reason) for t in report.torch_ops]


def test_resnet_runs_correctly_with_convolutions_in_yirage():
    """The conv-net lowerings (dynamo/lowering_conv.py): convolutions, batch norms and pooling
    run in yirage partitions, and the model matches eager."""
    report, expected, got = run_model(resnet)
    err, cos = _check_close("resnet", got, expected)
    print("\n" + _describe("resnet", report, err, cos))
    assert not [p for p in report.partitions if p.runs_in != "yirage"], "a partition fell back"
    in_yirage = {op for p in report.partitions for op in p.ops}
    assert {"aten.convolution.default", "aten._native_batch_norm_legit_no_training.default",
            "aten.max_pool2d_with_indices.default"} <= in_yirage
    assert not {t.op for t in report.torch_ops} & {"aten.convolution.default",
                                                  "aten._native_batch_norm_legit_no_training.default"}


@pytest.mark.parametrize("make", [resnet, mobilenetv2], ids=lambda f: f.__name__)
def test_conv_nets_in_bfloat16_compile_whole_and_match_eager(make):
    """A conv net converted with ``.to(torch.bfloat16)`` (BatchNorm statistics in bfloat16 too)
    compiles into one partition and is as close to the float32 model as eager bfloat16 is
    (bfloat16 rounds differently once BatchNorm is folded into the weights: the tiny
    MobileNetV2 in eager bfloat16 is only at cosine 0.98 to float32 itself)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, kwargs = make()
    model = (_calibrated(model) if make is resnet else model).eval()
    with torch.no_grad():
        reference = _first_tensor(model(**kwargs)).float()
        model = model.to(torch.bfloat16)
        kwargs = {k: v.to(torch.bfloat16) for k, v in kwargs.items()}
        eager = _first_tensor(model(**kwargs)).float()
    report = yr.explain(model, **kwargs)
    got = _first_tensor(report.outputs).float()
    assert len(report.yirage_partitions) == 1 and not report.torch_ops, [(t.op, t.reason) for t in report.torch_ops]

    def cos(a):
        return torch.nn.functional.cosine_similarity(a.flatten(), reference.flatten(), dim=0).item()
    err, eager_err = (got - reference).abs().max().item(), (eager - reference).abs().max().item()
    assert cos(got) >= cos(eager) - 2e-3 and err <= 1.5 * eager_err + 1e-2, (cos(got), cos(eager), err, eager_err)
