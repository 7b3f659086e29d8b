"""Read a decoder-only LLM (Llama, Qwen2, Mistral) from a GGUF file or a safetensors checkpoint.

``load_model(spec)`` resolves ``spec`` (``registry.resolve_model``) and returns a ``LoadedModel``:
a ``ModelConfig``, the weights as ``Weight`` records under their Hugging Face names, and a
transformers tokenizer with its chat template. Both formats come out in the same layout:

- projections are ``[out_features, in_features]`` (``torch.nn.functional.linear`` convention);
- q/k projections are in Hugging Face order for ``rotate_half`` RoPE (llama.cpp's interleaving
  permutation of GGUF ``attn_q``/``attn_k`` rows is undone);
- GGUF ``Q8_0``/``Q4_1`` tensors stay block-quantized: raw block bytes in a ``uint8`` tensor of
  shape ``dtype.storage_shape(logical_shape)`` (see ``yirage.dtypes``). F32/F16/BF16 stay as they
  are; the legacy and K-quant GGUF types (Q4_0, Q5_0, Q5_1, Q2_K..Q6_K) are dequantized to
  float32; IQ and other types are refused. Safetensors float tensors keep their dtype.

RoPE frequencies are computed by transformers' own RoPE init functions from the transformers
config, so every RoPE scaling type transformers supports comes out right.

Validation: native kernels later index tables with sizes taken from the config, so a file is
checked completely before anything is built from it, in this order, and the first problem is one
``ModelLoadError`` naming the file, the field or tensor, the value and what was expected:

1. the container: GGUF header, metadata array lengths, tensor infos (known type, 1-4 positive
   dims, rows a whole number of blocks) and data layout (every tensor at the offset llama.cpp
   expects, inside the file, no overlap, no wraparound); GGUF strings valid UTF-8; the safetensors
   index (shards inside the model directory) and headers;
2. the hyper-parameters (layers, heads, KV heads, head dim, hidden, intermediate, vocab, context,
   sliding window, RMSNorm eps, RoPE theta/dims/scaling) for type and range, before transformers
   builds a config from them, and against the tensor table: the layer count must equal the blocks
   present, the vocab the embedding rows, every tensor the shape the config implies, each tensor
   a type its role allows;
3. the tokenizer: every token id it can produce and the special ids below the embedding rows;
4. the values: NaN/inf in float weights or in the fp16 block scales of Q8_0/Q4_1 tensors is
   refused unless ``allow_nonfinite=True`` (then a warning).

This module only reads files. It must never build compute graphs, run a model, pick a backend or
move tensors off the CPU (that is ``models/llama.py``'s and the runtime's work), never allocate
more than the file's own tensors and metadata justify (no loop or table sized by a header value
that the tensors present do not confirm), and never open a file outside the model's directory
that a model file names.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..config import cache_dir, logger
from ..dtypes import DType, as_dtype
from ..errors import ModelLoadError
from .registry import ModelFormat, model_file, resolve_model

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
_ROTARY_CLASS = {"llama": "LlamaRotaryEmbedding", "qwen2": "Qwen2RotaryEmbedding",
                 "mistral": "MistralRotaryEmbedding"}


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, in Hugging Face terms.

    ``inv_freq`` is float32 of shape ``[head_dim // 2]`` and ``attention_scaling`` the factor
    transformers applies to cos/sin (1.0 except for yarn/longrope), both from transformers' RoPE
    init function for ``rope_type``. ``eos_token_ids`` is every id that ends generation, de-duplicated.
    Every size here is validated against the weights (``vocab_size`` is the embedding's row count,
    and every token id the tokenizer produces is below it).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    inv_freq: torch.Tensor = field(repr=False)
    attention_scaling: float
    rope_type: str = "default"
    sliding_window: int | None = None
    hf_config: Any = field(default=None, repr=False)


@dataclass
class Weight:
    """One parameter: ``data`` is its storage (``uint8`` of ``dtype.storage_shape(shape)`` when
    ``dtype`` is quantized), ``shape`` its logical shape (``[out, in]`` for projections)."""

    data: torch.Tensor
    dtype: DType
    shape: tuple[int, ...]


@dataclass
class LoadedModel:
    """A model read from disk: config, weights keyed by Hugging Face name, tokenizer."""

    config: ModelConfig
    weights: dict[str, Weight] = field(repr=False)
    tokenizer: Any = field(repr=False)
    path: Path
    format: ModelFormat
    name: str = ""


def load_model(spec: str, progress: bool = True, allow_nonfinite: bool = False) -> LoadedModel:
    """Load the model named by ``spec``: a short name, a ``.gguf`` file, a Hugging Face directory or
    a hub id (see ``registry.resolve_model``). ``progress`` shows a bar on stderr while reading tensors.

    ``allow_nonfinite``: a weight holding NaN or inf (a float tensor's values, or the fp16 block
    scales of a Q8_0/Q4_1 tensor) is refused by default; True loads it anyway and logs a warning
    naming the tensors (the model will most likely produce NaN logits).

    Weight names: ``model.embed_tokens.weight``, ``model.layers.{i}.input_layernorm.weight``,
    ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.{i}.self_attn.{q,k,v}_proj.bias``
    (when ``config.attention_bias``), ``model.layers.{i}.post_attention_layernorm.weight``,
    ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.norm.weight`` and
    ``lm_head.weight`` (only when embeddings are not tied).

    Everything is validated before a tensor is used (see the module doc); nothing allocates more
    than the file's tensors justify.

    Raises ModelLoadError (one per problem, naming the file, the field or tensor, the value and
    the expectation): spec not found (see ``resolve_model``); not a valid/complete GGUF file
    (bad header, metadata running past the end, tensor data outside the file, overlapping or
    misplaced tensors, unknown tensor type, a string that is not UTF-8); unsupported
    architecture (supported: llama, qwen2, mistral); a hyper-parameter of the wrong type, out of
    range (e.g. <= 0, NaN, inf) or inconsistent with another or with the tensors (layer count vs
    blocks present, vocab vs embedding rows, heads vs KV heads, head dim vs q_proj rows, ...);
    missing, unsupported or mis-shaped tensors; a tensor type its role does not allow (norms
    must be float; projections float, Q8_0, Q4_1 or a dequantizable legacy/K-quant type; IQ
    and other types are refused); a broken ``model.safetensors.index.json`` or one naming a shard
    outside the model directory; a tokenizer that cannot be loaded or produces ids (or special
    ids) past the embedding rows; NaN/inf weights (unless ``allow_nonfinite``).
    """
    resolved = resolve_model(spec)
    if resolved.format == "gguf":
        model = _load_gguf(resolved.path, progress, allow_nonfinite)
    else:
        model = _load_safetensors(resolved.path, progress, allow_nonfinite)
    model.name = resolved.name
    return model


# ----------------------------------------------------------------------------------------------
# shared: hyper-parameter rules, RoPE, tensor-table checks


def _check_arch(model_type: Any, origin: Any) -> str:
    if model_type not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{origin}: architecture {_show(model_type)} is not supported; "
                             f"supported architectures: {', '.join(SUPPORTED_ARCHS)}")
    return model_type


def _show(value: Any) -> str:
    """``repr(value)`` cut to 80 characters, for messages."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _int_field(origin: Any, name: str, value: Any, minimum: int = 1, optional: bool = False) -> int | None:
    """``value`` as an int >= ``minimum``; None when absent and ``optional``."""
    if value is None:
        if optional:
            return None
        raise ModelLoadError(f"{origin}: {name} is missing")
    if not _is_int(value):
        raise ModelLoadError(f"{origin}: {name} = {_show(value)} must be an integer")
    value = int(value)
    if value < minimum:
        raise ModelLoadError(f"{origin}: {name} = {value} must be {'> 0' if minimum == 1 else f'>= {minimum}'}")
    return value


