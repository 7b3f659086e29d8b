"""Read a Hugging Face model directory (``config.json``, safetensors weights, tokenizer files) into
a ``LoadedModel``: ``_load_safetensors``, which ``load_model`` calls for a directory or hub id.

``config.json`` is checked (``checks._hf_hparams``) before and after transformers reads it; the
safetensors headers (one file, or the shards ``model.safetensors.index.json`` names) give the tensor
table (``_safetensors_table``), checked before any tensor is read; float32/float16/bfloat16 tensors
keep their dtype, others are refused; names saved from the bare base model get the ``model.``
prefix; Phi-3's fused ``qkv_proj``/``gate_up_proj`` are checked as such and then split into the Llama
names as row views (``loaded_model._split_fused``). Gemma 3's norm weights are kept as the checkpoint
holds them (``weight``; scaled by ``1 + weight`` at run time: ``ModelConfig.norm_weight_offset``). The
token ids the tokenizer files define are checked against the embedding rows (``_hf_tokenizer_file_ids``). The tokenizer transformers loads is
handed out as yirage's ``tokenizer.Tokenizer`` when that is exactly the same tokenizer
(``Tokenizer.from_transformers``), so that GGUF and Hugging Face models have one tokenizer class;
otherwise transformers' own.

This module must never open a file outside the model's directory that a model file names (shards
named by the index go through ``registry.model_file``), and never read a tensor's data before the
table is checked.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import logger
from ..dtypes import as_dtype
from ..errors import ModelLoadError
from .checks import (FUSED_PROJ_ARCHS, QK_NORM_ARCHS, _TensorInfo, _check_arch, _check_table, _check_tokenizer,
                     _check_weights, _foreign_errors, _hf_hparams, _is_int, _nonfinite, _read_json, _report_nonfinite,
                     _show)
from .loaded_model import (LoadedModel, Weight, _as_id_list, _local_rope_table, _model_config, _progress_bar,
                           _rope_table, _split_fused, config_fields)
from .registry import model_file
from .tokenizer import Tokenizer


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
    arch = raw.get("model_type")
    _check_table(directory, hp, table, raw.get("tie_word_embeddings"), lambda n: n, arch=arch,
                 attention_bias=raw.get("attention_bias", False) if arch in QK_NORM_ARCHS else None)
    try:
        hf_config = AutoConfig.from_pretrained(str(directory))
    except Exception as exc:
        raise ModelLoadError(f"{directory}: cannot read config.json ({exc})") from exc
    fields = config_fields(hf_config)
    _check_arch(fields["model_type"], directory)
    hf_hp = _hf_hparams(f"{config_json} (as read by transformers)", fields.get)
    vocab, tied = _check_table(directory, hf_hp, table, fields["tie_word_embeddings"], lambda n: n,
                               arch=fields["model_type"], attention_bias=fields["attention_bias"])
    file_ids = _hf_tokenizer_file_ids(directory, vocab)
    weights = _read_safetensors(handles, table, progress, directory, allow_nonfinite)
    weights = _check_weights(weights, table, tied, directory)
    if fields["model_type"] in FUSED_PROJ_ARCHS:  # Phi-3: q/k/v and gate/up as row views of the fused weights
        _split_fused(weights, hf_hp.heads, hf_hp.kv_heads, hf_hp.head_dim, hf_hp.intermediate)
    with _foreign_errors(f"{directory}: cannot load the tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    _check_tokenizer(tokenizer, vocab, "model.embed_tokens.weight", directory,
                     tolerated=(lambda i: False) if file_ids is None else (lambda i: i not in file_ids))
    try:  # the same tokenizer class as GGUF models get, where it is exactly transformers' tokenizer
        tokenizer = Tokenizer.from_transformers(tokenizer)
    except ValueError as exc:
        logger.info("%s: keeping transformers' tokenizer (%s)", directory, exc)
    eos: list[int] = []
    if (directory / "generation_config.json").is_file():
        try:
            eos += _as_id_list(GenerationConfig.from_pretrained(str(directory)).eos_token_id)
        except Exception as exc:
            logger.warning("ignoring unreadable generation_config.json in %s (%s)", directory, exc)
    eos += _as_id_list(fields["eos_token_id"]) + _as_id_list(tokenizer.eos_token_id)
    bos = fields["bos_token_id"]
    config = _model_config(fields, _rope_table(hf_config, directory), weights,
                           bos if bos is not None else tokenizer.bos_token_id, eos, directory,
                           local_rope=_local_rope_table(hf_config, directory))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=directory, format="safetensors")
