"""Loading without transformers (GitHub issue 7, part 4): the GGUF reader that does not split
metadata arrays into items, the cache of the config and the converted tokenizer, and yirage's
``Tokenizer`` (tokenizers + jinja2), each checked against transformers as the reference.

- the tokenizer: the same ids as transformers' conversion of the default model's GGUF (with and
  without special tokens), the same chat-template rendering and ids, the same decoded text;
- the cache: a warm load does not import transformers (a subprocess), a damaged config or
  tokenizer entry is ignored and rebuilt, a changed file does not hit the old entry;
- the reader: metadata values equal the stock ``gguf.GGUFReader``'s.

Small GGUF files come from test_validation.py's builders (a tiny Llama with a 64-token
byte-level tokenizer), converted by transformers in-process in a per-test cache.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
import torch

from test_validation import gguf_metadata, patch_gguf, write_gguf
from yirage.models import gguf_file
from yirage.models.loading import load_model
from yirage.models.registry import resolve_model
from yirage.models.tokenizer import Tokenizer

DEFAULT = "smollm2-135m-instruct"

TEXTS = [
    "", "Hello, world!", "hello world", "The quick brown fox jumps over the lazy dog.",
    " leading space", "trailing space ", "   three leading spaces", "two  inner  spaces",
    "line one\nline two\n\nline four", "\t tabs \t and spaces \t", "\r\nwindows\r\nnewlines", " \n \n ",
    "naïve café résumé", "Straße über Öl", "日本語のテキスト", "中文 和 English mixed", "한국어 텍스트",
    "Ελληνικά και русский", "עברית ועربي", "🙂", "🙂👍🏽🇫🇷", "family: 👨‍👩‍👧‍👦", "math: ∑ x² ≤ ∞",
    "x = f(y) + 3.14159; // comment", "def f(a, b):\n    return a ** b\n", "<html><body>hi</body></html>",
    "1234567890", "3.14159265358979", "don't I'm we've they're it's", "Hello , world . Isn 't it ?",
    "\u00a0no-break\u200bzero-width\ufeffbom", "a" * 300, "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<|im_start|>user\nhi<|im_end|>\n", "before<|im_end|>after", "<|im_start|><|im_start|>",
    "<repo_name>yirage<file_sep>x.py", "<|unknown|> <s> </s> [INST]",
]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 🙂"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one, in 日本語."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "<|im_end|> c"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    """transformers' conversion of the default model's GGUF tokenizer: the reference."""
    from transformers import AutoTokenizer

    path = resolve_model(DEFAULT).path
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def light(hf_tokenizer, tmp_path_factory):
    """yirage's tokenizer as a cache hit makes it: converted, saved, loaded back."""
    directory = tmp_path_factory.mktemp("tokenizer") / "entry"
    Tokenizer.from_transformers(hf_tokenizer).save(directory)
    return Tokenizer.load(directory)


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(cache))
    return cache


# ------------------------------------------------------------------ the tokenizer against transformers


@pytest.mark.parametrize("special", [True, False])
def test_encode_matches_transformers(light, hf_tokenizer, special):
    for text in TEXTS:
        assert light.encode(text, add_special_tokens=special) == \
            hf_tokenizer.encode(text, add_special_tokens=special), text


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(light, hf_tokenizer, skip):
    for text in TEXTS:
        ids = hf_tokenizer.encode(text)
        assert light.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip), text
    ids = list(range(0, 200)) + [1, 2, 0, 49151]
    assert light.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)
    assert light.decode(torch.tensor(ids), skip_special_tokens=skip) == \
        hf_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("prompt", [True, False])
def test_chat_template_matches_transformers(light, hf_tokenizer, prompt):
    for chat in CHATS:
        text = light.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
        assert text == hf_tokenizer.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False), chat
        ids = light.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True)
        assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
        assert ids == list(hf_tokenizer.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True,
                                                            return_dict=False)), chat


def test_special_tokens_match_transformers(light, hf_tokenizer):
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                 "unk_token_id", "pad_token_id", "all_special_ids", "all_special_tokens", "special_tokens_map",
                 "chat_template"):
        assert getattr(light, name) == getattr(hf_tokenizer, name), name
    assert len(light) == len(hf_tokenizer) and light.get_vocab() == hf_tokenizer.get_vocab()
    assert light.convert_tokens_to_ids(["<|im_start|>", "hello", "no such token"]) == \
        hf_tokenizer.convert_tokens_to_ids(["<|im_start|>", "hello", "no such token"])


