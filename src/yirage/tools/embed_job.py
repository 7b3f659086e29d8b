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
    """Every row of ``files`` in order (``file_rows`` of each). YirageError naming the file (and
    row): a missing column, a line that is not JSON, an empty or null text (unless
    ``skip_empty``), no rows at all."""
    rows = [row for path, kind in files for row in file_rows(path, kind, text_column, id_column, skip_empty)]
    if not rows:
        raise YirageError(f"no rows to embed in {', '.join(str(p) for p, _ in files)}")
    return rows


def file_rows(path: Path, kind: str, text_column: str = "text", id_column: str | None = None,
              skip_empty: bool = False):
    """Yield the ``Row``s of one input file in order: the text from ``text_column`` (a text
    file's line), the id from ``id_column`` (None: ``<file name>:<row>``, the row counted from 0
    over every record, skipped ones included). The one definition of a row for the local job and
    the Ray job (scale/embed_job.py), so both give the same ids. YirageError naming the file and
    row: a missing column, an empty or null text (unless ``skip_empty``), a text that is not a
    string, or the file's own read errors (``_records``)."""
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
        yield Row(f"{path.name}:{i}" if rid is None else str(rid), text)


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


def open_job(output: str, record: dict) -> Path:
    """The job directory ``output``, created with ``record`` (a JSON-able description of the job)
    in its ``_job.json``, or found holding the same record (a rerun: its shards are kept).
    YirageError: ``output`` is a file, holds a different job, or cannot be written."""
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise YirageError(f"{output} exists and is not a directory (the job writes its shards there)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise YirageError(f"cannot create {output}: {e.strerror or e}") from None
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
    return out


def shard_metadata(job: dict) -> dict[bytes, bytes]:
    """The Parquet metadata of every shard of ``job``: the model, its dtype and quantization."""
    return {b"yirage.model": str(job.get("model")).encode(), b"yirage.dtype": str(job.get("dtype")).encode(),
            b"yirage.quantization": str(job.get("quantization")).encode(),
            b"yirage.vectors": b"float32 (every dtype and quantization writes float32 vectors)"}


def write_shard(path: Path, ids: list[str], vectors, meta: dict[bytes, bytes]) -> None:
    """Write one shard: an ``id`` string column and an ``embedding`` fixed-size list of float32
    (``vectors``: a float32 array [len(ids), dim]), with ``meta`` as the file's metadata,
    renamed into place whole. YirageError if it cannot be written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = pa.array(vectors.reshape(-1), type=pa.float32())
    table = pa.table({"id": pa.array(ids, type=pa.string()),
                      "embedding": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])})
    table = table.replace_schema_metadata(meta)
    _commit(path, lambda tmp: pq.write_table(table, tmp))


class Progress:
    """``rows``/``total`` rows, rows/s and the ETA, redrawn on one stderr line (``update``),
    ended with a line break (``close``); silent when ``enabled`` is false."""

    def __init__(self, total: int | None, enabled: bool = True):
        self.total, self.enabled, self.t0, self.done = total, enabled, time.perf_counter(), 0

    def update(self, rows: int) -> None:
        self.done += rows
        if not self.enabled:
            return
        rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
        if self.total is None:
            line = f"embed: {self.done} rows, {rate:.0f} rows/s"
        else:
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            line = f"embed: {self.done}/{self.total} rows, {rate:.0f} rows/s, ETA {eta:.0f} s"
        print(f"\r{line}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)


def run_job(model, rows: list[Row], output: str, job: dict, shard_rows: int = 10000, batch_size: int = 32,
            normalize: bool = False, workers: int = 1, progress: bool = True) -> dict:
    """Embed ``rows`` into Parquet shards in the directory ``output``, skipping the shards a
    previous run of the same ``job`` (a JSON-able description) finished. Returns {"rows",
    "shards", "written", "skipped", "seconds"} (seconds: the job, the workers' start and model
    loads included). YirageError: ``output`` holds a different job
    or is not a directory, a shard cannot be written, pyarrow missing."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise YirageError("Parquet output needs pyarrow: pip install pyarrow") from None
    out = open_job(output, {**job, "rows": len(rows), "shard_rows": shard_rows})
    n_shards = -(-len(rows) // shard_rows)
    meta = shard_metadata(job)
    t0 = time.perf_counter()
    pool = model.start_multi_process_pool(["cpu"] * workers) if workers > 1 else None
    written, bar = 0, Progress(len(rows), progress)
    try:
        for s in range(n_shards):
            path = out / f"part-{s:05d}.parquet"
            chunk = rows[s * shard_rows:(s + 1) * shard_rows]
            if not path.exists():
                texts = [r.text for r in chunk]
                vectors = (model.encode_multi_process(texts, pool, batch_size=batch_size,
                                                      normalize_embeddings=normalize) if pool is not None
                           else model.encode(texts, batch_size=batch_size, normalize_embeddings=normalize))
                write_shard(path, [r.id for r in chunk], vectors, meta)
                written += 1
            bar.update(len(chunk))
    finally:
        if pool is not None:
            model.stop_multi_process_pool(pool)
        bar.close()
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