def _positive_float(origin: Any, name: str, value: Any, optional: bool = False) -> float | None:
    """``value`` as a finite float > 0; None when absent and ``optional``."""
    if value is None:
        if optional:
            return None
        raise ModelLoadError(f"{origin}: {name} is missing")
    if not _is_number(value):
        raise ModelLoadError(f"{origin}: {name} = {_show(value)} must be a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number <= 0:
        raise ModelLoadError(f"{origin}: {name} = {_show(value)} must be a finite number > 0")
    return number


def _finite_float(origin: Any, name: str, value: Any) -> float:
    if not _is_number(value):
        raise ModelLoadError(f"{origin}: {name} = {_show(value)} must be a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ModelLoadError(f"{origin}: {name} = {_show(value)} must be finite")
    return number


# RoPE parameter keys transformers' init functions read: positive numbers, positive ints, finite numbers
_ROPE_POSITIVE = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "attention_factor",
                  "beta_fast", "beta_slow", "partial_rotary_factor")
_ROPE_INTS = ("original_max_position_embeddings",)
_ROPE_FINITE = ("mscale", "mscale_all_dim")
_ROPE_LISTS = ("short_factor", "long_factor")


def _check_rope_params(origin: Any, name: str, params: Any) -> dict:
    """A RoPE parameter dict (``rope_parameters`` / ``rope_scaling``): every numeric entry checked."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{origin}: {name} = {_show(params)} must be an object (or null)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        raise ModelLoadError(f"{origin}: {name}.rope_type = {_show(rope_type)} must be a string")
    for key in _ROPE_POSITIVE:
        if params.get(key) is not None:
            _positive_float(origin, f"{name}.{key}", params[key])
    for key in _ROPE_INTS:
        if params.get(key) is not None:
            _int_field(origin, f"{name}.{key}", params[key])
    for key in _ROPE_FINITE:
        if params.get(key) is not None:
            _finite_float(origin, f"{name}.{key}", params[key])
    for key in _ROPE_LISTS:
        values = params.get(key)
        if values is not None:
            if not isinstance(values, (list, tuple)):
                raise ModelLoadError(f"{origin}: {name}.{key} must be a list of numbers")
            for i, v in enumerate(values):
                _positive_float(origin, f"{name}.{key}[{i}]", v)
    return params


@dataclass
class _HParams:
    """Hyper-parameters checked for type, range and mutual consistency; ``names`` maps each
    canonical key to the name it has in the file (``llama.block_count``, ``num_hidden_layers``)."""

    names: dict[str, str]
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int | None
    context: int | None
    eps: float | None
    theta: float | None
    sliding: int | None


def _hparams(origin: Any, names: dict[str, str], get: Callable[[str], Any]) -> _HParams:
    """Check the hyper-parameters ``get(canonical key)`` returns (None: absent). Keys: layers,
    hidden, intermediate, heads, kv_heads, head_dim, rope_dim, value_dim, vocab, context, eps,
    theta, sliding; ``names`` gives each its name in the file (a key without a name is absent)."""

    def value(key: str) -> Any:
        return get(key) if key in names else None

    n = names
    layers = _int_field(origin, n["layers"], value("layers"))
    hidden = _int_field(origin, n["hidden"], value("hidden"))
    intermediate = _int_field(origin, n["intermediate"], value("intermediate"))
    heads = _int_field(origin, n["heads"], value("heads"))
    kv_heads = _int_field(origin, n.get("kv_heads", ""), value("kv_heads"), optional=True) or heads
    if heads % kv_heads:
        raise ModelLoadError(f"{origin}: {n['kv_heads']} = {kv_heads} must divide {n['heads']} = {heads}")
    if hidden % heads:
        raise ModelLoadError(f"{origin}: {n['hidden']} = {hidden} must be a multiple of {n['heads']} = {heads}")
    head_dim = _int_field(origin, n.get("head_dim", ""), value("head_dim"), optional=True)
    derived = f"{n['hidden']} / {n['heads']}"
    if head_dim is None:
        head_dim = hidden // heads
    else:
        derived = n["head_dim"]
    if head_dim % 2:
        raise ModelLoadError(f"{origin}: the head dimension {head_dim} ({derived}) must be even (RoPE rotates "
                             "pairs of dimensions)")
    for key in ("rope_dim", "value_dim"):
        other = _int_field(origin, n.get(key, ""), value(key), optional=True)
        if other is not None and other != head_dim:
            what = "partial rotary embeddings are not supported" if key == "rope_dim" else "it must match"
            raise ModelLoadError(f"{origin}: {n[key]} = {other} must equal the head dimension {head_dim} "
                                 f"({derived}); {what}")
    sliding = value("sliding")
    if sliding is not None:
        sliding = _int_field(origin, n["sliding"], sliding, minimum=0)
    return _HParams(
        names=names, layers=layers, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, vocab=_int_field(origin, n.get("vocab", ""), value("vocab"), optional=True),
        context=_int_field(origin, n.get("context", ""), value("context"), optional=True),
        eps=_positive_float(origin, n.get("eps", ""), value("eps"), optional=True),
        theta=_positive_float(origin, n.get("theta", ""), value("theta"), optional=True),
        sliding=sliding)


_HF_NAMES = {"layers": "num_hidden_layers", "hidden": "hidden_size", "intermediate": "intermediate_size",
             "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
             "vocab": "vocab_size", "context": "max_position_embeddings", "eps": "rms_norm_eps",
             "theta": "rope_theta", "sliding": "sliding_window"}


def _hf_hparams(origin: Any, get: Callable[[str], Any]) -> _HParams:
    """Hyper-parameters of a transformers config (``get`` reads a config.json key or a config
    attribute): the rules of ``_hparams`` plus RoPE parameters, activation and special ids."""
    names = dict(_HF_NAMES)
    theta = get("rope_theta")
    for rope_name in ("rope_parameters", "rope_scaling"):  # transformers 5 / older configs
        rope = _check_rope_params(origin, rope_name, get(rope_name))
        if theta is None and rope.get("rope_theta") is not None:
            theta, names["theta"] = rope["rope_theta"], f"{rope_name}.rope_theta"
    act = get("hidden_act")
    if act is not None and act not in ("silu", "swish"):
        raise ModelLoadError(f"{origin}: hidden_act = {_show(act)} is not supported; the MLP is SwiGLU (silu)")
    for key in ("bos_token_id", "eos_token_id"):
        ids = get(key)
        for i, v in enumerate(ids if isinstance(ids, (list, tuple)) else [ids]):
            if v is not None:
                _int_field(origin, key if not isinstance(ids, (list, tuple)) else f"{key}[{i}]", v, minimum=0)

    def lookup(key: str) -> Any:
        return theta if key == "theta" else get(_HF_NAMES[key])

    return _hparams(origin, names, lookup)


def rope_parameters(hf_config: Any) -> tuple[torch.Tensor, float, str]:
    """(inv_freq float32 [head_dim // 2], attention_scaling, rope_type) from transformers' RoPE init.

    ``default`` uses the model's ``RotaryEmbedding.compute_default_rope_parameters``; every other
    type uses ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type]``. For ``dynamic``
    this is the initial (unscaled-length) table, as in transformers before its first update.

    Raises ModelLoadError: unknown RoPE type, or the init function fails on the parameters.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        module = importlib.import_module(f"transformers.models.{hf_config.model_type}.modeling_{hf_config.model_type}")
        rotary = getattr(module, _ROTARY_CLASS[hf_config.model_type])
        init = getattr(rotary, "compute_default_rope_parameters", None) or ROPE_INIT_FUNCTIONS["default"]
    elif rope_type in ROPE_INIT_FUNCTIONS:
        init = ROPE_INIT_FUNCTIONS[rope_type]
    else:
        raise ModelLoadError(f"RoPE type {_show(rope_type)} is not supported by this transformers version; "
                             f"supported: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    try:
        inv_freq, attention_scaling = init(hf_config)  # called as the model's RotaryEmbedding does
    except (ArithmeticError, ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"RoPE parameters {_show(params)} are not valid for rope_type {_show(rope_type)} "
                             f"({exc})") from exc
    return inv_freq.to(torch.float32).contiguous(), float(attention_scaling), rope_type


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def _dedupe(ids: list[int]) -> list[int]:
    return list(dict.fromkeys(ids))


def _model_config(hf_config: Any, weights: dict[str, Weight], bos_token_id: int | None,
                  eos_token_ids: list[int], origin: Any) -> ModelConfig:
    arch = hf_config.model_type
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    try:
        inv_freq, attention_scaling, rope_type = rope_parameters(hf_config)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{origin}: {exc}") from exc
    if tuple(inv_freq.shape) != (head_dim // 2,):
        raise ModelLoadError(f"{origin}: RoPE table has shape {tuple(inv_freq.shape)}, expected ({head_dim // 2},): "
                             "partial rotary embeddings are not supported")
    if not (bool(torch.isfinite(inv_freq).all()) and bool((inv_freq > 0).all())):
        raise ModelLoadError(f"{origin}: the RoPE parameters give non-finite or non-positive frequencies "
                             f"({rope_type}: {getattr(hf_config, 'rope_parameters', None)})")
    if not (math.isfinite(attention_scaling) and attention_scaling > 0):
        raise ModelLoadError(f"{origin}: the RoPE parameters give attention scaling {attention_scaling}, "
                             "which must be finite and > 0")
    vocab = int(hf_config.vocab_size)
    for what, ids in (("bos_token_id", _as_id_list(bos_token_id)), ("eos_token_id", eos_token_ids)):
        for token in ids:
            if not 0 <= token < vocab:
                raise ModelLoadError(f"{origin}: {what} = {token} must be in [0, {vocab}): the embedding "
                                     f"has {vocab} rows")
    sliding = getattr(hf_config, "sliding_window", None)
    if arch == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
        sliding = None
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=int(hf_config.hidden_size),
        intermediate_size=int(hf_config.intermediate_size),
        num_layers=int(hf_config.num_hidden_layers),
        num_heads=int(num_heads),
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        tie_word_embeddings="lm_head.weight" not in weights,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        bos_token_id=bos_token_id,
        eos_token_ids=_dedupe(eos_token_ids),
        inv_freq=inv_freq,
        attention_scaling=attention_scaling,
        rope_type=rope_type,
        sliding_window=int(sliding) if sliding else None,
        hf_config=hf_config,
    )


@dataclass
class _TensorInfo:
    """A tensor of the file before its data is read: its name in the file, logical shape
    (``[out, in]``) and type label (``Q4_1``, ``F32``, ``BF16``...)."""

    name: str
    shape: tuple[int, ...]
    kind: str


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _expected_shapes(hp: _HParams, vocab: int, tied: bool,
                     attention_bias: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every weight name a supported model must have: (logical shape, which fields imply it).
    Loops over ``hp.layers``, which the caller has checked against the blocks present."""
    n = hp.names
    h, inter, heads, kv, hd = hp.hidden, hp.intermediate, hp.heads, hp.kv_heads, hp.head_dim
    hid = f"{n['hidden']} = {h}"
    q_why = f"{n['heads']} = {heads} × head dim {hd}; {hid}"
    kv_why = f"{n.get('kv_heads', n['heads'])} = {kv} × head dim {hd}; {hid}"
    ff_why = f"{n['intermediate']} = {inter}; {hid}"
    vocab_why = f"{n.get('vocab', 'vocab size')} = {vocab}; {hid}"
    shapes = {"model.embed_tokens.weight": ((vocab, h), vocab_why), "model.norm.weight": ((h,), hid)}
    if not tied:
        shapes["lm_head.weight"] = ((vocab, h), vocab_why)
    for i in range(hp.layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": ((h,), hid), p + "post_attention_layernorm.weight": ((h,), hid),
            p + "self_attn.q_proj.weight": ((heads * hd, h), q_why),
            p + "self_attn.k_proj.weight": ((kv * hd, h), kv_why),
            p + "self_attn.v_proj.weight": ((kv * hd, h), kv_why),
            p + "self_attn.o_proj.weight": ((h, heads * hd), q_why),
            p + "mlp.gate_proj.weight": ((inter, h), ff_why), p + "mlp.up_proj.weight": ((inter, h), ff_why),
            p + "mlp.down_proj.weight": ((h, inter), ff_why),
        })
        if attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": ((heads * hd,), q_why),
                           p + "self_attn.k_proj.bias": ((kv * hd,), kv_why),
                           p + "self_attn.v_proj.bias": ((kv * hd,), kv_why)})
    return shapes


def _check_table(origin: Any, hp: _HParams, table: dict[str, _TensorInfo], tie: bool | None,
                 display: Callable[[str], str]) -> tuple[int, bool]:
    """Check the tensor table (HF name -> info, data not read yet) against ``hp``; (vocab, tied).

    ``tie``: the config's tie_word_embeddings (None: unknown yet). ``display`` names a tensor as
    the file does. The layer count must equal the blocks present before anything loops over it.
    """
    n = hp.names
    present = {int(m.group(1)) for name in table if (m := _LAYER.match(name))}
    if len(present) != hp.layers or max(present, default=-1) != hp.layers - 1:  # i.e. not exactly 0..layers-1
        if present and len(present) == max(present) + 1:
            have = f"blocks 0..{max(present)}" if len(present) > 1 else "block 0"
        else:
            have = f"block indices {sorted(present)[:6]}{' ...' if len(present) > 6 else ''}"
        raise ModelLoadError(f"{origin}: {n['layers']} = {hp.layers} but the file has tensors for "
                             f"{len(present)} blocks ({have if present else 'none'})")
    embed = table.get("model.embed_tokens.weight")
    if embed is None:
        raise ModelLoadError(f"{origin}: missing tensor {display('model.embed_tokens.weight')}")
    if len(embed.shape) != 2:
        raise ModelLoadError(f"{origin}: tensor {embed.name} has shape {embed.shape}, expected 2 dims "
                             f"(vocab, {n['hidden']})")
    rows, cols = embed.shape
    vocab = hp.vocab if hp.vocab is not None else rows
    if rows != vocab:
        raise ModelLoadError(f"{origin}: {n['vocab']} = {vocab} but {embed.name} has {rows} rows "
                             "(one per token id)")
    if cols != hp.hidden:
        raise ModelLoadError(f"{origin}: {n['hidden']} = {hp.hidden} but {embed.name} has {cols} columns")
    has_head = "lm_head.weight" in table
    tied = bool(tie) or not has_head
    if tie is False and not has_head:
        raise ModelLoadError(f"{origin}: config says embeddings are not tied but there is no lm_head weight "
                             f"({display('lm_head.weight')})")
    bias = "model.layers.0.self_attn.q_proj.bias" in table
    expected = _expected_shapes(hp, vocab, tied, bias)
    extra = sorted(display(k) for k in set(table) - set(expected) if not (k == "lm_head.weight" and tied))
    if extra:
        raise ModelLoadError(f"{origin}: unsupported tensors {extra[:4]}{' ...' if len(extra) > 4 else ''} "
                             "(yirage supports q/k/v biases only, no o_proj/MLP biases)")
    missing = [display(k) for k in expected if k not in table]
    if missing:
        raise ModelLoadError(f"{origin}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for name, (shape, why) in expected.items():
        info = table[name]
        if info.shape != shape:
            raise ModelLoadError(f"{origin}: tensor {info.name} has shape {info.shape}, the config implies "
                                 f"{shape} ({why})")
    return vocab, tied


def _check_weights(weights: dict[str, Weight], table: dict[str, _TensorInfo], tied: bool,
                   origin: Any) -> dict[str, Weight]:
    """After reading: drop a tied ``lm_head`` and check that every weight came out as the checked
    table said (a backstop: any difference is a bug of the reader)."""
    if tied:
        weights.pop("lm_head.weight", None)
    for name, weight in weights.items():
        info = table.get(name)
        if info is None or weight.shape != info.shape:
            raise ModelLoadError(f"{origin}: tensor {name} was read with shape {weight.shape}, "
                                 f"expected {info.shape if info else 'no such tensor'}")
    return weights


def _nonfinite(weight: Weight) -> str | None:
    """What is not finite in ``weight`` (None: all finite). Float tensors: every value
    (``torch.isfinite``). Q8_0/Q4_1: the fp16 block scales (``d``, and ``m`` of Q4_1), read from the
    raw blocks as 16-bit patterns (exponent all ones = inf/NaN); the int8/int4 quants themselves
    cannot be non-finite. The scale check runs in numpy: single-threaded, it takes ~25 ms for the
    default model's 92 MiB, where torch's thread pool measured anywhere from 30 ms to 1.5 s on a
    busy 2-core machine."""
    data = weight.data
    if not weight.dtype.is_quantized:
        return None if bool(torch.isfinite(data).all()) else "NaN or inf values"
    per, nbytes = weight.dtype.block
    scales = 1 if weight.dtype == DType.q8_0 else 2
    halves = data.numpy().reshape(-1).view(np.uint16).reshape(-1, nbytes // 2)[:, :scales]
    if int((halves & 0x7FFF).max(initial=0)) < 0x7C00:
        return None
    bad = int(((halves & 0x7C00) == 0x7C00).any(axis=1).sum())
    return f"NaN or inf block scales ({bad} of {halves.shape[0]} blocks)"


def _report_nonfinite(bad: list[str], origin: Any, allow: bool) -> None:
    if not bad:
        return
    listed = "; ".join(bad[:4]) + (f"; ... ({len(bad)} tensors)" if len(bad) > 4 else "")
    if not allow:
        raise ModelLoadError(f"{origin}: non-finite weights: {listed}. Pass allow_nonfinite=True to load the "
                             "model anyway")
    logger.warning("%s: loading non-finite weights (allow_nonfinite=True): %s", origin, listed)


def _check_tokenizer(tokenizer: Any, rows: int, embed_name: str, origin: Any,
                     tolerated: Callable[[int], bool] = lambda i: False) -> None:
    """Every id the tokenizer can produce (its vocab and added tokens, ``len(tokenizer)``) and its
    special ids must index a row of the embedding, and a test prompt must encode and decode.
    ``tolerated(id)``: ids past the table that are only logged: tokens transformers adds that the
    model's files do not have (the GGUF tokenizer conversion and some tokenizer classes add a
    default ``<|endoftext|>``)."""
    try:
        vocab = tokenizer.get_vocab()
        size = len(tokenizer)
    except Exception as exc:  # a tokenizer object that cannot list its vocabulary
        raise ModelLoadError(f"{origin}: cannot read the tokenizer's vocabulary ({exc})") from exc
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    values = list(vocab.values()) + [int(i) for i in added]
    if values and (min(values) < 0 or max(values) >= rows):
        ids = dict(vocab)
        for token_id, token in added.items():
            ids.setdefault(str(token), int(token_id))
        past = sorted(((int(i), t) for t, i in ids.items() if not 0 <= int(i) < rows), key=lambda p: p[0])
    else:
        past = []
    hard = [(i, t) for i, t in past if not tolerated(i)]
    if hard:
        top_id, top = hard[-1]
        raise ModelLoadError(f"{origin}: the tokenizer maps {_show(top)} to id {top_id}, but {embed_name} has only "
                             f"{rows} rows: every token id must be below {rows} ({len(hard)} ids are not)")
    if past:
        logger.warning("%s: the tokenizer has ids %s beyond the %d embedding rows, added by transformers (not in "
                       "the model's tokenizer files); text that spells them cannot be run", origin,
                       [f"{t!r}={i}" for i, t in past[:4]], rows)
    elif size > rows:
        raise ModelLoadError(f"{origin}: the tokenizer has {size} tokens but {embed_name} has only {rows} rows")
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id"):
        token_id = getattr(tokenizer, attr, None)
        if isinstance(token_id, int) and not 0 <= token_id < rows and not tolerated(token_id):
            raise ModelLoadError(f"{origin}: the tokenizer's {attr} = {token_id} must be below the {rows} rows "
                                 f"of {embed_name}")
    # a prompt of unknown words and special characters must encode (unk token, post-processor)
    with _foreign_errors(f"{origin}: the tokenizer cannot encode a test prompt"):
        encoded = list(tokenizer(_TOKENIZER_PROBE, add_special_tokens=True)["input_ids"])
        tokenizer.decode(encoded)
    if any(not 0 <= int(i) < rows and not tolerated(int(i)) for i in encoded):
        raise ModelLoadError(f"{origin}: the tokenizer encodes a test prompt to ids {encoded} outside the {rows} rows "
                             f"of {embed_name}")


_TOKENIZER_PROBE = "Hello, world! w5 hi 123 naïve 日本語 🙂\n\t<|unknown|>"


@contextmanager
def _progress_bar(enabled: bool, total: int, description: str) -> Iterator[Any]:
    """A rich progress bar on stderr (only when stderr is a terminal); yields ``advance()``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not (enabled and console.is_terminal), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)


# ----------------------------------------------------------------------------------------------
# GGUF

_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_TOP = {v: k for k, v in _GGUF_TOP.items()}
_HF_BLOCK = {v: k for k, v in _GGUF_BLOCK.items()}
_HF_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")

# GGUF tensor types by role: kept as they are, or dequantized to float32 (numpy, gguf.quants)
_FLOAT_TYPES = ("F32", "F16", "BF16")
_KEPT_TYPES = _FLOAT_TYPES + ("Q8_0", "Q4_1")
_DEQUANTIZED_TYPES = ("Q4_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_GGUF_INT_VALUES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
_GGUF_NUMBER_VALUES = _GGUF_INT_VALUES + ("FLOAT32", "FLOAT64")


def gguf_to_hf_name(name: str) -> str | None:
    """Hugging Face name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for tensors yirage does not use."""
    m = _GGUF_BLOCK_NAME.match(name)
    if m:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_GGUF_BLOCK[part]}.{kind}" if part in _GGUF_BLOCK else None
    stem, _, kind = name.rpartition(".")
    return f"{_GGUF_TOP[stem]}.{kind}" if stem in _GGUF_TOP and kind in ("weight", "bias") else None


def _hf_to_gguf_name(name: str) -> str:
    """The GGUF name of a Hugging Face weight name (for messages); the name itself if unknown."""
    m = _HF_LAYER_NAME.match(name)
    if m and m.group(2) in _HF_BLOCK:
        return f"blk.{m.group(1)}.{_HF_BLOCK[m.group(2)]}.{m.group(3)}"
    stem, _, kind = name.rpartition(".")
    return f"{_HF_TOP[stem]}.{kind}" if stem in _HF_TOP else name


def reverse_llama_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k rows (interleaved RoPE pairs -> rotate_half halves).

    Works on dim 0 only, so it applies unchanged to quantized storage (each row holds its own
    blocks) and to 1-D biases. Same as transformers' ``LlamaTensorProcessor._reverse_permute_weights``.

    Raises ModelLoadError: ``n_head`` is not positive or does not split the rows into heads of
    an even number of rows.
    """
    if n_head <= 0 or rows.shape[0] % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute {rows.shape[0]} q/k rows into {n_head} heads of an even size")
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


_READER_CLASS: Any = None


def _reader_class() -> Any:
    """``gguf.GGUFReader`` with bounds checks: a read past the end of the file, a metadata array or
    count longer than the rest of the file could hold, a nested array, or a tensor table that is
    not laid out as llama.cpp lays it out is an error before anything is allocated from it (the
    stock reader hangs on a huge array length, and reports a short read as "index 0 is out of
    bounds" and bad tensor infos as a numpy reshape error)."""
    global _READER_CLASS
    if _READER_CLASS is not None:
        return _READER_CLASS
    import gguf

    V = gguf.GGUFValueType
    ARRAY, STRING = int(V.ARRAY), int(V.STRING)
    value_types = {int(t): t for t in V}
    sizes = {int(t): np.dtype(n).itemsize for t, n in gguf.GGUFReader.gguf_scalar_to_np.items()}
    itemsize: dict[Any, int] = {}
    base_get, base_parts = gguf.GGUFReader._get, gguf.GGUFReader._get_field_parts

    class CheckedReader(gguf.GGUFReader):
        def __init__(self, path: Any, mode: Any = "r"):
            self._yr_path = Path(path)
            self._yr_size = os.path.getsize(path)
            super().__init__(path, mode)

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            size = itemsize.get(dtype)
            if size is None:
                size = itemsize[dtype] = np.dtype(dtype).itemsize
            if offset + size * int(count) > self._yr_size:
                raise ValueError(f"the header runs past the end of the file ({self._yr_size} bytes) at byte "
                                 f"{int(offset)}{self._yr_where()}")
            return base_get(self, offset, dtype, count, override_order)

        def _yr_where(self) -> str:
            """', in metadata field KEY' for the field being parsed (the one after the last parsed)."""
            if not self._yr_in_fields:
                return ""
            try:
                last = next(reversed(self.fields.values()))
                offset = last.offset + sum(int(p.nbytes) for p in last.parts)
                length = min(int(base_get(self, offset, np.uint64)[0]), 80)
                key = bytes(base_get(self, offset + 8, np.uint8, length)).decode("utf-8", "replace")
                return f", in metadata field {key!r}"
            except Exception:  # noqa: BLE001: only for the message
                return ""

        _yr_in_fields = False

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if int(raw_type) != ARRAY:
                return base_parts(self, orig_offs, raw_type)
            # an array, as the stock reader parses it, with its length checked first
            offs = orig_offs
            raw_itype = self._get(offs, np.uint32)
            alen = self._get(offs + 4, np.uint64)
            offs += 12
            item_type, count = int(raw_itype[0]), int(alen[0])
            if item_type == ARRAY or item_type not in value_types:
                raise ValueError(f"metadata array item type {item_type} is not supported{self._yr_where()}")
            least = 8 if item_type == STRING else sizes[item_type]
            if count * least > self._yr_size - offs:
                raise ValueError(f"a metadata array declares {count} items, more than the rest of the file can "
                                 f"hold{self._yr_where()}")
            types = [V.ARRAY]
            parts: list = [raw_itype, alen]
            data_idxs: list[int] = []
            for idx in range(count):
                size, item_parts, item_idxs, item_types = base_parts(self, offs, item_type)
                if idx == 0:
                    types += item_types
                first = len(parts)
                parts += item_parts
                data_idxs += (i + first for i in item_idxs)
                offs += size
            return offs - orig_offs, parts, data_idxs, types

        def _build_fields(self, offs: int, count: int) -> int:
            if int(count) * 13 > self._yr_size - offs:  # key length, value type, >= 1 byte of value
                raise ValueError(f"the header declares {int(count)} metadata fields, more than the file can hold")
            self._yr_in_fields = True
            offs = super()._build_fields(offs, count)
            self._yr_in_fields = False
            return offs

        def _build_tensor_info(self, offs: int, count: int) -> Any:
            if int(count) * 24 > self._yr_size - offs:  # name length, n_dims, type, offset
                raise ValueError(f"the header declares {int(count)} tensors, more than the file can hold")
            return super()._build_tensor_info(offs, count)

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            _check_gguf_layout(self._yr_path, fields, int(start_offs), int(self.alignment), self._yr_size)
            super()._build_tensors(start_offs, fields)

    _READER_CLASS = CheckedReader
    return CheckedReader


def _check_gguf_layout(path: Path, fields: list, start: int, alignment: int, size: int) -> None:
    """Tensor infos as llama.cpp's ``gguf_init_from_file`` checks them: a known type, 1..4 dims
    each > 0, rows a whole number of blocks, and each tensor at exactly the (aligned) offset
    where the previous one ends, its data inside the file. A type relabelled in place, a wrong
    shape or a corrupt (wrapping) offset all break that chain; the message names the tensor."""
    import gguf

    Q = gguf.GGMLQuantizationType
    expected = 0
    previous = None
    for field_ in fields:
        _, name_data, n_dims, dims, raw_type, raw_offset = field_.parts
        name = field_.name
        nd = int(n_dims[0])
        if not 1 <= nd <= 4:
            raise ModelLoadError(f"{path} is not a valid GGUF file: tensor {name} has {nd} dimensions (1 to 4 allowed)")
        shape = [int(d) for d in dims]
        if min(shape) < 1:
            raise ModelLoadError(f"{path} is not a valid GGUF file: tensor {name} has a zero dimension "
                                 f"(shape {list(reversed(shape))})")
        try:
            qtype = Q(int(raw_type[0]))
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path} is not a valid GGUF file: tensor {name} has unknown type id "
                                 f"{int(raw_type[0])}") from None
        logical = tuple(reversed(shape))
        if shape[0] % block:
            raise ModelLoadError(f"{path} is not a valid GGUF file: tensor {name} ({qtype.name}, shape {logical}) has "
                                 f"rows of {shape[0]} values, not a whole number of {qtype.name} blocks of {block}")
        n_bytes = math.prod(shape) // block * type_size
        offset = int(raw_offset[0])
        if offset != expected:
            if previous is None:
                detail = f"the first tensor must start at data offset 0"
            else:
                prev_name, prev_type, prev_shape, prev_end = previous
                detail = (f"the previous tensor {prev_name} ({prev_type}, shape {prev_shape}) ends at {prev_end}, so "
                          f"{name} must start at {expected}: the type or shape of {prev_name} does not match its "
                          f"stored data, or the offset of {name} is corrupt")
            raise ModelLoadError(f"{path} is not a valid GGUF file: tensor {name} starts at data offset {offset}; "
                                 f"{detail}")
        end = start + offset + n_bytes
        if end > size:
            raise ModelLoadError(f"{path} is not a valid or complete GGUF file: tensor {name} ({qtype.name}, shape "
                                 f"{logical}) needs bytes {start + offset}..{end} but the file has {size} bytes")
        previous = (name, qtype.name, logical, offset + n_bytes)
        expected = offset + (n_bytes + alignment - 1) // alignment * alignment


def _open_gguf(path: Path) -> Any:
    try:
        return _reader_class()(path)
    except ModelLoadError:
        raise
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{path} is not a valid GGUF file: a metadata key or tensor name is not valid UTF-8 "
                             f"({exc})") from exc
    except Exception as exc:  # bad magic, truncated data, corrupt header: numpy/struct/value errors
        reason = (str(exc).strip().splitlines() or [""])[0] or type(exc).__name__
        raise ModelLoadError(f"{path} is not a valid or complete GGUF file ({reason})") from exc


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _gguf_check_strings(reader: Any, path: Path) -> None:
    """Every string value (and every string of a string array) must be UTF-8: transformers and
    the tokenizer decode them, and a bad byte would surface as an unrelated error."""
    import gguf

    V = gguf.GGUFValueType
    for key, f in reader.fields.items():
        if not f.types or V.STRING not in (f.types[0], f.types[-1]):
            continue
        parts = [f.parts[i] for i in f.data] if f.types[0] == V.ARRAY else [f.parts[-1]]
        try:  # one decode for the whole field; the separator keeps items from completing each other
            b"\0".join(p.tobytes() for p in parts).decode("utf-8")
        except UnicodeDecodeError:
            for i, p in enumerate(parts):
                try:
                    p.tobytes().decode("utf-8")
                except UnicodeDecodeError as exc:
                    where = f"{key}[{i}]" if f.types[0] == V.ARRAY else key
                    raise ModelLoadError(f"{path}: metadata {where} is not valid UTF-8 ({exc.reason} at byte "
                                         f"{exc.start}: {p.tobytes()[:32]!r})") from None