def test_chat_template_errors_propagate(light, hf_tokenizer):
    """A failing template raises jinja2's error (generate.py turns it into a GenerationError)."""
    chat = CHATS[0]
    for template in ("{{ raise_exception('no system messages') }}", "{% for %}", "{{ messages[0].content.x.y }}"):
        with pytest.raises(Exception) as ours:
            light.apply_chat_template(chat, chat_template=template)
        with pytest.raises(Exception) as theirs:
            hf_tokenizer.apply_chat_template(chat, chat_template=template)
        assert type(ours.value) is type(theirs.value), template
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system messages"):
        light.apply_chat_template(chat, chat_template="{{ raise_exception('no system messages') }}")
    with pytest.raises(ValueError, match="empty conversation"):
        light.apply_chat_template([])


def test_chat_template_globals_and_filters(light, hf_tokenizer):
    """The environment transformers gives templates: tojson (no HTML escaping), namespace, dict,
    loop controls, trim/lstrip blocks, the {% generation %} tag, special-token variables, kwargs."""
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{% set ns.n = ns.n + 1 %}{{ m | tojson }}\n  {% generation %}{{ bos_token }}{% endgeneration %}"
                "{% endfor %}{{ ns.n }} {{ dict(a=1) | tojson }} {{ extra }}")
    chat = [{"role": "user", "content": "<b>&'\"é"}, {"role": "assistant", "content": "x"}, {"role": "user"}]
    ours = light.apply_chat_template(chat, chat_template=template, tokenize=False, extra="E")
    assert ours == hf_tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False, extra="E")
    assert '"<b>&\'\\"é"' in ours and "<|im_start|>" in ours


def test_load_model_gives_yirage_tokenizer(private_cache):
    first = load_model(DEFAULT, progress=False)  # converts (cache miss)
    second = load_model(DEFAULT, progress=False)  # from the cache
    assert type(first.tokenizer) is Tokenizer and type(second.tokenizer) is Tokenizer
    assert first.tokenizer.encode(TEXTS[3]) == second.tokenizer.encode(TEXTS[3])
    assert first.config.eos_token_ids == second.config.eos_token_ids == [2]
    assert torch.equal(first.config.inv_freq, second.config.inv_freq)
    assert first.config.hf_config == second.config.hf_config


# ------------------------------------------------------------------ the cache


def test_cache_hit_does_not_import_transformers(private_cache):
    load_model(DEFAULT, progress=False)  # warm-up: fills the private cache
    code = ("import sys, time, torch\nfrom yirage.models.loading import load_model\n"
            "t = time.perf_counter(); load_model('smollm2-135m-instruct', progress=False)\n"
            "print('transformers' in sys.modules, round(time.perf_counter() - t, 3))\n")
    env = dict(os.environ, YIRAGE_CACHE_DIR=str(private_cache))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported, seconds = proc.stdout.split()
    assert imported == "False", proc.stdout
    print(f"warm load_model in a fresh process: {seconds} s")


def _entries(cache: Path) -> tuple[list[Path], list[Path]]:
    configs = sorted((cache / "gguf-config").glob("*.json"))
    tokenizers = sorted(p for p in (cache / "tokenizers").iterdir() if not p.name.startswith("."))
    return configs, tokenizers


