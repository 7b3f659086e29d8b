"""The embedding engine (issue 10): yr.EmbeddingModel and `yirage embed` vs sentence-transformers,
and the IR ops it added (layer_norm, attention_bidir) vs torch on every backend."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F

import yirage as yr
from yirage.errors import ModelLoadError, YirageError

pytestmark = pytest.mark.slow


def _sentences() -> list[str]:
    """~300 sentences: empty, whitespace, very long (truncated at 256 tokens), non-Latin, emoji,
    and generated ones of 2 to ~60 tokens."""
    base = ["", " ", "hello", "Hello, world!", "The quick brown fox jumps over the lazy dog.",
            "Ein kurzer deutscher Satz über das Wetter.", "Это предложение на русском языке.",
            "日本語の文です。東京は大きな都市です。", "这是一个中文句子。", "مرحبا بالعالم", "नमस्ते दुनिया",
            "emoji only 🎉🚀🔥👍", "🙂", "mixed: café naïve résumé — “quotes” …", "tabs\tand\nnewlines inside",
            "word " * 400, "long sentence with many different words " * 60, "a" * 3000,
            "Numbers 3.14159 and 2,718 and 1e-9.", "<html><body>tags</body></html>", "UPPER CASE TEXT"]
    more = [f"Sentence {i}: " + " ".join(f"token{j}" for j in range((i * 7) % 41)) for i in range(90)]
    subjects = ["The committee", "Une petite chienne", "Our new compiler", "Das Wetter in Berlin", "My neighbour's cat",
                "El informe trimestral", "The train to Kyoto", "Старый маяк", "研究チーム", "A cup of green tea 🍵"]
    verbs = ["announced", "ignored", "measured", "described", "improved", "delayed", "explained"]
    objects = ["the results of the experiment", "a plan for the coming winter", "the price of electricity",
               "how the network handles long sentences, even very long ones with many clauses and commas",
               "the history of the old harbour", "several unexpected problems", "nothing at all"]
    prose = [f"{subjects[i % 10]} {verbs[(i * 3) % 7]} {objects[(i * 5) % 7]}" + "!" * (i % 3) for i in range(190)]
    return base + more + prose


@pytest.fixture(scope="module")
def model():
    return yr.EmbeddingModel("all-minilm-l6-v2", backend="cpu")


@pytest.fixture(scope="module")
def st_model(model):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(model.spec.directory), device="cpu")


@pytest.fixture(scope="module")
def reference(st_model):
    sents = _sentences()
    return sents, st_model.encode(sents, batch_size=32, convert_to_numpy=True, normalize_embeddings=False)


def _assert_close(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == np.float32
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.min() >= 0.99999, cos.min()
    assert np.abs(a - b).max() <= 1e-4, np.abs(a - b).max()


@pytest.mark.parametrize("batch_size", [32, 7])
def test_float32_equals_sentence_transformers(model, reference, batch_size):
    sents, expect = reference
    _assert_close(model.encode(sents, batch_size=batch_size), expect)
    # packed batches, token rows bucketed: a few plans, never one per distinct length or total
    assert all(T % 16 == 0 for _, T in model.plan_shapes)
    assert len(model.plan_shapes) <= 2 * (len(sents) // batch_size + 1)


def test_int8_close_to_float32_and_same_neighbours(model, reference):
    """int8 (per-channel weights, activations per token in groups of 64 features): cosine >= 0.99
    to float32 on every sentence (issue 10; 0.9946 measured on the worst, the empty string:
    [CLS] [SEP] only), mean >= 0.998, and the same nearest document as float32 for every query
    of a small retrieval set."""
    q8 = yr.EmbeddingModel("all-minilm-l6-v2", backend="cpu", quantization="int8")
    sents, _ = reference
    a, b = model.encode(sents), q8.encode(sents)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    tokens = np.array([len(x) for x in model.tokenizer(sents)["input_ids"]])
    assert cos.min() >= 0.99 and cos.mean() >= 0.998, (cos.min(), cos.mean())
    assert len(tokens) == len(sents) and tokens.min() == 2  # the empty string is among them
    docs = ["The cat sat on the mat.", "Stock markets fell sharply on Monday.", "Photosynthesis turns light into sugar.",
            "The recipe needs two eggs and flour.", "A goal in the last minute won the match.",
            "The new phone has a faster processor.", "Rain is expected across the north tomorrow.",
            "The museum shows paintings from the 17th century.", "Vaccines train the immune system.",
            "The train to Paris was delayed by an hour."]
    queries = ["Where did the kitten sit?", "What happened to shares?", "How do plants make food?",
               "What do I need to bake a cake?", "Who won the football game?", "Tell me about the smartphone.",
               "What is the weather forecast?", "Which art is in the gallery?", "How does immunization work?",
               "Why was my rail journey late?"]
    top = [(m.encode(queries, normalize_embeddings=True) @ m.encode(docs, normalize_embeddings=True).T).argmax(1)
           for m in (model, q8)]
    assert (top[0] == np.arange(10)).all() and (top[1] == top[0]).all()


def test_bfloat16_close_to_float32(model, st_model, reference, monkeypatch):
    """dtype="bfloat16" (bfloat16 GEMMs, float32 accumulation, float32 norms and softmax): cosine
    >= 0.9999 to sentence-transformers' float32 on every sentence (issue 18), as close to
    sentence-transformers with its linear layers computed the same way (a different summation
    order rounds some sums to the neighbouring bfloat16), and really not float32."""
    sents, expect = reference
    bf = yr.EmbeddingModel("all-minilm-l6-v2", backend="cpu", dtype="bfloat16")
    got = bf.encode(sents)
    cos = (got * expect).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expect, axis=1))
    assert cos.min() >= 0.9999, cos.min()
    linear = torch.nn.functional.linear

    def bf16_linear(x, w, b=None):   # ir.ops' bfloat16 GEMM: bf16 inputs, sum rounded to bf16, fp32 bias
        y = linear(x.to(torch.bfloat16), w.to(torch.bfloat16)).float()
        return y if b is None else y + b
    monkeypatch.setattr(torch.nn.functional, "linear", bf16_linear)
    same = st_model.encode(sents, batch_size=32, convert_to_numpy=True)
    monkeypatch.undo()
    cos = (got * same).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(same, axis=1))
    assert cos.min() >= 0.9999, cos.min()
    assert np.abs(got - expect).max() > 1e-4     # float32 is equal to 1e-7 (test_float32_...)
    with pytest.raises(YirageError, match="dtype must be 'float32' or 'bfloat16'"):
        yr.EmbeddingModel("all-minilm-l6-v2", dtype="float16")
    with pytest.raises(YirageError, match="cannot also be"):
        yr.EmbeddingModel("all-minilm-l6-v2", quantization="int8", dtype="bfloat16")


def test_other_backends_match_the_cpu(model):
    """The same encoder graph through the backend contract on every other backend here
    (triton-interpret without a GPU: Triton's CPU interpreter, slow, so two short sentences)."""
    sents = ["hello world", "a second sentence, longer than the first one"]
    for name in (b.value for b in yr.get_available_backends()):
        if name != "cpu":
            other = yr.EmbeddingModel("all-minilm-l6-v2", backend=name)
            _assert_close(other.encode(sents, convert_to_tensor=True).cpu().numpy(), model.encode(sents))


def test_threads_get_the_embeddings_they_would_get_alone(model, reference):
    """8 threads encoding different slices (batch sizes 3 to 10: their batches interleave) get
    exactly the embeddings of the same calls made one after another, which match
    sentence-transformers."""
    import concurrent.futures

    sents, ref = reference
    calls = [(sents[i * 25:(i + 1) * 25], 3 + i) for i in range(8)]
    alone = [model.encode(s, batch_size=b) for s, b in calls]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda c: model.encode(c[0], batch_size=c[1]), calls))
    for i, (a, t) in enumerate(zip(alone, together)):
        np.testing.assert_array_equal(t, a)
        _assert_close(t, ref[i * 25:(i + 1) * 25])