def _gguf_value(reader: Any, key: str, path: Path, integer: bool) -> Any:
    """A scalar metadata value checked for type: an integer type, or (``integer`` False) any
    number type; None when absent."""
    f = reader.fields.get(key)
    if f is None:
        return None
    types = [t.name for t in f.types]
    allowed = _GGUF_INT_VALUES if integer else _GGUF_NUMBER_VALUES
    if len(types) != 1 or types[0] not in allowed:
        got = "an array" if types and types[0] == "ARRAY" else f"a {types[0] if types else 'typeless'} value"
        raise ModelLoadError(f"{path}: {key} must be a single {'integer' if integer else 'number'}, got {got}")
    return f.contents()


def _gguf_hparams(reader: Any, arch: str, path: Path) -> _HParams:
    """The hyper-parameters of the GGUF metadata, checked (type, range, consistency) by their GGUF
    names, before transformers builds a config from them."""
    keys = {"layers": "block_count", "hidden": "embedding_length", "intermediate": "feed_forward_length",
            "heads": "attention.head_count", "kv_heads": "attention.head_count_kv",
            "head_dim": "attention.key_length", "value_dim": "attention.value_length",
            "rope_dim": "rope.dimension_count", "vocab": "vocab_size", "context": "context_length",
            "eps": "attention.layer_norm_rms_epsilon", "theta": "rope.freq_base",
            "sliding": "attention.sliding_window"}
    names = {k: f"{arch}.{v}" for k, v in keys.items()}
    floats = ("eps", "theta")
    values = {k: _gguf_value(reader, names[k], path, integer=k not in floats) for k in keys}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if values["vocab"] is None and tokens is not None:
        values["vocab"], names["vocab"] = len(tokens.data), "the number of tokenizer.ggml.tokens"
    scaling = _gguf_field(reader, f"{arch}.rope.scaling.type")
    if scaling is not None and not isinstance(scaling, str):
        raise ModelLoadError(f"{path}: {arch}.rope.scaling.type = {_show(scaling)} must be a string")
    factor = _gguf_value(reader, f"{arch}.rope.scaling.factor", path, integer=False)
    if factor is not None and scaling not in (None, "none"):
        _positive_float(path, f"{arch}.rope.scaling.factor", factor)
    original = _gguf_value(reader, f"{arch}.rope.scaling.original_context_length", path, integer=True)
    _int_field(path, f"{arch}.rope.scaling.original_context_length", original, optional=True)
    return _hparams(path, names, values.get)


