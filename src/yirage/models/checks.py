"""Validation shared by the GGUF and safetensors loaders (``gguf_file.py``, ``safetensors_dir.py``).

Native kernels later index tables with sizes taken from the config, so a model file is checked
completely before anything is built from it. This module holds the rules both formats share; each
problem is one ``ModelLoadError`` naming the file, the field or tensor, the value and what was
expected:

- hyper-parameters (``_hparams``, ``_hf_hparams``, ``_check_rope_params`` and the field checks
  ``_int_field``, ``_positive_float``, ``_finite_float``): layers, heads, KV heads, head dim,
  hidden, intermediate, vocab, context, sliding window, RMSNorm eps, RoPE theta/scaling, for type,
  range and consistency with each other, before transformers builds a config from them; the
  architecture (``_check_arch``, ``SUPPORTED_ARCHS``: Llama, Qwen2, Mistral and Qwen3, which is
  Qwen2 without q/k/v biases unless ``attention_bias``, with a per-head RMSNorm on q and k and an
  explicit ``head_dim``; Yang et al. 2025, transformers' ``modeling_qwen3.py``; Phi-3, a Llama
  decoder with fused projections, ``FUSED_PROJ_ARCHS``; and Gemma 3's text models, ``GEMMA_ARCHS``,
  whose own config fields ``_gemma_hparams`` checks: activation, no logit soft-capping, layer
  types, query_pre_attn_scalar, the per-layer-type RoPE parameters);
- the tensor table, before any tensor data is read (``_check_table``): the layer count equals the
  blocks present, the vocab the embedding rows, every tensor has the shape the config implies
  (``_expected_shapes``; Qwen3's and Gemma 3's ``q_norm``/``k_norm`` are [head dim], Gemma 3 has
  ``pre_feedforward_layernorm``/``post_feedforward_layernorm`` [hidden] too, Phi-3's fused ``qkv_proj``
  [(heads + 2 KV heads) × head dim, hidden] and ``gate_up_proj`` [2 × intermediate, hidden]), none is missing or
  unsupported; after reading, every weight came out as the table said (``_check_weights``);
- the values: NaN/inf in float weights or in the fp16 block scales of Q8_0/Q4_1 tensors
  (``_nonfinite``), refused unless ``allow_nonfinite`` (then a warning: ``_report_nonfinite``);
- the tokenizer (``_check_tokenizer``): every token id it can produce and its special ids index a
  row of the embedding, and a test prompt encodes and decodes;
- third-party parsing: a JSON file (``_read_json``) or a transformers/tokenizers failure
  (``_foreign_errors``) that goes wrong becomes one ``ModelLoadError``.

Format-specific checks (the GGUF container and its metadata types, the safetensors index) live
with their loaders.

This module must never read tensor data beyond what it is given (a table of names, shapes and
types; weights a loader has already read; a tokenizer; the one JSON file it is handed), and never
allocate what the file does not justify: no loop or table sized by a header value that the tensors
present do not confirm (``_expected_shapes`` loops over the layer count only once ``_check_table``
has matched it against the blocks present).
"""
from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from ..config import logger
from ..errors import ModelLoadError

if TYPE_CHECKING:  # annotations only: loaded_model.py imports this module
    from .loaded_model import Weight

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma3_text")

# The GGUF (llama.cpp) name of an architecture where it differs from the transformers model_type:
# Gemma 3's text model is ``gemma3`` in GGUF files (transformers' GGUF loader maps it to gemma3_text).
GGUF_ARCH_NAMES = {"gemma3_text": "gemma3"}

# Architectures whose attention has a per-head RMSNorm on q and k (weights ``self_attn.q_norm`` and
# ``self_attn.k_norm``, shape [head_dim], applied after the projection and before RoPE): Qwen3
# (Yang et al. 2025, the Qwen3 technical report; transformers' ``modeling_qwen3.py``) and Gemma 3.
QK_NORM_ARCHS = ("qwen3", "gemma3_text")

