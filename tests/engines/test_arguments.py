"""yr.LLM's argument checks: every bad argument is one GenerationError saying what is wrong;
valid edge values give a correct result. A tiny random Llama keeps these fast."""
import math

import numpy as np
import pytest

import yirage as yr
from yirage.engines.generate import SEED_MAX, check_generation_args

GOOD = dict(max_new_tokens=4, temperature=0.0, top_k=None, top_p=None, seed=None)


@pytest.mark.parametrize("name,value,fragment", [
    ("max_new_tokens", 0, "max_new_tokens must be a positive integer"),
    ("max_new_tokens", -3, "max_new_tokens must be a positive integer"),
    ("max_new_tokens", 2.0, "max_new_tokens must be a positive integer"),
    ("max_new_tokens", True, "max_new_tokens must be a positive integer"),
    ("max_new_tokens", "8", "max_new_tokens must be a positive integer"),
    ("temperature", math.nan, "temperature must be a finite number >= 0"),
    ("temperature", math.inf, "temperature must be a finite number >= 0"),
    ("temperature", -math.inf, "temperature must be a finite number >= 0"),
    ("temperature", -0.5, "temperature must be a finite number >= 0"),
    ("temperature", 10**400, "temperature must be a finite number >= 0"),
    ("temperature", None, "temperature must be a number >= 0"),
    ("temperature", "0.7", "temperature must be a number >= 0"),
    ("temperature", True, "temperature must be a number >= 0"),
    ("top_k", 0, "top_k must be a positive integer"),
    ("top_k", -1, "top_k must be a positive integer"),
    ("top_k", 4.5, "top_k must be a positive integer"),
    ("top_k", True, "top_k must be a positive integer"),
    ("top_p", 0.0, "top_p must be a number in (0, 1]"),
    ("top_p", 1.5, "top_p must be a number in (0, 1]"),
    ("top_p", math.nan, "top_p must be a number in (0, 1]"),
    ("top_p", "0.9", "top_p must be a number in (0, 1]"),
    ("seed", -1, "seed must be an integer in 0..2**64-1"),
    ("seed", 2**64, "seed must be an integer in 0..2**64-1"),
    ("seed", 99999999999999999999999, "seed must be an integer in 0..2**64-1"),
    ("seed", 1.5, "seed must be an integer in 0..2**64-1"),
    ("seed", False, "seed must be an integer in 0..2**64-1"),
])
def test_bad_generation_argument_is_one_generation_error(name, value, fragment):
    with pytest.raises(yr.GenerationError) as info:
        check_generation_args(**{**GOOD, name: value})
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name,value", [
    ("max_new_tokens", np.int64(3)), ("temperature", 0), ("temperature", np.float32(0.5)),
    ("temperature", 1e6), ("top_k", np.int32(5)), ("top_p", 1.0), ("top_p", 1e-9),
    ("seed", 0), ("seed", SEED_MAX), ("seed", np.uint64(7)),
])
def test_edge_values_are_accepted(name, value):
    check_generation_args(**{**GOOD, name: value})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, save_tiny_model):
    """A tiny random Llama (safetensors) with a word-level tokenizer and no chat template."""
    directory = tmp_path_factory.mktemp("tiny")
    save_tiny_model("llama", directory)
    return directory


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return yr.LLM(str(tiny_dir), backend="cpu", max_seq_length=64)


@pytest.fixture
def template(llm):
    """Set the tokenizer's chat template for one test."""
    def set_template(text):
        llm.tokenizer.chat_template = text
    yield set_template
    llm.tokenizer.chat_template = None


@pytest.mark.parametrize("value", [0, -1, 16.0, True, "64", None])
def test_bad_max_seq_length(tiny_dir, value):
    with pytest.raises(yr.GenerationError, match="max_seq_length must be a positive integer"):
        yr.LLM(str(tiny_dir), backend="cpu", max_seq_length=value)


def test_generate_checks_its_arguments(llm):
    for kwargs, fragment in [
        (dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
        (dict(top_k=0), "top_k"), (dict(top_p=math.nan), "top_p"), (dict(seed=2**64), "seed"),
        (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop=5), "stop must be a string"),
        (dict(stop=["w3", 4]), "stop must be a string"),
    ]:
        with pytest.raises(yr.GenerationError, match=fragment):
            llm.generate("w5 w6", **kwargs)