def _gguf_table(reader: Any, path: Path) -> tuple[dict[str, _TensorInfo], Any]:
    """The tensors yirage uses (HF name -> info) and ``rope_freqs.weight`` (or None), each type
    checked against its role: norms and biases float; matrices float, Q8_0/Q4_1 (kept) or a
    type gguf dequantizes exactly (legacy and K-quants)."""
    table: dict[str, _TensorInfo] = {}
    rope_freqs = None
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if tensor.name == "rope_freqs.weight":
            if kind not in _FLOAT_TYPES:
                raise ModelLoadError(f"{path}: tensor rope_freqs.weight has type {kind}; it must be F32, F16 or BF16")
            rope_freqs = tensor
            continue
        name = gguf_to_hf_name(tensor.name)
        if name is None:
            logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        if name.endswith(".bias") or name.endswith("norm.weight"):
            if kind not in _FLOAT_TYPES:
                role = "bias" if name.endswith(".bias") else "norm weight"
                raise ModelLoadError(f"{path}: tensor {tensor.name} has type {kind}; a {role} must be "
                                     f"{', '.join(_FLOAT_TYPES)}")
        elif kind not in _KEPT_TYPES + _DEQUANTIZED_TYPES:
            raise ModelLoadError(f"{path}: tensor {tensor.name} has type {kind}, which yirage does not support; "
                                 f"supported: {', '.join(_KEPT_TYPES)} (used as stored) and "
                                 f"{', '.join(_DEQUANTIZED_TYPES)} (dequantized to float32)")
        table[name] = _TensorInfo(tensor.name, shape, kind)
    return table, rope_freqs


