"""``yirage embed ... --ray``: the job on Ray Data (a local Ray instance, 2 actors) gives the ids
and vectors of the local job and of --workers 2 (max abs difference 1e-6, ids in any order);
a run whose actor is killed mid-job still ends with every id exactly once; a rerun after a kill
writes only the missing shards; bad input and a Ray address that does not answer are one clear
error."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import kill_one, ray_worker_pids

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TEXTS = [f"sentence {i}: " + " ".join(["ray", "data", "embeds", "every", "row"][: 1 + i % 5]) for i in range(90)]


def write_input(folder):
    folder.mkdir(exist_ok=True)
    with open(folder / "docs.jsonl", "w") as f:
        for i, t in enumerate(TEXTS):
            f.write(json.dumps({"doc": f"d{i}", "body": t}) + "\n")
    return folder / "docs.jsonl"


def read_job(out) -> dict:
    """{id: vector} of a job's shards; asserts no id is there twice."""
    found = {}
    for p in sorted(out.glob("part-*.parquet")):
        t = pq.read_table(p)
        for i, v in zip(t.column("id").to_pylist(), t.column("embedding").to_pylist()):
            assert i not in found, f"id {i} twice"
            found[i] = np.asarray(v, dtype=np.float32)
    return found


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    diff = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert diff <= 1e-6, diff


@pytest.mark.slow
def test_ray_job_equals_local_and_workers_and_resumes(ray_local, tmp_path, yirage_cli):
    src = write_input(tmp_path / "in")
    common = [str(src), "--text-column", "body", "--id-column", "doc", "--shard-rows", "16"]
    code, _, err = yirage_cli("embed", *common, "-o", str(tmp_path / "local.parquet"))
    assert code in (None, 0), err
    code, _, err = yirage_cli("embed", *common, "-o", str(tmp_path / "workers.parquet"), "--workers", "2")
    assert code in (None, 0), err
    code, _, err = yirage_cli("embed", *common, "-o", str(tmp_path / "ray.parquet"), "--ray", "--workers", "2")
    assert code in (None, 0), err
    assert "90 rows in 6 shards" in err and "6 written" in err, err
    local = read_job(tmp_path / "local.parquet")
    assert len(local) == 90
    assert_same(read_job(tmp_path / "workers.parquet"), local)
    assert_same(read_job(tmp_path / "ray.parquet"), local)
    schema = pq.read_schema(next((tmp_path / "ray.parquet").glob("part-*.parquet")))
    assert schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert schema.metadata[b"yirage.model"] == b"all-minilm-l6-v2"
    # a killed run, rerun: only the missing shards are written, every id once
    for p in sorted((tmp_path / "ray.parquet").glob("part-*.parquet"))[::2]:
        p.unlink()
    code, _, err = yirage_cli("embed", *common, "-o", str(tmp_path / "ray.parquet"), "--ray", "--workers", "2")
    assert code in (None, 0) and "3 written, 3 already there" in err, err
    assert_same(read_job(tmp_path / "ray.parquet"), local)
    # the local job's directory holds another job: refused, nothing lost
    code, _, err = yirage_cli("embed", *common, "-o", str(tmp_path / "local.parquet"), "--ray", "--workers", "1")
    assert code == 1 and "holds the shards of a different job" in err
    assert len(read_job(tmp_path / "local.parquet")) == 90


@pytest.mark.slow
def test_a_killed_actor_is_retried_and_every_id_is_written_once(ray_local, tmp_path):
    from yirage.scale.embed_job import run_ray_embed_job
    from yirage.tools.embed_job import expand_inputs

    src = write_input(tmp_path / "in")
    files = expand_inputs([str(src)], None)
    job = {"model": "all-minilm-l6-v2", "backend": "cpu", "dtype": "float32", "quantization": None}
    out = tmp_path / "out.parquet"
    result = {}

    def run():
        try:
            result["ok"] = run_ray_embed_job(files, str(out), job, actors=2, shard_rows=3, batch_size=4,
                                             text_column="body", id_column="doc", progress=False)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 180
    while not list(out.glob("part-*.parquet")) and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    killed = kill_one("ray::MapWorker(MapBatches(Embedder))")
    thread.join(300)
    assert not thread.is_alive(), "the job hung after its actor was killed"
    assert "error" not in result, result.get("error")
    assert killed not in ray_worker_pids("ray::MapWorker(MapBatches(Embedder))")
    found = read_job(out)
    assert sorted(found) == sorted(f"d{i}" for i in range(90))
    import yirage as yr

    reference = yr.EmbeddingModel("all-minilm-l6-v2", backend="cpu").encode(TEXTS, batch_size=4)
    got = np.stack([found[f"d{i}"] for i in range(90)])
    np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0)


def test_ray_job_input_errors_name_the_file(ray_local, tmp_path, yirage_cli):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "fine"}) + "\n" + json.dumps({"text": "no body"}) + "\n")
    code, _, err = yirage_cli("embed", str(tmp_path / "a.jsonl"), "--text-column", "body", "-o",
                              str(tmp_path / "o.parquet"), "--ray", "--workers", "1")
    assert code == 1 and "a.jsonl: row 1 has no column 'body'" in err, err
    assert len(err.strip().splitlines()) <= 2, err   # the progress line, then the one error line
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "fine"}) + "\n" + json.dumps({"body": None}) + "\n")
    code, _, err = yirage_cli("embed", str(tmp_path / "b.jsonl"), "--text-column", "body", "-o",
                              str(tmp_path / "p.parquet"), "--ray", "--workers", "1")
    assert code == 1 and "b.jsonl: row 1 has an empty or null text" in err, err
    code, _, err = yirage_cli("embed", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "q.parquet"),
                              "--cpus-per-worker", "2")
    assert code == 1 and "--cpus-per-worker sets each Ray actor's CPUs: give --ray" in err


def _embed_cli(tmp_path, address: str, timeout_s: float, env: dict | None = None):
    (tmp_path / "a.txt").write_text("hello\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "yirage.cli", "embed", str(tmp_path / "a.txt"), "-o",
                           str(tmp_path / f"o{address.replace(':', '_')}.parquet"), "--ray", address],
                          capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
    return proc, time.monotonic() - t0


def test_a_ray_address_that_does_not_answer_is_an_error_within_30_s(tmp_path):
    pytest.importorskip("ray")
    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, took = _embed_cli(tmp_path, f"127.0.0.1:{port}", 60)
    assert proc.returncode == 1 and f"no Ray cluster answers at 127.0.0.1:{port}" in proc.stderr, proc.stderr
    assert took < 30
    # a port that accepts connections but never speaks Ray's protocol: the connect limit
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        proc, took = _embed_cli(tmp_path, f"127.0.0.1:{port}", 90, {"YIRAGE_RAY_CONNECT_TIMEOUT_S": "5"})
    assert proc.returncode == 1 and "did not connect within 5 s" in proc.stderr, proc.stderr
    assert took < 60
    proc, _ = _embed_cli(tmp_path, "not-an-address", 60)
    assert proc.returncode == 1 and "is not HOST:PORT" in proc.stderr, proc.stderr
