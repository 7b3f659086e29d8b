"""Mutation fuzzer for model files: deterministic mutants of the seeds of tests/fuzz/seeds.py.

A mutant is a *recipe*: a small JSON-able dict ``{"category", "target", "op", "args", "desc"}``
that ``apply_recipe`` turns into a model file (target ``gguf``) or directory (target ``hf``) from
the seed. Recipes name what they change structurally (a metadata key, a tensor, a JSON path, a
safetensors header entry) and, for byte-level mutations (bit flips, truncations), offsets into
the seed, so a recipe plus the seed parameters is the whole input: ``make fuzz`` saves recipes
(tests/fuzz/regressions/*.json), not files.

``make_recipes(ctx, per_category, seed)`` draws ``per_category`` recipes for every category of
``CATEGORIES`` with ``random.Random`` seeded by ``(seed, category)``: the same arguments give the
same mutants. Up to half of a category's budget goes to its ``SYSTEMATIC`` list (every size field
x every boundary value, in a seeded order), the rest to random draws. Categories:

GGUF (the tiny SmolLM2 seed)
  gguf_bitflip        1-8 bit flips at random offsets (header + metadata, tensor infos, tensor data)
  gguf_header         magic, version, tensor_count, kv_count -> boundary values
  gguf_metadata       metadata values -> boundary values in place (0, 1, -1, 2**31-1, 2**32-1,
                      2**63-1, NaN, inf ...), wrong value types, deleted/added keys, bad strings
                      (empty, huge, invalid UTF-8), huge string/array lengths, token/merge lists
  gguf_truncate       truncations: empty, header only, mid metadata, mid tensor infos, at/inside data
  gguf_tensor_type    a tensor's type -> every GGMLQuantizationType (IQ types too) or an invalid
                      number (in place, data unchanged), or re-encoded as F16/BF16/Q4_0/Q8_0/Q5_K...
  gguf_tensor_shape   dims -> 0/1/huge/off by one/swapped; n_dims -> 0..5/huge
  gguf_tensor_offset  data offsets -> 0/overlapping/unaligned/at or past EOF/wraparound; names ->
                      duplicate, unknown, out-of-range layer, rope_freqs; tensors removed/added
HF safetensors directory (tiny Llama, 3 shards + index, word-level tokenizer)
  hf_config           config.json / generation_config.json: each numeric field -> boundary values
                      and wrong types, missing keys, bad model_type / rope scaling, malformed JSON
  hf_index            model.safetensors.index.json: absolute paths, '..', missing shards, wrong
                      types, malformed JSON; shards replaced by symlinks (outside the directory, to
                      /dev/zero, /proc/self/mem, loops, dangling)
  hf_tokenizer        tokenizer.json / tokenizer_config.json: ids past the vocab, negative/huge ids,
                      invalid UTF-8, unknown model types, missing unk token, bad chat templates
  hf_safetensors      a shard's header: dtype, shape, data_offsets, header length, malformed JSON,
                      renamed/removed tensors
  hf_bytes            bit flips and truncations of any file of the directory, deleted files, files
                      replaced by symlinks to /dev/zero, /dev/urandom, /proc/self/mem, loops, directories
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# ================================================================================================
# GGUF: a byte-exact parser (with every field's offset) and a writer

# GGUFValueType numbers and their struct formats (little-endian)
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B",
        U64: "<Q", I64: "<q", F64: "<d"}
VTYPE_NAMES = {U8: "UINT8", I8: "INT8", U16: "UINT16", I16: "INT16", U32: "UINT32", I32: "INT32",
               F32: "FLOAT32", BOOL: "BOOL", STRING: "STRING", ARRAY: "ARRAY", U64: "UINT64",
               I64: "INT64", F64: "FLOAT64"}
GGUF_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The seed is not a GGUF file this parser understands (never raised for a valid seed)."""


@dataclass
class Slot:
    """A fixed-size field of the file: its offset, size and struct format."""

    offset: int
    size: int
    fmt: str | None = None


@dataclass
class KV:
    key: str
    vtype: int
    value: Any  # scalars, str (or bytes when not UTF-8), list for arrays
    subtype: int | None = None
    slots: dict[str, Any] = field(default_factory=dict)


@dataclass
class TensorInfo:
    name: str
    dims: list[int]  # GGUF order (ne0 first: the fastest-varying dim)
    type: int
    offset: int  # relative to the data section
    slots: dict[str, Any] = field(default_factory=dict)


@dataclass
class GGUFLayout:
    """Everything in a GGUF file, with the offset of every field (``slots``)."""

    version: int
    kvs: list[KV]
    tensors: list[TensorInfo]
    header: dict[str, Slot]
    kv_end: int  # end of the metadata section (= start of the tensor infos)
    info_end: int  # end of the tensor infos
    data_start: int
    size: int

    def kv(self, key: str) -> KV:
        for kv in self.kvs:
            if kv.key == key:
                return kv
        raise KeyError(key)

    def tensor(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def tensor_nbytes(self, t: TensorInfo) -> int:
        return tensor_nbytes(t.type, t.dims)

    def resolve(self, at: list) -> Slot:
        """The slot named by ``at``: ["header", field] | ["kv", key, part(, i)] |
        ["tensor", name, part(, i)] where part is a key of the record's ``slots``."""
        kind = at[0]
        if kind == "header":
            return self.header[at[1]]
        rec = self.kv(at[1]) if kind == "kv" else self.tensor(at[1])
        slot = rec.slots[at[2]]
        if len(at) > 3:
            slot = slot[at[3]]
        return slot


def _type_size(qtype: int) -> tuple[int, int]:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]


def tensor_nbytes(qtype: int, dims: list[int]) -> int:
    block, nbytes = _type_size(qtype)
    n = math.prod(dims)
    return n // block * nbytes