def _gguf_check_tokens(reader: Any, rows: int, path: Path) -> None:
    """The file's own tokenizer metadata: every token id (one per entry of tokenizer.ggml.tokens)
    and the special ids must index a row of token_embd.weight."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    count = len(tokens.data) if tokens is not None else None
    if count is not None and count > rows:
        raise ModelLoadError(f"{path}: tokenizer.ggml.tokens has {count} tokens (ids up to {count - 1}) but "
                             f"token_embd.weight has only {rows} rows: every token id must be below {rows}")
    for which in ("bos", "eos", "eot", "eom", "unknown", "padding"):
        key = f"tokenizer.ggml.{which}_token_id"
        token_id = _gguf_value(reader, key, path, integer=True)
        if token_id is None:
            continue
        limit = rows if count is None else min(rows, count)
        if which == "padding" and count is not None:
            limit = count  # never fed to the model, but transformers looks it up in the token list
        if not 0 <= int(token_id) < limit:
            raise ModelLoadError(f"{path}: {key} = {int(token_id)} must be in [0, {limit}) (token_embd.weight has "
                                 f"{rows} rows{'' if count is None else f', tokenizer.ggml.tokens {count} entries'})")


def _gguf_hf_config(reader: Any, path: Path) -> Any:
    """The transformers config of a GGUF file, from transformers' own GGUF metadata reader.

    That reader parses the whole file a second time (about 2.5 s for the default model), so
    the result is cached as ``cache_dir()/gguf-config/<hash of path, size, mtime>.json``.
    Call it only after the metadata has been checked (``_gguf_hparams``).
    """
    from transformers import AutoConfig

    cached = cache_dir() / "gguf-config" / f"{_file_cache_key(path)}.json"
    if cached.is_file():
        try:
            config = AutoConfig.from_pretrained(str(cached))
            config.name_or_path = str(path)
            return config
        except Exception as exc:  # a damaged cache entry: read the file again
            logger.warning("ignoring damaged config cache %s (%s)", cached, exc)
    config = _gguf_hf_config_uncached(reader, path)
    config.name_or_path = str(path)
    cached.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=cached.parent)
    os.close(fd)
    try:
        config.to_json_file(tmp)
        os.replace(tmp, cached)  # atomic: concurrent loaders see no half-written file
    except OSError as exc:
        logger.debug("config cache not written: %s", exc)
        Path(tmp).unlink(missing_ok=True)
    return config


def _gguf_hf_config_uncached(reader: Any, path: Path) -> Any:
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    arch = _gguf_field(reader, "general.architecture")
    try:
        config = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    except Exception as exc:
        if arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(f"{path}: architecture {_show(arch)} is not supported; "
                                 f"supported architectures: {', '.join(SUPPORTED_ARCHS)}") from exc
        raise ModelLoadError(f"{path}: transformers cannot read the GGUF metadata ({type(exc).__name__}: "
                             f"{exc})") from exc
    model_type = _check_arch(config.pop("model_type", arch), path)
    config.pop("_model_name_or_path", None)
    scaling = _gguf_field(reader, f"{arch}.rope.scaling.type")
    factor = _gguf_field(reader, f"{arch}.rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor and float(factor) != 1.0:
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(factor)}
        original = _gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
        if scaling == "yarn" and original:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)
    try:
        return AutoConfig.for_model(model_type, **config)
    except Exception as exc:  # transformers' own config validation
        raise ModelLoadError(f"{path}: transformers rejects the config built from the GGUF metadata "
                             f"({type(exc).__name__}: {exc})") from exc


def _gguf_tensor(tensor: Any) -> Weight:
    """A GGUF tensor as a Weight: Q8_0/Q4_1 raw blocks, F32/F16/BF16 as is, the types of
    ``_DEQUANTIZED_TYPES`` dequantized (the caller has checked the type and layout)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    kind = tensor.tensor_type
    if kind in (Q.Q8_0, Q.Q4_1):
        dtype = DType.q8_0 if kind == Q.Q8_0 else DType.q4_1
        data = np.array(tensor.data, dtype=np.uint8).reshape(dtype.storage_shape(shape))
        return Weight(torch.from_numpy(data), dtype, shape)
    if kind in (Q.F32, Q.F16):
        data = np.array(tensor.data, dtype=tensor.data.dtype.newbyteorder("=")).reshape(shape)
        return Weight(torch.from_numpy(data), DType.float32 if kind == Q.F32 else DType.float16, shape)
    if kind == Q.BF16:
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(-1))
        return Weight(raw.view(torch.bfloat16).reshape(shape), DType.bfloat16, shape)
    try:
        values = gguf.quants.dequantize(tensor.data, kind)
    except NotImplementedError as exc:
        raise ModelLoadError(f"GGUF tensor {tensor.name} has type {kind.name}, which cannot be dequantized") from exc
    return Weight(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape)), DType.float32, shape)


