"""Structured output (engines/structured.py): ``response_format`` constrains generation to JSON
with llguidance's grammars, on the single-sequence path and on the continuous-batching engine,
greedy and sampled. The outputs are checked by ``json`` and ``jsonschema`` (independent of the
grammar library), the masks against known-valid and known-invalid JSON text."""
import json

import pytest
import torch

pytest.importorskip("llguidance")

from yirage.errors import GenerationError  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colours"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                         "colours": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
ANN = [{"role": "user", "content": "Describe a person named Ann, 31, who likes blue and green, as JSON."}]
BOB = [{"role": "user", "content": "Describe Bob, 40, who likes red, as JSON."}]


def is_valid(text: str, schema: dict) -> bool:
    """True when ``text`` is JSON valid against ``schema`` (``validate`` does not raise)."""
    try:
        validate(text, schema)
    except (ValueError, AssertionError, KeyError, TypeError):
        return False
    except Exception as e:  # noqa: BLE001 - jsonschema.ValidationError, whose module may be absent
        if type(e).__name__ != "ValidationError":
            raise
        return False
    return True


def validate(text: str, schema: dict | None) -> object:
    """``text`` parsed as JSON and, with ``schema``, validated (jsonschema when installed, else
    the PERSON keys and types); AssertionError/ValueError otherwise."""
    value = json.loads(text)
    if schema is None:
        assert isinstance(value, dict)
        return value
    try:
        import jsonschema
    except ImportError:
        assert set(value) == set(schema["required"]) and isinstance(value["age"], int)
        return value
    jsonschema.validate(value, schema)
    return value


@pytest.mark.slow
def test_the_mask_allows_valid_json_and_refuses_invalid(smollm):
    fmt = smollm.response_format(SCHEMA_FORMAT)
    good = smollm.tokenizer.encode('{"name": "Ann", "age": 31, "colours": ["blue"]}', add_special_tokens=False)
    c = fmt.constraint()
    for tok in good:
        assert bool(c.allowed()[tok]), smollm.tokenizer.decode([tok])
        c.accept(tok)
    assert c.done
    allowed = c.allowed()   # the JSON is complete: only an end-of-sequence token
    assert set(allowed.nonzero().flatten().tolist()) <= smollm.eos_token_ids and allowed.any()
    fresh = fmt.constraint()
    for bad in ('[', '"', 'x', '}'):
        assert not bool(fresh.allowed()[smollm.tokenizer.encode(bad, add_special_tokens=False)[0]])
    with pytest.raises(GenerationError, match="does not follow the grammar"):
        fresh.accept(smollm.tokenizer.encode("}", add_special_tokens=False)[0])
    masked = fmt.constraint().mask(torch.zeros(1, smollm.config.vocab_size))
    assert torch.isinf(masked).sum() > smollm.config.vocab_size - 100   # almost every token is masked


@pytest.mark.slow
def test_json_schema_greedy_and_sampled_on_both_engines(smollm):
    free = smollm.generate(ANN, max_new_tokens=60)
    assert not is_valid(free.text, PERSON)   # unconstrained, this model strays from the schema
    alone = smollm.generate(ANN, max_new_tokens=80, response_format=SCHEMA_FORMAT)
    assert alone.finish_reason == "stop"
    assert validate(alone.text, PERSON)["age"] == 31
    bob = smollm.generate(BOB, max_new_tokens=80, response_format=SCHEMA_FORMAT)
    batch = smollm.generate([ANN, BOB], max_new_tokens=80, response_format=SCHEMA_FORMAT)
    assert [r.text for r in batch] == [alone.text, bob.text]    # the batch engine: the same answers
    for seed in (1, 2):
        sampled = smollm.generate(ANN, max_new_tokens=80, temperature=1.0, seed=seed, response_format=SCHEMA_FORMAT)
        assert sampled.finish_reason == "stop"
        validate(sampled.text, PERSON)
        again = smollm.generate([ANN], max_new_tokens=80, temperature=1.0, seed=seed, response_format=SCHEMA_FORMAT)
        assert again[0].text == sampled.text
    obj = smollm.generate("List three fruits with their colours.", max_new_tokens=60,
                          response_format={"type": "json_object"})
    validate(obj.text, None)
    streamed = smollm.generate(ANN, max_new_tokens=80, response_format=SCHEMA_FORMAT, stream=True)
    assert "".join(streamed) == alone.text


@pytest.mark.slow
@pytest.mark.parametrize("fmt,words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}, "Invalid type: bogus"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/none"}}}, "does not exist"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs json_schema.schema"),
    ({"type": "xml"}, "must be one of text, json_object, json_schema"),
    ("json", "must be a dict"),
    ({"type": "json_object", "schema": {}}, "unknown field"),
])
def test_bad_response_formats_are_refused(smollm, fmt, words):
    with pytest.raises(GenerationError, match=words):
        smollm.generate("Hi", max_new_tokens=4, response_format=fmt)


@pytest.mark.slow
def test_response_format_with_ignore_eos_is_refused(smollm):
    with pytest.raises(GenerationError, match="ignore_eos"):
        smollm.generate("Hi", max_new_tokens=4, response_format={"type": "json_object"}, ignore_eos=True)
    assert smollm.generate("Hi", max_new_tokens=4, response_format={"type": "text"}).text