def test_normalize_and_shapes(model, st_model):
    sents = ["first sentence", "a second, longer sentence than the first", ""]
    dim = model.get_sentence_embedding_dimension()
    assert dim == 384 and model.max_seq_length == 256
    for norm in (False, True):
        a = model.encode(sents, normalize_embeddings=norm)
        _assert_close(a, st_model.encode(sents, normalize_embeddings=norm))
        assert a.shape == (3, dim)
    one = model.encode("first sentence")
    assert one.shape == (dim,) and one.dtype == np.float32
    _assert_close(one[None], st_model.encode(["first sentence"]))
    t = model.encode(sents, convert_to_tensor=True)
    assert isinstance(t, torch.Tensor) and t.shape == (3, dim) and t.dtype == torch.float32
    lst = model.encode(sents, convert_to_numpy=False)
    assert isinstance(lst, list) and len(lst) == 3 and lst[0].shape == (dim,)


def test_bad_input(model):
    assert model.encode([]).shape == (0, model.get_sentence_embedding_dimension())
    with pytest.raises(YirageError, match="sentence 1 is a int"):
        model.encode(["ok", 3])
    with pytest.raises(YirageError, match="not a str"):
        model.encode(["ok", None])
    with pytest.raises(YirageError, match="batch_size"):
        model.encode(["ok"], batch_size=0)
    with pytest.raises(YirageError, match="quantization must be None or 'int8'"):
        yr.EmbeddingModel("all-minilm-l6-v2", quantization="int4")
    with pytest.raises(ModelLoadError, match="language model"):
        yr.EmbeddingModel("smollm2-135m-instruct")


