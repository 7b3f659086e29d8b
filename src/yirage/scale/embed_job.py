"""``yirage embed INPUT... -o OUT.parquet --ray [ADDRESS]``: the embedding job of
``tools/embed_job.py`` on Ray Data, local by default, a cluster with one flag.

The pipeline, the shape of Ray's batch-inference examples:

- **Read**: a Ray Data ``Datasource`` whose read tasks run on the cluster's workers, P per input
  file (P: up to 4 tasks per actor in all, at most one per shard), task p yielding the file's shards s (``shard_rows``
  rows each) with s % P == p. Each task parses its whole file with
  ``tools.embed_job.file_rows`` (the local job's one definition of a row: the same ids,
  ``<file>:<row>`` where there is no id column, and the same errors naming file and row); Ray's
  own readers (``read_text``, ``read_csv``, ...) cannot number a file's rows, so they could not
  give the local ids.
- **Embed**: ``map_batches`` with a class (``_ShardEmbedder``) on an actor pool of ``actors``
  actors of ``cpus_per_actor`` CPUs each, torch and OpenMP threads set to that count, one
  ``EmbeddingModel`` per actor; each actor embeds a shard once all its rows have come.
- **Write**: each actor commits its shard as ``part-F<file>-<shard>.parquet``, written under a
  temporary name and renamed (``tools.embed_job.write_shard``) instead of ``write_parquet``,
  whose files get fresh names per run. So a batch that Ray retries after an actor died rewrites
  the same file whole, a rerun of a killed job skips the shards that exist, and the output holds
  every id exactly once either way. The output directory must be one that every node sees (a
  shared file system), as for ``write_parquet``.

Vectors equal the local job's (same model, same batches within a shard).
"""
from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from ..config import thread_env
from ..errors import YirageError
from ..tools.embed_job import Progress, file_rows, open_job, shard_metadata, write_shard


def shard_name(file_index: int, shard: int) -> str:
    """The file name of the Ray job's shard ``shard`` of input file ``file_index``."""
    return f"part-F{file_index:05d}-{shard:05d}.parquet"


