"""``yirage embed INPUT... -o OUT.parquet``: an embedding job over text files, JSON lines, CSV and
Parquet, written as Parquet shards that a rerun of the same command resumes.

- **Inputs**: files, directories (their files with a known extension, sorted) and globs. The
  format comes from the extension (``.txt``: one sentence per line; ``.jsonl``/``.ndjson``;
  ``.csv``; ``.parquet``) or ``--format``. Tabular inputs take the text from ``text_column``
  and the id from ``id_column`` (None: ``<file name>:<row>``, as text files always do). Rows are
  read with the standard library (json, csv) and pyarrow (Parquet).
- **Output**: a directory (named like the ``-o`` path) of shards ``part-00000.parquet``, ...,
  each ``shard_rows`` rows in input order: an ``id`` string column and an ``embedding`` column,
  a fixed-size list of float32; the file's metadata names the model, its dtype and quantization
  (vectors are float32 whichever). Each shard is written to a temporary name in the directory,
  then renamed: a shard is there whole or not at all. ``_job.json`` records what the job is
  (inputs, model, options, row count); a rerun with the same job skips the shards that exist,
  a different one is refused. So a killed job, rerun, ends with every input row exactly once.
- **Workers**: ``workers`` > 1 encodes on ``EmbeddingModel``'s multi-process pool.

Empty or null texts are an error naming the file and row, or skipped with ``skip_empty``.
"""
from __future__ import annotations

import csv
import glob
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import YirageError

FORMATS = {".txt": "text", ".text": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
           ".parquet": "parquet"}
JOB_FILE = "_job.json"


@dataclass(frozen=True)
class Row:
    id: str
    text: str