def _copy_model(model, tmp_path):
    """A copy of the model directory (weights linked, small files copied) to break."""
    src = model.spec.directory
    dst = tmp_path / "m"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    return dst


def test_hub_id_offline_is_one_clear_error(monkeypatch, tmp_path):
    """A hub id that cannot be fetched (offline here) gives one ModelLoadError naming it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError) as info:
        yr.EmbeddingModel("yirage-test/no-such-embedder")
    message = str(info.value)
    assert "could not fetch embedding model 'yirage-test/no-such-embedder'" in message and "\n" not in message


def test_bad_model_directories(model, tmp_path):
    d = _copy_model(model, tmp_path)
    shutil.rmtree(d / "1_Pooling")
    with pytest.raises(ModelLoadError, match="pooling config"):
        yr.EmbeddingModel(str(d))
    d2 = _copy_model(model, tmp_path / "b")
    cfg = json.loads((d2 / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        yr.EmbeddingModel(str(d2))


def test_nan_weights(model, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy_model(model, tmp_path)
    w = load_file(str(model.spec.directory / "model.safetensors"))
    w["encoder.layer.2.output.dense.weight"][3, 5] = float("nan")
    (d / "model.safetensors").unlink()
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="encoder.layer.2.output.dense.weight.*NaN"):
        yr.EmbeddingModel(str(d))


def _yirage(*args, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "yirage.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def _yirage_here(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """`yirage ARGS` run in this process (no interpreter start-up): (status, stdout, stderr)."""
    from yirage.cli import main

    monkeypatch.setattr(sys, "argv", ["yirage", *args])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_round_trip(model, tmp_path, monkeypatch, capsys):
    sents = ["hello world", "", "日本語 🎉", "a longer sentence for the command line"]
    expect = model.encode(sents, normalize_embeddings=True)
    proc = _yirage("embed", "--normalize", "--batch-size", "3", stdin="\n".join(sents) + "\n")
    assert proc.returncode == 0, proc.stderr
    got = np.array([json.loads(line) for line in proc.stdout.splitlines()], dtype=np.float32)
    _assert_close(got, expect)
    assert "4 sentences" in proc.stderr
    src = tmp_path / "in.txt"
    src.write_text("\n".join(sents) + "\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    code, stdout, err = _yirage_here(monkeypatch, capsys, "embed", "--format", "npy", "-o", str(out), str(src))
    assert code == 0, err
    _assert_close(np.load(out), model.encode(sents))
    code, stdout, err = _yirage_here(monkeypatch, capsys, "embed", "--int8", "--format", "npy", "-o", str(out), str(src))
    assert code == 0, err
    assert (np.load(out) * model.encode(sents)).sum(1).min() >= 0.98  # unit vectors: cosine
    code, stdout, err = _yirage_here(monkeypatch, capsys, "embed", "--dtype", "bfloat16", "--format", "npy", "-o",
                                     str(out), str(src))
    assert code == 0, err
    assert (np.load(out) * model.encode(sents)).sum(1).min() >= 0.9999
    for args, message in ((["-m", "no-such-model", str(src)], "unknown embedding model"),
                          (["--format", "npy", str(src)], "-o FILE"),
                          ([str(tmp_path / "missing.txt")], "cannot read"),
                          (["--int8", "--dtype", "bfloat16", str(src)], "cannot also be")):
        code, stdout, err = _yirage_here(monkeypatch, capsys, "embed", *args)
        lines = err.strip().splitlines()
        assert code == 1 and stdout == "" and len(lines) == 1, (args, err)
        assert lines[0].startswith("yirage: error: ") and message in lines[0], (args, err)


# ---- the IR ops the encoder uses, on every backend ------------------------------------------------

def _on(backend, inputs):
    """Run a graph's ``inputs`` (CPU tensors) on ``backend``: moved to its device."""
    from yirage.backends import get_backend_impl
    dev = get_backend_impl(backend).torch_device
    return [t.to(dev) for t in inputs]


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_op(backend, affine):
    g = yr.new_kernel_graph()
    X = g.new_input((3, 5, 40))
    R = g.new_input((3, 5, 40))
    W = g.new_input((40,)) if affine else None
    B = g.new_input((40,)) if affine else None
    g.mark_output(g.layer_norm(g.add(X, R), (40,), W, B, eps=1e-12))
    x, r, w, b = torch.randn(3, 5, 40) * 3 + 1, torch.randn(3, 5, 40), torch.randn(40), torch.randn(40)
    inputs = [x, r, w, b] if affine else [x, r]
    out = g(inputs=_on(backend, inputs), backend=backend)[0].cpu()
    expect = F.layer_norm(x + r, (40,), w if affine else None, b if affine else None, 1e-12)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g.interpret(inputs)[0], expect, atol=1e-5, rtol=1e-5)
    assert g.compile(backend).num_kernels == 1  # add + layer_norm: one fused row kernel