# Gemma 3 text models (Gemma Team 2025, the Gemma 3 technical report; transformers'
# ``modeling_gemma3.py``): a Llama-like decoder with "sandwich" norms (``post_attention_layernorm``
# normalises the attention output before its residual add, ``pre_feedforward_layernorm`` /
# ``post_feedforward_layernorm`` surround the MLP), RMSNorms that scale by ``1 + weight``, a GELU
# (tanh) gated MLP, embeddings scaled by sqrt(hidden), per-head q/k norms, attention scale
# ``query_pre_attn_scalar ** -0.5``, and per-layer sliding/full attention with two RoPE bases.
GEMMA_ARCHS = ("gemma3_text",)

# Architectures whose checkpoints fuse the attention and MLP input projections: Phi-3 (Abdin et al.
# 2024, the Phi-3 technical report; transformers' ``modeling_phi3.py``) is a Llama decoder whose
# ``self_attn.qkv_proj.weight`` [(heads + 2 KV heads) × head dim, hidden] holds q, then k, then v
# rows, and whose ``mlp.gate_up_proj.weight`` [2 × intermediate, hidden] holds the gate rows, then
# the up rows; no biases. The loaders check the fused tensors and then split them into the
# Llama names as row views (``loaded_model._split_fused``).
FUSED_PROJ_ARCHS = ("phi3",)


def _check_arch(model_type: Any, origin: Any, gguf: bool = False) -> str:
    """``model_type`` if yirage supports it, as the transformers model_type; ``gguf``: it is a GGUF
    ``general.architecture`` (llama.cpp's names, ``GGUF_ARCH_NAMES``: ``gemma3`` is gemma3_text).
    Raises ModelLoadError naming it and the supported list."""
    names = {GGUF_ARCH_NAMES.get(a, a): a for a in SUPPORTED_ARCHS} if gguf else {a: a for a in SUPPORTED_ARCHS}
    if model_type not in names:
        hint = ""
        if model_type == "gemma3" and not gguf:
            hint = (" (Gemma 3's multimodal checkpoints, Gemma3ForConditionalGeneration; its text-only models, "
                    "model_type gemma3_text, are supported)")
        raise ModelLoadError(f"{origin}: architecture {_show(model_type)} is not supported{hint}; "
                             f"supported architectures: {', '.join(names)}")
    return names[model_type]


def _show(value: Any) -> str:
    """``repr(value)`` cut to 80 characters, for messages."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


#: the largest integer hyper-parameter accepted: sizes, ids and spans reach the kernels as 32-bit
#: values (a config's sliding_window of 10**30 once overflowed a C long long in LLM, fuzz seed 112826)
INT_FIELD_MAX = 2**31 - 1


def _int_field(origin: Any, name: str, value: Any, minimum: int = 1, optional: bool = False) -> int | None:
    """``value`` as an int in [``minimum``, ``INT_FIELD_MAX``]; None when absent and ``optional``."""
    if value is None:
        if optional:
            return None
        raise ModelLoadError(f"{origin}: {name} is missing")
    if not _is_int(value):
        raise ModelLoadError(f"{origin}: {name} = {_show(value)} must be an integer")
    value = int(value)
    if value < minimum:
        raise ModelLoadError(f"{origin}: {name} = {value} must be {'> 0' if minimum == 1 else f'>= {minimum}'}")
    if value > INT_FIELD_MAX:
        raise ModelLoadError(f"{origin}: {name} = {value} must be at most {INT_FIELD_MAX} (2**31 - 1); "
                             "fix the model's config")
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
    attribute): the rules of ``_hparams`` plus RoPE parameters, activation and special ids, and
    for Gemma 3 (``GEMMA_ARCHS``) the fields of ``_gemma_hparams``."""
    names = dict(_HF_NAMES)
    theta = get("rope_theta")
    gemma = get("model_type") in GEMMA_ARCHS
    for rope_name in ("rope_parameters", "rope_scaling"):  # transformers 5 / older configs
        rope = _check_rope_params(origin, rope_name, get(rope_name))
        if theta is None and rope.get("rope_theta") is not None:
            theta, names["theta"] = rope["rope_theta"], f"{rope_name}.rope_theta"
    act = get("hidden_act")
    if act is not None and act not in ("silu", "swish") and not gemma:  # Gemma reads hidden_activation
        raise ModelLoadError(f"{origin}: hidden_act = {_show(act)} is not supported; the MLP is SwiGLU (silu)")
    for key in ("bos_token_id", "eos_token_id"):
        ids = get(key)
        for i, v in enumerate(ids if isinstance(ids, (list, tuple)) else [ids]):
            if v is not None:
                _int_field(origin, key if not isinstance(ids, (list, tuple)) else f"{key}[{i}]", v, minimum=0)

    def lookup(key: str) -> Any:
        return theta if key == "theta" else get(_HF_NAMES[key])

    hp = _hparams(origin, names, lookup)
    if gemma:
        _gemma_hparams(origin, get, hp)
    return hp


