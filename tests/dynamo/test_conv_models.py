"""Conv nets through ``torch.compile(backend="yirage")``: transformers' ResNet (a small config,
random weights initialized as issue 21 asks: Kaiming convolutions, BatchNorm statistics
calibrated on random batches) runs with its convolutions, BatchNorms and pooling in yirage
partitions and matches eager."""
import pytest
import torch
import torch.nn as nn

import yirage as yr

transformers = pytest.importorskip("transformers")


def _calibrated_resnet():
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    layer_type="basic", num_labels=5)
    model = transformers.ResNetForImageClassification(cfg)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight), nn.init.zeros_(m.bias)
    model.train()
    with torch.no_grad():   # running statistics from a few random batches
        for _ in range(4):
            model(torch.randn(4, 3, 32, 32))
    return model.eval()


def test_resnet_matches_eager_with_convs_in_yirage():
    model = _calibrated_resnet()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(x).logits
        out = torch.compile(model, backend="yirage")(x).logits
        report = yr.explain(model, x).to_dict()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    in_yirage = [op for g in report["graphs"] for p in g["partitions"] if p["runs_in"] == "yirage" for op in p["ops"]]
    in_torch = [t["op"] for g in report["graphs"] for t in g["torch_ops"]]
    assert in_yirage.count("aten.convolution.default") >= 5   # stem, two basic blocks' convs, a shortcut
    assert "aten._native_batch_norm_legit_no_training.default" in in_yirage
    assert "aten.max_pool2d_with_indices.default" in in_yirage
    assert not [op for op in in_torch if "convolution" in op or "batch_norm" in op], in_torch
