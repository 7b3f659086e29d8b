"""The registered Gemma 3 270M (Q4_K_M GGUF: Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors) against
transformers loading the same file (``gguf_file=``, dequantized to float32): the same prompt
ids, and the same greedy tokens for the first 16 new tokens on at least 5 of 6 plain-text
prompts. ``make test`` installs the model (``yirage models pull gemma3-270m``)."""
import pytest
import torch

import yirage as yr
from yirage.models.registry import model_entry, resolve_model

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
]
N_TOKENS = 16

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not model_entry("gemma3-270m").installed(),
                       reason="gemma3-270m is not installed: yirage models pull gemma3-270m (make test does)"),
]


@pytest.fixture(scope="module")
def gemma():
    return yr.LLM("gemma3-270m", backend="cpu", max_seq_length=256)


@pytest.fixture(scope="module")
def hf_gemma(gguf_once):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("gemma3-270m").path
    with gguf_once():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tok


def test_prompt_ids_match_transformers_tokenizer(gemma, hf_gemma):
    _, tok = hf_gemma
    for prompt in PROMPTS:
        assert gemma.encode_prompt(prompt) == tok(prompt)["input_ids"], prompt


def test_prefill_logits_match_transformers(gemma, hf_gemma):
    model, _ = hf_gemma
    assert gemma.config.arch == "gemma3_text" and gemma.tokenizer.chat_template is None
    ids = gemma.encode_prompt(PROMPTS[0])
    assert ids[0] == 2  # <bos>
    logits, _ = gemma.steps.run(ids, 0)
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0].float(), ref, atol=2e-3, rtol=1e-3)


def test_greedy_matches_transformers_on_plain_prompts(gemma, hf_gemma):
    model, _ = hf_gemma
    eos = set(gemma.eos_token_ids)
    matches = []
    for prompt in PROMPTS:
        ids = gemma.encode_prompt(prompt)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=N_TOKENS, do_sample=False,
                                 pad_token_id=0)[0, len(ids):].tolist()
        ref = ref[:next((i for i, t in enumerate(ref) if t in eos), len(ref))]
        out = gemma.generate(prompt, max_new_tokens=N_TOKENS)
        matches.append(out.token_ids == ref)
    assert sum(matches) >= 5, matches


def test_gemma3_template_has_no_tool_format_and_says_so(gemma):
    """Gemma 3's own chat template renders no tools: a request with tools is one clear error
    naming the model (serve answers it with a 400), not a prompt that silently drops them."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with pytest.raises(yr.GenerationError, match="the chat template of gemma3-270m has no tool format"):
        gemma.generate("What is the weather in Paris?", max_new_tokens=4, tools=tools)
