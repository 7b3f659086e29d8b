"""What ``load_model`` returns, and what both loaders build it with.

``LoadedModel`` holds a ``ModelConfig``, the weights as ``Weight`` records under their Hugging Face
names, and the tokenizer. ``_model_config`` turns the fields of a transformers config
(``config_fields``, already checked by ``checks.py``) and a RoPE table into a ``ModelConfig``; the
RoPE table (``rope_parameters``) comes from transformers' own RoPE init functions applied to the
transformers config (``rope_parameters``/``rope_scaling``), so every RoPE scaling type transformers
supports comes out right; a loader may hand in a table it cached (GGUF files do), which is checked
the same way. Gemma 3 configs hold one RoPE entry per layer type: ``rope_parameters(config,
layer_type)`` gives each (``_local_rope_table``: the sliding layers'), and ``_gemma_fields`` the
``ModelConfig`` fields only Gemma sets. ``_split_fused`` turns Phi-3's fused projections into the
Llama names (row views, no copy). ``_progress_bar`` shows the loaders' tensor reading on stderr.

This module never opens a model file (``gguf_file.py`` and ``safetensors_dir.py`` do), and never
builds compute graphs, runs a model, picks a backend or moves tensors off the CPU; it imports
transformers only in ``rope_parameters``.
"""
from __future__ import annotations

import importlib
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from ..dtypes import DType
from ..errors import ModelLoadError
from .checks import GEMMA_ARCHS, _show
from .registry import ModelFormat

_ROTARY_CLASS = {"llama": "LlamaRotaryEmbedding", "qwen2": "Qwen2RotaryEmbedding",
                 "mistral": "MistralRotaryEmbedding", "qwen3": "Qwen3RotaryEmbedding",
                 "phi3": "Phi3RotaryEmbedding", "gemma3_text": "Gemma3RotaryEmbedding"}
