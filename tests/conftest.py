"""Shared fixtures: the default model loaded once, and transformers' copy of it.

Without a GPU, Triton kernels run under Triton's CPU interpreter: TRITON_INTERPRET=1 is set
here, before any test module imports triton (the flag is read when a kernel is decorated).
"""
import os

import torch

if not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import yirage as yr  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same torch seed, so random inputs repeat run to run."""
    torch.manual_seed(0)


@pytest.fixture(params=[b.value for b in yr.get_available_backends()])
def backend(request):
    """Every backend this machine can run: the CPU, the GPU backends present, and
    'triton-interpret' (the GPU kernels under Triton's CPU interpreter; enabled above when
    no GPU is present). The shared backend suite (tests/backends/test_ops.py) uses it."""
    return request.param


@pytest.fixture(scope="session")
def smollm():
    """yr.LLM on the default model (CPU), loaded once per test session."""
    import yirage as yr
    return yr.LLM("smollm2-135m-instruct", backend="cpu", max_seq_length=512)


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' reference: the same GGUF loaded by transformers, dequantized to float32."""
    from transformers import AutoModelForCausalLM
    from yirage.models.registry import resolve_model

    path = resolve_model("smollm2-135m-instruct").path
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Factory: a word-level tokenizer 'w0'..'w{n-1}' (no network) to save beside tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def make(vocab_size: int):
        vocab = {f"w{i}": i for i in range(vocab_size)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1", bos_token="w2")
    return make