def _read_gguf_weights(reader: Any, table: dict[str, _TensorInfo], hp: _HParams, permute_qk: bool,
                       progress: bool, path: Path, allow_nonfinite: bool) -> dict[str, Weight]:
    """The checked tensors under HF names (q/k rows un-permuted when ``permute_qk``); NaN/inf
    refused (or warned about, ``allow_nonfinite``)."""
    weights: dict[str, Weight] = {}
    bad: list[str] = []
    used = {info.name: name for name, info in table.items()}
    with _progress_bar(progress, len(reader.tensors), f"reading {path.name}") as advance:
        for tensor in reader.tensors:
            name = used.get(tensor.name)
            if name is not None:
                weight = _gguf_tensor(tensor)
                problem = _nonfinite(weight)
                if problem:
                    bad.append(f"{tensor.name} ({tensor.tensor_type.name}) has {problem}")
                if permute_qk and (".q_proj." in name or ".k_proj." in name):
                    n = hp.heads if ".q_proj." in name else hp.kv_heads
                    rows = reverse_llama_permute(weight.data.numpy(), n)
                    weight = Weight(torch.from_numpy(np.ascontiguousarray(rows)), weight.dtype, weight.shape)
                weights[name] = weight
            advance()
    _report_nonfinite(bad, path, allow_nonfinite)
    return weights


