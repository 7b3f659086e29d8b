"""``yirage embed INPUT... -o OUT.parquet``: text, JSONL, CSV and Parquet inputs (files,
directories, globs) give the vectors ``EmbeddingModel.encode`` gives (read back with pyarrow),
one row per input id; a rerun after a kill writes only the missing shards and the output holds
every id exactly once; --workers 2 gives the same vectors; bad input is one clear error."""
import csv
import json

import numpy as np
import pytest

import yirage as yr

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TEXTS = [f"row {i}: {'a short one' if i % 2 else 'a somewhat longer sentence about embeddings and jobs'}"
         for i in range(23)]


@pytest.fixture(scope="module")
def model():
    return yr.EmbeddingModel("all-minilm-l6-v2", backend="cpu")


def write_inputs(folder):
    folder.mkdir()
    (folder / "a.txt").write_text("\n".join(TEXTS[:5]) + "\n")
    with open(folder / "b.jsonl", "w") as f:
        for i, t in enumerate(TEXTS[5:12]):
            f.write(json.dumps({"doc": f"j{i}", "body": t}) + "\n")
    with open(folder / "c.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["doc", "body"])
        w.writeheader()
        for i, t in enumerate(TEXTS[12:18]):
            w.writerow({"doc": f"c{i}", "body": t})
    pq.write_table(pa.table({"doc": [f"p{i}" for i in range(5)], "body": TEXTS[18:]}), folder / "d.parquet")


def read_output(out):
    tables = [pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))]
    ids = [i for t in tables for i in t.column("id").to_pylist()]
    vecs = np.concatenate([np.stack(t.column("embedding").to_numpy(zero_copy_only=False)) for t in tables])
    return ids, vecs, tables[0].schema


@pytest.mark.slow
def test_a_job_over_every_format_equals_encode_and_resumes(model, tmp_path, yirage_cli):
    write_inputs(tmp_path / "in")
    out = tmp_path / "out.parquet"
    code, _, err = yirage_cli("embed", str(tmp_path / "in" / "a.txt"), str(tmp_path / "in" / "*.jsonl"),
                              str(tmp_path / "in" / "c.csv"), str(tmp_path / "in" / "d.parquet"), "-o", str(out),
                              "--text-column", "body", "--id-column", "doc", "--shard-rows", "4")
    # a text file has no columns: its ids are FILE:ROW, its text the line
    assert code is None or code == 0, err
    ids, vecs, schema = read_output(out)
    assert ids == [f"a.txt:{i}" for i in range(5)] + [f"j{i}" for i in range(7)] + [f"c{i}" for i in range(6)] + \
        [f"p{i}" for i in range(5)]
    np.testing.assert_allclose(vecs, model.encode(TEXTS), atol=1e-5, rtol=0)
    assert schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert schema.metadata[b"yirage.model"] == b"all-minilm-l6-v2"
    assert len(list(out.glob("part-*.parquet"))) == 6
    # killed after 2 shards: the rerun writes the other 4, and every id is there once
    for p in sorted(out.glob("part-*.parquet"))[2:]:
        p.unlink()
    code, _, err = yirage_cli("embed", str(tmp_path / "in" / "a.txt"), str(tmp_path / "in" / "*.jsonl"),
                              str(tmp_path / "in" / "c.csv"), str(tmp_path / "in" / "d.parquet"), "-o", str(out),
                              "--text-column", "body", "--id-column", "doc", "--shard-rows", "4", "--workers", "2")
    assert "4 written, 2 already there" in err, err
    ids2, vecs2, _ = read_output(out)
    assert ids2 == ids and len(set(ids2)) == len(ids2)
    np.testing.assert_allclose(vecs2, vecs, atol=1e-5, rtol=0)
    # the same output with another job is refused
    code, _, err = yirage_cli("embed", str(tmp_path / "in" / "a.txt"), "-o", str(out))
    assert code == 1 and "holds the shards of a different job" in err


def test_bad_inputs_are_one_clear_error(tmp_path, yirage_cli):
    write_inputs(tmp_path / "in")
    (tmp_path / "empty.jsonl").write_text(json.dumps({"body": ""}) + "\n")
    (tmp_path / "x.xml").write_text("<a/>")
    cases = [([str(tmp_path / "in" / "b.jsonl")], "has no column 'text' (--text-column)"),
             ([str(tmp_path / "missing.txt")], "missing.txt: no such file"),
             ([str(tmp_path / "nothing*.csv")], "no file matches"),
             ([str(tmp_path / "x.xml")], "unknown format '.xml'"),
             ([str(tmp_path / "empty.jsonl"), "--text-column", "body"], "row 0 has an empty or null text"),
             (["-"], "not stdin"),
             ([str(tmp_path / "in" / "a.txt"), "--workers", "0"], "--workers must be a positive integer")]
    for args, words in cases:
        code, _, err = yirage_cli("embed", *args, "-o", str(tmp_path / "o.parquet"))
        assert code == 1 and words in err and len(err.splitlines()) == 1, (args, err)
    code, _, err = yirage_cli("embed", str(tmp_path / "in" / "a.txt"), str(tmp_path / "in" / "a.txt"))
    assert code == 1 and "give -o OUT.parquet" in err
