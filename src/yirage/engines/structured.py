"""Structured output: generation constrained to JSON, optionally to a JSON Schema, by a grammar
from llguidance (the grammar engine behind Guidance, llama.cpp's and vLLM's structured output;
the ``structured`` extra: ``pip install 'yirage[structured]'``).

The format is given as OpenAI's ``response_format``:

- ``{"type": "text"}``: no constraint;
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: JSON
  that validates against ``schema``.

``compile_response_format(llm, response_format)`` turns it into a ``ResponseFormat`` (the grammar,
checked against the model's tokenizer, so a bad schema is refused before any token is
computed). Each sequence then gets its own ``TokenConstraint`` (``ResponseFormat.constraint()``):
before a token is picked, ``mask`` sets the logits of every token the grammar does not allow at
this point to -inf (greedy and sampled decoding alike, ``_Sampling.pick``), and ``accept``
advances the grammar by the token picked. Once the JSON is complete, the only token allowed is
an end-of-sequence token, so the sequence ends with finish_reason 'stop'. A generation cut short
by ``max_new_tokens`` ends with 'length' and its text is then incomplete JSON.

This module must never build graphs or touch kernels; llguidance is imported only when a
constrained format is asked for.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import GenerationError

_FORMATS = ("text", "json_object", "json_schema")
_tokenizers: dict[int, Any] = {}
_tokenizers_lock = threading.Lock()


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GenerationError("response_format 'json_object' / 'json_schema' needs llguidance: "
                              "pip install 'yirage[structured]'") from None
    return llguidance


def grammar_tokenizer(llm) -> Any:
    """The llguidance tokenizer of ``llm`` (its vocabulary padded to the logits' width
    ``config.vocab_size``, its EOS tokens the model's), made once per LLM (about 0.5 s) and
    shared by every constraint on it. GenerationError without llguidance."""
    llg = _llguidance()
    with _tokenizers_lock:
        tok = getattr(llm, "_grammar_tokenizer", None)
        if tok is None:
            backend = llm.tokenizer.backend_tokenizer
            tok = llg.LLTokenizer(backend.to_str(), n_vocab=llm.config.vocab_size,
                                  eos_token=sorted(llm.eos_token_ids))
            llm._grammar_tokenizer = tok
    return tok


@dataclass(frozen=True)
class ResponseFormat:
    """A checked constrained format: ``type`` 'json_object' or 'json_schema', ``grammar`` the
    llguidance grammar (a JSON string), ``schema`` the JSON Schema (None for json_object).
    ``constraint()`` makes the per-sequence state."""

    type: str
    grammar: str
    schema: dict | None
    tokenizer: Any

    def constraint(self) -> "TokenConstraint":
        """A fresh TokenConstraint for one sequence (its grammar state at the start)."""
        return TokenConstraint(self.tokenizer, self.grammar)


def compile_response_format(llm, response_format) -> ResponseFormat | None:
    """``response_format`` (OpenAI's: a dict with ``type`` 'text', 'json_object' or
    'json_schema'; a ``ResponseFormat`` is returned as it is) checked and compiled for ``llm``.

    Returns None for 'text' or None (no constraint). Raises GenerationError with one clear
    message for anything else: not a dict, an unknown type, 'json_schema' without
    ``json_schema.schema`` (a dict), a schema llguidance refuses (unknown type, a ``$ref`` that
    does not resolve, contradictory keywords, ...), or llguidance not installed.
    """
    if response_format is None or isinstance(response_format, ResponseFormat):
        return response_format
    if not isinstance(response_format, Mapping):
        raise GenerationError("response_format must be a dict such as {'type': 'json_object'} or {'type': "
                              f"'json_schema', 'json_schema': {{'name': ..., 'schema': {{...}}}}}}, got "
                              f"{type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in _FORMATS:
        raise GenerationError(f"response_format type must be one of {', '.join(_FORMATS)}, got {kind!r}")
    extra = set(response_format) - {"type", "json_schema"}
    if extra:
        raise GenerationError(f"response_format has unknown field(s) {', '.join(sorted(extra))}")
    if kind == "text":
        return None
    schema: dict | None = None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise GenerationError("response_format 'json_schema' needs json_schema.schema: a JSON Schema object")
        schema = dict(spec["schema"])
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise GenerationError(f"response_format json_schema.schema is not JSON: {e}") from None
    grammar, tok = checked_grammar(
        llm, lambda m: m.grammar_from_json_schema(schema if schema is not None else {"type": "object"}),
        "response_format json_schema.schema is not a valid JSON Schema",
        "response_format json_schema.schema is not a JSON Schema yirage can follow")
    return ResponseFormat(kind, grammar, schema, tok)


def checked_grammar(llm, make, invalid: str, unfollowable: str) -> tuple[str, Any]:
    """(grammar, llguidance tokenizer of ``llm``): ``make(llguidance.LLMatcher)`` builds the
    grammar, then llguidance checks it against the tokenizer. GenerationError
    ``"<invalid>: <detail>"`` when it cannot be built, ``"<unfollowable>: <warnings>"`` when the
    check fails, or when llguidance is not installed."""
    llg = _llguidance()
    tok = grammar_tokenizer(llm)
    try:
        grammar = make(llg.LLMatcher)
    except (ValueError, TypeError) as e:
        raise GenerationError(f"{invalid}: {e}") from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tok)
    if is_error:
        raise GenerationError(f"{unfollowable}: {' '.join(' '.join(messages).split())}")
    return grammar, tok


class TokenConstraint:
    """The grammar state of one sequence (an llguidance ``LLMatcher``).

    Args:
        tokenizer: the llguidance tokenizer (``grammar_tokenizer(llm)``).
        grammar: an llguidance grammar (``ResponseFormat.grammar``).

    Not thread-safe: one sequence, one thread at a time (the one that samples it).
    """

    def __init__(self, tokenizer, grammar: str):
        llg = _llguidance()
        self._matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        self._vocab = tokenizer.vocab_size
        self._bits = torch.zeros((self._vocab + 31) // 32, dtype=torch.int32)
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GenerationError(f"constrained decoding failed: {self._matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: the tokens the grammar allows next (an EOS token only, once the JSON
        is complete)."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        self._check()
        bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")[:self._vocab]
        return torch.from_numpy(bits.astype(np.bool_))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 CPU logits [1, V] (a copy of ``logits`` [1, V], any dtype or device) with -inf
        wherever the grammar allows no token: columns past the grammar's vocabulary too.
        GenerationError when the grammar allows no token at all."""
        out = logits.float().cpu().clone()
        allowed = self.allowed()
        V = out.shape[-1]
        keep = torch.zeros(V, dtype=torch.bool)
        n = min(V, allowed.numel())
        keep[:n] = allowed[:n]
        if not bool(keep.any()):
            raise GenerationError("constrained decoding: the grammar allows no token of this model here")
        out[..., ~keep] = float("-inf")
        return out

    def accept(self, token: int) -> None:
        """Advance the grammar by ``token`` (one that ``mask`` allowed). GenerationError if the
        grammar refuses it."""
        if not self._matcher.consume_token(int(token)):
            raise GenerationError(f"constrained decoding: token {token} does not follow the grammar "
                                  f"({self._matcher.get_error()})")

    @property
    def done(self) -> bool:
        """True once the grammar is complete (only an EOS token may follow)."""
        return self._matcher.is_stopped()