def _gguf_rope_freqs(tensor: Any, hp: _HParams, path: Path) -> torch.Tensor:
    """llama.cpp's per-frequency RoPE divisors: head_dim // 2 finite values > 0."""
    values = np.array(tensor.data, dtype=np.float32).reshape(-1)
    if values.shape != (hp.head_dim // 2,):
        raise ModelLoadError(f"{path}: tensor rope_freqs.weight has {values.size} values, expected "
                             f"{hp.head_dim // 2} (head dim {hp.head_dim} / 2)")
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ModelLoadError(f"{path}: tensor rope_freqs.weight must hold finite values > 0 (it divides the "
                             "RoPE frequencies)")
    return torch.from_numpy(values)


def _file_cache_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]


def _gguf_tokenizer(path: Path) -> Any:
    """The GGUF's tokenizer converted by transformers (slow), cached under
    ``cache_dir()/tokenizers/<hash of path, size, mtime>``."""
    from transformers import AutoTokenizer

    cached = cache_dir() / "tokenizers" / _file_cache_key(path)
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as exc:  # a damaged cache entry: convert again
            logger.warning("ignoring damaged tokenizer cache %s (%s)", cached, exc)
            shutil.rmtree(cached, ignore_errors=True)
    logger.info("converting the tokenizer of %s (cached afterwards)", path.name)
    with _foreign_errors(f"{path}: cannot build the tokenizer from the GGUF metadata"):
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, cached)
    except OSError as exc:  # another process got there first, or the cache is read-only
        logger.debug("tokenizer cache not written: %s", exc)
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def _load_gguf(path: Path, progress: bool, allow_nonfinite: bool = False) -> LoadedModel:
    reader = _open_gguf(path)  # header, metadata bounds and tensor layout checked
    _gguf_check_strings(reader, path)
    arch = _gguf_field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{path}: general.architecture is {'missing' if arch is None else _show(arch)}; "
                             "it must name the architecture (llama, qwen2, mistral)")
    _check_arch(arch, path)
    hp = _gguf_hparams(reader, arch, path)
    table, rope_freqs_tensor = _gguf_table(reader, path)
    display = _hf_to_gguf_name
    vocab, tied = _check_table(path, hp, table, None, display)
    _gguf_check_tokens(reader, vocab, path)
    hf_config = _gguf_hf_config(reader, path)
    _check_arch(hf_config.model_type, path)
    # the same checks on the config as transformers built it (names as in transformers)
    hf_hp = _hf_hparams(f"{path} (as read by transformers)", lambda k: getattr(hf_config, k, None))
    _check_table(f"{path} (as read by transformers)", hf_hp, table, hf_config.tie_word_embeddings, display)
    rope_freqs = _gguf_rope_freqs(rope_freqs_tensor, hp, path) if rope_freqs_tensor is not None else None
    permute_qk = arch == "llama"  # llama.cpp permutes llama only
    weights = _read_gguf_weights(reader, table, hp, permute_qk, progress, path, allow_nonfinite)
    weights = _check_weights(weights, table, tied, path)
    tokenizer = _gguf_tokenizer(path)
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    _check_tokenizer(tokenizer, vocab, "token_embd.weight", path, tolerated=lambda i: i >= n_tokens)
    eos = (_as_id_list(hf_config.eos_token_id) + _as_id_list(_gguf_field(reader, "tokenizer.ggml.eos_token_id"))
           + _as_id_list(_gguf_field(reader, "tokenizer.ggml.eot_token_id"))
           + _as_id_list(_gguf_field(reader, "tokenizer.ggml.eom_token_id")) + _as_id_list(tokenizer.eos_token_id))
    bos = hf_config.bos_token_id if hf_config.bos_token_id is not None else tokenizer.bos_token_id
    config = _model_config(hf_config, weights, bos, eos, path)
    if rope_freqs is not None:  # llama.cpp's per-frequency divisors (e.g. Llama 3.1 files)
        config.inv_freq = config.inv_freq / rope_freqs
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=path, format="gguf")


# ----------------------------------------------------------------------------------------------
# safetensors (Hugging Face directory)

_ST_FLOAT = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


def _safetensors_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The checkpoint's files, and the index's weight map (tensor -> shard) when it is sharded.
    Shards named by ``model.safetensors.index.json`` must lie inside the directory."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: must be a JSON object with a non-empty \"weight_map\" object "
                                 "(tensor name -> shard file)")
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str):
                raise ModelLoadError(f"{index}: weight_map[{_show(tensor)}] = {_show(shard)} must be a shard file name")
        shards = {s: model_file(directory, s, str(index)) for s in sorted(set(weight_map.values()))}
        return list(shards.values()), {t: str(shards[s]) for t, s in weight_map.items()}
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"], None
    return sorted(p for p in directory.glob("*.safetensors") if not p.name.startswith("consolidated")), None


