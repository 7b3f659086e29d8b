"""Everything above the backend on webgpu (Mesa's lavapipe here): SmolLM2's greedy tokens equal the
CPU backend's, all-MiniLM-L6-v2's vectors the CPU's, and torch.compile of a small CNN and a small
BERT equals eager. Short, since lavapipe is slow; the kernels themselves are checked case by case
in tests/backends (test_ops.py runs every conformance case on webgpu)."""
import pytest
import torch

import yirage as yr
from yirage.backends import get_backend_impl, get_backend_info

pytestmark = pytest.mark.slow

if not yr.is_backend_available("webgpu"):
    pytest.skip(f"webgpu unavailable: {get_backend_info('webgpu').reason}", allow_module_level=True)

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_smollm2_greedy_tokens_equal_the_cpu_backends(prompt):
    kw = {"max_seq_length": 96}
    want = yr.LLM("smollm2-135m-instruct", backend="cpu", **kw).generate(prompt, max_new_tokens=16, temperature=0)
    got = yr.LLM("smollm2-135m-instruct", backend="webgpu", **kw).generate(prompt, max_new_tokens=16, temperature=0)
    assert got.token_ids == want.token_ids and len(got.token_ids) == 16


def test_minilm_vectors_equal_the_cpu_backends():
    sentences = ["The quick brown fox jumps over the lazy dog.", "WebGPU runs compute shaders on Metal and Vulkan.",
                 "short", "A longer sentence about the weather in Paris, which was mild and sunny all week long."]
    want = torch.as_tensor(yr.EmbeddingModel("all-minilm-l6-v2", backend="cpu").encode(sentences))
    got = torch.as_tensor(yr.EmbeddingModel("all-minilm-l6-v2", backend="webgpu").encode(sentences))
    assert torch.nn.functional.cosine_similarity(got, want).min() >= 0.99999


def _compiled(model, *inputs, monkeypatch):
    """(torch.compile on webgpu's outputs, eager's); asserts the partitions ran on webgpu's buffers."""
    impl = get_backend_impl("webgpu")
    allocated = []
    real = impl.alloc
    monkeypatch.setattr(impl, "alloc", lambda n, d: allocated.append(n) or real(n, d))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="yirage", options={"backend": "webgpu"})
    with torch.no_grad():
        out = compiled(*inputs), model(*inputs)
    assert allocated, "no plan allocated webgpu buffers: the model did not run on webgpu"
    return out


def test_a_small_cnn_through_torch_compile_equals_eager(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8), torch.nn.ReLU6(), torch.nn.MaxPool2d(2),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5)).eval()
    got, want = _compiled(model, torch.randn(2, 3, 17, 15), monkeypatch=monkeypatch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_small_bert_through_torch_compile_equals_eager(monkeypatch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=64)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 100, (2, 11))
    got, want = _compiled(model, ids, monkeypatch=monkeypatch)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-4)