def _no_transformers(monkeypatch):
    """Make any conversion by transformers fail: what is loaded must come from the cache."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoTokenizer

    def fail(*args, **kwargs):
        raise AssertionError("transformers was asked to convert: the cache was not used")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", fail)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fail)


def test_cache_is_used_and_keyed_by_content(private_cache, tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "model.gguf")
    first = load_model(str(path), progress=False)
    configs, tokenizers = _entries(private_cache)
    assert len(configs) == 1 and len(tokenizers) == 1 and configs[0].stem == tokenizers[0].name
    with monkeypatch.context() as m:
        _no_transformers(m)
        second = load_model(str(path), progress=False)
        copy = tmp_path / "copy" / "other-name.gguf"  # the same header elsewhere: the same entry
        copy.parent.mkdir()
        copy.write_bytes(path.read_bytes())
        load_model(str(copy), progress=False)
    assert type(second.tokenizer) is Tokenizer
    assert second.config.hf_config == first.config.hf_config
    assert torch.equal(second.config.inv_freq, first.config.inv_freq)
    assert second.tokenizer.encode("ab cd ef") == first.tokenizer.encode("ab cd ef")
    assert _entries(private_cache) == (configs, tokenizers)


def test_changed_file_misses_the_old_entry(private_cache, tmp_path):
    """Metadata changed in place, same size, mtime put back: a new key, the new values."""
    path = write_gguf(tmp_path / "model.gguf")
    before = load_model(str(path), progress=False)
    assert before.config.max_position_embeddings == 128 and before.tokenizer.eos_token_id == 2
    stat = path.stat()
    patch_gguf(path, {"llama.context_length": 256, "tokenizer.ggml.eos_token_id": 3})
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = load_model(str(path), progress=False)
    assert after.config.max_position_embeddings == 256
    assert after.tokenizer.eos_token_id == 3 and 3 in after.config.eos_token_ids
    configs, tokenizers = _entries(private_cache)
    assert len(configs) == 2 and len(tokenizers) == 2


@pytest.mark.parametrize("damage", ["garbage", "valid_json_edited", "truncated", "empty"])
def test_damaged_config_entry_is_rebuilt(private_cache, tmp_path, caplog, damage):
    path = write_gguf(tmp_path / "model.gguf")
    reference = load_model(str(path), progress=False)
    (entry,), _ = _entries(private_cache)
    text = entry.read_text()
    if damage == "garbage":
        entry.write_bytes(b"\xff\x00not json" * 10)
    elif damage == "valid_json_edited":  # a plausible value, but not what was written: the checksum says so
        body = json.loads(text)
        body["fields"]["max_position_embeddings"] = 4096
        entry.write_text(json.dumps(body))
    elif damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    else:
        entry.write_text("")
    with caplog.at_level(logging.WARNING, logger="yirage"):
        model = load_model(str(path), progress=False)
    assert any("config cache" in r.getMessage() for r in caplog.records)
    assert model.config.max_position_embeddings == 128
    assert model.config.hf_config == reference.config.hf_config
    assert json.loads(entry.read_text()) == json.loads(text)  # rewritten as it was


@pytest.mark.parametrize("damage", ["settings_edited", "backend_edited", "backend_missing", "settings_garbage"])
def test_damaged_tokenizer_entry_is_rebuilt(private_cache, tmp_path, caplog, damage):
    path = write_gguf(tmp_path / "model.gguf", gguf_metadata(tokenizer__chat_template=(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", gguf.GGUFValueType.STRING, None)))
    reference = load_model(str(path), progress=False)
    _, (entry,) = _entries(private_cache)
    settings, backend = entry / "yirage-tokenizer.json", entry / "tokenizer.json"
    if damage == "settings_edited":
        body = json.loads(settings.read_text())
        body["settings"]["special_ids"]["eos_token_id"] = 5
        settings.write_text(json.dumps(body))
    elif damage == "backend_edited":
        backend.write_text(backend.read_text().replace('"ab"', '"ba"'))
    elif damage == "backend_missing":
        backend.unlink()
    else:
        settings.write_text("{")
    with caplog.at_level(logging.WARNING, logger="yirage"):
        model = load_model(str(path), progress=False)
    assert any("tokenizer cache" in r.getMessage() for r in caplog.records)
    assert model.tokenizer.eos_token_id == reference.tokenizer.eos_token_id == 2
    assert model.tokenizer.encode("ab cd") == reference.tokenizer.encode("ab cd")
    assert model.tokenizer.chat_template == reference.tokenizer.chat_template
    Tokenizer.load(entry)  # rebuilt: sound again


# ------------------------------------------------------------------ the reader


@pytest.mark.parametrize("endian", ["little", "big"])
def test_reader_values_equal_the_stock_reader(tmp_path, endian):
    path = tmp_path / "model.gguf"
    if endian == "little":
        write_gguf(path)
    else:
        writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
        for key, (value, vtype, sub) in gguf_metadata().items():
            writer.add_key_value(key, value, vtype, sub_type=sub)
        writer.add_key_value("test.floats", [1.5, -2.5], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
        writer.add_tensor("output_norm.weight", np.arange(8, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    ours, stock = gguf_file._open_gguf(path), gguf.GGUFReader(str(path))
    assert ours.byte_order == stock.byte_order == ("I" if endian == "little" else "S")
    assert list(ours.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types[0] == field.types[0], key
    assert ours.data_offset == stock.data_offset
    for a, b in zip(ours.tensors, stock.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        assert (a.data == b.data).all()
        weight = gguf_file._gguf_tensor(a).data
        assert weight.dtype != torch.float32 or torch.equal(weight.reshape(-1), torch.from_numpy(
            b.data.astype(np.float32).reshape(-1)))


def test_default_model_tokens_are_read_lazily(hf_tokenizer):
    reader = gguf_file._open_gguf(resolve_model(DEFAULT).path)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert tokens.count == len(tokens.values) == 49152
    for i in (0, 1, 2, 17, 100, 1000, 30000, 49151):
        assert tokens.contents(i) == hf_tokenizer.convert_ids_to_tokens(i), i
    assert reader.fields["tokenizer.ggml.token_type"].contents()[:3] == [3, 3, 3]


def test_hf_directory_gets_yirage_tokenizer(tmp_path, save_tiny_model):
    from transformers import AutoTokenizer

    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}"
                "{% if add_generation_prompt %}w3{% endif %}")
    save_tiny_model("llama", tmp_path, chat_template=template)
    model = load_model(str(tmp_path), progress=False)
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(model.tokenizer) is Tokenizer
    for text in ("w1 w2 w3", "w299 w0 nope", ""):
        assert model.tokenizer.encode(text) == reference.encode(text)
    chat = [{"role": "user", "content": "w5 w6"}]
    assert model.tokenizer.apply_chat_template(chat, add_generation_prompt=True) == \
        list(reference.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
