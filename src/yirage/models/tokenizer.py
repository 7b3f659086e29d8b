"""The tokenizer of a loaded model: Hugging Face's ``tokenizers.Tokenizer`` (the Rust tokenizer that
transformers' "fast" tokenizers run) plus the few settings transformers keeps around it, so that a
model whose converted tokenizer is cached loads and runs without importing transformers (about 4 s).

``Tokenizer`` behaves as the transformers tokenizer (``TokenizersBackend``) it was made from:

- ``encode`` runs the backend's whole pipeline (normalizer, pre-tokenizer, model, post-processor):
  whether BOS/EOS are added is the post-processor's, which transformers has already set from the
  tokenizer's ``add_bos_token``/``add_eos_token`` settings; added and special tokens are matched
  as transformers matches them (``split_special_tokens``);
- ``decode`` is the backend's decode (``skip_special_tokens`` drops the added tokens marked
  special), with transformers' clean-up of spaces before punctuation when the converted tokenizer
  has it on (transformers never applies it to BPE tokenizers);
- ``apply_chat_template`` renders the chat template with jinja2 as transformers renders it
  (``transformers/utils/chat_template_utils.py``: an ``ImmutableSandboxedEnvironment`` with
  ``trim_blocks``, ``lstrip_blocks`` and the ``loopcontrols`` extension, the ``{% generation %}``
  tag, the ``tojson`` filter, the ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``
  globals, the named special tokens as variables, inputs reduced to plain data) and encodes the
  text without adding special tokens. jinja2 errors propagate as they are.

A ``Tokenizer`` is made by ``from_transformers`` from a loaded transformers tokenizer, which checks
that the result gives the same ids, text and chat rendering as the original on probe texts (and
refuses tokenizer classes that override encoding or decoding in Python), and is kept in the cache
by ``save`` / ``load``: ``tokenizer.json`` (the backend) and ``yirage-tokenizer.json`` (the settings
and a SHA-256 over both files); ``load`` raises ValueError for a missing, damaged or altered entry.

This module must never import transformers except in ``from_transformers`` (whose argument is a
transformers object already), and never tokenize by itself: every id comes from ``tokenizers``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

BACKEND_FILE = "tokenizer.json"
SETTINGS_FILE = "yirage-tokenizer.json"
_FORMAT = 1
# the named special tokens of transformers (SPECIAL_TOKENS_ATTRIBUTES)
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with transformers' special tokens, chat template and decode settings.

    Attributes: ``chat_template`` (a jinja2 template string, a dict of named templates, or None;
    may be reassigned), ``bos_token``/``eos_token``/``unk_token``/``pad_token``/... (str or None)
    and their ``*_id`` (int or None), ``special_tokens_map``, ``all_special_tokens``,
    ``all_special_ids``, ``backend_tokenizer`` (the ``tokenizers.Tokenizer``).
    """

    def __init__(self, backend_json: str, settings: dict):
        """``backend_json``: a ``tokenizer.json`` document; ``settings``: as ``from_transformers``
        makes them (checked here). Raises ValueError: settings of the wrong shape, or a document
        ``tokenizers`` cannot load."""
        from tokenizers import Tokenizer as Backend

        _check_settings(settings)
        try:
            backend = Backend.from_str(backend_json)
        except BaseException as exc:  # pyo3 panics are BaseExceptions
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            raise ValueError(f"tokenizers cannot load the tokenizer ({type(exc).__name__}: {exc})") from exc
        backend.no_truncation()  # transformers turns both off for a plain encode
        backend.no_padding()
        backend.encode_special_tokens = bool(settings["split_special_tokens"])
        self._backend = backend
        self._backend_json = backend_json
        self._settings = settings
        self._special = dict(settings["special_tokens"])
        self._special_ids = dict(settings["special_ids"])
        self._cleanup = bool(settings["clean_up_tokenization_spaces"])
        self.chat_template: str | dict | None = settings["chat_template"]

    # ---- construction and the cache -------------------------------------------------------------
    @classmethod
    def from_transformers(cls, hf: Any) -> "Tokenizer":
        """The same tokenizer as the transformers tokenizer ``hf`` (a ``TokenizersBackend``).

        Raises ValueError: ``hf`` is not a ``TokenizersBackend``, its class overrides how text is
        encoded, decoded or templated, or the result differs from ``hf`` on a probe text (ids with
        and without special tokens, decoded text, chat rendering), naming the first difference.
        """
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError as exc:
            raise ValueError(f"this transformers version has no TokenizersBackend ({exc})") from exc
        if not isinstance(hf, TokenizersBackend):
            raise ValueError(f"{type(hf).__name__} is not a transformers TokenizersBackend")
        overridden = [name for name in _HF_METHODS
                      if getattr(type(hf), name, None) is not getattr(TokenizersBackend, name, None)]
        if overridden:
            raise ValueError(f"{type(hf).__name__} overrides {', '.join(overridden)}")
        try:
            cleanup = bool(hf.clean_up_tokenization_spaces)
            if cleanup and type(hf.backend_tokenizer.model).__name__ == "BPE" and not getattr(
                    hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False):
                cleanup = False  # transformers skips it for BPE (TokenizersBackend._decode)
            special = {str(k): str(v) for k, v in hf.special_tokens_map.items()
                       if v is not None and not isinstance(v, (list, tuple, dict))}
            settings = {
                "special_tokens": special,
                "special_ids": {f"{k}_id": _opt_int(getattr(hf, f"{k}_id", None)) for k in _NAMED if k in special},
                "all_special_tokens": [str(t) for t in hf.all_special_tokens],
                "all_special_ids": [int(i) for i in hf.all_special_ids if i is not None],
                "chat_template": _template_value(hf.chat_template),
                "clean_up_tokenization_spaces": cleanup,
                "split_special_tokens": bool(getattr(hf, "split_special_tokens", False)),
            }
            ids = list(hf.backend_tokenizer.get_vocab(with_added_tokens=True).values())
            ids += [int(i) for i in hf.backend_tokenizer.get_added_tokens_decoder()]
            settings["id_range"] = [min(ids), max(ids)] if ids else None
            tok = cls(hf.backend_tokenizer.to_str(), settings)
            _verify_against(tok, hf)
        except ValueError:
            raise
        except BaseException as exc:  # pyo3 panics are BaseExceptions
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            raise ValueError(f"cannot convert the tokenizer ({type(exc).__name__}: {exc})") from exc
        return tok

    def save(self, directory: Path) -> None:
        """Write ``tokenizer.json`` and ``yirage-tokenizer.json`` into ``directory`` (created).
        Raises OSError."""
        directory.mkdir(parents=True, exist_ok=True)
        data = self._backend_json.encode("utf-8")
        (directory / BACKEND_FILE).write_bytes(data)
        body = {"format": _FORMAT, "settings": self._settings, "backend_sha256": hashlib.sha256(data).hexdigest()}
        body["sha256"] = _digest(body)
        (directory / SETTINGS_FILE).write_text(json.dumps(body, ensure_ascii=False), encoding="utf-8")

    @classmethod
    def load(cls, directory: Path) -> "Tokenizer":
        """The tokenizer ``save`` wrote into ``directory``.

        Raises ValueError: a file is missing or unreadable, the format is another one, a checksum
        does not match (a damaged or edited entry), or the content does not load.
        """
        try:
            body = json.loads((directory / SETTINGS_FILE).read_text(encoding="utf-8"))
            data = (directory / BACKEND_FILE).read_bytes()
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ValueError(f"unreadable tokenizer cache entry ({type(exc).__name__}: {exc})") from exc
        if not isinstance(body, dict) or body.get("format") != _FORMAT:
            raise ValueError("tokenizer cache entry of another format")
        digest = body.pop("sha256", None)
        if digest != _digest(body) or body.get("backend_sha256") != hashlib.sha256(data).hexdigest():
            raise ValueError("tokenizer cache entry fails its checksum")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"tokenizer cache entry is not UTF-8 ({exc})") from exc
        return cls(text, body.get("settings"))

    # ---- vocabulary ---------------------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` that encodes and decodes."""
        return self._backend

    def __len__(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Number of ids of the base vocabulary (without added tokens)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def id_range(self) -> tuple[int, int] | None:
        """(smallest, largest) id of the vocabulary and added tokens, as recorded when the tokenizer
        was converted (part of the checksummed cache entry); None for an empty vocabulary. Lets
        ``checks._check_tokenizer`` bound every id without listing the vocabulary (~30 ms)."""
        found = self._settings["id_range"]
        return None if found is None else (found[0], found[1])

    @property
    def added_tokens_decoder(self) -> dict[int, str]:
        """Id -> content of every added token."""
        return {int(i): t.content for i, t in self._backend.get_added_tokens_decoder().items()}

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """The id of a token (or a list of them); unknown tokens give ``unk_token_id``."""
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            return found if found is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> Any:
        """The token of an id (or a list of them; special ids dropped when ``skip_special_tokens``)."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # ---- special tokens -----------------------------------------------------------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens (``bos_token``, ``eos_token``, ...) -> text; chat templates see these."""
        return dict(self._special)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(self._settings["all_special_tokens"])

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._settings["all_special_ids"])

    def _token(self, name: str) -> str | None:
        return self._special.get(name)

    def _token_id(self, name: str) -> int | None:
        return self._special_ids.get(f"{name}_id")

    bos_token = property(lambda self: self._token("bos_token"))
    eos_token = property(lambda self: self._token("eos_token"))
    unk_token = property(lambda self: self._token("unk_token"))
    sep_token = property(lambda self: self._token("sep_token"))
    pad_token = property(lambda self: self._token("pad_token"))
    cls_token = property(lambda self: self._token("cls_token"))
    mask_token = property(lambda self: self._token("mask_token"))
    bos_token_id = property(lambda self: self._token_id("bos_token"))
    eos_token_id = property(lambda self: self._token_id("eos_token"))
    unk_token_id = property(lambda self: self._token_id("unk_token"))
    sep_token_id = property(lambda self: self._token_id("sep_token"))
    pad_token_id = property(lambda self: self._token_id("pad_token"))
    cls_token_id = property(lambda self: self._token_id("cls_token"))
    mask_token_id = property(lambda self: self._token_id("mask_token"))

    # ---- text ---------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (BOS/EOS as the
        tokenizer's settings say). Raises TypeError: ``text`` is not a str."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=bool(add_special_tokens)).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str | list[str]:
        """The text of ``token_ids`` (an int, a sequence of ints, a numpy array or tensor; a list of
        sequences gives a list of texts); ``skip_special_tokens`` drops added tokens marked special.
        Raises OverflowError/TypeError for ids that are not non-negative integers."""
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self.decode(seq, skip_special_tokens) for seq in token_ids]
        text = self._backend.decode([int(i) for i in token_ids], skip_special_tokens=bool(skip_special_tokens))
        return _clean_up_tokenization(text) if self._cleanup else text

    def apply_chat_template(self, conversation: Any, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = False, **kwargs: Any) -> Any:
        """Render ``conversation`` (a list of message dicts, or a list of such lists) with the chat
        template, as transformers does; ``kwargs`` are extra template variables (they override the
        named special tokens). ``tools`` must be JSON schemas (dicts). transformers' other arguments
        (``continue_final_message``, ``return_tensors``, padding and truncation, ...) are refused
        with NotImplementedError when set.

        Returns: the token ids (special tokens not added again: the template writes them), or the
        text when ``tokenize`` is False, or ``{"input_ids", "attention_mask"}`` when ``return_dict``;
        a list of those for a batch of conversations.
        Raises: ValueError (no chat template, an empty conversation), TypeError (a message that is
        not a dict, a tool that is not a dict), and whatever the template raises (jinja2's
        TemplateError for ``raise_exception`` or a syntax error, ...).
        """
        unsupported = sorted(k for k in _HF_ONLY_ARGUMENTS if kwargs.get(k))
        if unsupported:
            raise NotImplementedError(f"apply_chat_template: {', '.join(unsupported)} is not supported by yirage's "
                                      "tokenizer (render with tokenize=False and encode the text instead)")
        for key in _HF_ONLY_ARGUMENTS:
            kwargs.pop(key, None)  # given as False/None: transformers' default, nothing to do
        template = self._resolve_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        batched = isinstance(conversation, (list, tuple)) and isinstance(conversation[0], (list, tuple))
        conversations = list(conversation) if batched else [conversation]
        for tool in tools or []:
            if not isinstance(tool, dict):
                raise TypeError(f"tools must be JSON schemas (dicts), got {type(tool).__name__}")
        for document in documents or []:
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        variables = _plain_template_data({**self.special_tokens_map, **kwargs})
        tools, documents = _plain_template_data(tools), _plain_template_data(documents)
        compiled = _compile_template(template)
        out = []
        for chat in conversations:
            messages = []
            for message in chat:
                if not isinstance(message, Mapping):
                    raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
                messages.append({k: v for k, v in message.items() if v is not None})
            messages = _alias_reasoning_fields(_plain_template_data(messages))
            text = compiled.render(messages=messages, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
            if not tokenize:
                out.append(text)
                continue
            ids = self.encode(text, add_special_tokens=False)
            out.append({"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids)
        return out if batched else out[0]

    def _resolve_template(self, chat_template: str | None, tools: Any) -> str:
        """The template to render, chosen as transformers' ``get_chat_template`` chooses it."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError("This model has multiple chat templates with no default specified! Available "
                                 f"template names are {sorted(templates)}.")
            return chat_template
        if chat_template is not None:
            return chat_template
        if not templates:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set and no "
                             "template argument was passed!")
        return templates

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab={len(self)}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")


# ---- settings, checksums --------------------------------------------------------------------------

# what transformers' TokenizersBackend does in Python around the Rust tokenizer; a subclass that
# overrides any of these may encode or decode differently, so it is not converted
_HF_METHODS = ("__call__", "_call_one", "encode", "encode_plus", "_encode_plus", "decode", "_decode",
               "batch_decode", "convert_tokens_to_ids", "_convert_token_to_id_with_added_voc",
               "convert_ids_to_tokens", "clean_up_tokenization", "apply_chat_template", "get_chat_template",
               "special_tokens_map", "all_special_tokens", "all_special_ids")


# arguments of transformers' apply_chat_template that this one does not implement (refused when
# set, so that they do not end up as template variables)
_HF_ONLY_ARGUMENTS = ("continue_final_message", "return_assistant_tokens_mask", "sanitize_control_tokens",
                      "padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs")


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _template_value(value: Any) -> str | dict | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    raise ValueError(f"unsupported chat_template of type {type(value).__name__}")


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def _check_settings(settings: Any) -> None:
    """Raise ValueError unless ``settings`` has the keys and value types ``from_transformers`` writes."""
    def fail(what: str) -> None:
        raise ValueError(f"bad tokenizer settings: {what}")

    if not isinstance(settings, dict):
        fail("not an object")
    special, ids = settings.get("special_tokens"), settings.get("special_ids")
    if not isinstance(special, dict) or not all(isinstance(v, str) for v in special.values()):
        fail("special_tokens")
    if not isinstance(ids, dict) or not all(
            k[:-3] in _NAMED and k.endswith("_id") and (v is None or type(v) is int) for k, v in ids.items()):
        fail("special_ids")
    tokens, all_ids = settings.get("all_special_tokens"), settings.get("all_special_ids")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        fail("all_special_tokens")
    if not isinstance(all_ids, list) or not all(type(i) is int for i in all_ids):
        fail("all_special_ids")
    try:
        _template_value(settings.get("chat_template"))
    except ValueError:
        fail("chat_template")
    found = settings.get("id_range", "missing")
    if found is not None and not (isinstance(found, list) and len(found) == 2 and all(type(i) is int for i in found)
                                  and found[0] <= found[1]):
        fail("id_range")
    for key in ("clean_up_tokenization_spaces", "split_special_tokens"):
        if not isinstance(settings.get(key), bool):
            fail(key)


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (spaces before punctuation and English contractions)."""
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",").replace(" ' ", "'")
            .replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s").replace(" 've", "'ve")
            .replace(" 're", "'re"))


# ---- the check against transformers --------------------------------------------------------------

_PROBES = [
    "", "Hello, world!", "The quick brown fox jumps over the lazy dog.", " leading space", "trailing space ",
    "  two  spaces\n\nand newlines\t\ttabs   ", "naïve café, Straße, 日本語, 한국어, Ελληνικά, עברית",
    "🙂👍🏽 emoji 🇫🇷 and ZWJ 👩‍💻", "x = f(y) + 3.14159; // 0x1F",
    "Hello , world . Isn 't it ? I 'm sure they 're fine",
    "\u00a0no-break\u200bzero-width\ufeffbom", "1234567890 12 345", "<|unknown|> <s> </s> [INST] <<SYS>>",
]


def _verify_against(tok: Tokenizer, hf: Any) -> None:
    """Raise ValueError at the first probe where ``tok`` and transformers' ``hf`` differ."""
    specials = list(dict.fromkeys(tok.all_special_tokens + list(tok.added_tokens_decoder.values())[:32]))
    texts = _PROBES + specials + [f"a{s}b {s}\n{s} x" for s in specials[:8]] + [" ".join(specials)]

    def same(what: str, ours: Any, theirs: Any) -> None:
        outcome = [None, None]
        for i, f in enumerate((ours, theirs)):
            try:
                outcome[i] = ("ok", f())
            except (KeyboardInterrupt, SystemExit, GeneratorExit):
                raise
            except BaseException as exc:  # noqa: BLE001: both must fail (pyo3 panics too), or agree
                outcome[i] = ("error", type(exc).__name__)
        if (outcome[0][0], outcome[0][1] if outcome[0][0] == "ok" else None) != \
                (outcome[1][0], outcome[1][1] if outcome[1][0] == "ok" else None):
            raise ValueError(f"{what}: yirage gives {_short(outcome[0])}, transformers {_short(outcome[1])}")

    for text in texts:
        for special in (True, False):
            same(f"encode({text!r}, add_special_tokens={special})", lambda: tok.encode(text, special),
                 lambda: list(hf.encode(text, add_special_tokens=special)))
            try:
                ids = tok.encode(text, special)
            except (KeyboardInterrupt, SystemExit, GeneratorExit):
                raise
            except BaseException:  # noqa: BLE001: compared above
                continue
            for skip in (True, False):
                same(f"decode({ids[:8]}..., skip_special_tokens={skip})", lambda: tok.decode(ids, skip),
                     lambda: hf.decode(ids, skip_special_tokens=skip))
    sample = list(range(min(len(tok), 96)))
    for skip in (True, False):
        same(f"decode(ids 0..{len(sample) - 1})", lambda: tok.decode(sample, skip),
             lambda: hf.decode(sample, skip_special_tokens=skip))
    if not tok.chat_template:
        return
    chats = [[{"role": "user", "content": "What is 2+2?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂 <|x|>"}],
             [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
              {"role": "user", "content": "c"}]]
    for chat in chats:
        for prompt in (True, False):
            same(f"apply_chat_template({chat}, add_generation_prompt={prompt})",
                 lambda: tok.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False),
                 lambda: hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False))
            same(f"apply_chat_template({chat}, add_generation_prompt={prompt}, tokenize=True)",
                 lambda: tok.apply_chat_template(chat, add_generation_prompt=prompt),
                 lambda: list(hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True,
                                                     return_dict=False)))