GEMMA_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gemma_hparams(origin: Any, get: Callable[[str], Any], hp: _HParams) -> None:
    """The Gemma 3 fields of a transformers config (``Gemma3TextConfig``): ``hidden_activation``
    gelu_pytorch_tanh (the only MLP activation implemented for Gemma), no logit soft-capping
    (``attn_logit_softcapping`` / ``final_logit_softcapping`` null, as in every Gemma 3 config:
    soft-capping is Gemma 2's), causal attention (``use_bidirectional_attention`` false),
    ``query_pre_attn_scalar`` and ``rope_local_base_freq`` finite numbers > 0, ``layer_types`` one
    of 'sliding_attention' / 'full_attention' per layer (or ``sliding_window_pattern``, an integer
    >= 1, from which transformers derives them), ``sliding_window`` >= 1, and each per-layer-type
    entry of a nested ``rope_parameters``."""
    act = get("hidden_activation")
    if act is not None and act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{origin}: hidden_activation = {_show(act)} is not supported; Gemma 3's MLP is "
                             "gelu_pytorch_tanh (GELU, tanh approximation) gated")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(key) is not None:
            raise ModelLoadError(f"{origin}: {key} = {_show(get(key))} is not supported (logit soft-capping is "
                                 "Gemma 2's; Gemma 3 configs leave it null)")
    if get("use_bidirectional_attention"):
        raise ModelLoadError(f"{origin}: use_bidirectional_attention = {_show(get('use_bidirectional_attention'))} "
                             "is not supported (yirage decodes with causal attention)")
    _positive_float(origin, "query_pre_attn_scalar", get("query_pre_attn_scalar"), optional=True)
    _positive_float(origin, "rope_local_base_freq", get("rope_local_base_freq"), optional=True)
    _int_field(origin, "sliding_window_pattern", get("sliding_window_pattern"), optional=True)
    if hp.sliding is not None and hp.sliding < 1:
        raise ModelLoadError(f"{origin}: sliding_window = {hp.sliding} must be >= 1 (the span of the sliding "
                             "attention layers)")
    types = get("layer_types")
    if types is not None:
        if not isinstance(types, (list, tuple)) or len(types) != hp.layers:
            raise ModelLoadError(f"{origin}: layer_types must be a list of {hp.layers} entries (one per layer, "
                                 f"{hp.names['layers']} = {hp.layers}), got {_show(types)}")
        for i, kind in enumerate(types):
            if kind not in GEMMA_LAYER_TYPES:
                raise ModelLoadError(f"{origin}: layer_types[{i}] = {_show(kind)} must be one of "
                                     f"{', '.join(GEMMA_LAYER_TYPES)}")
    rope = get("rope_parameters")
    for kind in GEMMA_LAYER_TYPES:
        if isinstance(rope, dict) and rope.get(kind) is not None:
            _check_rope_params(origin, f"rope_parameters.{kind}", rope[kind])