def expand_inputs(inputs: list[str], fmt: str | None) -> list[tuple[Path, str]]:
    """(file, format) of every input: files as given, directories' files with a known extension
    (sorted), globs' matches (sorted). YirageError: nothing matches, a file is unreadable, or its
    format is unknown (give --format)."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and (fmt or p.suffix.lower() in FORMATS))
            if not found:
                raise YirageError(f"{item}: the directory holds no input file (.txt, .jsonl, .csv, .parquet)")
            files.extend(found)
        elif any(c in item for c in "*?["):
            matched = sorted(Path(p) for p in glob.glob(item) if Path(p).is_file())
            if not matched:
                raise YirageError(f"{item}: no file matches")
            files.extend(matched)
        else:
            if not path.is_file():
                raise YirageError(f"{item}: no such file")
            files.append(path)
    out = []
    for f in files:
        kind = fmt or FORMATS.get(f.suffix.lower())
        if kind is None:
            raise YirageError(f"{f}: unknown format {f.suffix!r}: give --format text|jsonl|csv|parquet")
        if not os.access(f, os.R_OK):
            raise YirageError(f"{f}: cannot be read")
        out.append((f, kind))
    return out


def read_rows(files: list[tuple[Path, str]], text_column: str = "text", id_column: str | None = None,
              skip_empty: bool = False) -> list[Row]:
    """Every row of ``files`` in order. YirageError naming the file (and row): a missing column,
    a line that is not JSON, an empty or null text (unless ``skip_empty``), no rows at all."""
    rows: list[Row] = []
    for path, kind in files:
        for i, record in enumerate(_records(path, kind)):
            if kind == "text":
                text, rid = record, None
            else:
                if text_column not in record:
                    raise YirageError(f"{path}: row {i} has no column {text_column!r} (--text-column); it has "
                                      f"{', '.join(map(repr, list(record)[:8]))}")
                text = record[text_column]
                if id_column is not None and id_column not in record:
                    raise YirageError(f"{path}: row {i} has no column {id_column!r} (--id-column)")
                rid = None if id_column is None else record[id_column]
            if text is None or (isinstance(text, str) and not text.strip()):
                if skip_empty:
                    continue
                raise YirageError(f"{path}: row {i} has an empty or null text: fix it or pass --skip-empty")
            if not isinstance(text, str):
                raise YirageError(f"{path}: row {i}: the text is a {type(text).__name__}, not a string")
            rows.append(Row(f"{path.name}:{i}" if rid is None else str(rid), text))
    if not rows:
        raise YirageError(f"no rows to embed in {', '.join(str(p) for p, _ in files)}")
    return rows


def _records(path: Path, kind: str):
    try:
        if kind == "text":
            with open(path, encoding="utf-8") as f:
                yield from (line.rstrip("\n").rstrip("\r") for line in f)
        elif kind == "jsonl":
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        raise YirageError(f"{path}: line {i + 1} is not JSON ({e})") from None
                    if not isinstance(record, dict):
                        raise YirageError(f"{path}: line {i + 1} is not a JSON object")
                    yield record
        elif kind == "csv":
            with open(path, encoding="utf-8", newline="") as f:
                yield from csv.DictReader(f)
        else:
            import pyarrow.parquet as pq

            yield from pq.read_table(path).to_pylist()
    except UnicodeDecodeError as e:
        raise YirageError(f"{path}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise YirageError(f"{path}: cannot be read ({e.strerror or e})") from None
    except ImportError:
        raise YirageError(f"{path}: Parquet needs pyarrow: pip install pyarrow") from None
    except Exception as e:  # pyarrow's errors for a damaged file
        if isinstance(e, YirageError):
            raise
        raise YirageError(f"{path}: cannot be read as {kind} ({type(e).__name__}: {e})") from None


def run_job(model, rows: list[Row], output: str, job: dict, shard_rows: int = 10000, batch_size: int = 32,
            normalize: bool = False, workers: int = 1, progress: bool = True) -> dict:
    """Embed ``rows`` into Parquet shards in the directory ``output``, skipping the shards a
    previous run of the same ``job`` (a JSON-able description) finished. Returns {"rows",
    "shards", "written", "skipped", "seconds"}. YirageError: ``output`` holds a different job
    or is not a directory, a shard cannot be written, pyarrow missing."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise YirageError("Parquet output needs pyarrow: pip install pyarrow") from None
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise YirageError(f"{output} exists and is not a directory (the job writes its shards there)")
    out.mkdir(parents=True, exist_ok=True)
    record = {**job, "rows": len(rows), "shard_rows": shard_rows}
    job_path = out / JOB_FILE
    if job_path.exists():
        try:
            previous = json.loads(job_path.read_text())
        except ValueError:
            previous = None
        if previous != record:
            raise YirageError(f"{output} holds the shards of a different job ({JOB_FILE} differs): give another "
                              "-o, or delete it to start over")
    else:
        _commit(job_path, lambda tmp: tmp.write_bytes(json.dumps(record, indent=1, sort_keys=True).encode()))
    n_shards = -(-len(rows) // shard_rows)
    meta = {b"yirage.model": str(job.get("model")).encode(), b"yirage.dtype": str(job.get("dtype")).encode(),
            b"yirage.quantization": str(job.get("quantization")).encode(),
            b"yirage.vectors": b"float32 (every dtype and quantization writes float32 vectors)"}
    pool = model.start_multi_process_pool(["cpu"] * workers) if workers > 1 else None
    t0, done, written = time.perf_counter(), 0, 0
    try:
        for s in range(n_shards):
            path = out / f"part-{s:05d}.parquet"
            chunk = rows[s * shard_rows:(s + 1) * shard_rows]
            if not path.exists():
                texts = [r.text for r in chunk]
                vectors = (model.encode_multi_process(texts, pool, batch_size=batch_size,
                                                      normalize_embeddings=normalize) if pool is not None
                           else model.encode(texts, batch_size=batch_size, normalize_embeddings=normalize))
                dim = vectors.shape[1]
                flat = pa.array(vectors.reshape(-1), type=pa.float32())
                table = pa.table({"id": pa.array([r.id for r in chunk], type=pa.string()),
                                  "embedding": pa.FixedSizeListArray.from_arrays(flat, dim)})
                table = table.replace_schema_metadata(meta)
                _commit(path, lambda tmp: pq.write_table(table, tmp))
                written += 1
            done += len(chunk)
            if progress:
                rate = done / max(time.perf_counter() - t0, 1e-9)
                eta = (len(rows) - done) / rate if rate > 0 else 0.0
                print(f"\rembed: {done}/{len(rows)} rows, {rate:.0f} rows/s, ETA {eta:.0f} s", end="",
                      file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            model.stop_multi_process_pool(pool)
        if progress:
            print(file=sys.stderr, flush=True)
    return {"rows": len(rows), "shards": n_shards, "written": written, "skipped": n_shards - written,
            "seconds": time.perf_counter() - t0}


def _commit(path: Path, write) -> None:
    """``write(tmp)`` a file beside ``path``, then rename it over ``path`` (whole or not at all);
    the temporary file is removed if anything fails. YirageError naming ``path`` on OSError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise YirageError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