def _short(outcome: tuple) -> str:
    text = repr(outcome[1])
    return ("an error " if outcome[0] == "error" else "") + (text if len(text) <= 120 else text[:117] + "...")


# ---- chat templates, as transformers renders them ---------------------------------------------------

def _plain_template_data(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types, as transformers' ``_plain_template_data`` does (the
    sandbox sees no methods of rich objects): str/int/float subclasses reduced to the base type,
    mappings to dicts, lists and tuples kept, numpy scalars to Python, dataclasses and pydantic
    models to dicts, anything else to a placeholder ``"<TypeName>"``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_template_data(k): _plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_template_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_template_data(v) for v in value)
    if isinstance(value, np.generic):  # np.bool_(False) must not become a truthy placeholder
        return _plain_template_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning_fields(chat: list) -> list:
    """A message's reasoning under every name templates read (as transformers does)."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def check_chat_template(template: str) -> None:
    """ValueError with jinja2's message (and line) unless ``template`` compiles as a chat template
    (the environment ``apply_chat_template`` renders in)."""
    import jinja2.exceptions

    try:
        _compile_template(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"line {e.lineno}: {e.message}") from None


@lru_cache(maxsize=16)
def _compile_template(template: str) -> Any:
    """``template`` compiled in transformers' chat-template environment (jinja2 >= 3.1.6 required,
    as transformers requires it: older versions have sandbox escapes)."""
    import jinja2
    import jinja2.exceptions
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    version = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2>=3.1.6, this is {jinja2.__version__}: pip install -U jinja2")

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: Any) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:  # noqa: A002: the name templates use
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805: jinja2's signature trick
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def _atomic_save(tok: Tokenizer, entry: Path) -> bool:
    """Save ``tok`` as the cache entry ``entry`` (a directory) atomically: written into a staging
    directory beside it, then renamed. False (nothing left behind) when another process got there
    first or the directory cannot be written."""
    import shutil
    import tempfile

    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    except OSError:
        return False
    try:
        tok.save(staging)
        os.replace(staging, entry)
        return True
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        return False