def count_rows(path: Path, kind: str) -> int:
    """About how many rows ``path`` holds, for the progress bar's ETA: Parquet's metadata, else
    its line count (a CSV's header not counted)."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    lines += last != b"\n"
    return max(0, lines - (kind == "csv"))


def _datasource(files: list[tuple[Path, str]], out: Path, shard_rows: int, text_column: str,
                id_column: str | None, skip_empty: bool, parts: list[int]):
    """A Ray Data ``Datasource`` over ``files``: ``parts[i]`` read tasks for file i, task p yielding
    one pyarrow block (id, text, shard, shard_rows) per shard s of the file with s % parts[i] == p
    whose output is not yet in ``out``. Each task parses its whole file (parsing costs little
    beside embedding) so that the rows, and so the ids, are counted as the local job counts them;
    Ray Data hands a read task's blocks on as one input, so a file read by one task would feed
    one actor only."""
    import pyarrow as pa
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata

    class InputFiles(Datasource):
        def estimate_inmemory_data_size(self):
            return sum(p.stat().st_size for p, _ in files)

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            return [ReadTask(lambda i=i, path=path, kind=kind, part=part: read(i, path, kind, part),
                             BlockMetadata(num_rows=None, size_bytes=path.stat().st_size // parts[i], exec_stats=None,
                                           input_files=(str(path),)))
                    for i, (path, kind) in enumerate(files) for part in range(parts[i])]

    def read(index: int, path: Path, kind: str, part: int):
        shard, chunk = 0, []

        def wanted() -> bool:
            return shard % parts[index] == part and not (out / shard_name(index, shard)).exists()

        def block():
            return pa.table({"id": [r.id for r in chunk], "text": [r.text for r in chunk],
                             "shard": [shard_name(index, shard)] * len(chunk),
                             "shard_rows": pa.array([len(chunk)] * len(chunk), type=pa.int64())})

        for row in file_rows(path, kind, text_column, id_column, skip_empty):
            chunk.append(row)
            if len(chunk) == shard_rows:
                if wanted():
                    yield block()
                shard, chunk = shard + 1, []
        if chunk and wanted():
            yield block()

    return InputFiles()


class _ShardEmbedder:
    """A Ray Data actor: one ``EmbeddingModel`` with ``threads`` torch/OpenMP threads. Batches may
    cut shards anywhere (Ray Data joins a read task's blocks and re-slices them into batches); the
    actor keeps each shard's rows until it holds all ``shard_rows`` of them, then embeds the shard
    and commits its Parquet file. Each call returns (shard, rows) for the shards it completed.
    A read task's output reaches one actor task whole, so a shard's rows all reach one actor; if
    the actor dies, Ray retries the task from its start on a new one."""

    def __init__(self, spec: dict, out: str, meta: dict, threads: int, batch_size: int, normalize: bool):
        import torch

        torch.set_num_threads(threads)   # the process' environment has set OpenMP's (thread_env)
        from ..engines.embed import EmbeddingModel

        self.model = EmbeddingModel(spec["model"], backend=spec["backend"], quantization=spec["quantization"],
                                    dtype=spec["dtype"])
        self.out, self.meta, self.batch_size, self.normalize = Path(out), meta, batch_size, normalize
        self.threads = threads
        self.pending: dict[str, list] = {}   # shard -> its rows' pyarrow slices so far

    def __call__(self, batch):
        import pyarrow as pa
        import torch

        if torch.get_num_threads() != self.threads:   # a call may come on another thread than __init__'s
            torch.set_num_threads(self.threads)
        names = batch.column("shard").to_pylist()
        done = []
        for name in dict.fromkeys(names):
            part = batch.take([i for i, n in enumerate(names) if n == name])
            self.pending.setdefault(name, []).append(part)
            have = sum(t.num_rows for t in self.pending[name])
            expected = part.column("shard_rows")[0].as_py()
            if have > expected:
                raise YirageError(f"shard {name}: {have} rows arrived for its {expected}")
            if have < expected:
                continue
            rows = pa.concat_tables(self.pending.pop(name))
            vectors = self.model.encode(rows.column("text").to_pylist(), batch_size=self.batch_size,
                                        normalize_embeddings=self.normalize)
            write_shard(self.out / name, rows.column("id").to_pylist(), vectors, self.meta)
            done.append((name, expected))
        return pa.table({"shard": pa.array([d[0] for d in done], type=pa.string()),
                         "rows": pa.array([d[1] for d in done], type=pa.int64())})


def run_ray_embed_job(files: list[tuple[Path, str]], output: str, job: dict, *, address: str | None = None,
                      actors: int | None = None, cpus_per_actor: int = 1, shard_rows: int = 10000,
                      batch_size: int = 32, normalize: bool = False, text_column: str = "text",
                      id_column: str | None = None, skip_empty: bool = False, progress: bool = True) -> dict:
    """Run the embedding job of ``files`` (``tools.embed_job.expand_inputs``) on Ray Data into the
    directory ``output`` (see the module's docstring), skipping the shards a previous run of the
    same ``job`` finished.

    Args:
        job: the job's description, as the local job's (model, backend, dtype, quantization,
            normalize, columns, skip_empty); it and ``shard_rows`` go into ``_job.json``.
        address: Ray's address (``cluster.connect``): None/``local``, ``auto`` or ``HOST:PORT``.
        actors: actors of the pool (None: the cluster's CPUs // ``cpus_per_actor``, at least 1).
        cpus_per_actor: Ray CPUs, and torch/OpenMP threads, per actor.

    Returns: {"rows", "shards", "written", "skipped", "seconds", "actors"}: rows and shards in
    the output, the shards this run wrote and the ones a previous run had.

    Raises: YirageError: bad arguments, Ray missing or not answering (``RayUnavailableError``),
    a different job in ``output``, an input error (naming the file and row), a model that
    cannot load, a shard that cannot be written.
    """
    from .cluster import connect

    if cpus_per_actor < 1 or (actors is not None and actors < 1):
        raise YirageError("--workers and --cpus-per-worker must be positive integers")
    out = open_job(output, {**job, "engine": "ray", "shard_rows": shard_rows})
    ray = connect(address, num_cpus=None)
    import ray.data

    cluster_cpus = int(ray.cluster_resources().get("CPU", 1))
    if cpus_per_actor > cluster_cpus:
        raise YirageError(f"--cpus-per-worker {cpus_per_actor} is more than the Ray cluster's {cluster_cpus} CPUs")
    actors = actors or max(1, cluster_cpus // cpus_per_actor)
    existing = {p.name for p in out.glob("part-F*.parquet")}
    skipped_rows = sum(_rows_in(out / name) for name in existing)
    counts = [count_rows(p, k) for p, k in files]
    total = sum(counts)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.CRITICAL)   # its errors come back as one YirageError
    spec = {k: job.get(k) for k in ("model", "backend", "quantization", "dtype")}
    # Read tasks per file: Ray Data hands each read task's output to one actor task, so the
    # shards are dealt to up to 4 tasks per actor in all (at most one task per shard of a file),
    # and every actor stays busy to the end. Read tasks take no CPU of their own (parsing is
    # light beside embedding) and run at most one per actor at a time: with the default 1 CPU,
    # the actors holding every CPU would starve them.
    per_file = max(1, -(-4 * actors // len(files)))
    parts = [max(1, min(per_file, -(-n // shard_rows))) for n in counts]
    ds = ray.data.read_datasource(_datasource(files, out, shard_rows, text_column, id_column, skip_empty, parts),
                                  num_cpus=0, concurrency=actors, override_num_blocks=sum(parts))
    args = (spec, str(out), shard_metadata(job), cpus_per_actor, batch_size, normalize)

    class Embedder(_ShardEmbedder):   # the arguments travel with the class: a restarted actor has them
        def __init__(self):
            super().__init__(*args)

    # Each actor's OpenMP/MKL threads are set in its process' environment before it starts (OpenMP
    # reads them once; an actor inheriting the driver's count ran 2 x 2 threads on 2 cores at half
    # speed). An actor takes one task at a time, so that the first actor up does not queue the
    # tasks that the others would take.
    ds = ds.map_batches(Embedder, batch_size=min(shard_rows, 1024), batch_format="pyarrow",
                        compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
                        num_cpus=cpus_per_actor, runtime_env={"env_vars": thread_env(cpus_per_actor)})
    t0, written = time.perf_counter(), set()
    bar = Progress(total, progress)
    bar.update(skipped_rows)
    try:
        for row in ds.iter_rows():
            written.add(row["shard"])
            bar.update(row["rows"])
    except Exception as e:  # Ray wraps a task's or actor's error: report its cause, one line
        raise _cause(e) from None
    finally:
        bar.close()
    shards = {p.name for p in out.glob("part-F*.parquet")}
    if not shards:
        raise YirageError(f"no rows to embed in {', '.join(str(p) for p, _ in files)}")
    return {"rows": sum(_rows_in(out / s) for s in shards), "shards": len(shards), "written": len(written),
            "skipped": len(existing), "seconds": time.perf_counter() - t0, "actors": actors}


def _rows_in(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def _cause(e: BaseException) -> YirageError:
    """The YirageError behind Ray's wrapping of ``e`` (RayTaskError, UserCodeException, ...):
    the error itself where it reached this process, else its last line in the remote traceback
    Ray sends as text; one naming ``e`` where there is none."""
    seen = e
    for _ in range(8):
        if isinstance(seen, YirageError):
            return YirageError(str(seen))
        nxt = getattr(seen, "cause", None) or seen.__cause__
        if nxt is None or nxt is seen:
            break
        seen = nxt
    found = re.findall(r"yirage\.errors\.\w+: (.+)", str(e))
    if found:
        return YirageError(found[-1].strip())
    return YirageError(f"the Ray job failed: {type(e).__name__}: {' '.join(str(e).split())[:400]}")