def test_layer_norm_errors():
    g = yr.new_kernel_graph()
    X = g.new_input((4, 8))
    with pytest.raises(yr.GraphError, match="normalized_shape"):
        g.layer_norm(X, (7,))
    with pytest.raises(yr.GraphError, match="weight and bias"):
        g.layer_norm(X, (8,), g.new_input((7,)))
    with pytest.raises(yr.GraphError, match="eps"):
        g.layer_norm(X, (8,), eps=-1.0)


@pytest.mark.parametrize("bias,group", [(True, 0), (False, 0), (True, 16)])
def test_linear_w8a8_op(backend, bias, group):
    from yirage.ir.ops import quantize_rows_int8
    g = yr.new_kernel_graph()
    X = g.new_input((2, 19, 64))
    W = g.new_input((64, 40), dtype=yr.int8)
    S = g.new_input((40,))
    B = g.new_input((40,)) if bias else None
    g.mark_output(g.linear_w8a8(X, W, S, B, group_size=group))
    w, x, b = torch.randn(40, 64), torch.randn(2, 19, 64), torch.randn(40)
    x[1, 3] = 0  # a zero row: scale 1, output = bias
    wq, ws = quantize_rows_int8(w)
    inputs = [x, wq.t().contiguous(), ws.reshape(-1)] + ([b] if bias else [])
    out = g(inputs=_on(backend, inputs), backend=backend)[0].cpu()
    torch.testing.assert_close(out, g.interpret(inputs)[0], atol=1e-5, rtol=1e-5)
    expect = F.linear(x, w, b if bias else None)
    assert (out - expect).abs().max() <= 0.03 * expect.abs().max()  # int8 rounding of x and w
    with pytest.raises(yr.GraphError, match="int8"):
        g.linear_w8a8(X, g.new_input((64, 40)), S)
    for bad in (3, 6, 128):  # not a multiple of 4, not dividing K = 64, larger than K
        with pytest.raises(yr.GraphError, match="group_size"):
            g.linear_w8a8(X, W, S, group_size=bad)