def parse_gguf(data: bytes) -> GGUFLayout:
    """Parse a (valid) GGUF v2/v3 file; every field's offset is recorded."""
    pos = 0

    def take(fmt: str) -> tuple[Any, Slot]:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise GGUFFormatError("truncated")
        (value,) = struct.unpack_from(fmt, data, pos)
        slot = Slot(pos, size, fmt)
        pos += size
        return value, slot

    def string() -> tuple[Any, Slot, Slot]:
        nonlocal pos
        n, len_slot = take("<Q")
        raw = data[pos:pos + n]
        bytes_slot = Slot(pos, n)
        pos += n
        try:
            return raw.decode("utf-8"), len_slot, bytes_slot
        except UnicodeDecodeError:
            return raw, len_slot, bytes_slot

    header = {"magic": Slot(0, 4)}
    if data[:4] != b"GGUF":
        raise GGUFFormatError("bad magic")
    pos = 4
    version, header["version"] = take("<I")
    n_tensors, header["tensor_count"] = take("<Q")
    n_kv, header["kv_count"] = take("<Q")
    kvs = []
    for _ in range(n_kv):
        key, key_len, key_bytes = string()
        vtype, type_slot = take("<I")
        slots: dict[str, Any] = {"key_len": key_len, "key_bytes": key_bytes, "type": type_slot}
        subtype = None
        if vtype == STRING:
            value, slots["str_len"], slots["str_bytes"] = string()
        elif vtype == ARRAY:
            subtype, slots["array_type"] = take("<I")
            count, slots["array_count"] = take("<Q")
            value, items = [], []
            for _ in range(count):
                if subtype == STRING:
                    v, len_slot, _b = string()
                    items.append(len_slot)  # an item's slot is its length field
                else:
                    v, s = take(_FMT[subtype])
                    items.append(s)
                value.append(v)
            slots["items"] = items
        else:
            value, slots["value"] = take(_FMT[vtype])
        kvs.append(KV(key if isinstance(key, str) else key.decode("latin-1"), vtype, value, subtype, slots))
    tensors = []
    for _ in range(n_tensors):
        name, name_len, name_bytes = string()
        n_dims, nd_slot = take("<I")
        dims, dim_slots = [], []
        for _ in range(n_dims):
            d, s = take("<Q")
            dims.append(d)
            dim_slots.append(s)
        qtype, type_slot = take("<I")
        offset, off_slot = take("<Q")
        tensors.append(TensorInfo(name, dims, qtype, offset, {"name_len": name_len, "name_bytes": name_bytes,
                                                              "n_dims": nd_slot, "dims": dim_slots,
                                                              "type": type_slot, "offset": off_slot}))
    info_end = pos
    align = GGUF_ALIGNMENT
    for kv in kvs:
        if kv.key == "general.alignment":
            align = int(kv.value)
    data_start = -(-info_end // align) * align
    kv_end = tensors[0].slots["name_len"].offset if tensors else info_end
    return GGUFLayout(version, kvs, tensors, header, kv_end, info_end, data_start, len(data))


def _encode_string(value: Any) -> bytes:
    raw = bytes.fromhex(value["hex"]) if isinstance(value, dict) else (
        value if isinstance(value, bytes) else str(value).encode("utf-8"))
    return struct.pack("<Q", len(raw)) + raw


def encode_value(vtype: int, value: Any, subtype: int | None = None) -> bytes:
    """GGUF bytes of a metadata value (``value`` may be {"hex": ...} for raw string bytes)."""
    if vtype == STRING:
        return _encode_string(value)
    if vtype == ARRAY:
        out = struct.pack("<IQ", subtype, len(value))
        return out + b"".join(encode_value(subtype, v) for v in value)
    if vtype in (F32, F64):
        return struct.pack(_FMT[vtype], float(value))
    if vtype == BOOL:
        return struct.pack("<B", int(value) & 0xFF)
    fmt = _FMT[vtype]
    bits = struct.calcsize(fmt) * 8
    v = int(value)
    v &= (1 << bits) - 1  # wrap to the field width (so -1 becomes all ones)
    return struct.pack(fmt.upper() if fmt[-1].islower() else fmt, v)


def write_gguf(version: int, kvs: list[tuple], tensors: list[tuple], alignment: int = GGUF_ALIGNMENT,
               tensor_count: int | None = None, kv_count: int | None = None) -> bytes:
    """A GGUF file: ``kvs`` are (key, vtype, value, subtype); ``tensors`` (name, dims, type,
    data bytes) get offsets in order, each aligned; counts default to the list lengths."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors) if tensor_count is None else tensor_count,
                                          len(kvs) if kv_count is None else kv_count))
    for key, vtype, value, subtype in kvs:
        out += _encode_string(key) + struct.pack("<I", vtype) + encode_value(vtype, value, subtype)
    offset, blobs = 0, []
    for name, dims, qtype, blob in tensors:
        out += _encode_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", qtype, offset)
        pad = -len(blob) % alignment
        blobs.append(blob + b"\0" * pad)
        offset += len(blob) + pad
    out += b"\0" * (-len(out) % alignment)
    for blob in blobs:
        out += blob
    return bytes(out)


def gguf_parts(data: bytes, layout: GGUFLayout) -> tuple[list[tuple], list[tuple]]:
    """(kvs, tensors) of ``write_gguf`` that rebuild ``data`` byte for byte."""
    kvs = [(kv.key, kv.vtype, {"hex": kv.value.hex()} if isinstance(kv.value, bytes) else kv.value, kv.subtype)
           for kv in layout.kvs]
    tensors = []
    for t in layout.tensors:
        start = layout.data_start + t.offset
        tensors.append((t.name, list(t.dims), t.type, data[start:start + layout.tensor_nbytes(t)]))
    return kvs, tensors


# ================================================================================================
# safetensors: header split/join

def st_split(data: bytes) -> tuple[dict, bytes]:
    """(header dict, tensor bytes) of a safetensors file."""
    n = struct.unpack_from("<Q", data, 0)[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def st_join(header: Any, body: bytes, raw_header: bytes | None = None) -> bytes:
    """A safetensors file from a header (dict, or raw bytes) and the tensor bytes; the header is
    padded with spaces to a multiple of 8 as safetensors writes it."""
    raw = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


# ================================================================================================
# seeds and the context generators draw from

@dataclass
class Seeds:
    """Paths of the seed GGUF file and the seed Hugging Face directory."""

    gguf: Path
    hf: Path

    def digest(self) -> dict[str, str]:
        """sha256 of the seeds (stored with saved regressions: offsets refer to these bytes)."""
        h = hashlib.sha256()
        for p in sorted(self.hf.iterdir()):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        return {"gguf": hashlib.sha256(self.gguf.read_bytes()).hexdigest()[:16], "hf": h.hexdigest()[:16]}


def build_seeds(directory: Path) -> Seeds:
    """Build both seeds under ``directory`` (tests/fuzz/seeds.py); reuses them when present."""
    from . import seeds as _seeds

    directory = Path(directory)
    gguf_path, hf_dir = directory / "seed.gguf", directory / "seed-hf"
    if not gguf_path.is_file():
        tmp = directory / "seed.tmp.gguf"
        _seeds.build_gguf_seed(tmp)
        tmp.replace(gguf_path)
    if not (hf_dir / "config.json").is_file():
        shutil.rmtree(hf_dir, ignore_errors=True)
        tmp_dir = directory / "seed-hf.tmp"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        _seeds.build_hf_seed(tmp_dir)
        tmp_dir.replace(hf_dir)
    return Seeds(gguf_path, hf_dir)


@dataclass
class Context:
    """What the generators need to know about the seeds."""

    gguf: bytes
    layout: GGUFLayout
    hf_files: dict[str, bytes]
    config: dict
    index: dict
    tokenizer: dict
    st_headers: dict[str, dict]  # shard name -> header

    @classmethod
    def from_seeds(cls, seeds: Seeds) -> "Context":
        data = seeds.gguf.read_bytes()
        files = {p.name: p.read_bytes() for p in sorted(seeds.hf.iterdir()) if p.is_file()}
        shards = {n: st_split(b)[0] for n, b in files.items() if n.endswith(".safetensors")}
        return cls(data, parse_gguf(data), files, json.loads(files["config.json"]),
                   json.loads(files["model.safetensors.index.json"]), json.loads(files["tokenizer.json"]), shards)


# ================================================================================================
# applying a recipe

def apply_recipe(recipe: dict, seeds: Seeds, out_dir: Path) -> Path:
    """Write the mutant of ``recipe`` under ``out_dir`` (created); return the path to load:
    ``out_dir/model.gguf`` or ``out_dir/model`` (a Hugging Face directory)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    op, args = recipe["op"], expand(recipe.get("args", {}))
    if op.startswith("selftest_"):
        _selftest(op)
    if recipe["target"] == "gguf":
        data = seeds.gguf.read_bytes()
        path = out_dir / "model.gguf"
        path.write_bytes(_GGUF_OPS[op](data, args))
        return path
    path = out_dir / "model"
    if path.exists():
        shutil.rmtree(path)
    shutil.copytree(seeds.hf, path)
    if op == "symlink":
        args = dict(args, target=args["target"].replace("$SEED_HF", str(Path(seeds.hf).resolve())))
    _HF_OPS[op](path, args)
    return path


def _selftest(op: str) -> None:
    """Misbehave on purpose, so that tests can check that the runner observes it (these recipes
    only ever come from ``selftest_recipes``)."""
    import os
    import signal
    import threading
    import time

    if op == "selftest_segv":
        # thread-directed: os.kill(getpid()) may deliver the signal to another thread (the
        # faulthandler watchdog), and this thread would go on and report a harness error first
        signal.pthread_kill(threading.get_ident(), signal.SIGSEGV)
        time.sleep(3600)  # not reached: the default action ends the process
    elif op == "selftest_abort":
        os.abort()
    elif op == "selftest_hang":
        time.sleep(3600)
    raise ValueError(f"unknown self-test op {op}")


def selftest_recipes() -> list[dict]:
    """Recipes whose child dies of SIGSEGV, of SIGABRT, hangs, and fails in the harness: the
    outcomes crash, crash, hang and harness_error, whatever yirage does."""
    return [_r("selftest", "gguf", op, {}, f"self-test: {what}") for op, what in [
        ("selftest_segv", "the child kills itself with SIGSEGV"), ("selftest_abort", "the child aborts"),
        ("selftest_hang", "the child sleeps for an hour"), ("selftest_bogus", "apply_recipe raises")]]


# ---- GGUF ops: bytes -> bytes

def _pack(fmt: str, value: Any) -> bytes:
    if fmt[-1] in "fd":
        return struct.pack(fmt, float(value))
    bits = struct.calcsize(fmt) * 8
    return struct.pack(fmt.upper(), int(value) & ((1 << bits) - 1))


def _g_write(data: bytes, args: dict) -> bytes:
    """Overwrite one field in place: args {"at": slot address, "fmt": struct format, "value"} or
    {"at", "hex"}."""
    slot = parse_gguf(data).resolve(args["at"])
    raw = bytes.fromhex(args["hex"]) if "hex" in args else _pack(args.get("fmt") or slot.fmt, args["value"])
    out = bytearray(data)
    out[slot.offset:slot.offset + len(raw)] = raw
    return bytes(out)


def _g_bitflip(data: bytes, args: dict) -> bytes:
    out = bytearray(data)
    for offset, bit in args["flips"]:
        out[offset] ^= 1 << bit
    return bytes(out)


def _g_truncate(data: bytes, args: dict) -> bytes:
    return data[:args["length"]]


def _g_rebuild(data: bytes, args: dict) -> bytes:
    """Re-serialize after structural edits. args: "set" [[key, vtype, value, subtype]] (replace the
    value and type of ``key``, or append the key), "array_edit" [[key, {"keep": n} | {"dup_head": n}
    | {"set": [i, value]}]] (edit the seed's list), "delete" [key], "duplicate" [key],
    "tensor_set" [[name, {"name", "dims", "type", "data": "zeros"|"requantize"|"short"}]],
    "tensor_delete" [name], "tensor_add" [[name, dims, type, fill]], "counts" {...}."""
    layout = parse_gguf(data)
    kvs, tensors = gguf_parts(data, layout)
    for key, vtype, value, subtype in args.get("set", []):
        row = (key, vtype, value, subtype)
        idx = [i for i, kv in enumerate(kvs) if kv[0] == key]
        if idx:
            kvs[idx[0]] = row
        else:
            kvs.append(row)
    for key, edit in args.get("array_edit", []):
        i = next(j for j, kv in enumerate(kvs) if kv[0] == key)
        _, vtype, vals, subtype = kvs[i]
        vals = list(vals)
        if "keep" in edit:
            vals = vals[:edit["keep"]]
        if "dup_head" in edit:
            vals = vals + vals[:edit["dup_head"]]
        if "set" in edit:
            vals[edit["set"][0]] = edit["set"][1]
        kvs[i] = (key, vtype, vals, subtype)
    for key in args.get("delete", []):
        kvs = [kv for kv in kvs if kv[0] != key]
    for key in args.get("duplicate", []):
        kvs += [kv for kv in kvs if kv[0] == key][:1]
    for name, edit in args.get("tensor_set", []):
        i = next(j for j, t in enumerate(tensors) if t[0] == name)
        tname, dims, qtype, blob = tensors[i]
        dims, new_type = edit.get("dims", dims), edit.get("type", qtype)
        fill = edit.get("data")
        if fill == "requantize":
            blob = _requantize(blob, qtype, new_type, tensors[i][1])
        elif fill == "zeros":
            blob = b"\0" * tensor_nbytes(new_type, dims)
        elif fill == "short":
            blob = blob[: len(blob) // 2]
        tensors[i] = (edit.get("name", tname), dims, new_type, blob)
    for name in args.get("tensor_delete", []):
        tensors = [t for t in tensors if t[0] != name]
    for name, dims, qtype, fill in args.get("tensor_add", []):
        n = tensor_nbytes(qtype, dims)
        if fill == "zeros":
            blob = b"\0" * n
        else:  # a float32 constant
            blob = struct.pack("<f", float(fill)) * (n // 4)
        tensors.append((name, dims, qtype, blob))
    counts = args.get("counts", {})
    return write_gguf(layout.version, kvs, tensors, tensor_count=counts.get("tensor_count"),
                      kv_count=counts.get("kv_count"))


def _requantize(blob: bytes, old_type: int, new_type: int, dims: list[int]) -> bytes:
    """The tensor's values re-encoded as ``new_type`` (same logical shape)."""
    import gguf
    import numpy as np

    shape = tuple(reversed(dims))
    raw = np.frombuffer(blob, dtype=np.uint8)
    values = gguf.quants.dequantize(raw.reshape(-1, raw.size // shape[0]) if len(shape) > 1 else raw,
                                    gguf.GGMLQuantizationType(old_type))
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    Q = gguf.GGMLQuantizationType
    if new_type == Q.F32:
        return values.tobytes()
    if new_type == Q.F16:
        return values.astype(np.float16).tobytes()
    return gguf.quants.quantize(values, Q(new_type)).tobytes()


_GGUF_OPS: dict[str, Callable[[bytes, dict], bytes]] = {
    "write": _g_write, "bitflip": _g_bitflip, "truncate": _g_truncate, "rebuild": _g_rebuild,
    "none": lambda data, args: data,
}


# ---- HF ops: edit files of a directory in place

def _json_load(path: Path) -> Any:
    return json.loads(path.read_text())


def _walk(obj: Any, keys: list) -> tuple[Any, Any]:
    for k in keys[:-1]:
        obj = obj[k]
    return obj, keys[-1]


def _h_json_set(d: Path, args: dict) -> None:
    """args {"file", "path": [keys], "value"}: set (or add) the value at a JSON path."""
    p = d / args["file"]
    obj = _json_load(p)
    parent, last = _walk(obj, args["path"]) if args["path"] else (None, None)
    if parent is None:
        obj = args["value"]
    else:
        parent[last] = args["value"]
    p.write_text(json.dumps(obj, indent=1))


def _h_json_del(d: Path, args: dict) -> None:
    p = d / args["file"]
    obj = _json_load(p)
    parent, last = _walk(obj, args["path"])
    del parent[last]
    p.write_text(json.dumps(obj, indent=1))


def _h_raw(d: Path, args: dict) -> None:
    """args {"file", "hex"}: replace a file's bytes."""
    (d / args["file"]).write_bytes(bytes.fromhex(args["hex"]))


def _h_replace(d: Path, args: dict) -> None:
    """args {"file", "find", "replace_hex", "count"}: replace bytes of a file (first ``count``)."""
    p = d / args["file"]
    data = p.read_bytes()
    find = args["find"].encode()
    if find not in data:
        raise ValueError(f"{args['find']!r} not in {args['file']}")
    p.write_bytes(data.replace(find, bytes.fromhex(args["replace_hex"]), args.get("count", 1)))


def _h_bitflip(d: Path, args: dict) -> None:
    p = d / args["file"]
    out = bytearray(p.read_bytes())
    for offset, bit in args["flips"]:
        out[offset] ^= 1 << bit
    p.write_bytes(bytes(out))


def _h_truncate(d: Path, args: dict) -> None:
    p = d / args["file"]
    p.write_bytes(p.read_bytes()[:args["length"]])


def _h_delete(d: Path, args: dict) -> None:
    (d / args["file"]).unlink()


def _h_symlink(d: Path, args: dict) -> None:
    """args {"file", "target"}: replace a file by a symlink to ``target`` ("$SEED_HF" in it is the
    seed directory: an absolute path to a valid file outside the model directory)."""
    p = d / args["file"]
    if p.exists() or p.is_symlink():
        p.unlink()
    p.symlink_to(args["target"])


def _h_st_header(d: Path, args: dict) -> None:
    """A shard's header edited: args {"file", "tensor", "key", "value"} sets header[tensor][key]
    (``key`` None replaces the entry, ``value`` None deletes it); {"rename": new} renames;
    {"raw_hex"} replaces the whole header text; {"length"} writes the u64 length field only."""
    p = d / args["file"]
    data = p.read_bytes()
    header, body = st_split(data)
    if "length" in args:
        out = bytearray(data)
        out[0:8] = _pack("<Q", args["length"])
        p.write_bytes(bytes(out))
        return
    if "raw_hex" in args:
        p.write_bytes(st_join(None, body, bytes.fromhex(args["raw_hex"])))
        return
    t = args["tensor"]
    if "rename" in args:
        header[args["rename"]] = header.pop(t)
    elif args.get("key") is None:
        if args.get("value") is None:
            del header[t]
        else:
            header[t] = args["value"]
    else:
        header[t][args["key"]] = args["value"]
    p.write_bytes(st_join(header, body))


_HF_OPS: dict[str, Callable[[Path, dict], None]] = {
    "json_set": _h_json_set, "json_del": _h_json_del, "raw": _h_raw, "replace": _h_replace,
    "bitflip": _h_bitflip, "truncate": _h_truncate, "delete": _h_delete, "st_header": _h_st_header,
    "symlink": _h_symlink,
    "none": lambda d, args: None,
}


# ================================================================================================
# generators: (rng, ctx) -> recipe

U32_VALUES = [0, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**32 - 1]
I32_VALUES = [0, 1, -1, -2**31, 2**31 - 1]
U64_VALUES = [0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]
FLOAT_VALUES = [0.0, -0.0, 1.0, -1.0, 1e-45, 1e-30, 3.4e38, float("nan"), float("inf"), float("-inf")]
JSON_NUMBERS = [0, 1, -1, 2, 3, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64, 10**30, 0.5, 1e-30, 1e308,
                float("nan"), float("inf"), float("-inf")]
JSON_WRONG_TYPES = ["7", "", None, [], [1, 2], {}, {"a": 1}, True, False]


def rep(text: str, times: int) -> dict:
    """A long repeated value, stored compactly in recipes: ``apply_recipe`` expands it to
    ``text * times`` (for a "hex" argument, ``text`` is hex)."""
    return {"$repeat": text, "times": times}


def _hex(raw: Any) -> Any:
    """A "hex" argument: bytes as hex, or a list of parts (hex strings or ``rep``) kept compact."""
    return raw.hex() if isinstance(raw, bytes) else raw


def expand(value: Any) -> Any:
    """``value`` with every ``rep`` expanded and "hex" part lists joined."""
    if isinstance(value, dict):
        if "$repeat" in value:
            return value["$repeat"] * value["times"]
        out = {k: expand(v) for k, v in value.items()}
        if isinstance(out.get("hex"), list):
            out["hex"] = "".join(out["hex"])
        return out
    if isinstance(value, list):
        return [expand(v) for v in value]
    return value


def _r(category: str, target: str, op: str, args: dict, desc: str) -> dict:
    return {"category": category, "target": target, "op": op, "args": args, "desc": desc}


def _fmt_value(v: Any) -> str:
    if isinstance(v, dict) and "$repeat" in v:
        return f"{v['$repeat'][:30]!r} * {v['times']}"
    if isinstance(v, dict) and "hex" in v:
        return f"bytes {v['hex'][:40]}"
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


# ---- GGUF generators

def gen_gguf_bitflip(rng: random.Random, ctx: Context) -> dict:
    lay = ctx.layout
    regions = {"metadata": (0, lay.kv_end), "tensor_infos": (lay.kv_end, lay.info_end),
               "data": (lay.data_start, lay.size)}
    region = rng.choice(list(regions))
    lo, hi = regions[region]
    n = rng.choice([1, 1, 1, 2, 3, 4, 8])
    flips = sorted({(rng.randrange(lo, hi), rng.randrange(8)) for _ in range(n)})
    return _r("gguf_bitflip", "gguf", "bitflip", {"flips": [list(f) for f in flips]},
              f"{len(flips)} bit flip(s) in {region} at {[f[0] for f in flips][:4]}")


def gen_gguf_header(rng: random.Random, ctx: Context) -> dict:
    lay = ctx.layout
    fld = rng.choice(["magic", "version", "version", "tensor_count", "tensor_count", "kv_count", "kv_count"])
    if fld == "magic":
        raw = rng.choice([b"GGUG", b"FUGG", b"\0\0\0\0", b"GGML", bytes(rng.randrange(256) for _ in range(4))])
        return _r("gguf_header", "gguf", "write", {"at": ["header", "magic"], "hex": raw.hex()}, f"magic -> {raw!r}")
    if fld == "version":
        value = rng.choice([0, 1, 2, 4, 2**31 - 1, 2**32 - 1, 0x03000000])
    else:
        n = len(lay.tensors) if fld == "tensor_count" else len(lay.kvs)
        value = rng.choice([0, 1, n - 1, n + 1, 2 * n, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1])
    return _r("gguf_header", "gguf", "write", {"at": ["header", fld], "value": value}, f"{fld} -> {value}")


# the metadata keys yirage or transformers read; mutations favour them
def _important_keys(lay: GGUFLayout) -> list[str]:
    arch = lay.kv("general.architecture").value
    keys = [kv.key for kv in lay.kvs if kv.key.startswith(arch + ".") or kv.key.startswith("tokenizer.ggml.")
            and kv.vtype != ARRAY]
    return keys + ["general.architecture", "tokenizer.chat_template"]


def _scalar_values(vtype: int) -> list:
    if vtype in (U32, U16, U8):
        return U32_VALUES
    if vtype in (I32, I16, I8, I64):
        return I32_VALUES + ([2**63 - 1, -2**63] if vtype == I64 else [])
    if vtype == U64:
        return U64_VALUES
    if vtype in (F32, F64):
        return FLOAT_VALUES
    if vtype == BOOL:
        return [0, 1, 2, 255]
    return [0]


def gen_gguf_metadata(rng: random.Random, ctx: Context) -> dict:
    lay = ctx.layout
    arch = lay.kv("general.architecture").value
    important = _important_keys(lay)
    kind = rng.choice(["inplace", "inplace", "inplace", "wrong_type", "wrong_type", "delete", "string",
                       "string", "length", "length", "array", "array", "add", "add"])
    cat = "gguf_metadata"
    if kind == "inplace":
        scalars = [kv for kv in lay.kvs if kv.vtype not in (STRING, ARRAY)]
        pref = [kv for kv in scalars if kv.key in important]
        kv = rng.choice(pref if rng.random() < 0.85 else scalars)
        value = rng.choice(_scalar_values(kv.vtype))
        return _r(cat, "gguf", "write", {"at": ["kv", kv.key, "value"], "value": value},
                  f"{kv.key} ({VTYPE_NAMES[kv.vtype]}) -> {_fmt_value(value)} in place")
    if kind == "wrong_type":
        key = rng.choice(important)
        vtype, value, sub = rng.choice([
            (STRING, "abc", None), (STRING, "64", None), (F32, 1.5, None), (F32, float("nan"), None),
            (F64, 64.0, None), (I64, 2**63 - 1, None), (I64, -1, None), (U64, 2**64 - 1, None),
            (I8, -1, None), (BOOL, 1, None), (U8, 255, None), (U32, 0, None), (I32, -1, None),
            (ARRAY, [1, 2, 3], U32), (ARRAY, [], U32), (ARRAY, ["a"], STRING)])
        return _r(cat, "gguf", "rebuild", {"set": [[key, vtype, value, sub]]},
                  f"{key} -> {VTYPE_NAMES[vtype]}{'[' + VTYPE_NAMES[sub] + ']' if sub is not None else ''} "
                  f"{_fmt_value(value)}")
    if kind == "delete":
        key = rng.choice(important + [kv.key for kv in lay.kvs if kv.vtype == ARRAY])
        return _r(cat, "gguf", "rebuild", {"delete": [key]}, f"delete key {key}")
    if kind == "string":
        key, value = rng.choice([
            ("general.architecture", ""), ("general.architecture", "gpt2"), ("general.architecture", "qwen2"),
            ("general.architecture", "mistral"), ("general.architecture", "LLAMA"),
            ("general.architecture", "llama\0"), ("general.architecture", {"hex": "6c6cff61"}),
            ("general.architecture", rep("a", 70000)), ("general.architecture", "bert"),
            ("tokenizer.ggml.model", ""), ("tokenizer.ggml.model", "llama"), ("tokenizer.ggml.model", "bert"),
            ("tokenizer.ggml.model", "t5"), ("tokenizer.ggml.model", "no_vocab"), ("tokenizer.ggml.model", "xyz"),
            ("tokenizer.ggml.pre", ""), ("tokenizer.ggml.pre", "qwen2"), ("tokenizer.ggml.pre", "nonexistent"),
            ("tokenizer.chat_template", ""), ("tokenizer.chat_template", "{% for m in messages %}"),
            ("tokenizer.chat_template", "{{ raise_exception('no') }}"),
            ("tokenizer.chat_template", "{{ messages[7]['content'] }}"),
            ("tokenizer.chat_template", rep("{% for m in messages %}{{ m.content }}{% endfor %}", 2000)),
            ("tokenizer.chat_template", {"hex": "7b7bff7d7d"}),
            ("general.name", {"hex": "ff" * 8}), ("general.name", rep("x", 100000))])
        return _r(cat, "gguf", "rebuild", {"set": [[key, STRING, value, None]]}, f"{key} -> {_fmt_value(value)}")
    if kind == "length":
        strings = [kv for kv in lay.kvs if kv.vtype == STRING]
        target = rng.choice(["str", "str", "key", "item"])
        if target == "item":
            kv = rng.choice([kv for kv in lay.kvs if kv.vtype == ARRAY and kv.subtype == STRING])
            i = rng.randrange(len(kv.value))
            at, orig = ["kv", kv.key, "items", i], len(str(kv.value[i]).encode())
        elif target == "key":
            kv = rng.choice(lay.kvs)
            at, orig = ["kv", kv.key, "key_len"], len(kv.key.encode())
        else:
            kv = rng.choice(strings)
            at, orig = ["kv", kv.key, "str_len"], kv.slots["str_bytes"].size
        value = rng.choice([0, 1, orig - 1, orig + 1, lay.size, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1])
        return _r(cat, "gguf", "write", {"at": at, "value": value},
                  f"length of {'/'.join(map(str, at[1:]))} ({orig}) -> {value}")
    if kind == "array":
        arrays = [kv for kv in lay.kvs if kv.vtype == ARRAY]
        kv = rng.choice(arrays)
        n = len(kv.value)
        sub = rng.choice(["count", "count", "type", "set", "item"])
        if sub == "count":
            value = rng.choice([0, 1, n - 1, n + 1, 2**31 - 1, 2**63 - 1, 2**64 - 1])
            return _r(cat, "gguf", "write", {"at": ["kv", kv.key, "array_count"], "value": value},
                      f"{kv.key} array count ({n}) -> {value}")
        if sub == "type":
            value = rng.choice([U8, I32, U64, F32, BOOL, STRING, ARRAY, 13, 2**32 - 1])
            return _r(cat, "gguf", "write", {"at": ["kv", kv.key, "array_type"], "value": value},
                      f"{kv.key} array item type -> {VTYPE_NAMES.get(value, value)}")
        if sub == "item" and kv.subtype != STRING:
            i = rng.randrange(n)
            value = rng.choice(_scalar_values(kv.subtype))
            return _r(cat, "gguf", "write", {"at": ["kv", kv.key, "items", i], "value": value},
                      f"{kv.key}[{i}] -> {value}")
        # list edits relative to the seed's list (recipes stay small): keep the first n items,
        # repeat the first n at the end, or set item i
        if kv.subtype == STRING:
            vals = list(kv.value)
            choice = rng.choice(["empty", "short", "dup", "bad_utf8", "blank", "garbage"])
            if choice == "empty":
                edit = {"keep": 0}
            elif choice == "short":
                edit = {"keep": rng.choice([1, 2, 17, len(vals) // 2])}
            elif choice == "dup":
                edit = {"dup_head": 3}
            elif choice == "bad_utf8":
                i = rng.randrange(len(vals))
                edit = {"set": [i, {"hex": "ff" + str(vals[i]).encode().hex()}]}
            elif choice == "blank":
                edit = {"set": [rng.randrange(len(vals)), ""]}
            else:
                edit = {"set": [rng.randrange(len(vals)), "a b c d"]}
            return _r(cat, "gguf", "rebuild", {"array_edit": [[kv.key, edit]]},
                      f"{kv.key} ({n} items): {choice} {_fmt_value(edit)}")
        choice = rng.choice(["empty", "short", "out_of_range"])
        if choice == "empty":
            edit = {"keep": 0}
        elif choice == "short":
            edit = {"keep": 5}
        else:
            edit = {"set": [rng.randrange(n), rng.choice([-1, 7, 2**31 - 1])]}
        return _r(cat, "gguf", "rebuild", {"array_edit": [[kv.key, edit]]},
                  f"{kv.key} ({n} items): {choice} {_fmt_value(edit)}")
    # add: keys the seed lacks but readers look at
    vocab = len(lay.kv("tokenizer.ggml.tokens").value)
    key, vtype, value = rng.choice([
        ("general.alignment", U32, 0), ("general.alignment", U32, 1), ("general.alignment", U32, 3),
        ("general.alignment", U32, 64), ("general.alignment", U32, 2**32 - 1),
        (f"{arch}.rope.scaling.type", STRING, "linear"), (f"{arch}.rope.scaling.type", STRING, "yarn"),
        (f"{arch}.rope.scaling.type", STRING, "dynamic"), (f"{arch}.rope.scaling.type", STRING, "bogus"),
        (f"{arch}.rope.scaling.factor", F32, 0.0), (f"{arch}.rope.scaling.factor", F32, -1.0),
        (f"{arch}.rope.scaling.factor", F32, float("nan")), (f"{arch}.rope.scaling.factor", F32, float("inf")),
        (f"{arch}.rope.scaling.factor", F32, 1e30), (f"{arch}.attention.key_length", U32, 0),
        (f"{arch}.attention.key_length", U32, 7), (f"{arch}.attention.value_length", U32, 2**31 - 1),
        (f"{arch}.attention.sliding_window", U32, 0), (f"{arch}.expert_count", U32, 8),
        ("tokenizer.ggml.eot_token_id", U32, vocab), ("tokenizer.ggml.eot_token_id", U32, 2**32 - 1),
        ("tokenizer.ggml.eom_token_id", I32, -1), ("tokenizer.ggml.eos_token_id", U32, vocab + 5),
        ("tokenizer.ggml.bos_token_id", U32, 2**31 - 1), ("tokenizer.ggml.add_bos_token", BOOL, 1),
        ("tokenizer.ggml.unknown_token_id", U32, 10**9)])
    extra = {}
    if key.endswith("rope.scaling.type"):
        extra = {"set": [[key, vtype, value, None], [f"{arch}.rope.scaling.factor", F32,
                                                     rng.choice([0.0, 2.0, -4.0, float("nan")]), None]]}
        if value == "yarn":
            extra["set"].append([f"{arch}.rope.scaling.original_context_length", U32,
                                 rng.choice([0, 1, 2**32 - 1]), None])
    args = extra or {"set": [[key, vtype, value, None]]}
    return _r(cat, "gguf", "rebuild", args,
              "set " + ", ".join(f"{k} = {_fmt_value(v)} ({VTYPE_NAMES[t]})" for k, t, v, _ in args["set"]))


def gen_gguf_truncate(rng: random.Random, ctx: Context) -> dict:
    lay = ctx.layout
    where = rng.choice(["empty", "magic", "header_only", "mid_metadata", "end_metadata", "mid_infos",
                        "end_infos", "data_start", "mid_tensor", "mid_tensor", "minus_one", "random", "random"])
    t = rng.choice(lay.tensors)
    t_start = lay.data_start + t.offset
    length = {
        "empty": 0, "magic": rng.choice([1, 3, 4, 8, 16]), "header_only": 24,
        "mid_metadata": rng.randrange(24, lay.kv_end), "end_metadata": lay.kv_end,
        "mid_infos": rng.randrange(lay.kv_end, lay.info_end), "end_infos": lay.info_end,
        "data_start": lay.data_start, "mid_tensor": t_start + max(1, lay.tensor_nbytes(t) // 2),
        "minus_one": lay.size - 1, "random": rng.randrange(lay.size),
    }[where]
    desc = f"truncate to {length} bytes ({where}{' of ' + t.name if where == 'mid_tensor' else ''})"
    return _r("gguf_truncate", "gguf", "truncate", {"length": length}, desc)


def _qtypes() -> dict[str, int]:
    import gguf

    return {q.name: int(q.value) for q in gguf.GGMLQuantizationType}


def gen_gguf_tensor_type(rng: random.Random, ctx: Context) -> dict:
    lay = ctx.layout
    t = rng.choice(lay.tensors)
    qtypes = _qtypes()
    if rng.random() < 0.75:
        names = list(qtypes) + ["invalid"]
        name = rng.choice(names)
        value = qtypes[name] if name != "invalid" else rng.choice([4, 5, 40, 99, 2**31 - 1, 2**32 - 1])
        return _r("gguf_tensor_type", "gguf", "write", {"at": ["tensor", t.name, "type"], "value": value},
                  f"{t.name} type {_qname(t.type)} -> {_qname(value)} in place (data unchanged)")
    # re-encoded: a valid file whose tensor has another type (loaded, dequantized or rejected)
    cands = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
    if t.dims[0] % 256 == 0:
        cands += ["Q4_K", "Q6_K", "Q2_K"]
    name = rng.choice(cands)
    return _r("gguf_tensor_type", "gguf", "rebuild",
              {"tensor_set": [[t.name, {"type": qtypes[name], "data": "requantize"}]]},
              f"{t.name} re-encoded {_qname(t.type)} -> {name}")


def _qname(value: int) -> str:
    names = {v: k for k, v in _qtypes().items()}
    return names.get(value, str(value))


def gen_gguf_tensor_shape(rng: random.Random, ctx: Context) -> dict:
    lay = ctx.layout
    t = rng.choice(lay.tensors)
    kind = rng.choice(["dim", "dim", "dim", "n_dims", "swap", "rebuild"])
    cat = "gguf_tensor_shape"
    if kind == "dim" or (kind == "swap" and len(t.dims) < 2):
        i = rng.randrange(len(t.dims))
        d = t.dims[i]
        value = rng.choice([0, 1, 2, d - 1, d + 1, 2 * d, d // 2, 2**31 - 1, 2**32, 2**63 - 1, 2**64 - 1])
        return _r(cat, "gguf", "write", {"at": ["tensor", t.name, "dims", i], "value": value},
                  f"{t.name} dim {i} ({d}) -> {value} in place")
    if kind == "n_dims":
        value = rng.choice([0, 1, 3, 4, 5, 2**31 - 1, 2**32 - 1])
        if value == len(t.dims):
            value = 0
        return _r(cat, "gguf", "write", {"at": ["tensor", t.name, "n_dims"], "value": value},
                  f"{t.name} n_dims ({len(t.dims)}) -> {value} in place")
    if kind == "swap":
        a, b = t.dims[0], t.dims[1]
        out = bytearray(struct.pack("<QQ", b, a))
        return _r(cat, "gguf", "write", {"at": ["tensor", t.name, "dims", 0], "hex": out.hex()},
                  f"{t.name} dims {t.dims} -> {[b, a]} (swapped)")
    # rebuilt with a consistent but wrong shape (data sized to match)
    block, _ = _type_size(t.type)
    options = [[block * 2] + t.dims[1:], [block * 4] + t.dims[1:], t.dims + [1], [math.prod(t.dims)],
               [t.dims[0]] + [d * 2 for d in t.dims[1:]] if len(t.dims) > 1 else [t.dims[0] * 2]]
    dims = rng.choice([d for d in options if d != t.dims])
    return _r(cat, "gguf", "rebuild", {"tensor_set": [[t.name, {"dims": dims, "data": "zeros"}]]},
              f"{t.name} dims {t.dims} -> {dims} (file rebuilt, data zeros)")


def gen_gguf_tensor_offset(rng: random.Random, ctx: Context) -> dict:
    lay = ctx.layout
    t = rng.choice(lay.tensors)
    data_size = lay.size - lay.data_start
    kind = rng.choice(["offset", "offset", "offset", "name_len", "rename", "rename", "delete", "add", "dup"])
    cat = "gguf_tensor_offset"
    if kind == "offset":
        other = rng.choice(lay.tensors)
        value = rng.choice([0, other.offset, t.offset + 1, t.offset + 32, data_size, data_size - 1,
                            data_size + 32, 2**31, 2**63 - 1, 2**64 - 1, 2**64 - 32, 2**64 - t.offset])
        return _r(cat, "gguf", "write", {"at": ["tensor", t.name, "offset"], "value": value},
                  f"{t.name} data offset ({t.offset}) -> {value} (data section is {data_size} bytes)")
    if kind == "name_len":
        n = len(t.name)
        value = rng.choice([0, 1, n - 1, n + 1, 2**32, 2**63 - 1, 2**64 - 1])
        return _r(cat, "gguf", "write", {"at": ["tensor", t.name, "name_len"], "value": value},
                  f"{t.name} name length ({n}) -> {value}")
    if kind == "rename":
        other = rng.choice([x for x in lay.tensors if x.name != t.name])
        new = rng.choice([other.name, "blk.2.attn_q.weight", "blk.99999999999.attn_q.weight", "blk.-1.attn_q.weight",
                          "blk.0.attn_q.bias", "blk.0.attn_output.bias", "output.weight", "rope_freqs.weight",
                          "token_embd.bias", "", rep("x", 70000), "blk.0.attn_qq.weight"])
        return _r(cat, "gguf", "rebuild", {"tensor_set": [[t.name, {"name": new}]]},
                  f"rename tensor {t.name} -> {_fmt_value(new)}")
    if kind == "delete":
        return _r(cat, "gguf", "rebuild", {"tensor_delete": [t.name]}, f"remove tensor {t.name}")
    if kind == "dup":
        return _r(cat, "gguf", "rebuild", {"tensor_add": [[t.name, t.dims, t.type, "zeros"]]},
                  f"duplicate tensor {t.name} (zeros)")
    name, dims, fill = rng.choice([
        ("rope_freqs.weight", [8], 0.0), ("rope_freqs.weight", [8], 1.0), ("rope_freqs.weight", [4], 1.0),
        ("rope_freqs.weight", [8], float("nan")), ("rope_freqs.weight", [1], -1.0),
        ("output.weight", [64, 16], 0.0), ("blk.0.attn_q.bias", [64], 0.0), ("blk.0.attn_q.bias", [7], 0.0),
        ("blk.5.ffn_up.weight", [64, 128], 0.0), ("token_embd.weight", [64, 3], 0.0)])
    return _r(cat, "gguf", "rebuild", {"tensor_add": [[name, dims, 0, fill]]},
              f"add F32 tensor {name} {dims} filled with {fill}")


# ---- HF generators

CONFIG_NUMERIC = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "head_dim", "bos_token_id",
                  "eos_token_id", "pad_token_id", "initializer_range", "attention_dropout", "pretraining_tp",
                  "sliding_window"]


def gen_hf_config(rng: random.Random, ctx: Context) -> dict:
    cfg = ctx.config
    cat = "hf_config"
    kind = rng.choice(["numeric"] * 6 + ["wrong_type", "wrong_type", "missing", "missing", "model_type", "rope",
                                         "rope", "flags", "malformed", "generation"])
    if kind == "numeric":
        key = rng.choice(CONFIG_NUMERIC + ["rope_parameters.rope_theta"])
        value = rng.choice(JSON_NUMBERS)
        path = key.split(".")
        return _r(cat, "hf", "json_set", {"file": "config.json", "path": path, "value": value},
                  f"config.json {key} -> {_fmt_value(value)}")
    if kind == "wrong_type":
        key = rng.choice(CONFIG_NUMERIC + ["tie_word_embeddings", "attention_bias", "rope_parameters", "dtype"])
        value = rng.choice(JSON_WRONG_TYPES)
        return _r(cat, "hf", "json_set", {"file": "config.json", "path": [key], "value": value},
                  f"config.json {key} -> {_fmt_value(value)}")
    if kind == "missing":
        key = rng.choice(sorted(cfg))
        return _r(cat, "hf", "json_del", {"file": "config.json", "path": [key]}, f"config.json: delete {key}")
    if kind == "model_type":
        value = rng.choice(["", "gpt2", "qwen2", "mistral", "bert", "LLAMA", None, 5, "llama4", "../llama"])
        return _r(cat, "hf", "json_set", {"file": "config.json", "path": ["model_type"], "value": value},
                  f"config.json model_type -> {_fmt_value(value)}")
    if kind == "rope":
        value = rng.choice([
            {"rope_type": "linear", "factor": 0.0, "rope_theta": 10000.0},
            {"rope_type": "linear", "factor": -2.0, "rope_theta": 10000.0},
            {"rope_type": "linear", "factor": float("nan"), "rope_theta": 10000.0},
            {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
            {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 0},
            {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0},
            {"rope_type": "longrope", "rope_theta": 10000.0},
            {"rope_type": "bogus", "rope_theta": 10000.0},
            {"rope_type": "default", "rope_theta": 0.0}, {"rope_type": "default", "rope_theta": -1.0},
            {"rope_type": "default", "rope_theta": float("inf")}, {"rope_type": "default"},
            {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.0}, {}])
        return _r(cat, "hf", "json_set", {"file": "config.json", "path": ["rope_parameters"], "value": value},
                  f"config.json rope_parameters -> {_fmt_value(value)}")
    if kind == "flags":
        key, value = rng.choice([("tie_word_embeddings", True), ("tie_word_embeddings", "no"),
                                 ("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu"),
                                 ("hidden_act", "bogus"), ("dtype", "float64"), ("dtype", "int8"),
                                 ("dtype", "bogus"), ("architectures", ["Bogus"]), ("use_sliding_window", True),
                                 ("head_dim", 8), ("head_dim", 32), ("num_key_value_heads", 3)])
        return _r(cat, "hf", "json_set", {"file": "config.json", "path": [key], "value": value},
                  f"config.json {key} -> {_fmt_value(value)}")
    if kind == "generation":
        key, value = rng.choice([("eos_token_id", 10**9), ("eos_token_id", -1), ("eos_token_id", [1, 2**63 - 1]),
                                 ("eos_token_id", "w1"), ("eos_token_id", None), ("bos_token_id", 2**64),
                                 ("max_new_tokens", -1), ("temperature", float("nan"))])
        if rng.random() < 0.2:
            return _r(cat, "hf", "raw", {"file": "generation_config.json", "hex": b'{"eos_token_id": [1,'.hex()},
                      "generation_config.json malformed")
        return _r(cat, "hf", "json_set", {"file": "generation_config.json", "path": [key], "value": value},
                  f"generation_config.json {key} -> {_fmt_value(value)}")
    text = ctx.hf_files["config.json"]
    raw, what = rng.choice([(b"", "empty"), (b"{", "'{'"), (b"[]", "a list"), (b"null", "null"),
                            (text[: len(text) // 2], "cut in half"), (b"\xff\xfe" + text, "invalid UTF-8 prefix"),
                            ([rep("5b", 100000), rep("5d", 100000)], "100000-deep nesting"),
                            (text.replace(b'"vocab_size"', b'"vocab_size": 1, "vocab_size"'), "duplicate key")])
    return _r(cat, "hf", "raw", {"file": "config.json", "hex": _hex(raw)}, f"config.json -> {what}")


def gen_hf_index(rng: random.Random, ctx: Context) -> dict:
    cat = "hf_index"
    idx = ctx.index
    names = sorted(idx["weight_map"])
    shards = sorted(set(idx["weight_map"].values()))
    kind = rng.choice(["entry", "entry", "entry", "map", "malformed", "delete_shard", "symlink", "symlink"])
    if kind == "symlink":  # a shard replaced by a symlink: outside the directory, special files, loops
        s = rng.choice(shards)
        target = rng.choice(["/etc/passwd", "/dev/zero", "/dev/null", "/proc/self/mem", "/", ".", "..",
                             s, "missing.safetensors", f"$SEED_HF/{s}", f"../../../../../../../..$SEED_HF/{s}",
                             "config.json", "tokenizer.json"])
        return _r(cat, "hf", "symlink", {"file": s, "target": target}, f"shard {s} -> symlink to {target}")
    if kind == "entry":
        name = rng.choice(names)
        value = rng.choice(["/etc/passwd", "/" + shards[0], "../" + shards[0], "../../../../etc/hostname",
                            "missing.safetensors", "", ".", "..", "config.json", "tokenizer.json",
                            shards[0] + "/x", "sub/" + shards[0], "\0", rep("a", 5000), None, 5, [shards[0]],
                            {"file": shards[0]}, shards[0].upper()])
        return _r(cat, "hf", "json_set", {"file": "model.safetensors.index.json", "path": ["weight_map", name],
                                          "value": value}, f"index weight_map[{name}] -> {_fmt_value(value)}")
    if kind == "map":
        value = rng.choice([{}, [], None, "x", {names[0]: shards[0]}, 5])
        if rng.random() < 0.3:
            return _r(cat, "hf", "json_del", {"file": "model.safetensors.index.json", "path": ["weight_map"]},
                      "index: delete weight_map")
        return _r(cat, "hf", "json_set", {"file": "model.safetensors.index.json", "path": ["weight_map"],
                                          "value": value}, f"index weight_map -> {_fmt_value(value)}")
    if kind == "delete_shard":
        s = rng.choice(shards)
        return _r(cat, "hf", "delete", {"file": s}, f"delete shard {s} (still in the index)")
    text = ctx.hf_files["model.safetensors.index.json"]
    raw, what = rng.choice([(b"", "empty"), (b"{", "'{'"), (b"[]", "a list"), (b"null", "null"),
                            (text[: len(text) // 2], "cut in half"), (b"\xff" + text, "invalid UTF-8"),
                            ([rep("7b", 50000), rep("7d", 50000)], "deep nesting")])
    return _r(cat, "hf", "raw", {"file": "model.safetensors.index.json", "hex": _hex(raw)}, f"index -> {what}")


def gen_hf_tokenizer(rng: random.Random, ctx: Context) -> dict:
    cat = "hf_tokenizer"
    tok = ctx.tokenizer
    vocab = tok["model"]["vocab"]
    n = len(vocab)
    kind = rng.choice(["vocab_id", "vocab_id", "vocab_id", "added", "added", "utf8", "model", "config",
                       "config", "malformed"])
    if kind == "vocab_id":
        word = rng.choice(["w0", "w0", "w1", "w2", f"w{rng.randrange(n)}"])
        value = rng.choice([n, n + 1, 10**6, 2**31 - 1, 2**32, 2**63 - 1, 2**64, -1, -2**31, 1.5, "x", None])
        return _r(cat, "hf", "json_set", {"file": "tokenizer.json", "path": ["model", "vocab", word], "value": value},
                  f"tokenizer.json vocab[{word}] -> {_fmt_value(value)}"
                  + (" (the unk token: the prompt's id)" if word == "w0" else ""))
    if kind == "added":
        i = rng.randrange(len(tok["added_tokens"]))
        key, value = rng.choice([("id", n), ("id", 10**6), ("id", 2**32 - 1), ("id", -1), ("id", 2**63),
                                 ("content", ""), ("content", "hi"), ("special", "yes")])
        return _r(cat, "hf", "json_set", {"file": "tokenizer.json", "path": ["added_tokens", i, key],
                                          "value": value}, f"tokenizer.json added_tokens[{i}].{key} -> {value}")
    if kind == "utf8":
        word = f"w{rng.randrange(n)}"
        bad = rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"])
        return _r(cat, "hf", "replace", {"file": "tokenizer.json", "find": f'"{word}"',
                                         "replace_hex": (b'"' + word.encode() + bad + b'"').hex(), "count": 1},
                  f"tokenizer.json token {word} -> invalid UTF-8 {bad!r}")
    if kind == "model":
        path, value = rng.choice([(["model", "type"], "Bogus"), (["model", "type"], "BPE"),
                                  (["model", "type"], None), (["model", "vocab"], {}), (["model", "vocab"], []),
                                  (["model", "unk_token"], "zz"), (["model", "unk_token"], None),
                                  (["pre_tokenizer"], {"type": "Bogus"}), (["decoder"], {"type": "ByteLevel"}),
                                  (["post_processor", "single"], [{"SpecialToken": {"id": "zz", "type_id": 0}}]),
                                  (["normalizer"], {"type": "Replace", "pattern": {"Regex": "("}, "content": ""})])
        return _r(cat, "hf", "json_set", {"file": "tokenizer.json", "path": path, "value": value},
                  f"tokenizer.json {'.'.join(map(str, path))} -> {_fmt_value(value)}")
    if kind == "config":
        key, value = rng.choice([("eos_token", "w999"), ("eos_token", ""), ("eos_token", None), ("eos_token", 5),
                                 ("bos_token", {"content": "w2", "bogus": 1}), ("unk_token", "zz"),
                                 ("model_max_length", -1), ("model_max_length", 0), ("tokenizer_class", "Bogus"),
                                 ("tokenizer_class", "LlamaTokenizer"),
                                 ("chat_template", "{% for m in messages %}"),
                                 ("chat_template", "{{ raise_exception('no') }}"),
                                 ("chat_template", "{{ messages[3] }}"),
                                 ("chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
                                 ("add_bos_token", True), ("padding_side", "middle")])
        return _r(cat, "hf", "json_set", {"file": "tokenizer_config.json", "path": [key], "value": value},
                  f"tokenizer_config.json {key} -> {_fmt_value(value)}")
    fname = rng.choice(["tokenizer.json", "tokenizer.json", "tokenizer_config.json"])
    text = ctx.hf_files[fname]
    raw, what = rng.choice([(b"", "empty"), (b"{", "'{'"), (b"null", "null"), (text[: len(text) // 2], "cut in half"),
                            (b"\xff\xfe" + text, "invalid UTF-8 prefix")])
    return _r(cat, "hf", "raw", {"file": fname, "hex": raw.hex()}, f"{fname} -> {what}")


ST_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64", "BOOL",
             "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "C64", "XX", ""]


def gen_hf_safetensors(rng: random.Random, ctx: Context) -> dict:
    cat = "hf_safetensors"
    shard = rng.choice(sorted(ctx.st_headers))
    header = ctx.st_headers[shard]
    names = sorted(k for k in header if k != "__metadata__")
    t = rng.choice(names)
    entry = header[t]
    start, end = entry["data_offsets"]
    body = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    kind = rng.choice(["dtype", "dtype", "shape", "shape", "offsets", "offsets", "offsets", "length", "raw",
                       "rename", "delete", "metadata"])
    args: dict[str, Any] = {"file": shard, "tensor": t}
    if kind == "dtype":
        value = rng.choice(ST_DTYPES)
        args.update(key="dtype", value=value)
        desc = f"{shard} {t} dtype {entry['dtype']} -> {value!r}"
    elif kind == "shape":
        shape = entry["shape"]
        value = rng.choice([[], [0], [0] + shape[1:], shape[::-1], shape + [1], [math.prod(shape)],
                            [shape[0] * 2] + shape[1:], [2**62, 4], [2**63 - 1] + shape[1:], [-1] + shape[1:],
                            [shape[0], shape[-1] + 1] if len(shape) > 1 else [shape[0] + 1], [1.5], ["a"]])
        args.update(key="shape", value=value)
        desc = f"{shard} {t} shape {shape} -> {value}"
    elif kind == "offsets":
        value = rng.choice([[0, 0], [end, start], [start, end + 4], [start, body + 4], [body, body + end - start],
                            [start + 1, end + 1], [start, 2**63], [start, 2**64 - 1], [-4, end], [2**64 - 8, end],
                            [start], [start, end, end], "x", [0.5, end]])
        args.update(key="data_offsets", value=value)
        desc = f"{shard} {t} data_offsets {[start, end]} -> {value} (body {body} bytes)"
    elif kind == "length":
        hlen = struct.unpack_from("<Q", ctx.hf_files[shard], 0)[0]
        value = rng.choice([0, 1, 7, hlen - 8, hlen + 8, len(ctx.hf_files[shard]), 2**31, 2**63 - 1, 2**64 - 1])
        args = {"file": shard, "length": value}
        desc = f"{shard} header length {hlen} -> {value}"
    elif kind == "raw":
        raw_header = json.dumps(header, separators=(",", ":")).encode()
        raw, what = rng.choice([(b"", "empty"), (b"{", "'{'"), (b"[]", "a list"), (b"null", "null"),
                                (raw_header[: len(raw_header) // 2], "cut in half"),
                                (b"\xff" + raw_header[1:], "invalid UTF-8"),
                                (raw_header[:-1] + b',' + json.dumps(t).encode() + b':'
                                 + json.dumps(entry).encode() + b'}', "duplicate tensor key")])
        args = {"file": shard, "raw_hex": raw.hex()}
        desc = f"{shard} header JSON -> {what}"
    elif kind == "rename":
        new = rng.choice(["model.layers.9.mlp.up_proj.weight", "bogus", "", "model.embed_tokens.weight",
                          "model.rotary_emb.inv_freq", "layers.0.mlp.up_proj.weight"])
        args["rename"] = new
        desc = f"{shard} rename {t} -> {new!r}"
    elif kind == "delete":
        args.update(key=None, value=None)
        desc = f"{shard} header: remove {t}"
    else:
        value = rng.choice([{"format": 5}, {"format": "tf"}, [], "x", None, {"a": {"b": 1}}])
        args = {"file": shard, "tensor": "__metadata__", "key": None, "value": value}
        if value is None:
            args["value"] = 0
        desc = f"{shard} __metadata__ -> {_fmt_value(args['value'])}"
    return _r(cat, "hf", "st_header", args, desc)


def gen_hf_bytes(rng: random.Random, ctx: Context) -> dict:
    cat = "hf_bytes"
    files = sorted(ctx.hf_files)
    shards = [f for f in files if f.endswith(".safetensors")]
    fname = rng.choice(shards + shards + files)
    data = ctx.hf_files[fname]
    kind = rng.choice(["bitflip", "bitflip", "bitflip", "truncate", "truncate", "delete", "symlink"])
    if kind == "symlink":  # any file of the directory replaced by a special file, a loop or a directory
        target = rng.choice(["/dev/zero", "/dev/null", "/dev/urandom", "/proc/self/mem", fname, ".", "/",
                             "missing.json"])
        return _r(cat, "hf", "symlink", {"file": fname, "target": target}, f"{fname} -> symlink to {target}")
    if kind == "bitflip":
        lo = 0
        if fname.endswith(".safetensors") and rng.random() < 0.5:
            lo = 8 + struct.unpack_from("<Q", data, 0)[0]  # in the tensor data
        n = rng.choice([1, 1, 2, 4, 8])
        flips = sorted({(rng.randrange(lo, len(data)), rng.randrange(8)) for _ in range(n)})
        return _r(cat, "hf", "bitflip", {"file": fname, "flips": [list(f) for f in flips]},
                  f"{fname}: {len(flips)} bit flip(s) at {[f[0] for f in flips][:4]}")
    if kind == "truncate":
        length = rng.choice([0, 1, 8, rng.randrange(len(data)), len(data) - 1])
        return _r(cat, "hf", "truncate", {"file": fname, "length": length},
                  f"{fname}: truncate {len(data)} -> {length} bytes")
    return _r(cat, "hf", "delete", {"file": fname}, f"delete {fname}")


# ---- systematic lists: the boundary values of the fields that size things, every one of them
# (make_recipes spends up to half of a category's budget on these, in a seeded order)

SIZE_KEYS_HF = ["num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings"]
SIZE_VALUES = [0, -1, 1, 3, 2**31 - 1, 2**32 - 1, 2**63 - 1, 10**30, 1.5, float("nan"), "7", None]


def sys_hf_config(ctx: Context) -> list[dict]:
    out = [_r("hf_config", "hf", "json_set", {"file": "config.json", "path": [k], "value": v},
              f"config.json {k} -> {_fmt_value(v)}") for k in SIZE_KEYS_HF for v in SIZE_VALUES]
    for v in [0.0, -1.0, float("nan"), float("inf"), 1e308, "x", None]:
        out.append(_r("hf_config", "hf", "json_set", {"file": "config.json", "path": ["rms_norm_eps"], "value": v},
                      f"config.json rms_norm_eps -> {_fmt_value(v)}"))
        out.append(_r("hf_config", "hf", "json_set",
                      {"file": "config.json", "path": ["rope_parameters", "rope_theta"], "value": v},
                      f"config.json rope_parameters.rope_theta -> {_fmt_value(v)}"))
    return out


def sys_gguf_metadata(ctx: Context) -> list[dict]:
    lay = ctx.layout
    arch = lay.kv("general.architecture").value
    out = []
    for kv in lay.kvs:
        if kv.vtype in (STRING, ARRAY) or not (kv.key.startswith(arch + ".") or kv.key.endswith("_token_id")):
            continue
        values = [0.0, -1.0, float("nan"), float("inf")] if kv.vtype in (F32, F64) else [0, 1, 2**31 - 1, 2**32 - 1]
        if kv.key.endswith("_token_id"):
            values = [len(lay.kv("tokenizer.ggml.tokens").value), 2**31 - 1, 2**32 - 1]
        out += [_r("gguf_metadata", "gguf", "write", {"at": ["kv", kv.key, "value"], "value": v},
                   f"{kv.key} ({VTYPE_NAMES[kv.vtype]}) -> {_fmt_value(v)} in place") for v in values]
        if kv.key.startswith(arch + "."):
            out.append(_r("gguf_metadata", "gguf", "rebuild", {"set": [[kv.key, U64, 2**63 - 1, None]]},
                          f"{kv.key} -> UINT64 {2**63 - 1}"))
    return out


def sys_hf_tokenizer(ctx: Context) -> list[dict]:
    n = len(ctx.tokenizer["model"]["vocab"])
    return [_r("hf_tokenizer", "hf", "json_set", {"file": "tokenizer.json", "path": ["model", "vocab", "w0"], "value": v},
               f"tokenizer.json vocab[w0] -> {_fmt_value(v)} (the unk token: the prompt's id)")
            for v in [n, n + 1, 10**6, 2**31 - 1, 2**32 - 1, -1]]


SYSTEMATIC: dict[str, Callable[[Context], list[dict]]] = {
    "hf_config": sys_hf_config, "gguf_metadata": sys_gguf_metadata, "hf_tokenizer": sys_hf_tokenizer,
}


GENERATORS: dict[str, Callable[[random.Random, Context], dict]] = {
    "gguf_bitflip": gen_gguf_bitflip, "gguf_header": gen_gguf_header, "gguf_metadata": gen_gguf_metadata,
    "gguf_truncate": gen_gguf_truncate, "gguf_tensor_type": gen_gguf_tensor_type,
    "gguf_tensor_shape": gen_gguf_tensor_shape, "gguf_tensor_offset": gen_gguf_tensor_offset,
    "hf_config": gen_hf_config, "hf_index": gen_hf_index, "hf_tokenizer": gen_hf_tokenizer,
    "hf_safetensors": gen_hf_safetensors, "hf_bytes": gen_hf_bytes,
}
CATEGORIES = list(GENERATORS)


def recipe_key(recipe: dict) -> str:
    """A stable identity of a recipe (its op and args), for de-duplication and file names."""
    text = json.dumps([recipe["target"], recipe["op"], recipe["args"]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_recipes(ctx: Context, per_category: int, seed: int = 0, categories: list[str] | None = None) -> list[dict]:
    """``per_category`` distinct recipes for each category (fewer when a category runs out of
    distinct mutations), deterministic in ``seed``; interleaved across categories."""
    by_cat = []
    for cat in categories or CATEGORIES:
        rng = random.Random(f"{seed}:{cat}")
        seen, out = set(), []
        fixed = SYSTEMATIC[cat](ctx) if cat in SYSTEMATIC else []
        rng.shuffle(fixed)
        for recipe in fixed[:per_category // 2]:
            key = recipe_key(recipe)
            if key not in seen:
                seen.add(key)
                out.append(recipe)
        tries = 0
        while len(out) < per_category and tries < per_category * 20:
            tries += 1
            recipe = GENERATORS[cat](rng, ctx)
            key = recipe_key(recipe)
            if key not in seen:
                seen.add(key)
                out.append(recipe)
        by_cat.append(out)
    recipes = []
    for i in range(max((len(c) for c in by_cat), default=0)):
        recipes += [c[i] for c in by_cat if i < len(c)]
    for i, r in enumerate(recipes):
        r["id"] = i
    return recipes
