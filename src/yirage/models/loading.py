"""Read a decoder-only LLM (Llama, Qwen2, Mistral) from a GGUF file or a safetensors checkpoint.

``load_model(spec)`` resolves ``spec`` (``registry.resolve_model``) and returns a ``LoadedModel``:
a ``ModelConfig``, the weights as ``Weight`` records under their Hugging Face names, and a
transformers tokenizer with its chat template. Both formats come out in the same layout:

- projections are ``[out_features, in_features]`` (``torch.nn.functional.linear`` convention);
- q/k projections are in Hugging Face order for ``rotate_half`` RoPE (llama.cpp's interleaving
  permutation of GGUF ``attn_q``/``attn_k`` rows is undone);
- GGUF ``Q8_0``/``Q4_1`` tensors stay block-quantized: raw block bytes in a ``uint8`` tensor of
  shape ``dtype.storage_shape(logical_shape)`` (see ``yirage.dtypes``). F32/F16/BF16 stay as they
  are; other GGUF quant types are dequantized to float32. Safetensors float tensors keep their dtype.

RoPE frequencies are computed by transformers' own RoPE init functions from the transformers
config, so every RoPE scaling type transformers supports comes out right.

This module only reads files. It must never build compute graphs, run a model, pick a backend or
move tensors off the CPU: that is ``models/llama.py``'s and the runtime's work.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..config import cache_dir, logger
from ..dtypes import DType, as_dtype
from ..errors import ModelLoadError
from .registry import ModelFormat, resolve_model

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
_ROTARY_CLASS = {"llama": "LlamaRotaryEmbedding", "qwen2": "Qwen2RotaryEmbedding",
                 "mistral": "MistralRotaryEmbedding"}


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, in Hugging Face terms.

    ``inv_freq`` is float32 of shape ``[head_dim // 2]`` and ``attention_scaling`` the factor
    transformers applies to cos/sin (1.0 except for yarn/longrope), both from transformers' RoPE
    init function for ``rope_type``. ``eos_token_ids`` is every id that ends generation, de-duplicated.
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


def load_model(spec: str, progress: bool = True) -> LoadedModel:
    """Load the model named by ``spec``: a short name, a ``.gguf`` file, a Hugging Face directory or
    a hub id (see ``registry.resolve_model``). ``progress`` shows a bar on stderr while reading tensors.

    Weight names: ``model.embed_tokens.weight``, ``model.layers.{i}.input_layernorm.weight``,
    ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.{i}.self_attn.{q,k,v}_proj.bias``
    (when ``config.attention_bias``), ``model.layers.{i}.post_attention_layernorm.weight``,
    ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.norm.weight`` and
    ``lm_head.weight`` (only when embeddings are not tied).

    Raises ModelLoadError: spec not found (see ``resolve_model``), not a valid/complete GGUF file,
    unsupported architecture (supported: llama, qwen2, mistral), missing or mis-shaped tensors,
    tensor types or biases yirage does not support, tokenizer that cannot be loaded.
    """
    resolved = resolve_model(spec)
    if resolved.format == "gguf":
        model = _load_gguf(resolved.path, progress)
    else:
        model = _load_safetensors(resolved.path, progress)
    model.name = resolved.name
    return model


# ----------------------------------------------------------------------------------------------
# shared: config, RoPE, checks


def _check_arch(model_type: str | None, origin: Path) -> str:
    if model_type not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{origin}: architecture {model_type!r} is not supported; "
                             f"supported architectures: {', '.join(SUPPORTED_ARCHS)}")
    return model_type


def rope_parameters(hf_config: Any) -> tuple[torch.Tensor, float, str]:
    """(inv_freq float32 [head_dim // 2], attention_scaling, rope_type) from transformers' RoPE init.

    ``default`` uses the model's ``RotaryEmbedding.compute_default_rope_parameters``; every other
    type uses ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type]``. For ``dynamic``
    this is the initial (unscaled-length) table, as in transformers before its first update.
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
        raise ModelLoadError(f"RoPE type {rope_type!r} is not supported by this transformers version; "
                             f"supported: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    inv_freq, attention_scaling = init(hf_config)  # called as the model's RotaryEmbedding does
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
                  eos_token_ids: list[int]) -> ModelConfig:
    arch = hf_config.model_type
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    inv_freq, attention_scaling, rope_type = rope_parameters(hf_config)
    if tuple(inv_freq.shape) != (head_dim // 2,):
        raise ModelLoadError(f"RoPE table has shape {tuple(inv_freq.shape)}, expected ({head_dim // 2},): "
                             "partial rotary embeddings are not supported")
    sliding = getattr(hf_config, "sliding_window", None)
    if arch == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
        sliding = None
    return ModelConfig(
        arch=arch,
        vocab_size=int(hf_config.vocab_size),
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


def _expected_shapes(cfg: Any, tied: bool, attention_bias: bool) -> dict[str, tuple[int, ...]]:
    """Every weight name a supported model must have, with its logical shape."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
            p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                           p + "self_attn.v_proj.bias": (kv * hd,)})
    return shapes


def _check_weights(weights: dict[str, Weight], hf_config: Any, origin: Path) -> dict[str, Weight]:
    """Drop a tied ``lm_head``, then check names and shapes; ModelLoadError on anything off."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) or "lm_head.weight" not in weights
    if tied and "lm_head.weight" in weights:
        del weights["lm_head.weight"]
    if not getattr(hf_config, "tie_word_embeddings", True) and tied:
        raise ModelLoadError(f"{origin}: config says embeddings are not tied but there is no lm_head weight")
    attention_bias = "model.layers.0.self_attn.q_proj.bias" in weights
    expected = _expected_shapes(hf_config, tied, attention_bias)
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ModelLoadError(f"{origin}: unsupported tensors {extra[:4]}{' ...' if len(extra) > 4 else ''} "
                             "(yirage supports q/k/v biases only, no o_proj/MLP biases)")
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ModelLoadError(f"{origin}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for name, shape in expected.items():
        if weights[name].shape != shape:
            raise ModelLoadError(f"{origin}: tensor {name} has shape {weights[name].shape}, "
                                 f"the config implies {shape}")
    return weights


@contextmanager
def _progress_bar(enabled: bool, total: int, description: str) -> Iterator[Any]:
    """A rich progress bar on stderr; yields ``advance()``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), disable=not enabled, transient=True) as bar:
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


def gguf_to_hf_name(name: str) -> str | None:
    """Hugging Face name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for tensors yirage does not use."""
    m = _GGUF_BLOCK_NAME.match(name)
    if m:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_GGUF_BLOCK[part]}.{kind}" if part in _GGUF_BLOCK else None
    stem, _, kind = name.rpartition(".")
    return f"{_GGUF_TOP[stem]}.{kind}" if stem in _GGUF_TOP and kind in ("weight", "bias") else None


def reverse_llama_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k rows (interleaved RoPE pairs -> rotate_half halves).

    Works on dim 0 only, so it applies unchanged to quantized storage (each row holds its own
    blocks) and to 1-D biases. Same as transformers' ``LlamaTensorProcessor._reverse_permute_weights``.
    """
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def _open_gguf(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # bad magic, truncated data, corrupt header: numpy/struct/value errors
        reason = (str(exc).strip().splitlines() or [""])[0] or type(exc).__name__
        raise ModelLoadError(f"{path} is not a valid or complete GGUF file ({reason})") from exc


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _gguf_hf_config(reader: Any, path: Path) -> Any:
    """The transformers config of a GGUF file, from transformers' own GGUF metadata reader.

    That reader parses the whole file a second time (about 2.5 s for the default model), so
    the result is cached as ``cache_dir()/gguf-config/<hash of path, size, mtime>.json``.
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
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported; "
                             f"supported architectures: {', '.join(SUPPORTED_ARCHS)}") from exc
    model_type = _check_arch(config.pop("model_type", arch), path)
    config.pop("_model_name_or_path", None)
    scaling = _gguf_field(reader, f"{arch}.rope.scaling.type")
    factor = _gguf_field(reader, f"{arch}.rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor and float(factor) != 1.0:
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(factor)}
        original = _gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
        if scaling == "yarn" and original:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)
    return AutoConfig.for_model(model_type, **config)


def _gguf_tensor(tensor: Any) -> Weight:
    """A GGUF tensor as a Weight: Q8_0/Q4_1 raw blocks, F32/F16/BF16 as is, others dequantized."""
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


def _read_gguf_weights(reader: Any, hf_config: Any, permute_qk: bool, progress: bool,
                       path: Path) -> tuple[dict[str, Weight], np.ndarray | None]:
    """Weights under HF names (q/k rows un-permuted when ``permute_qk``) and llama.cpp's
    ``rope_freqs`` factors when the file has them."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    weights: dict[str, Weight] = {}
    rope_freqs = None
    with _progress_bar(progress, len(reader.tensors), f"reading {path.name}") as advance:
        for tensor in reader.tensors:
            name = gguf_to_hf_name(tensor.name)
            if tensor.name == "rope_freqs.weight":
                rope_freqs = np.array(tensor.data, dtype=np.float32)
            elif name is None:
                logger.debug("skipping GGUF tensor %s", tensor.name)
            else:
                weight = _gguf_tensor(tensor)
                if permute_qk and (".q_proj." in name or ".k_proj." in name):
                    n = heads if ".q_proj." in name else kv_heads
                    rows = reverse_llama_permute(weight.data.numpy(), n)
                    weight = Weight(torch.from_numpy(np.ascontiguousarray(rows)), weight.dtype, weight.shape)
                weights[name] = weight
            advance()
    return weights, rope_freqs


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
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot build the tokenizer from the GGUF metadata ({exc})") from exc
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, cached)
    except OSError as exc:  # another process got there first, or the cache is read-only
        logger.debug("tokenizer cache not written: %s", exc)
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def _load_gguf(path: Path, progress: bool) -> LoadedModel:
    reader = _open_gguf(path)
    hf_config = _gguf_hf_config(reader, path)
    permute_qk = _gguf_field(reader, "general.architecture") == "llama"  # llama.cpp permutes llama only
    weights, rope_freqs = _read_gguf_weights(reader, hf_config, permute_qk, progress, path)
    weights = _check_weights(weights, hf_config, path)
    tokenizer = _gguf_tokenizer(path)
    eos = (_as_id_list(hf_config.eos_token_id) + _as_id_list(_gguf_field(reader, "tokenizer.ggml.eos_token_id"))
           + _as_id_list(_gguf_field(reader, "tokenizer.ggml.eot_token_id"))
           + _as_id_list(_gguf_field(reader, "tokenizer.ggml.eom_token_id")) + _as_id_list(tokenizer.eos_token_id))
    bos = hf_config.bos_token_id if hf_config.bos_token_id is not None else tokenizer.bos_token_id
    config = _model_config(hf_config, weights, bos, eos)
    if rope_freqs is not None:  # llama.cpp's per-frequency divisors (e.g. Llama 3.1 files)
        config.inv_freq = config.inv_freq / torch.from_numpy(rope_freqs.reshape(-1)[: config.inv_freq.numel()])
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=path, format="gguf")


# ----------------------------------------------------------------------------------------------
# safetensors (Hugging Face directory)


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / s for s in shards]
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    return sorted(p for p in directory.glob("*.safetensors") if not p.name.startswith("consolidated"))


def _hf_name(name: str) -> str:
    """Names saved from the bare base model (``layers.0...``) get the ``model.`` prefix."""
    if name.startswith(("layers.", "embed_tokens.", "norm.")):
        return "model." + name
    return name


def _read_safetensors(directory: Path, progress: bool) -> dict[str, Weight]:
    from safetensors import safe_open

    files = _safetensors_files(directory)
    handles = []
    try:
        for f in files:
            handles.append(safe_open(str(f), framework="pt"))
    except Exception as exc:
        raise ModelLoadError(f"{directory}: cannot read safetensors file ({exc})") from exc
    weights: dict[str, Weight] = {}
    total = sum(len(list(h.keys())) for h in handles)
    with _progress_bar(progress, total, f"reading {directory.name}") as advance:
        for handle in handles:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    if "rotary_emb.inv_freq" in key:
                        advance()
                        continue
                    raise ModelLoadError(f"{directory}: tensor {key} has dtype {tensor.dtype}; only float32, "
                                         "float16 and bfloat16 checkpoints are supported")
                if "rotary_emb.inv_freq" not in key:
                    weights[_hf_name(key)] = Weight(tensor.contiguous(), as_dtype(tensor.dtype), tuple(tensor.shape))
                advance()
    return weights


def _load_safetensors(directory: Path, progress: bool) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(directory))
    except Exception as exc:
        raise ModelLoadError(f"{directory}: cannot read config.json ({exc})") from exc
    _check_arch(getattr(hf_config, "model_type", None), directory)
    weights = _check_weights(_read_safetensors(directory, progress), hf_config, directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:
        raise ModelLoadError(f"{directory}: cannot load the tokenizer ({exc})") from exc
    eos: list[int] = []
    if (directory / "generation_config.json").is_file():
        try:
            eos += _as_id_list(GenerationConfig.from_pretrained(str(directory)).eos_token_id)
        except Exception as exc:
            logger.warning("ignoring unreadable generation_config.json in %s (%s)", directory, exc)
    eos += _as_id_list(getattr(hf_config, "eos_token_id", None)) + _as_id_list(tokenizer.eos_token_id)
    bos = getattr(hf_config, "bos_token_id", None)
    config = _model_config(hf_config, weights, bos if bos is not None else tokenizer.bos_token_id, eos)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=directory, format="safetensors")
