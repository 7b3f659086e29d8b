"""Read a GGUF file (llama.cpp's format) into a ``LoadedModel``: ``_load_gguf``, which
``load_model`` calls for a ``.gguf`` spec. (Not ``gguf.py``: that would shadow the ``gguf`` package.)

In the order ``_load_gguf`` runs them:

- the container, read by ``gguf.GGUFReader`` with bounds checks (``_reader_class``): the header,
  metadata array lengths and counts, tensor infos (known type, 1-4 positive dims, rows a whole
  number of blocks) and data layout (every tensor at the offset llama.cpp expects, inside the file,
  no overlap, no wraparound: ``_check_gguf_layout``); every metadata string valid UTF-8
  (``_gguf_check_strings``). Metadata arrays are not split into one numpy view per item (the stock
  reader's 5 s for the default model's 49,152 tokens and 48,900 merges): a number array is one
  view of the file, a string array is located by a walk over its length prefixes, each checked
  against the file size (``_StringArray``), and decoded only when asked for (a cache miss); the
  tensor data stays mapped (a copy-on-write numpy memmap), not read;
- the hyper-parameters by their GGUF names (``_gguf_hparams``), the tensor table with each tensor's
  type checked against its role (``_gguf_table``) and the tokenizer metadata (``_gguf_check_tokens``);
  then the config transformers builds from the metadata (``_gguf_hf_config``, with ``head_dim``
  from ``<arch>.attention.key_length`` where transformers' mapping omits it, as for qwen3) is checked again
  (``checks._hf_hparams``, ``checks._check_table``) and its RoPE table computed
  (``loaded_model.rope_parameters``);
- the tensors under Hugging Face names (``gguf_to_hf_name``; Qwen3's and Gemma 3's per-head q/k RMSNorm
  weights ``attn_q_norm``/``attn_k_norm`` are ``self_attn.q_norm``/``k_norm``; for Gemma 3, GGUF
  architecture ``gemma3`` = transformers' ``gemma3_text``, ``ffn_norm`` is ``pre_feedforward_layernorm``
  and ``post_attention_norm``/``post_ffw_norm`` the post-attention/feed-forward norms, and every norm
  weight, which llama.cpp stores as ``1 + weight``, gets 1 subtracted as transformers' GGUF loader
  does): the GGML block formats (Q8_0, Q4_1, Q4_0, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS) stay block-quantized (raw
  block bytes in a ``uint8`` tensor of ``dtype.storage_shape(logical_shape)``, read in place by the
  kernels), F32/F16/BF16 stay as they are (other types, e.g. IQ2_XXS or TQ1_0, are refused); llama.cpp's interleaving permutation of
  llama ``attn_q``/``attn_k`` rows is undone (``reverse_llama_permute``) so q/k are in Hugging Face
  order for ``rotate_half`` RoPE; ``rope_freqs.weight`` divides the RoPE frequencies. Kept and
  float tensors are not copied: they are tensors over the file mapped copy-on-write, so a loaded
  model's file must not be truncated or rewritten in place while the model is in use (replacing
  it by a rename is safe), as with llama.cpp's mmap;
- the tokenizer: transformers' conversion of the GGUF metadata, as yirage's ``tokenizer.Tokenizer``
  (``_gguf_tokenizer``).

Phi-3 GGUF files (``phi3``: llama.cpp's fused ``attn_qkv`` and gate+up ``ffn_up``, ``rope_factors_*``)
are refused with a clear error (``checks.FUSED_PROJ_ARCHS``); Phi-3 loads from safetensors directories.

The cache. What transformers derives from the metadata is kept under ``cache_dir()``, so that a
file seen before loads without importing transformers (about 4 s) or parsing the file a second
time: the config fields and RoPE table(s) (``gguf-config/<key>.json``, ``_read_config_cache``; Gemma 3's
sliding layers have a second table) and the
converted tokenizer (``tokenizers/<key>/``, ``tokenizer.Tokenizer.save``). ``<key>``
(``_gguf_cache_key``) is a SHA-256 of the file's header, every byte before the tensor data (the
metadata and the tensor table, which is all that config and tokenizer are made from), with the
transformers version and the cache format: any change to the metadata or tensor table gives
another key, an identical header (a copy, a moved file) the same one; tensor data is read from
the file on every load. Entries are written atomically once every check has passed, carry a
SHA-256 of their content, and are checked again when read (checksum, then the same checks as a
fresh conversion); one that fails is logged, ignored and rebuilt. The first load of a file (or of
any file after a transformers upgrade) converts with transformers and is slower (about 7-10 s).

This module must never allocate from a header value before the file's size has confirmed it (the
stock reader hangs on a huge array length), never loop over or size a table by a count that the
tensors present do not confirm, and never read a tensor's data before its type and layout are
checked.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
from array import array
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..config import cache_dir, logger
from ..dtypes import DType
from ..errors import ModelLoadError
from .checks import (FUSED_PROJ_ARCHS, GEMMA_ARCHS, GGUF_ARCH_NAMES, SUPPORTED_ARCHS, _HParams, _TensorInfo,
                     _check_arch, _check_table, _check_tokenizer, _check_weights, _foreign_errors, _hf_hparams,
                     _hparams, _int_field, _nonfinite, _positive_float, _report_nonfinite, _show)
from .loaded_model import (CONFIG_FIELDS, LoadedModel, Weight, _as_id_list, _local_rope_table, _model_config,
                           _progress_bar, _rope_table, config_fields)
from .tokenizer import Tokenizer, _atomic_save


_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3's per-head q/k RMSNorm
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3 (GGUF architecture ``gemma3``): llama.cpp's ``ffn_norm`` is the pre-feedforward norm, and
# the attention/MLP outputs have norms of their own (as gguf-py's tensor_mapping names them)
_GGUF_BLOCK_ARCH = {"gemma3": {**_GGUF_BLOCK, "ffn_norm": "pre_feedforward_layernorm",
                               "post_attention_norm": "post_attention_layernorm",
                               "post_ffw_norm": "post_feedforward_layernorm"}}
_GGUF_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_TOP = {v: k for k, v in _GGUF_TOP.items()}
_HF_BLOCK = {v: k for k, v in _GGUF_BLOCK.items()}
_HF_BLOCK_ARCH = {arch: {v: k for k, v in names.items()} for arch, names in _GGUF_BLOCK_ARCH.items()}
_HF_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")

# GGUF tensor types yirage reads, all as they are stored (no copy, no dequantization at load):
# float types, and the GGML block formats the kernels read in place (DType of the same name)
_FLOAT_TYPES = ("F32", "F16", "BF16")
_BLOCK_TYPES = ("Q8_0", "Q4_1", "Q4_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
_KEPT_TYPES = _FLOAT_TYPES + _BLOCK_TYPES
_GGUF_INT_VALUES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
_GGUF_NUMBER_VALUES = _GGUF_INT_VALUES + ("FLOAT32", "FLOAT64")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """Hugging Face name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for tensors yirage does not use. ``arch``:
    the GGUF architecture (``gemma3``: ``ffn_norm`` is ``pre_feedforward_layernorm``,
    ``post_attention_norm`` / ``post_ffw_norm`` are ``post_attention_layernorm`` /
    ``post_feedforward_layernorm``)."""
    m = _GGUF_BLOCK_NAME.match(name)
    if m:
        layer, part, kind = m.groups()
        block = _GGUF_BLOCK_ARCH.get(arch, _GGUF_BLOCK)
        return f"model.layers.{layer}.{block[part]}.{kind}" if part in block else None
    stem, _, kind = name.rpartition(".")
    return f"{_GGUF_TOP[stem]}.{kind}" if stem in _GGUF_TOP and kind in ("weight", "bias") else None


def _hf_to_gguf_name(name: str, arch: str = "llama") -> str:
    """The GGUF name of a Hugging Face weight name (for messages); the name itself if unknown."""
    m = _HF_LAYER_NAME.match(name)
    block = _HF_BLOCK_ARCH.get(arch, _HF_BLOCK)
    if m and m.group(2) in block:
        return f"blk.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
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


class _StringArray:
    """The strings of one GGUF string-array value, found by a walk over their length prefixes
    (``CheckedReader._yr_strings``) and decoded only when asked for.

    ``starts[i]`` is the file offset of string ``i``'s bytes (its 8-byte length just before),
    ``ends[i]`` the offset after them (int64 arrays; the walk has checked every string to end
    inside the file); ``nbytes`` is the size of the whole value (prefixes and strings), ``len()``
    the item count. Indexing gives ``str`` (a slice: a list).
    Raises UnicodeDecodeError: an item read is not UTF-8.
    """

    def __init__(self, data: np.ndarray, starts: np.ndarray, ends: np.ndarray, nbytes: int):
        self._data, self.starts, self.ends, self.nbytes = data, starts, ends, nbytes

    def __len__(self) -> int:
        return len(self.starts)

    def raw(self, index: int) -> bytes:
        """The bytes of item ``index``."""
        return bytes(self._data[int(self.starts[index]):int(self.ends[index])])

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self.raw(i).decode("utf-8") for i in range(len(self))[index]]
        return self.raw(index).decode("utf-8")

    def first_invalid_utf8(self) -> tuple[int, UnicodeDecodeError] | None:
        """(index, error) of the first item that is not valid UTF-8; None when all are. One
        decode of the whole value with every length prefix zeroed (NUL bytes between the items,
        so that no item completes another's sequence), then item by item only on failure."""
        if not len(self):
            return None
        low = int(self.starts[0]) - 8
        region = np.array(self._data[low:int(self.ends[-1])])
        region[((self.starts - 8 - low)[:, None] + np.arange(8)).reshape(-1)] = 0
        try:
            region.tobytes().decode("utf-8")
            return None
        except UnicodeDecodeError:
            pass
        for i in range(len(self)):
            try:
                self.raw(i).decode("utf-8")
            except UnicodeDecodeError as exc:
                return i, exc
        return None


_READER_CLASS: Any = None


def _reader_class() -> Any:
    """``gguf.GGUFReader`` with bounds checks: a read past the end of the file, a metadata array or
    count longer than the rest of the file could hold, a nested array, or a tensor table that is
    not laid out as llama.cpp lays it out is an error before anything is allocated from it (the
    stock reader hangs on a huge array length, and reports a short read as "index 0 is out of
    bounds" and bad tensor infos as a numpy reshape error).

    Metadata arrays are fields of the class ``_ArrayField`` made here: ``parts`` are the key's
    length and bytes, the value type, the item type, the item count and the values (one numpy
    view of the items, or a ``_StringArray``); ``types`` is [ARRAY, item type]; ``count`` the
    item count, ``values`` the values, ``contents()`` as the stock field's."""
    global _READER_CLASS
    if _READER_CLASS is not None:
        return _READER_CLASS
    import gguf
    from gguf.gguf_reader import ReaderField

    V = gguf.GGUFValueType
    ARRAY, STRING = int(V.ARRAY), int(V.STRING)
    value_types = {int(t): t for t in V}
    scalar_types = {int(t): n for t, n in gguf.GGUFReader.gguf_scalar_to_np.items()}
    sizes = {t: np.dtype(n).itemsize for t, n in scalar_types.items()}
    itemsize: dict[Any, int] = {}
    stock = gguf.GGUFReader
    base_get, base_parts, base_push = stock._get, stock._get_field_parts, stock._push_field

    class _ArrayField(ReaderField):
        __slots__ = ()

        @property
        def count(self) -> int:
            return int(self.parts[4][0])

        @property
        def values(self) -> Any:
            return self.parts[5]

        def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
            values = self.parts[5]
            if isinstance(values, _StringArray):
                return values[index_or_slice]
            return values.tolist()[index_or_slice]

    class CheckedReader(gguf.GGUFReader):
        def __init__(self, path: Any, mode: Any = "r"):
            self._yr_path = Path(path)
            self._yr_size = os.path.getsize(path)
            self._yr_plain: Any = None
            super().__init__(path, mode)

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            # the stock _get, bounds-checked, on a plain ndarray view of the memmap (slicing a
            # memmap runs Python code per slice; this is called ~2,000 times per header)
            count = int(count)
            size = itemsize.get(dtype)
            if size is None:
                size = itemsize[dtype] = np.dtype(dtype).itemsize
            if offset + size * count > self._yr_size:
                raise ValueError(f"the header runs past the end of the file ({self._yr_size} bytes) at byte "
                                 f"{int(offset)}{self._yr_where()}")
            arr = self._yr_plain_data()[offset:offset + size * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

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

        def _yr_strings(self, offs: int, count: int) -> _StringArray:
            """The string array of ``count`` items at ``offs``: a walk over the length prefixes,
            each string checked to end inside the file before the next prefix is read (a prefix
            past the end fails to unpack; a string past the end leaves ``offs`` past it). Two
            int64 arrays of ``count`` offsets: ``count`` is already confirmed by the file size."""
            size = self._yr_size
            little = (self.byte_order == "I") == (sys.byteorder == "little")
            unpack = struct.Struct("<Q" if little else ">Q").unpack_from
            view = memoryview(self._yr_plain_data())[:size]
            ends = array("q")  # 8 bytes an item, as the file's own length prefixes
            append = ends.append
            start = at = offs
            try:
                for _ in range(count):
                    at = offs
                    # a length prefix past the end raises struct.error (the view is the file);
                    # a string running past the end moves offs past it (checked below)
                    offs += 8 + unpack(view, offs)[0]
                    append(offs)
            except (struct.error, OverflowError):  # OverflowError: an offset past 2**63
                offs = size + 1
            if offs > size:  # the failing item's prefix (or string) runs past the end of the file
                raise ValueError(f"the header runs past the end of the file ({size} bytes) at byte {at}"
                                 f"{self._yr_where()}")
            stop = np.frombuffer(ends, dtype=np.int64) if count else np.zeros(0, dtype=np.int64)
            begin = np.empty_like(stop)
            if count:
                begin[0] = start + 8
                begin[1:] = stop[:-1] + 8
            return _StringArray(self._yr_plain_data(), begin, stop, offs - start)

        def _yr_plain_data(self) -> np.ndarray:
            if self._yr_plain is None:
                self._yr_plain = self.data.view(np.ndarray)
            return self._yr_plain

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if int(raw_type) != ARRAY:
                return base_parts(self, orig_offs, raw_type)
            # an array: its length checked first, then read whole (one view, or a string walk)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            offs = orig_offs + 12
            item_type, count = int(raw_itype[0]), int(alen[0])
            if item_type == ARRAY or item_type not in value_types:
                raise ValueError(f"metadata array item type {item_type} is not supported{self._yr_where()}")
            least = 8 if item_type == STRING else sizes[item_type]
            if count * least > self._yr_size - offs:
                raise ValueError(f"a metadata array declares {count} items, more than the rest of the file can "
                                 f"hold{self._yr_where()}")
            if item_type == STRING:
                values = self._yr_strings(offs, count)
            else:
                values = self._get(offs, scalar_types[item_type], count)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], [V.ARRAY, value_types[item_type]]

        def _push_field(self, field: Any, skip_sum: bool = False) -> int:
            if field.types and field.types[0] == V.ARRAY:
                field = _ArrayField(*field)
            return base_push(self, field, skip_sum)

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
                detail = "the first tensor must start at data offset 0"
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
    """The checked reader of ``path``, mapped copy-on-write (mode "c"): weights are tensors over the
    mapped file, never written back. Raises ModelLoadError: any problem with the container."""
    try:
        return _reader_class()(path, "c")
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
        values = f.parts[-1] if f.parts else None
        if isinstance(values, _StringArray):
            bad = values.first_invalid_utf8()
            if bad is not None:
                i, exc = bad
                raise ModelLoadError(f"{path}: metadata {key}[{i}] is not valid UTF-8 ({exc.reason} at byte "
                                     f"{exc.start}: {values.raw(i)[:32]!r})")
        elif f.types == [V.STRING]:
            try:
                values.tobytes().decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ModelLoadError(f"{path}: metadata {key} is not valid UTF-8 ({exc.reason} at byte "
                                     f"{exc.start}: {values.tobytes()[:32]!r})") from None


def _gguf_token_count(reader: Any, path: Path) -> int | None:
    """The number of entries of ``tokenizer.ggml.tokens`` (None when absent).
    Raises ModelLoadError: it is not an array of strings."""
    f = reader.fields.get("tokenizer.ggml.tokens")
    if f is None:
        return None
    if not isinstance(f.parts[-1], _StringArray):
        raise ModelLoadError(f"{path}: tokenizer.ggml.tokens must be an array of strings, got "
                             f"{' of '.join(t.name for t in f.types) or 'a typeless value'}")
    return len(f.parts[-1])


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
    tokens = _gguf_token_count(reader, path)
    if values["vocab"] is None and tokens is not None:
        values["vocab"], names["vocab"] = tokens, "the number of tokenizer.ggml.tokens"
    scaling = _gguf_field(reader, f"{arch}.rope.scaling.type")
    if scaling is not None and not isinstance(scaling, str):
        raise ModelLoadError(f"{path}: {arch}.rope.scaling.type = {_show(scaling)} must be a string")
    factor = _gguf_value(reader, f"{arch}.rope.scaling.factor", path, integer=False)
    if factor is not None and scaling not in (None, "none"):
        _positive_float(path, f"{arch}.rope.scaling.factor", factor)
    original = _gguf_value(reader, f"{arch}.rope.scaling.original_context_length", path, integer=True)
    _int_field(path, f"{arch}.rope.scaling.original_context_length", original, optional=True)
    return _hparams(path, names, values.get)


def _gguf_table(reader: Any, path: Path, arch: str = "llama") -> tuple[dict[str, _TensorInfo], Any]:
    """The tensors yirage uses (HF name -> info) and ``rope_freqs.weight`` (or None), each type
    checked against its role: norms and biases float; matrices float or a GGML block format of
    ``_BLOCK_TYPES`` (legacy, K-quants, IQ4_NL/IQ4_XS, read in place); any other type (IQ2_XXS, TQ*, ...) is one
    ModelLoadError naming the tensor, its type and the supported types."""
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
        name = gguf_to_hf_name(tensor.name, arch)
        if name is None:
            logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        if name.endswith(".bias") or name.endswith("norm.weight"):
            if kind not in _FLOAT_TYPES:
                role = "bias" if name.endswith(".bias") else "norm weight"
                raise ModelLoadError(f"{path}: tensor {tensor.name} has type {kind}; a {role} must be "
                                     f"{', '.join(_FLOAT_TYPES)}")
        elif kind not in _KEPT_TYPES:
            raise ModelLoadError(f"{path}: tensor {tensor.name} has type {kind}, which yirage does not support; "
                                 f"supported types: {', '.join(_KEPT_TYPES)}")
        table[name] = _TensorInfo(tensor.name, shape, kind)
    return table, rope_freqs


def _gguf_check_tokens(reader: Any, rows: int, path: Path) -> None:
    """The file's own tokenizer metadata: every token id (one per entry of tokenizer.ggml.tokens)
    and the special ids must index a row of token_embd.weight."""
    count = _gguf_token_count(reader, path)
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


_CACHE_FORMAT = 4  # 4: Gemma 3 fields and the sliding layers' RoPE table
_TRANSFORMERS_VERSION: str | None = None


def _transformers_version() -> str:
    """The installed transformers version, read from its metadata (transformers is not imported)."""
    global _TRANSFORMERS_VERSION
    if _TRANSFORMERS_VERSION is None:
        from importlib import metadata

        try:
            _TRANSFORMERS_VERSION = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            _TRANSFORMERS_VERSION = "none"
    return _TRANSFORMERS_VERSION


def _gguf_cache_key(reader: Any) -> str:
    """The cache key of a GGUF file: SHA-256 (32 hex digits) of the cache format, the transformers
    version and every header byte before the tensor data (metadata and tensor table)."""
    digest = hashlib.sha256(f"yirage gguf cache {_CACHE_FORMAT}; transformers {_transformers_version()}\0".encode())
    digest.update(memoryview(reader.data)[:int(reader.data_offset)])
    return digest.hexdigest()[:32]


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def _config_cache_path(key: str) -> Path:
    return cache_dir() / "gguf-config" / f"{key}.json"


def _read_config_cache(key: str) -> tuple[dict, tuple[torch.Tensor, float, str], Any] | None:
    """The cached (config fields, RoPE table, sliding layers' RoPE table or None) of ``key``; None
    when there is no entry, or when it is damaged (unreadable, another format, checksum or
    structure wrong: logged, then rebuilt). The values are checked by the caller exactly as a
    fresh conversion's are."""
    path = _config_cache_path(key)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        logger.warning("ignoring unreadable config cache entry %s (%s)", path, exc)
        return None
    try:
        body = json.loads(text)
        if not isinstance(body, dict) or body.get("format") != _CACHE_FORMAT:
            raise ValueError("another format")
        if body.pop("sha256", None) != _checksum(body):
            raise ValueError("checksum mismatch")
        fields = body["fields"]
        if not isinstance(fields, dict) or set(fields) != set(CONFIG_FIELDS):
            raise ValueError("config fields missing")
        rope = _cached_rope(body["rope"])
        local_rope = _cached_rope(body["local_rope"]) if body["local_rope"] is not None else None
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        logger.warning("ignoring damaged config cache entry %s (%s)", path, exc)
        return None
    return fields, rope, local_rope


def _cached_rope(rope: Any) -> tuple[torch.Tensor, float, str]:
    """A RoPE table of a cache entry; ValueError when it is malformed."""
    inv_freq, scaling, rope_type = rope["inv_freq"], rope["attention_scaling"], rope["rope_type"]
    if not (isinstance(inv_freq, list) and all(type(v) in (int, float) for v in inv_freq)
            and type(scaling) in (int, float) and isinstance(rope_type, str)):
        raise ValueError("RoPE table malformed")
    return torch.tensor(inv_freq, dtype=torch.float32), float(scaling), rope_type


def _write_config_cache(key: str, fields: dict, rope: tuple[torch.Tensor, float, str],
                        local_rope: tuple[torch.Tensor, float, str] | None = None) -> None:
    """Keep ``fields``, ``rope`` and ``local_rope`` (Gemma 3's sliding layers' table, or None) as
    the entry of ``key`` (atomically; skipped, with a debug line, when the directory is not
    writable or a value has no JSON form)."""

    def table(r: tuple[torch.Tensor, float, str]) -> dict:
        return {"inv_freq": r[0].tolist(), "attention_scaling": r[1], "rope_type": r[2]}

    body = {"format": _CACHE_FORMAT, "fields": fields, "rope": table(rope),
            "local_rope": table(local_rope) if local_rope is not None else None}
    path = _config_cache_path(key)
    try:
        body["sha256"] = _checksum(body)
        text = json.dumps(body, allow_nan=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
    except (OSError, TypeError, ValueError) as exc:
        logger.debug("config cache not written: %s", exc)
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic: concurrent loaders see no half-written file
    except OSError as exc:
        logger.debug("config cache not written: %s", exc)
        Path(tmp).unlink(missing_ok=True)


def _gguf_hf_config(reader: Any, path: Path) -> Any:
    """The transformers config of a GGUF file, from transformers' own GGUF metadata reader (which
    parses the whole file a second time). Call it only after the metadata has been checked
    (``_gguf_hparams``). Raises ModelLoadError: transformers cannot read or rejects the metadata."""
    config = _gguf_hf_config_uncached(reader, path)
    config.name_or_path = str(path)
    return config


def _gguf_hf_config_uncached(reader: Any, path: Path) -> Any:
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    arch = _gguf_field(reader, "general.architecture")
    try:
        config = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    except Exception as exc:
        _check_arch(arch, path, gguf=True)
        raise ModelLoadError(f"{path}: transformers cannot read the GGUF metadata ({type(exc).__name__}: "
                             f"{exc})") from exc
    model_type = _check_arch(config.pop("model_type", arch), path)
    if model_type in FUSED_PROJ_ARCHS:
        raise ModelLoadError(f"{path}: architecture {model_type} is not supported in GGUF files yet")
    config.pop("_model_name_or_path", None)
    key_length = _gguf_field(reader, f"{arch}.attention.key_length")
    if config.get("head_dim") is None and key_length is not None:  # transformers' qwen3 mapping omits it
        config["head_dim"] = int(key_length)  # (Qwen3Config's default, 128, is not every file's head dim)
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


def _mapped(array: np.ndarray, align: int = 1) -> torch.Tensor:
    """A tensor over ``array``'s memory (the file's pages, mapped copy-on-write) when torch can take
    it as it is: C-contiguous, writable, native byte order, its address a multiple of its item size
    and of ``align`` bytes; else a copy (always aligned)."""
    a = np.asarray(array)
    if not (a.flags.c_contiguous and a.flags.writeable and a.dtype.isnative
            and a.ctypes.data % max(a.dtype.itemsize, align) == 0):
        a = np.array(a, dtype=a.dtype.newbyteorder("="), order="C")
    return torch.from_numpy(a)


def _gguf_tensor(tensor: Any) -> Weight:
    """A GGUF tensor as a Weight, over the mapped file (not copied): the block formats of
    ``_BLOCK_TYPES`` as their raw blocks (uint8 of ``dtype.storage_shape(shape)``, DType of the
    same name: q8_0, q4_1, q4_0, q5_0, q5_1, q2_k .. q6_k, iq4_nl, iq4_xs), F32/F16/BF16 as they are. The caller
    has checked the type (``_gguf_table``) and the layout (``_check_gguf_layout``: rows a whole
    number of blocks, the data inside the file); another type raises ModelLoadError."""
    import gguf

    Q = gguf.GGMLQuantizationType
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    kind = tensor.tensor_type
    if kind.name in _BLOCK_TYPES:
        dtype = DType(kind.name.lower())
        return Weight(_mapped(tensor.data.reshape(dtype.storage_shape(shape))), dtype, shape)
    if kind in (Q.F32, Q.F16):
        return Weight(_mapped(tensor.data.reshape(shape)), DType.float32 if kind == Q.F32 else DType.float16, shape)
    if kind == Q.BF16:
        raw = _mapped(tensor.data.reshape(-1).view(np.uint8), align=2)
        return Weight(raw.view(torch.bfloat16).reshape(shape), DType.bfloat16, shape)
    raise ModelLoadError(f"GGUF tensor {tensor.name} has type {kind.name}, which yirage does not support; "
                         f"supported types: {', '.join(_KEPT_TYPES)}")


def _read_gguf_weights(reader: Any, table: dict[str, _TensorInfo], hp: _HParams, permute_qk: bool,
                       progress: bool, path: Path, allow_nonfinite: bool, norm_shift: float = 0.0) -> dict[str, Weight]:
    """The checked tensors under HF names (q/k rows un-permuted when ``permute_qk``); NaN/inf
    refused (or warned about, ``allow_nonfinite``). ``norm_shift``: subtracted from every norm
    weight (``...norm.weight``, float32 copies): llama.cpp's converter stores Gemma's RMSNorm
    weights as ``1 + weight`` (its ``norm_shift``), transformers' GGUF loader
    (``Gemma2TensorProcessor``, used for gemma3) subtracts 1 again, and so does this, in float32 as
    transformers does, so that the weights are the checkpoint's (``ModelConfig.norm_weight_offset``
    adds the 1 back at run time, exactly as transformers' ``Gemma3RMSNorm``)."""
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
                if norm_shift and name.endswith("norm.weight"):
                    weight = Weight(weight.data.float() - norm_shift, DType.float32, weight.shape)
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


def _gguf_tokenizer(path: Path, key: str, check: Callable[[Any], None]) -> Any:
    """The GGUF's tokenizer: the cache entry ``cache_dir()/tokenizers/<key>`` when there is a sound
    one; else transformers' conversion of the metadata (slow), ``check``ed, then turned into a
    ``Tokenizer`` (checked equal to transformers' on probe texts) and cached. Should transformers'
    tokenizer not convert exactly, it is returned as it is and nothing is cached.

    Raises ModelLoadError: transformers cannot build the tokenizer, or ``check`` fails.
    """
    entry = cache_dir() / "tokenizers" / key
    if entry.is_dir():
        try:
            tokenizer = Tokenizer.load(entry)
        except ValueError as exc:  # a damaged entry: convert again
            logger.warning("ignoring damaged tokenizer cache entry %s (%s)", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
        else:
            check(tokenizer)
            return tokenizer
    logger.info("converting the tokenizer of %s (cached afterwards)", path.name)
    with _foreign_errors(f"{path}: cannot build the tokenizer from the GGUF metadata"):
        from transformers import AutoTokenizer

        converted = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    check(converted)
    try:
        tokenizer = Tokenizer.from_transformers(converted)
    except ValueError as exc:
        logger.warning("%s: using transformers' tokenizer as it is, not cached (%s)", path, exc)
        return converted
    if not _atomic_save(tokenizer, entry):
        logger.debug("tokenizer cache entry %s not written", entry)
    return tokenizer


def _load_gguf(path: Path, progress: bool, allow_nonfinite: bool = False) -> LoadedModel:
    reader = _open_gguf(path)  # header, metadata bounds and tensor layout checked
    _gguf_check_strings(reader, path)
    arch = _gguf_field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{path}: general.architecture is {'missing' if arch is None else _show(arch)}; "
                             f"it must name the architecture "
                             f"({', '.join(GGUF_ARCH_NAMES.get(a, a) for a in SUPPORTED_ARCHS)})")
    model_type = _check_arch(arch, path, gguf=True)  # the transformers name (gemma3 -> gemma3_text)
    if arch in FUSED_PROJ_ARCHS:
        raise ModelLoadError(f"{path}: architecture {arch} is not supported in GGUF files yet (llama.cpp's fused "
                             "attn_qkv and gate+up ffn_up tensors are not mapped); load the model's Hugging Face "
                             "safetensors directory instead")
    hp = _gguf_hparams(reader, arch, path)
    table, rope_freqs_tensor = _gguf_table(reader, path, arch)

    def display(name: str) -> str:
        return _hf_to_gguf_name(name, arch)

    vocab, tied = _check_table(path, hp, table, None, display, arch=model_type)
    _gguf_check_tokens(reader, vocab, path)
    key = _gguf_cache_key(reader)
    cached = _read_config_cache(key)
    if cached is None:
        hf_config = _gguf_hf_config(reader, path)
        fields = config_fields(hf_config)
    else:
        fields, rope, local_rope = cached
    # the same checks on the config as transformers built it (names as in transformers)
    _check_arch(fields.get("model_type"), path)
    origin = f"{path} (as read by transformers)"
    hf_hp = _hf_hparams(origin, fields.get)
    _check_table(origin, hf_hp, table, fields.get("tie_word_embeddings"), display, arch=fields.get("model_type"),
                 attention_bias=fields.get("attention_bias"))
    if cached is None:
        rope, local_rope = _rope_table(hf_config, path), _local_rope_table(hf_config, path)
    rope_freqs = _gguf_rope_freqs(rope_freqs_tensor, hp, path) if rope_freqs_tensor is not None else None
    permute_qk = arch == "llama"  # llama.cpp permutes llama only (not qwen2/qwen3, nor their q/k norms)
    norm_shift = 1.0 if model_type in GEMMA_ARCHS else 0.0  # llama.cpp stores Gemma norms as 1 + weight
    weights = _read_gguf_weights(reader, table, hp, permute_qk, progress, path, allow_nonfinite, norm_shift)
    weights = _check_weights(weights, table, tied, path)
    n_tokens = _gguf_token_count(reader, path) or 0
    tokenizer = _gguf_tokenizer(path, key, lambda tok: _check_tokenizer(tok, vocab, "token_embd.weight", path,
                                                                          tolerated=lambda i: i >= n_tokens))
    eos = (_as_id_list(fields.get("eos_token_id")) + _as_id_list(_gguf_field(reader, "tokenizer.ggml.eos_token_id"))
           + _as_id_list(_gguf_field(reader, "tokenizer.ggml.eot_token_id"))
           + _as_id_list(_gguf_field(reader, "tokenizer.ggml.eom_token_id")) + _as_id_list(tokenizer.eos_token_id))
    bos = fields.get("bos_token_id")
    config = _model_config(fields, rope, weights, bos if bos is not None else tokenizer.bos_token_id, eos, path,
                           local_rope=local_rope)
    if cached is None:  # every check has passed: keep what transformers derived
        _write_config_cache(key, fields, rope, local_rope)
    if rope_freqs is not None:  # llama.cpp's per-frequency divisors (e.g. Llama 3.1 files)
        config.inv_freq = config.inv_freq / rope_freqs
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=path, format="gguf")