def _hf_name(name: str) -> str:
    """Names saved from the bare base model (``layers.0...``) get the ``model.`` prefix."""
    if name.startswith(("layers.", "embed_tokens.", "norm.")):
        return "model." + name
    return name


def _safetensors_table(directory: Path) -> tuple[list[tuple[Path, Any, list[str]]], dict[str, _TensorInfo]]:
    """Open every file (headers only) and list its tensors: [(file, handle, keys)], and the table
    HF name -> info. Non-float tensors are refused (``rotary_emb.inv_freq`` buffers skipped)."""
    from safetensors import safe_open

    files, weight_map = _safetensors_files(directory)
    if not files:
        raise ModelLoadError(f"{directory}: no safetensors files")
    handles = []
    table: dict[str, _TensorInfo] = {}
    where: dict[str, Path] = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
            keys = list(handle.keys())
            infos = [(k, handle.get_slice(k)) for k in keys]
            infos = [(k, s.get_dtype(), tuple(int(d) for d in s.get_shape())) for k, s in infos]
        except Exception as exc:
            raise ModelLoadError(f"{f}: cannot read safetensors file ({exc})") from exc
        used = []
        for key, dtype, shape in infos:
            if "rotary_emb.inv_freq" in key:
                continue
            if dtype not in _ST_FLOAT:
                raise ModelLoadError(f"{f}: tensor {key} has dtype {dtype}; only float32, float16 and bfloat16 "
                                     "checkpoints are supported")
            name = _hf_name(key)
            if name in table:
                raise ModelLoadError(f"{directory}: tensor {key} is stored twice ({where[name].name} and {f.name})")
            table[name] = _TensorInfo(key, shape, dtype)
            where[name] = f
            used.append(key)
        handles.append((f, handle, used))
    if weight_map is not None:
        index = directory / "model.safetensors.index.json"
        for tensor, shard in weight_map.items():
            if "rotary_emb.inv_freq" in tensor:
                continue
            name = _hf_name(tensor)
            if name not in table or str(where[name]) != shard:
                raise ModelLoadError(f"{index}: weight_map says tensor {tensor} is in {Path(shard).name}, but that "
                                     "file has no such tensor")
    return handles, table


def _read_safetensors(handles: list, table: dict[str, _TensorInfo], progress: bool, directory: Path,
                      allow_nonfinite: bool) -> dict[str, Weight]:
    weights: dict[str, Weight] = {}
    bad: list[str] = []
    total = sum(len(keys) for _, _, keys in handles)
    with _progress_bar(progress, total, f"reading {directory.name}") as advance:
        for f, handle, keys in handles:
            for key in keys:
                try:
                    tensor = handle.get_tensor(key)
                except Exception as exc:
                    raise ModelLoadError(f"{f}: cannot read tensor {key} ({exc})") from exc
                weight = Weight(tensor.contiguous(), as_dtype(tensor.dtype), tuple(tensor.shape))
                problem = _nonfinite(weight)
                if problem:
                    bad.append(f"{key} has {problem}")
                weights[_hf_name(key)] = weight
                advance()
    _report_nonfinite(bad, directory, allow_nonfinite)
    return weights


def _hf_tokenizer_file_ids(directory: Path, rows: int) -> set[int] | None:
    """The token ids the directory's tokenizer files define (tokenizer.json's model vocab and
    added tokens, added_tokens.json), each checked to index a row of the embedding; None when
    there is neither file (then every id of the loaded tokenizer counts as the file's)."""
    found: list[tuple[str, str, Any]] = []
    tokenizer_json = directory / "tokenizer.json"
    if tokenizer_json.is_file():
        data = _read_json(tokenizer_json)
        model = data.get("model") if isinstance(data, dict) else None
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if isinstance(vocab, dict):
            found += [("tokenizer.json", str(t), i) for t, i in vocab.items()]
        elif isinstance(vocab, list):  # Unigram: [token, score] pairs, ids by position
            found += [("tokenizer.json", str(entry[0]) if isinstance(entry, list) and entry else "", i)
                      for i, entry in enumerate(vocab)]
        for entry in (data.get("added_tokens") or []) if isinstance(data, dict) else []:
            if isinstance(entry, dict):
                found.append(("tokenizer.json added_tokens", str(entry.get("content")), entry.get("id")))
    added = directory / "added_tokens.json"
    if added.is_file():
        extra = _read_json(added)
        if isinstance(extra, dict):
            found += [("added_tokens.json", str(t), i) for t, i in extra.items()]
    if not found:
        return None
    ids = set()
    for source, token, token_id in found:
        if not _is_int(token_id) or not 0 <= int(token_id) < rows:
            raise ModelLoadError(f"{directory / source.split()[0]}: token {_show(token)} has id {_show(token_id)}, but "
                                 f"model.embed_tokens.weight has {rows} rows: every token id must be an "
                                 f"integer in [0, {rows})")
        ids.add(int(token_id))
    return ids


@contextmanager
def _foreign_errors(what: str) -> Iterator[None]:
    """Turn any failure of a third-party parser (transformers, tokenizers) into one
    ModelLoadError ``"<what> (<type>: <first line>)"``: tokenizers' Rust panics arrive as
    pyo3's PanicException, a BaseException, so only interrupts and exits pass through."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:
        reason = (str(exc).strip().splitlines() or [""])[0] or type(exc).__name__
        raise ModelLoadError(f"{what} ({type(exc).__name__}: {reason})") from exc


def _read_json(path: Path) -> Any:
    """The JSON document in ``path``; ModelLoadError if it cannot be read or parsed (nesting
    deep enough to exhaust the parser's recursion included)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ModelLoadError(f"{path}: not a readable JSON file ({type(exc).__name__}: {exc})") from exc


def _read_config_json(directory: Path) -> dict:
    path = directory / "config.json"
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: must be a JSON object, got {type(raw).__name__}")
    return raw


def _load_safetensors(directory: Path, progress: bool, allow_nonfinite: bool = False) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    raw = _read_config_json(directory)
    _check_arch(raw.get("model_type"), directory)
    config_json = directory / "config.json"
    hp = _hf_hparams(config_json, raw.get)
    handles, table = _safetensors_table(directory)
    _check_table(directory, hp, table, raw.get("tie_word_embeddings"), lambda n: n)
    try:
        hf_config = AutoConfig.from_pretrained(str(directory))
    except Exception as exc:
        raise ModelLoadError(f"{directory}: cannot read config.json ({exc})") from exc
    _check_arch(getattr(hf_config, "model_type", None), directory)
    hf_hp = _hf_hparams(f"{config_json} (as read by transformers)", lambda k: getattr(hf_config, k, None))
    vocab, tied = _check_table(directory, hf_hp, table, getattr(hf_config, "tie_word_embeddings", None),
                               lambda n: n)
    file_ids = _hf_tokenizer_file_ids(directory, vocab)
    weights = _read_safetensors(handles, table, progress, directory, allow_nonfinite)
    weights = _check_weights(weights, table, tied, directory)
    with _foreign_errors(f"{directory}: cannot load the tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    _check_tokenizer(tokenizer, vocab, "model.embed_tokens.weight", directory,
                     tolerated=(lambda i: False) if file_ids is None else (lambda i: i not in file_ids))
    eos: list[int] = []
    if (directory / "generation_config.json").is_file():
        try:
            eos += _as_id_list(GenerationConfig.from_pretrained(str(directory)).eos_token_id)
        except Exception as exc:
            logger.warning("ignoring unreadable generation_config.json in %s (%s)", directory, exc)
    eos += _as_id_list(getattr(hf_config, "eos_token_id", None)) + _as_id_list(tokenizer.eos_token_id)
    bos = getattr(hf_config, "bos_token_id", None)
    config = _model_config(hf_config, weights, bos if bos is not None else tokenizer.bos_token_id, eos, directory)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=directory, format="safetensors")