def test_bucket_tokens():
    from yirage.engines.embed import bucket_tokens
    for n in range(1, 20000, 7):
        b = bucket_tokens(n)
        assert 0 <= b - n < max(16, n / 32) and b % 16 == 0
    assert len({bucket_tokens(n) for n in range(1, 8193)}) <= 64 + 32 * 7  # a few buckets per doubling


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=400), st.integers(1, 64))
def test_token_batches_pack_every_sentence_once_within_the_budget(lengths, batch_size):
    from yirage.engines.embed import bucket_tokens, token_batches
    batches = token_batches(lengths, batch_size)
    taken = [i for idx, _ in batches for i in idx]
    assert sorted(taken) == list(range(len(lengths)))                     # each sentence exactly once
    assert [lengths[i] for i in taken] == sorted(lengths, reverse=True)   # longest first
    budget = bucket_tokens(max(1, sum(sorted(lengths, reverse=True)[:batch_size])))
    for n, (idx, rows) in enumerate(batches):
        total = sum(lengths[i] for i in idx)
        assert total <= rows and len(idx) <= rows and rows % 16 == 0    # fits its plan (T rows, T sentences)
        if n < len(batches) - 1:
            assert rows == budget                                         # one plan for every full batch
            nxt = lengths[batches[n + 1][0][0]]
            assert total + nxt > rows or len(idx) == rows                 # full: the next one did not fit
    assert len({rows for _, rows in batches}) <= 2


def test_an_encode_builds_at_most_two_plans(reference):
    """Token budgets: 300 sentences of 1 to 256 tokens are one plan for the full batches and one
    for the last, whatever the batch size (before, every batch of a new bucket built one)."""
    sents, _ = reference
    for batch_size in (32, 5):
        m = yr.EmbeddingModel("all-minilm-l6-v2", backend="cpu")
        m.encode(sents, batch_size=batch_size)
        assert len(m.plan_shapes) <= 2, m.plan_shapes


def test_attention_varlen_op(backend):
    H, Dh, lengths = 4, 8, [5, 5, 3, 1]
    T = sum(lengths) + 3  # three rows of bucket padding
    g = yr.new_kernel_graph()
    Q = g.new_input((T, 3 * H * Dh))
    O = g.new_input((len(lengths) + 1,), dtype=yr.int64)
    g.mark_output(g.attention_varlen(Q, O, H))
    qkv = torch.randn(T, 3 * H * Dh)
    offsets = torch.tensor([0, 5, 10, 13, 14])
    out = g(inputs=_on(backend, [qkv, offsets]), backend=backend)[0].cpu()
    for s, e in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        q, k, v = qkv[s:e].view(e - s, 3, H, Dh).permute(1, 2, 0, 3)
        expect = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(e - s, H * Dh)
        torch.testing.assert_close(out[s:e], expect, atol=1e-5, rtol=1e-5)
    assert not out[14:].any()
    with pytest.raises(yr.IndexOutOfRangeError, match="attention_varlen"):
        g(inputs=_on(backend, [qkv, torch.tensor([0, 5, 4, 13, 14])]), backend=backend)
    with pytest.raises(yr.IndexOutOfRangeError, match="attention_varlen"):
        g(inputs=_on(backend, [qkv, torch.tensor([0, 5, 10, 13, T + 1])]), backend=backend)


def test_attention_bidir_op(backend):
    B, S, H, Dh = 3, 9, 4, 8
    g = yr.new_kernel_graph()
    Q = g.new_input((B, S, 3 * H * Dh))
    M = g.new_input((B, S))
    g.mark_output(g.attention_bidir(Q, M, H))
    qkv = torch.randn(B, S, 3 * H * Dh)
    lengths = [9, 4, 1]
    mask = torch.zeros(B, S)
    for b, n in enumerate(lengths):
        mask[b, n:] = float("-inf")
    out = g(inputs=_on(backend, [qkv, mask]), backend=backend)[0].cpu()
    q, k, v = qkv.view(B, S, 3, H, Dh).permute(2, 0, 3, 1, 4)
    keep = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :]).transpose(1, 2)
    torch.testing.assert_close(out, expect.reshape(B, S, H * Dh), atol=1e-5, rtol=1e-5)
    with pytest.raises(yr.GraphError, match="key_mask"):
        g.attention_bidir(Q, g.new_input((B, S + 1)), H)


def test_a_loaded_model_freezes_the_heap_so_full_collections_stay_short():
    """After load the process's objects sit in the collector's permanent generation: a full
    collection (which a first encode's plan building triggers) no longer walks them."""
    import gc

    gc.unfreeze()
    gc.collect()   # earlier tests' garbage (their models) must not count as what the load froze
    before = len(gc.get_objects(generation=2))
    yr.EmbeddingModel(backend="cpu")
    assert gc.get_freeze_count() >= before > 0
    assert len(gc.get_objects(generation=2)) < before // 10