# the transformers.models package of a model_type, where the two differ
_MODEL_PACKAGE = {"gemma3_text": "gemma3"}
# the layer types of configs whose ``rope_parameters`` hold one entry per layer type (Gemma 3)
_ROPE_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, in Hugging Face terms.

    ``inv_freq`` is float32 of shape ``[head_dim // 2]`` and ``attention_scaling`` the factor
    transformers applies to cos/sin (1.0 except for yarn/longrope), both from transformers' RoPE
    init function for ``rope_type``. ``eos_token_ids`` is every id that ends generation, de-duplicated.
    Every size here is validated against the weights (``vocab_size`` is the embedding's row count,
    and every token id the tokenizer produces is below it). ``hf_config``: the fields of the
    transformers config it was built from (``config_fields``: name -> JSON value).
    ``head_dim`` is the config's ``head_dim`` when it gives one (Qwen3's may differ from
    ``hidden_size // num_heads``), else ``hidden_size // num_heads``. ``qk_norm``: the attention has
    a per-head RMSNorm on q and k after the projections, before RoPE (Qwen3: weights
    ``self_attn.q_norm``/``k_norm`` [head_dim], eps ``rms_norm_eps``; Yang et al. 2025, transformers'
    ``modeling_qwen3.py``).

    Gemma 3 (``arch`` gemma3_text; Gemma Team 2025, the Gemma 3 technical report; transformers'
    ``modeling_gemma3.py``) sets the fields after ``sliding_window``: ``layer_types`` (one of
    'sliding_attention' / 'full_attention' per layer; empty when the config has none), the RoPE
    table of the sliding layers ``local_inv_freq`` [head_dim // 2] float32 (base
    ``rope_local_base_freq``) and ``local_attention_scaling`` (``inv_freq`` is then the full
    layers' table, base ``rope_theta`` with their ``rope_scaling``), ``embed_scale`` (the embedding
    output is multiplied by sqrt(hidden_size); None: no scaling), ``hidden_act``
    ('gelu_pytorch_tanh': MLP ``down(gelu_tanh(gate(x)) * up(x))``; 'silu' for the others),
    ``norm_weight_offset`` (1.0: every RMSNorm, q/k norms included, scales by ``1 + weight``; the
    weights here are the checkpoint's ``weight``), ``sandwich_norms`` (``post_attention_layernorm``
    normalises the attention output before its residual add, ``pre_feedforward_layernorm`` the MLP
    input and ``post_feedforward_layernorm`` the MLP output before its residual add) and
    ``attention_scale`` (``query_pre_attn_scalar ** -0.5``; None: ``head_dim ** -0.5``).
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
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    local_inv_freq: torch.Tensor | None = field(default=None, repr=False)
    local_attention_scaling: float = 1.0
    embed_scale: float | None = None
    hidden_act: str = "silu"
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    attention_scale: float | None = None
    hf_config: dict = field(default_factory=dict, repr=False)


@dataclass
class Weight:
    """One parameter: ``data`` is its storage (``uint8`` of ``dtype.storage_shape(shape)`` when
    ``dtype`` is quantized), ``shape`` its logical shape (``[out, in]`` for projections)."""

    data: torch.Tensor
    dtype: DType
    shape: tuple[int, ...]


@dataclass
class LoadedModel:
    """A model read from disk: config, weights keyed by Hugging Face name, tokenizer (yirage's
    ``tokenizer.Tokenizer``; transformers' own tokenizer in the rare case that it does not convert
    exactly, see ``Tokenizer.from_transformers``)."""

    config: ModelConfig
    weights: dict[str, Weight] = field(repr=False)
    tokenizer: Any = field(repr=False)
    path: Path
    format: ModelFormat
    name: str = ""


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> tuple[torch.Tensor, float, str]:
    """(inv_freq float32 [head_dim // 2], attention_scaling, rope_type) from transformers' RoPE init.

    ``default`` uses the model's ``RotaryEmbedding.compute_default_rope_parameters``; every other
    type uses ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type]``. For ``dynamic``
    this is the initial (unscaled-length) table, as in transformers before its first update.

    ``layer_type``: for configs whose ``rope_parameters`` hold one entry per layer type (Gemma 3:
    'full_attention', base ``rope_theta`` and any ``rope_scaling``; 'sliding_attention', base
    ``rope_local_base_freq``) the table of that type (default 'full_attention'), computed as
    transformers' ``Gemma3RotaryEmbedding`` does (the init function called with ``layer_type``);
    ignored for the other configs.

    Raises ModelLoadError: unknown RoPE type, or the init function fails on the parameters.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    kwargs = {}
    if isinstance(params, dict) and any(isinstance(params.get(k), dict) for k in _ROPE_LAYER_TYPES):
        layer_type = layer_type or "full_attention"
        params, kwargs = params.get(layer_type) or {}, {"layer_type": layer_type}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        package = _MODEL_PACKAGE.get(hf_config.model_type, hf_config.model_type)
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
        rotary = getattr(module, _ROTARY_CLASS[hf_config.model_type])
        init = getattr(rotary, "compute_default_rope_parameters", None) or ROPE_INIT_FUNCTIONS["default"]
    elif rope_type in ROPE_INIT_FUNCTIONS:
        init = ROPE_INIT_FUNCTIONS[rope_type]
    else:
        raise ModelLoadError(f"RoPE type {_show(rope_type)} is not supported by this transformers version; "
                             f"supported: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    try:
        inv_freq, attention_scaling = init(hf_config, **kwargs)  # called as the model's RotaryEmbedding does
    except (ArithmeticError, ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"RoPE parameters {_show(params)} are not valid for rope_type {_show(rope_type)} "
                             f"({exc})") from exc
    return inv_freq.to(torch.float32).contiguous(), float(attention_scaling), rope_type


def _split_fused(weights: dict[str, Weight], num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate: int) -> dict[str, Weight]:
    """Replace Phi-3's fused projections by the Llama names, in place; returns ``weights``.

    Phi-3 (Abdin et al. 2024, the Phi-3 technical report; transformers' ``modeling_phi3.py``) stores
    ``self_attn.qkv_proj.weight`` [(heads + 2 KV heads) × head dim, hidden] (q rows, then k, then v:
    ``Phi3Attention`` slices its output that way) and ``mlp.gate_up_proj.weight`` [2 × intermediate,
    hidden] (gate rows, then up: ``Phi3MLP`` chunks its output in two). Each becomes
    ``self_attn.q_proj/k_proj/v_proj.weight`` and ``mlp.gate_proj/up_proj.weight`` as row slices of
    the fused storage: views, nothing is copied (a block-quantized weight's storage is ``uint8``
    [rows, bytes per row], so a row slice is a view there too). The shapes were checked
    (``checks._check_table``) before this is called.
    """
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    for name in [k for k in weights if k.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"))]:
        fused = weights.pop(name)
        stem = name[: -len("qkv_proj.weight" if name.endswith("qkv_proj.weight") else "gate_up_proj.weight")]
        if name.endswith("qkv_proj.weight"):
            parts = (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv))
        else:
            parts = (("gate_proj", 0, intermediate), ("up_proj", intermediate, 2 * intermediate))
        for part, start, stop in parts:
            weights[f"{stem}{part}.weight"] = Weight(fused.data[start:stop], fused.dtype,
                                                     (stop - start, *fused.shape[1:]))
    return weights


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def _dedupe(ids: list[int]) -> list[int]:
    return list(dict.fromkeys(ids))


# the transformers config attributes yirage reads (checks._hf_hparams and _model_config)
CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                 "rope_theta", "rope_parameters", "rope_scaling", "sliding_window", "use_sliding_window",
                 "hidden_act", "bos_token_id", "eos_token_id", "tie_word_embeddings", "attention_bias",
                 # Gemma 3 (checks._gemma_hparams)
                 "layer_types", "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
                 "final_logit_softcapping", "use_bidirectional_attention", "rope_local_base_freq",
                 "sliding_window_pattern")


def config_fields(hf_config: Any) -> dict[str, Any]:
    """The attributes of a transformers config that yirage reads (``CONFIG_FIELDS``), as
    ``getattr(hf_config, name, None)`` gives them: what ``checks._hf_hparams`` checks and
    ``_model_config`` uses, and what a GGUF loader caches (JSON values)."""
    return {name: getattr(hf_config, name, None) for name in CONFIG_FIELDS}


def _rope_table(hf_config: Any, origin: Any, layer_type: str | None = None) -> tuple[torch.Tensor, float, str]:
    """``rope_parameters(hf_config, layer_type)`` with errors naming ``origin``."""
    try:
        return rope_parameters(hf_config, layer_type)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{origin}: {exc}") from exc


def _local_rope_table(hf_config: Any, origin: Any) -> tuple[torch.Tensor, float, str] | None:
    """The RoPE table of a Gemma 3 config's sliding layers (``rope_parameters(hf_config,
    'sliding_attention')``), or None for other architectures and configs without sliding layers."""
    if hf_config.model_type not in GEMMA_ARCHS or "sliding_attention" not in (getattr(hf_config, "layer_types", None)
                                                                             or ()):
        return None
    return _rope_table(hf_config, origin, "sliding_attention")


def _check_rope(inv_freq: torch.Tensor, attention_scaling: float, rope_type: str, head_dim: int,
                fields: dict[str, Any], origin: Any) -> None:
    """A RoPE table: shape [head_dim // 2] (no partial rotary), finite frequencies and scaling > 0."""
    if tuple(inv_freq.shape) != (head_dim // 2,):
        raise ModelLoadError(f"{origin}: RoPE table has shape {tuple(inv_freq.shape)}, expected ({head_dim // 2},): "
                             "partial rotary embeddings are not supported")
    if not (bool(torch.isfinite(inv_freq).all()) and bool((inv_freq > 0).all())):
        raise ModelLoadError(f"{origin}: the RoPE parameters give non-finite or non-positive frequencies "
                             f"({rope_type}: {fields.get('rope_parameters')})")
    if not (math.isfinite(attention_scaling) and attention_scaling > 0):
        raise ModelLoadError(f"{origin}: the RoPE parameters give attention scaling {attention_scaling}, "
                             "which must be finite and > 0")


def _gemma_fields(fields: dict[str, Any], local_rope: tuple[torch.Tensor, float, str] | None, head_dim: int,
                  origin: Any) -> dict[str, Any]:
    """The Gemma 3 fields of a ``ModelConfig`` (see its doc) from checked config ``fields``
    (``checks._gemma_hparams``) and the sliding layers' RoPE table ``local_rope``.
    Raises ModelLoadError: a sliding layer without its RoPE table, or a bad table."""
    layer_types = tuple(fields.get("layer_types") or ())
    extra: dict[str, Any] = {
        "layer_types": layer_types, "embed_scale": float(fields["hidden_size"]) ** 0.5,
        "hidden_act": fields.get("hidden_activation") or "gelu_pytorch_tanh", "norm_weight_offset": 1.0,
        "sandwich_norms": True, "attention_scale": float(fields.get("query_pre_attn_scalar") or 256) ** -0.5}
    if "sliding_attention" in layer_types:
        if local_rope is None:
            raise ModelLoadError(f"{origin}: the sliding attention layers need their RoPE table (rope_local_base_freq)")
        _check_rope(*local_rope, head_dim, fields, origin)
        extra["local_inv_freq"], extra["local_attention_scaling"] = local_rope[0], float(local_rope[1])
    return extra


def _model_config(fields: dict[str, Any], rope: tuple[torch.Tensor, float, str], weights: dict[str, Weight],
                  bos_token_id: int | None, eos_token_ids: list[int], origin: Any,
                  local_rope: tuple[torch.Tensor, float, str] | None = None) -> ModelConfig:
    """The ``ModelConfig`` of checked config ``fields`` (``config_fields``) and the RoPE table
    ``rope`` = (inv_freq, attention_scaling, rope_type) of ``rope_parameters`` or a cache; for
    Gemma 3, ``local_rope`` is the table of the sliding layers (``rope`` the full layers').

    Raises ModelLoadError: the RoPE table has the wrong shape (partial rotary), non-finite or
    non-positive frequencies or scaling; a special id is outside the embedding rows.
    """
    arch = fields["model_type"]
    num_heads = fields["num_attention_heads"]
    head_dim = fields.get("head_dim") or fields["hidden_size"] // num_heads
    inv_freq, attention_scaling, rope_type = rope
    if arch == "phi3" and rope_type != "default":
        # longrope (Phi-3 "su"/"yarn" configs): transformers switches from the short to the long
        # factors once the sequence passes original_max_position_embeddings; one fixed table cannot
        raise ModelLoadError(f"{origin}: RoPE type {_show(rope_type)} is not supported for phi3 (only the default "
                             "RoPE: longrope switches frequency tables with the sequence length)")
    _check_rope(inv_freq, attention_scaling, rope_type, head_dim, fields, origin)
    vocab = int(fields["vocab_size"])
    for what, ids in (("bos_token_id", _as_id_list(bos_token_id)), ("eos_token_id", eos_token_ids)):
        for token in ids:
            if not 0 <= token < vocab:
                raise ModelLoadError(f"{origin}: {what} = {token} must be in [0, {vocab}): the embedding "
                                     f"has {vocab} rows")
    sliding = fields.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not fields.get("use_sliding_window"):
        sliding = None
    gemma = _gemma_fields(fields, local_rope, int(head_dim), origin) if arch in GEMMA_ARCHS else {}
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=int(fields["hidden_size"]),
        intermediate_size=int(fields["intermediate_size"]),
        num_layers=int(fields["num_hidden_layers"]),
        num_heads=int(num_heads),
        num_kv_heads=int(fields.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(fields["rms_norm_eps"]),
        max_position_embeddings=int(fields["max_position_embeddings"]),
        tie_word_embeddings="lm_head.weight" not in weights,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in weights,
        bos_token_id=bos_token_id,
        eos_token_ids=_dedupe(eos_token_ids),
        inv_freq=inv_freq,
        attention_scaling=attention_scaling,
        rope_type=rope_type,
        sliding_window=int(sliding) if sliding else None,
        hf_config=dict(fields),
        **gemma,
    )


@contextmanager
def _progress_bar(enabled: bool, total: int, description: str) -> Iterator[Any]:
    """A rich progress bar on stderr (only when stderr is a terminal); yields ``advance()``.
    Disabled, it does not import rich."""
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not (enabled and console.is_terminal), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)
