"""sentence-transformers' multi-process pool on yirage's EmbeddingModel: two CPU worker
processes give the vectors ``encode`` gives in this process (the workers run one thread each:
the same kernels, so equal to 1e-5), in input order whatever the chunking; bad arguments and a
worker that dies are one clear error, never a hang."""
import numpy as np
import pytest

import yirage as yr

SENTENCES = [f"sentence number {i} is about {'cats' if i % 3 else 'the weather in a small town'}" * (1 + i % 4)
             for i in range(53)]


@pytest.fixture(scope="module")
def model():
    return yr.EmbeddingModel("all-minilm-l6-v2", backend="cpu")


@pytest.fixture(scope="module")
def pool(model):
    p = model.start_multi_process_pool(["cpu", "cpu"])
    yield p
    model.stop_multi_process_pool(p)


@pytest.mark.slow
def test_the_pool_gives_encodes_vectors_in_input_order(model, pool):
    want = model.encode(SENTENCES)
    assert len(pool["processes"]) == 2 and pool["threads"] >= 1
    for chunk_size in (None, 7, 1000):
        got = model.encode_multi_process(SENTENCES, pool, chunk_size=chunk_size)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    normed = model.encode_multi_process(SENTENCES[:5], pool, normalize_embeddings=True, prompt="query: ")
    np.testing.assert_allclose(normed, model.encode(["query: " + s for s in SENTENCES[:5]], normalize_embeddings=True),
                               atol=1e-5, rtol=0)
    for kwargs, message in [({"precision": "int8"}, "precision must be 'float32'"),
                            ({"prompt_name": "query"}, "defines no prompts"), ({"batch_size": 0}, "batch_size"),
                            ({"chunk_size": -1}, "chunk_size")]:
        with pytest.raises(yr.YirageError, match=message):
            model.encode_multi_process(SENTENCES, pool, **kwargs)
    with pytest.raises(yr.YirageError, match="sentence 1 is a int"):
        model.encode_multi_process(["a", 3], pool)
    # the pool still answers after refusing
    np.testing.assert_allclose(model.encode_multi_process(SENTENCES[:3], pool), want[:3], atol=1e-5, rtol=0)


def test_only_cpu_devices(model):
    with pytest.raises(yr.YirageError, match="device 'cuda:0' is not supported"):
        model.start_multi_process_pool(["cpu", "cuda:0"])


@pytest.mark.slow
def test_a_worker_that_dies_is_an_error_not_a_hang(model):
    p = model.start_multi_process_pool(["cpu"])
    try:
        p["processes"][0].kill()
        p["processes"][0].join(10)
        with pytest.raises(yr.YirageError, match="worker yirage-embed-0 died"):
            model.encode_multi_process(SENTENCES, p)
    finally:
        model.stop_multi_process_pool(p)
        model.stop_multi_process_pool(p)   # twice is fine
    assert p["processes"] == []