@pytest.mark.parametrize("prompt,fragment", [
    ("", "0 tokens"),
    (b"w5", "decode bytes first"),
    ([], "non-empty list of chat messages"),
    (42, "must be a string or a non-empty list"),
    ({"role": "user", "content": "w5"}, "must be a string or a non-empty list"),
    ("w5 \udcff", "not valid Unicode text"),  # a non-UTF-8 byte read with surrogateescape
])
def test_bad_prompt(llm, prompt, fragment):
    with pytest.raises(yr.GenerationError, match=fragment):
        llm.generate(prompt, max_new_tokens=2)


def test_bad_chat_messages(llm, template):
    template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(yr.GenerationError, match="chat message 1 must be a dict"):
        llm.generate([{"role": "user", "content": "w5"}, "w6"], max_new_tokens=2)
    with pytest.raises(yr.GenerationError, match=r"chat message 1 \('content'\) is not valid Unicode"):
        llm.generate([{"role": "user", "content": "w5"}, {"role": "user", "content": "\udcfe"}], max_new_tokens=2)


@pytest.mark.parametrize("text,fragment", [
    ("{{ raise_exception('no system messages') }}", "TemplateError: no system messages"),
    ("{{ messages | nosuchfilter }}", "No filter named 'nosuchfilter'"),
    ("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}", "nosuchfilter"),
    ("{{ undefined_thing.attr }}", "UndefinedError"),
    ("{% if %}", "TemplateSyntaxError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
])
def test_failing_chat_template_is_one_generation_error(llm, template, text, fragment):
    template(text)
    with pytest.raises(yr.GenerationError) as info:
        llm.generate("w5 w6", max_new_tokens=2)
    msg = str(info.value)
    assert msg.startswith("the model's chat template failed: ") and fragment in msg, msg
    assert "pass chat=False" in msg and "fix the template" in msg and "\n" not in msg
    assert llm.generate("w5 w6", max_new_tokens=2, chat=False).token_ids  # the way out works


def test_valid_edge_values_give_correct_results(llm):
    greedy = llm.generate("w5 w6", max_new_tokens=5).token_ids
    # a positive temperature too small for float32 logits / temperature is greedy decoding
    assert llm.generate("w5 w6", max_new_tokens=5, temperature=1e-40, seed=1).token_ids == greedy
    assert llm.generate("w5 w6", max_new_tokens=np.int64(5), top_k=np.int64(1), temperature=0.9,
                        seed=SEED_MAX).token_ids == greedy  # top_k=1 is greedy too
    a = llm.generate("w5 w6", max_new_tokens=5, temperature=1.0, seed=SEED_MAX)
    b = llm.generate("w5 w6", max_new_tokens=5, temperature=1.0, seed=SEED_MAX)
    assert a.token_ids == b.token_ids


def test_nonfinite_weights_refused_unless_allowed(tmp_path, save_tiny_model, caplog):
    """yr.LLM refuses NaN/inf weights (ModelLoadError) and takes them with a warning when
    allow_nonfinite_weights=True; the CLI flag --allow-nonfinite-weights does the same."""
    import logging
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    save_tiny_model("llama", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(yr.ModelLoadError, match="model.layers.0.mlp.down_proj.weight"):
        yr.LLM(str(tmp_path), backend="cpu", max_seq_length=16)
    with caplog.at_level(logging.WARNING, logger="yirage"):
        yr.LLM(str(tmp_path), backend="cpu", max_seq_length=16, allow_nonfinite_weights=True)
    assert any("down_proj" in r.getMessage() for r in caplog.records)
    cli = [sys.executable, "-m", "yirage.cli", "generate", "-m", str(tmp_path), "--backend", "cpu",
           "--max-new-tokens", "2", "--no-chat", "w5"]
    refused = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "down_proj" in refused.stderr and "Traceback" not in refused.stderr
    allowed = subprocess.run(cli + ["--allow-nonfinite-weights"], capture_output=True, text=True, timeout=300)
    assert allowed.returncode == 0, allowed.stderr