@dataclass
class _TensorInfo:
    """A tensor of the file before its data is read: its name in the file, logical shape
    (``[out, in]``) and type label (``Q4_1``, ``F32``, ``BF16``...)."""

    name: str
    shape: tuple[int, ...]
    kind: str


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _expected_shapes(hp: _HParams, vocab: int, tied: bool, attention_bias: bool,
                     qk_norm: bool = False, fused: bool = False,
                     sandwich: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every weight name a supported model must have: (logical shape, which fields imply it).
    ``qk_norm``: the per-head q/k RMSNorm weights of Qwen3 and Gemma 3 ([head dim] each). ``fused``:
    Phi-3's ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` in place of q/k/v_proj and gate/up_proj.
    ``sandwich``: Gemma 3's ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` [hidden]
    as well. Loops over ``hp.layers``, which the caller has checked against the blocks present."""
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
        if fused:
            for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                del shapes[p + part + ".weight"]
            shapes[p + "self_attn.qkv_proj.weight"] = (
                ((heads + 2 * kv) * hd, h),
                f"({n['heads']} = {heads} + 2 × {n.get('kv_heads', n['heads'])} = {kv}) × head dim {hd}; {hid}")
            shapes[p + "mlp.gate_up_proj.weight"] = ((2 * inter, h), f"2 × {n['intermediate']} = {inter}; {hid}")
        if attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": ((heads * hd,), q_why),
                           p + "self_attn.k_proj.bias": ((kv * hd,), kv_why),
                           p + "self_attn.v_proj.bias": ((kv * hd,), kv_why)})
        if sandwich:
            shapes.update({p + "pre_feedforward_layernorm.weight": ((h,), hid),
                           p + "post_feedforward_layernorm.weight": ((h,), hid)})
        if qk_norm:
            hd_why = f"head dim {hd} ({n.get('head_dim') or n['hidden'] + ' / ' + n['heads']})"
            shapes.update({p + "self_attn.q_norm.weight": ((hd,), hd_why),
                           p + "self_attn.k_norm.weight": ((hd,), hd_why)})
    return shapes


def _check_table(origin: Any, hp: _HParams, table: dict[str, _TensorInfo], tie: bool | None,
                 display: Callable[[str], str], arch: str | None = None,
                 attention_bias: bool | None = None) -> tuple[int, bool]:
    """Check the tensor table (HF name -> info, data not read yet) against ``hp``; (vocab, tied).

    ``tie``: the config's tie_word_embeddings (None: unknown yet). ``display`` names a tensor as
    the file does. ``arch``: the checked architecture; Qwen3 and Gemma 3 (``QK_NORM_ARCHS``) must have the
    per-head ``self_attn.q_norm``/``k_norm`` weights [head dim], the others must not; Phi-3
    (``FUSED_PROJ_ARCHS``) must have the fused ``self_attn.qkv_proj``/``mlp.gate_up_proj`` weights
    and no separate q/k/v or gate/up projections and no biases; Gemma 3 (``GEMMA_ARCHS``) must have
    the feed-forward pre/post norms, the others must not. ``attention_bias``:
    the config's flag; for Qwen3 it must be false (true adds an o_proj bias, which is not supported)
    and then there must be no q/k/v biases (None: unknown, and for the other architectures, whose
    configs may not say: the table decides whether q/k/v biases are expected). The layer
    count must equal the blocks present before anything loops over it.
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
    qk_norm = arch in QK_NORM_ARCHS
    fused = arch in FUSED_PROJ_ARCHS
    bias = "model.layers.0.self_attn.q_proj.bias" in table and not fused
    if qk_norm and attention_bias is not None:
        if not isinstance(attention_bias, bool):
            raise ModelLoadError(f"{origin}: attention_bias = {_show(attention_bias)} must be true or false")
        if attention_bias:  # transformers' Qwen3Attention then biases o_proj too
            raise ModelLoadError(f"{origin}: attention_bias = true is not supported for {arch} (it adds a bias to "
                                 "o_proj as well as q/k/v; yirage supports q/k/v biases only)")
        bias = False
    expected = _expected_shapes(hp, vocab, tied, bias, qk_norm, fused, sandwich=arch in GEMMA_ARCHS)
    extra = sorted(k for k in set(table) - set(expected) if not (k == "lm_head.weight" and tied))
    if extra:
        shown = sorted(display(k) for k in extra)
        listed = f"{shown[:4]}{' ...' if len(shown) > 4 else ''}"
        if any(k.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")) for k in extra):
            why = (f"per-head q/k norms belong to {', '.join(QK_NORM_ARCHS)}, not to architecture "
                   f"{_show(arch)}" if arch is not None else "per-head q/k norms are not expected here")
        elif qk_norm and not bias and any(re.search(r"self_attn\.[qkv]_proj\.bias$", k) for k in extra):
            why = "the config says attention_bias = false, so there must be no q/k/v biases"
        elif any(k.endswith(("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"))
                 for k in extra):
            why = (f"feed-forward pre/post norms belong to {', '.join(GEMMA_ARCHS)}, not to architecture "
                   f"{_show(arch)}")
        elif fused:
            why = (f"architecture {arch} has fused self_attn.qkv_proj and mlp.gate_up_proj weights and no biases, "
                   "not separate q/k/v or gate/up projections")
        else:
            why = "yirage supports q/k/v biases only, no o_proj/MLP biases"
        raise ModelLoadError(f"{origin}: unsupported tensors {listed} ({why})")
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
    (``torch.isfinite``). Block-quantized types: the fp16 block scales (``d``, and ``m`` / ``dmin``
    where the format has one; ``DType.scale_offsets``), read from the raw blocks as 16-bit patterns
    (exponent all ones = inf/NaN); the integer quants themselves cannot be non-finite. The scale check runs in numpy: single-threaded, it takes ~25 ms for the
    default model's 92 MiB, where torch's thread pool measured anywhere from 30 ms to 1.5 s on a
    busy 2-core machine."""
    data = weight.data
    if not weight.dtype.is_quantized:
        return None if bool(torch.isfinite(data).all()) else "NaN or inf values"
    per, nbytes = weight.dtype.block
    offsets = [o // 2 for o in weight.dtype.scale_offsets]   # every format's scales lie at even offsets
    halves = data.numpy().reshape(-1).view(np.uint16).reshape(-1, nbytes // 2)[:, offsets]
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
    ``tokenizer``: yirage's ``tokenizer.Tokenizer`` or a transformers tokenizer (both have
    ``get_vocab``, ``__len__``, ``added_tokens_decoder``, ``encode``, ``decode``; yirage's also
    ``id_range``, the smallest and largest id, which spares listing the vocabulary when both are
    inside the table).
    ``tolerated(id)``: ids past the table that are only logged: tokens transformers adds that the
    model's files do not have (the GGUF tokenizer conversion and some tokenizer classes add a
    default ``<|endoftext|>``)."""
    known = getattr(tokenizer, "id_range", None)  # yirage's Tokenizer: recorded at conversion
    try:
        size = len(tokenizer)
        if known is not None and 0 <= known[0] and known[1] < rows:
            vocab, added = {}, {}  # every id is inside the table: nothing to list
        else:
            vocab = tokenizer.get_vocab()
            added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    except Exception as exc:  # a tokenizer object that cannot list its vocabulary
        raise ModelLoadError(f"{origin}: cannot read the tokenizer's vocabulary ({exc})") from exc
    values = list(vocab.values()) + [int(i) for i in added]
    if values and (min(values) < 0 or max(values) >= rows):
        ids = dict(vocab)
        for token_id, token in added.items():
            ids.setdefault(str(getattr(token, "content", token)), int(token_id))
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
        encoded = list(tokenizer.encode(_TOKENIZER_PROBE, add_special_tokens=True))
        tokenizer.decode(encoded)
    if any(not 0 <= int(i) < rows and not tolerated(int(i)) for i in encoded):
        raise ModelLoadError(f"{origin}: the tokenizer encodes a test prompt to ids {encoded} outside the {rows} rows "
                             f"of {embed_name}")


_TOKENIZER_PROBE = "Hello, world! w5 hi 123 naïve 日本語 🙂\n\t<|unknown|>"


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
