"""yr.PersistentKernel and the CPU task-graph runtime, against torch and transformers.

References: the op table's torch references (``g.interpret``) for single ops, the
launch-per-op plan and transformers' greedy ``generate`` for whole decode steps.
"""
import ctypes
import json

import gguf
import numpy as np
import pytest
import torch

import yirage as yr
from yirage.backends import Backend
from yirage.errors import GraphError, IndexOutOfRangeError
from yirage.models.llama import LlamaModel
from yirage.models.loading import load_model
from yirage.runtime.task_graph import TaskGraphPlan, get_pool, scheduler


def _task_plan(g, inputs, workers):
    cg = g.compile("cpu")
    return TaskGraphPlan(cg, inputs, get_pool(workers, adaptive=False))


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("quant", [None, "q8_0", "q4_1"])
def test_linear_rmsnorm_argmax_match_the_reference(workers, quant):
    torch.manual_seed(workers)
    g = yr.new_kernel_graph()
    K, N = 256, 1030  # N not a multiple of the 4-row groups
    x = g.new_input((1, K))
    w = g.new_input((N, K), yr.DType(quant) if quant else yr.float32)
    nw = g.new_input((K,))
    y = g.linear(g.mul(g.rms_norm(x, (K,)), nw), w)
    g.mark_output(y)
    g.mark_output(g.argmax(y))
    xs, nws = torch.randn(1, K), torch.rand(K) + 0.5
    if quant:  # GGML blocks written by the gguf package
        qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}[quant]
        ws = torch.from_numpy(gguf.quants.quantize(np.random.default_rng(1).standard_normal((N, K)).astype(np.float32),
                                                   qt).copy())
    else:
        ws = torch.randn(N, K)
    ref = g.interpret([xs, ws, nws])
    plan = _task_plan(g, [xs, ws, nws], workers)
    assert plan.segments == 1
    out = plan.run()
    torch.testing.assert_close(out[0], ref[0], atol=2e-4, rtol=1e-4)
    assert int(out[1]) == int(ref[1])


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("pos", [0, 5, 300, 700])
@pytest.mark.parametrize("Dh", [16, 24, 32, 64, 128])  # AVX-512: scalar-loop paths (16, 24), 2, 4, 8 registers
def test_flash_decoding_attention_matches_the_reference(workers, pos, Dh, Hq=6, Hkv=2):
    """Decode attention split over the KV length (several splits at max_seq 1024) with GQA."""
    torch.manual_seed(pos)
    S = 1024
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((1, Hq, Dh)), g.new_input((1, Hkv, Dh)), g.new_input((1, Hkv, Dh))
    kc, vc = g.new_input((S, Hkv, Dh)), g.new_input((S, Hkv, Dh))
    start = g.new_input((1,), yr.int64)
    cos, sin = g.new_input((S, Dh // 2)), g.new_input((S, Dh // 2))
    out = g.attention(g.rope(q, cos, sin, start), g.rope(k, cos, sin, start), v, kc, vc, start)
    g.mark_output(out)
    tensors = [torch.randn(1, Hq, Dh), torch.randn(1, Hkv, Dh), torch.randn(1, Hkv, Dh),
               torch.randn(S, Hkv, Dh), torch.randn(S, Hkv, Dh), torch.tensor([pos]),
               torch.rand(S, Dh // 2), torch.rand(S, Dh // 2)]
    ref_inputs = [t.clone() for t in tensors]
    ref = g.interpret(ref_inputs)[0]
    got = _task_plan(g, tensors, workers).run()[0]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(tensors[3], ref_inputs[3])  # the cache row was written the same way


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (8, 2), (3, 3), (8, 1)])
@pytest.mark.parametrize("Dh", [64, 128])
def test_flash_decoding_attention_query_groups(Dh, Hq, Hkv):
    """Groups of 2, 4, 1 and 8 query heads per KV head (with AVX-512 the groups of 2 to 4 at Dh 64
    and of 2 at Dh 128 run all their heads in one pass over the keys, the others head by head)."""
    test_flash_decoding_attention_matches_the_reference(2, 300, Dh, Hq, Hkv)


def test_out_of_range_token_and_position_raise(tmp_path):
    g = yr.new_kernel_graph()
    ids = g.new_input((1,), yr.int64)
    table = g.new_input((10, 32))
    g.mark_output(g.embedding(ids, table))
    ids_t = torch.tensor([3])
    plan = _task_plan(g, [ids_t, torch.randn(10, 32)], 2)
    plan.run()
    ids_t.fill_(10)
    with pytest.raises(IndexOutOfRangeError, match="10"):
        plan.run()
    ids_t.fill_(-1)
    with pytest.raises(IndexOutOfRangeError):
        plan.run()
    ids_t.fill_(9)
    plan.run()  # the error state was cleared


def test_scheduler_rejects_malformed_graphs():
    lib = scheduler()
    fn = ctypes.cast(lib.yr_pk_pool_width, ctypes.c_void_p).value  # any non-null address: never called

    def create(tasks, ops, deps):
        t = torch.tensor([[r[0], r[1], 0, r[2], r[3], r[4], -1, 0] for r in tasks], dtype=torch.int64)
        o = torch.tensor(ops, dtype=torch.int64).reshape(-1, 3)
        d = torch.tensor(deps or [0], dtype=torch.int64)
        err = ctypes.c_int64(0)
        h = lib.yr_pk_graph_create(t.data_ptr(), len(t), o.data_ptr(), len(o), d.data_ptr(), len(deps),
                                   ctypes.byref(err))
        if h:
            lib.yr_pk_graph_destroy(h)
        return bool(h), err.value

    good = ([[fn, 0, 0, 1, 0], [fn, 0, 0, 1, 1]], [[1, 0, 0], [1, 0, 1]], [0])
    assert create(*good) == (True, 0)
    assert create(good[0], [[1, 0, 0], [1, 0, 1]], [1]) == (False, 3)          # depends on itself
    assert create(good[0], [[1, 0, 0], [1, 0, 2]], [0]) == (False, 2)          # dep range past the list
    assert create([[fn, 0, 0, 1, 1], [fn, 0, 0, 1, 0]], good[1], good[2])[0] is False  # out of order
    assert create([[fn, 0, 0, 1, 0], [fn, 0, 0, 1, 5]], good[1], good[2])[0] is False  # unknown op
    assert create([[0, 0, 0, 1, 0], [fn, 0, 0, 1, 1]], good[1], good[2])[0] is False   # null function
    assert create(good[0], [[2, 0, 0], [1, 0, 1]], [0]) == (False, 4)          # task count mismatch


def test_persistent_kernel_arguments_that_mean_nothing_here_raise():
    for kwargs, word in [({"world_size": 2}, "world_size"), ({"num_remote_schedulers": 1}, "remote"),
                         ({"num_local_schedulers": 8}, "num_local_schedulers"),
                         ({"spec_decode_config": object()}, "speculative"), ({"num_workers": 0}, "num_workers"),
                         ({"max_seq_length": 0}, "max_seq_length")]:
        args = {"max_seq_length": 16, **kwargs}
        with pytest.raises(GraphError, match=word):
            yr.PersistentKernel(**args)
    with pytest.raises(GraphError, match="meta_tensors"):
        yr.PersistentKernel(max_seq_length=16, meta_tensors=[torch.zeros(1, dtype=torch.int32),
                                                              torch.zeros(16, dtype=torch.int64)])
    mpk = yr.PersistentKernel(max_seq_length=16)
    h = mpk.new_tensor((1, 8), yr.float32, "h")
    with pytest.raises(GraphError, match="before any layer wrote it"):
        mpk.rmsnorm_layer(h, mpk.attach_input(torch.ones(8), "w"), mpk.new_tensor((1, 8), yr.float32, "o"))
    with pytest.raises(GraphError, match="already exists"):
        mpk.new_tensor((1, 8), yr.float32, "h")
    with pytest.raises(GraphError, match="nvshmem"):
        mpk.new_tensor((1, 8), yr.float32, "n", io_category="nvshmem_tensor")
    with pytest.raises(GraphError, match="argmax"):
        mpk.compile()


def _tiny_reference(save_tiny_model, kind, tmp_path):
    hf = save_tiny_model(kind, tmp_path)
    return hf, load_model(str(tmp_path), progress=False)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_llama_decode_kernel_equals_the_step_graph(save_tiny_model, tmp_path, kind, workers):
    _, loaded = _tiny_reference(save_tiny_model, kind, tmp_path)
    model = LlamaModel(loaded, Backend.CPU, max_seq_length=64)
    g, tensors = model.build_graph(1)
    ids, start = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    plan = g.compile("cpu").plan([ids, start, *tensors])
    mpk = model.decode_kernel(num_workers=workers)
    assert mpk.plan.segments == 1
    tokens = [5, 17, 250, 3, 99, 42]
    want = []
    for pos, tok in enumerate(tokens):
        ids.fill_(tok), start.fill_(pos)
        want.append([t.clone() for t in plan.run()])
    for pos, tok in enumerate(tokens):  # rewrites the same cache rows
        logits, arg = mpk.run_step(tok, pos)
        torch.testing.assert_close(logits, want[pos][0], atol=1e-5, rtol=1e-5)
        assert int(arg[0]) == int(want[pos][1][0])


def test_mpk_builders_decode_loop_equals_transformers_greedy(save_tiny_model, tmp_path):
    """MPK's own layout: fused qkv and gate_up weights, 4-D KV caches, full-width RoPE
    tables, meta tensors; mpk() runs prompt + decode inside the scheduler."""
    hf, loaded = _tiny_reference(save_tiny_model, "llama", tmp_path)
    cfg = loaded.config
    H, Dh, hq, hkv, S = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, 64
    sd = {k: v.float() for k, v in hf.state_dict().items()}
    step = torch.zeros(1, dtype=torch.int64)
    tokens = torch.zeros(1, S, dtype=torch.int64)
    prompt = [2, 17, 250, 3, 99, 42, 7]
    tokens[0, :len(prompt)] = torch.tensor(prompt)
    profile = torch.zeros(20000, 6, dtype=torch.int64)
    mpk = yr.PersistentKernel(num_workers=2, num_local_schedulers=1, max_seq_length=S, eos_token_id=[],
                              meta_tensors=[step, tokens], profiler_tensor=profile)
    x = mpk.attach_input(tokens, "tokens")
    pos = torch.arange(S, dtype=torch.float32)[:, None] * cfg.inv_freq.float()[None, :] * 1.0
    emb = torch.cat([pos, pos], dim=-1) * cfg.attention_scaling
    cos = mpk.attach_input(emb.cos().contiguous(), "cos")
    sin = mpk.attach_input(emb.sin().contiguous(), "sin")
    h = mpk.new_tensor((1, H), yr.float32, "embed_out")
    mpk.embed_layer(x, mpk.attach_input(sd["model.embed_tokens.weight"], "embed"), h, (1, 1, 1), (128, 1, 1))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        wqkv = torch.cat([sd[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"]).contiguous()
        qkv = mpk.new_tensor((1, (hq + 2 * hkv) * Dh), yr.float32, f"qkv{i}")
        mpk.rmsnorm_linear_layer(h, mpk.attach_input(sd[f"{p}.input_layernorm.weight"], f"n1.{i}"),
                                 mpk.attach_input(wqkv, f"wqkv{i}"), qkv, (8, 1, 1), (128, 1, 1), eps=cfg.rms_norm_eps)
        kc = mpk.attach_input(torch.zeros(1, S, hkv, Dh), f"kc{i}")
        vc = mpk.attach_input(torch.zeros(1, S, hkv, Dh), f"vc{i}")
        a = mpk.new_tensor((1, hq * Dh), yr.float32, f"attn{i}")
        mpk.attention_layer(qkv, kc, vc, None, None, cos, sin, a, (hkv, 1, 1), (128, 1, 1))
        h2 = mpk.new_tensor((1, H), yr.float32, f"h2.{i}")
        mpk.linear_with_residual_layer(a, mpk.attach_input(sd[f"{p}.self_attn.o_proj.weight"], f"wo{i}"), h, h2)
        gu = mpk.new_tensor((1, 2 * cfg.intermediate_size), yr.float32, f"gu{i}")
        wgu = torch.cat([sd[f"{p}.mlp.gate_proj.weight"], sd[f"{p}.mlp.up_proj.weight"]]).contiguous()
        mpk.rmsnorm_linear_layer(h2, mpk.attach_input(sd[f"{p}.post_attention_layernorm.weight"], f"n2.{i}"),
                                 mpk.attach_input(wgu, f"wgu{i}"), gu, eps=cfg.rms_norm_eps)
        h = mpk.new_tensor((1, H), yr.float32, f"h{i}")
        mpk.silu_mul_linear_with_residual_layer(gu, mpk.attach_input(sd[f"{p}.mlp.down_proj.weight"], f"wd{i}"), h2, h)
    logits = mpk.new_tensor((1, cfg.vocab_size), yr.float32, "logits")
    mpk.rmsnorm_linear_layer(h, mpk.attach_input(sd["model.norm.weight"], "norm"),
                             mpk.attach_input(sd["lm_head.weight"], "lm_head"), logits, eps=cfg.rms_norm_eps)
    part = (mpk.new_tensor((1, 8), yr.float32, "vals"), mpk.new_tensor((1, 8), yr.int64, "idx"))
    mpk.argmax_partial_layer(logits, part, (8, 1, 1), (128, 1, 1))
    mpk.argmax_reduce_layer(part, mpk.new_tensor((1, 1), yr.int64, "next"), (1, 1, 1), (128, 1, 1))
    mpk.compile()
    assert mpk.plan.segments == 1
    new = mpk(prompt_length=len(prompt), max_new_tokens=12)
    assert new == 12 and int(step[0]) == len(prompt) - 1 + 12
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                          pad_token_id=0, eos_token_id=None)[0].tolist()
    assert tokens[0, :len(ref)].tolist() == ref
    assert tokens[0, len(prompt):len(prompt) + 12].tolist() == ref[len(prompt):]
    # the profile: one task event per (task, step), one track per worker, a valid Chrome trace
    trace = tmp_path / "trace.json"
    n = mpk.write_trace(trace)
    assert n == mpk.num_tasks * (len(prompt) - 1 + 12)
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} <= {0, 1} and all(e["dur"] >= 0 for e in spans)
    assert any(e["name"].startswith("linear") for e in spans) and any("attention" in e["name"] for e in spans)


def test_cli_trace_writes_a_perfetto_trace(save_tiny_model, tmp_path):
    import subprocess
    import sys

    save_tiny_model("llama", tmp_path / "m")
    trace = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "yirage.cli", "generate", "-m", str(tmp_path / "m"), "--no-chat",
                           "--max-new-tokens", "4", "--workers", "2", "--trace", str(trace), "w5 w6 w7"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "task events" in proc.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    # which workers ran tasks depends on the OS: on a loaded machine either may do them all
    assert names and names <= {"worker 0", "worker 1"}
    assert len([e for e in events if e["ph"] == "X"]) > 0
    bad = subprocess.run([sys.executable, "-m", "yirage.cli", "generate", "-m", str(tmp_path / "m"), "--no-chat",
                          "--no-persistent", "--trace", str(trace), "w5"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "--no-persistent" in bad.stderr


def test_llm_persistent_and_plan_generate_the_same_tokens(save_tiny_model, tmp_path):
    save_tiny_model("llama", tmp_path)
    a = yr.LLM(str(tmp_path), persistent=True, num_workers=2, max_seq_length=96)
    b = yr.LLM(str(tmp_path), persistent=False, max_seq_length=96)
    assert a.persistent and not b.persistent
    ra = a.generate("w3 w4 w5", chat=False, max_new_tokens=20)
    rb = b.generate("w3 w4 w5", chat=False, max_new_tokens=20)
    assert ra.token_ids == rb.token_ids and len(ra.token_ids) > 0
    with pytest.raises(yr.GenerationError, match="profiler_tensor"):
        a.write_trace(tmp_path / "t.json")


def test_a_forked_child_runs_on_its_own_workers(save_tiny_model, tmp_path):
    """A fork has none of the parent's worker threads: the child must not wait for them."""
    import os

    _, loaded = _tiny_reference(save_tiny_model, "llama", tmp_path)
    mpk = LlamaModel(loaded, Backend.CPU, max_seq_length=32).decode_kernel(num_workers=2)
    want = mpk.run_step(5, 0)[1].clone()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the step ran and agrees
        code = 1
        try:
            code = 0 if int(mpk.run_step(5, 0)[1][0]) == int(want[0]) else 2
        finally:
            os._exit(code)
    import time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the forked child hung on the parent's worker pool")


@pytest.mark.parametrize("T,pos", [(2, 0), (16, 0), (17, 3), (100, 0), (70, 200)])
@pytest.mark.parametrize("Dh", [16, 24, 32, 64, 128])
def test_tiled_prefill_attention_matches_the_reference(T, pos, Dh):
    """Causal prefill attention (library.cpp attention_prefill_tiled: query tiles x key
    tiles, online softmax) against the op's torch reference, with GQA and a cache that
    already holds earlier positions."""
    torch.manual_seed(T * 1000 + Dh)
    S, Hq, Hkv = 512, 6, 2
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((T, Hq, Dh)), g.new_input((T, Hkv, Dh)), g.new_input((T, Hkv, Dh))
    kc, vc = g.new_input((S, Hkv, Dh)), g.new_input((S, Hkv, Dh))
    start = g.new_input((1,), yr.int64)
    g.mark_output(g.attention(q, k, v, kc, vc, start))
    tensors = [torch.randn(T, Hq, Dh) * 2, torch.randn(T, Hkv, Dh) * 2, torch.randn(T, Hkv, Dh),
               torch.randn(S, Hkv, Dh), torch.randn(S, Hkv, Dh), torch.tensor([pos])]
    ref = g.interpret([t.clone() for t in tensors])[0]
    got = g.compile("cpu")(tensors)[0]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def _window_attention_graph(T, S, Hq, Hkv, Dh, window, cache=yr.float32):
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((T, Hq, Dh)), g.new_input((T, Hkv, Dh)), g.new_input((T, Hkv, Dh))
    kc, vc = g.new_input((S, Hkv, Dh), cache), g.new_input((S, Hkv, Dh), cache)
    start = g.new_input((1,), yr.int64)
    g.mark_output(g.attention(q, k, v, kc, vc, start, window=window))
    return g


def _window_reference(tensors, window):
    """Sliding-window GQA attention by hand (SDPA with an explicit boolean mask in float64):
    the query at position p sees keys p - W < j <= p (transformers' sliding-window causal mask)."""
    q, k, v, kc, vc, pos = (t.clone() for t in tensors)
    T, Hq, _ = q.shape
    p0 = int(pos[0])
    kc[p0:p0 + T], vc[p0:p0 + T] = k, v
    L = p0 + T
    j, p = torch.arange(L)[None, :], (p0 + torch.arange(T))[:, None]
    mask = (j <= p) & (j > p - window) if window else j <= p
    rep = Hq // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).double(), kc[:L].repeat_interleave(rep, 1).transpose(0, 1).double(),
        vc[:L].repeat_interleave(rep, 1).transpose(0, 1).double(), attn_mask=mask, scale=q.shape[-1] ** -0.5)
    return out.transpose(0, 1).float()


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("window", [None, 1, 2, 7, 64, 300, 701, 5000])   # below, at and above the context
@pytest.mark.parametrize("pos", [0, 6, 300, 700])
@pytest.mark.parametrize("Dh,Hq,Hkv", [(16, 6, 2), (24, 4, 4), (64, 8, 2), (128, 3, 1)])
def test_sliding_window_flash_decoding_tasks_match_the_reference(workers, window, pos, Dh, Hq, Hkv):
    """Decode (T = 1) in a sliding window as persistent-kernel tasks (append, partial over the
    window's KV splits, combine): equal to the op's torch reference and to a hand-written masked
    SDPA, for windows smaller than, equal to (W = pos + 1) and larger than the context, W = 1,
    GQA and MHA, and every register width of the kernels (Dh 16/24: scalar loops; 64, 128)."""
    torch.manual_seed(pos * 7 + Dh)
    S = 1024
    g = _window_attention_graph(1, S, Hq, Hkv, Dh, window)
    tensors = [torch.randn(1, Hq, Dh) * 2, torch.randn(1, Hkv, Dh) * 2, torch.randn(1, Hkv, Dh),
               torch.randn(S, Hkv, Dh), torch.randn(S, Hkv, Dh), torch.tensor([pos])]
    ref_inputs = [t.clone() for t in tensors]
    ref = g.interpret(ref_inputs)[0]
    torch.testing.assert_close(ref, _window_reference(tensors, window), atol=2e-5, rtol=1e-4)
    plan = _task_plan(g, tensors, workers)
    assert plan.segments == 1
    got = plan.run()[0]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(tensors[3], ref_inputs[3])   # the cache keeps every row
    if window and window <= pos:   # the window changes the result (the test can see it)
        assert not torch.allclose(_window_reference(tensors, None), got, atol=2e-5, rtol=1e-4)


def test_sliding_window_decode_splits_only_the_window():
    """With a window, the flash-decoding partial op is split over the window's keys, not over
    the cache: with 8 workers a 4096-row cache gets 16 splits per KV head, W = 64 one."""
    S, Hq, Hkv, Dh = 4096, 4, 2, 32
    for window, splits in [(None, 16), (64, 1)]:
        g = _window_attention_graph(1, S, Hq, Hkv, Dh, window)
        tensors = [torch.randn(1, Hq, Dh), torch.randn(1, Hkv, Dh), torch.randn(1, Hkv, Dh),
                   torch.randn(S, Hkv, Dh), torch.randn(S, Hkv, Dh), torch.tensor([4000])]
        ref = g.interpret([t.clone() for t in tensors])[0]
        plan = _task_plan(g, tensors, 8)
        assert any(f"{Hkv} kv heads x {splits} splits" in name for name in plan.task_names), plan.task_names
        torch.testing.assert_close(plan.run()[0], ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 3, 16, 70, 300])
@pytest.mark.parametrize("T,pos", [(2, 0), (17, 3), (100, 0), (70, 200)])
@pytest.mark.parametrize("Dh", [16, 64])
def test_sliding_window_tiled_prefill_matches_the_reference(T, pos, Dh, window):
    """Prefill (T > 1: library.cpp attention_prefill_tiled, run for every T > 1) and the same
    step as persistent-kernel tasks, in a sliding window: windows inside one 16-query tile,
    across key tiles (64 keys) and longer than the context."""
    torch.manual_seed(T * 1000 + Dh + window)
    S, Hq, Hkv = 512, 6, 2
    g = _window_attention_graph(T, S, Hq, Hkv, Dh, window)
    tensors = [torch.randn(T, Hq, Dh) * 2, torch.randn(T, Hkv, Dh) * 2, torch.randn(T, Hkv, Dh),
               torch.randn(S, Hkv, Dh), torch.randn(S, Hkv, Dh), torch.tensor([pos])]
    ref = g.interpret([t.clone() for t in tensors])[0]
    torch.testing.assert_close(ref, _window_reference(tensors, window), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(g.compile("cpu")([t.clone() for t in tensors])[0], ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(_task_plan(g, [t.clone() for t in tensors], 2).run()[0], ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("T,pos", [(1, 0), (1, 300), (1, 700), (70, 200)])
@pytest.mark.parametrize("Dh,Hq,Hkv", [(16, 6, 2), (64, 9, 3), (64, 4, 1), (128, 4, 2)])
def test_float16_kv_cache_tasks_and_launch_match_the_reference(T, pos, window, Dh, Hq, Hkv):
    """A float16 KV cache (float32 q, k, v): the decode tasks (append, partial: the grouped GQA
    pass for 3 and 4 query heads per KV head at Dh 64, 2 at Dh 128, the per-head loops at Dh 16;
    combine), the tiled prefill and the launch form write k, v rounded as torch's ``.half()``
    and equal the op's reference, which reads the float16 keys back as float32; and a hand-written
    masked SDPA over the rounded cache."""
    torch.manual_seed(pos + T + Dh)
    S = 1024
    g = _window_attention_graph(T, S, Hq, Hkv, Dh, window, cache=yr.float16)
    tensors = [torch.randn(T, Hq, Dh) * 2, torch.randn(T, Hkv, Dh) * 2, torch.randn(T, Hkv, Dh),
               torch.randn(S, Hkv, Dh).half(), torch.randn(S, Hkv, Dh).half(), torch.tensor([pos])]
    ref_inputs = [t.clone() for t in tensors]
    ref = g.interpret(ref_inputs)[0]
    by_hand = [t.float() if t.dtype == torch.float16 else t for t in tensors]
    by_hand[1], by_hand[2] = tensors[1].half().float(), tensors[2].half().float()
    torch.testing.assert_close(ref, _window_reference(by_hand, window), atol=2e-5, rtol=1e-4)
    for run in ("tasks", "launch"):
        ts = [t.clone() for t in tensors]
        got = (_task_plan(g, ts, 3) if run == "tasks" else g.compile("cpu").plan(ts)).run()[0]
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
        assert torch.equal(ts[3], ref_inputs[3]) and torch.equal(ts[4], ref_inputs[4]), run   # the same roundings


@pytest.mark.parametrize("window", [3, None])
def test_attention_layer_passes_the_window(window):
    """``PersistentKernel.attention_layer(window=...)`` (fused qkv input, no RoPE) reaches the
    attention op: a decode step at position 10 equals the windowed reference, and W = 3
    differs from full attention; a bad window is a GraphError."""
    S, Hq, Hkv, Dh, pos = 32, 4, 2, 16, 10
    torch.manual_seed(1)
    kc0, vc0 = torch.randn(S, Hkv, Dh), torch.randn(S, Hkv, Dh)
    qkv = torch.randn(1, (Hq + 2 * Hkv) * Dh)
    mpk = yr.PersistentKernel(num_workers=2, max_seq_length=S, eos_token_id=[], backend="cpu")
    kc, vc = kc0.clone(), vc0.clone()
    out = mpk.new_tensor((1, Hq * Dh), yr.float32, "attn")
    x, kch, vch = mpk.attach_input(qkv, "qkv"), mpk.attach_input(kc, "k_cache"), mpk.attach_input(vc, "v_cache")
    for bad in (-1, 2.0, True):
        with pytest.raises(GraphError, match="window"):
            mpk.attention_layer(x, kch, vch, None, None, None, None, out, window=bad)
    mpk.attention_layer(x, kch, vch, None, None, None, None, out, window=window)
    mpk.mark_output(out)
    part = (mpk.new_tensor((1, 1), yr.float32, "vals"), mpk.new_tensor((1, 1), yr.int64, "idx"))
    mpk.argmax_partial_layer(out, part)
    mpk.argmax_reduce_layer(part, mpk.new_tensor((1, 1), yr.int64, "next"))
    mpk.compile()
    got = mpk.run_step(0, pos)[0].reshape(1, Hq, Dh)
    heads = qkv.reshape(Hq + 2 * Hkv, Dh)
    q, k, v = heads[:Hq][None], heads[Hq:Hq + Hkv][None], heads[Hq + Hkv:][None]
    want = _window_reference([q, k, v, kc0, vc0, torch.tensor([pos])], window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    if window:
        assert (want - _window_reference([q, k, v, kc0, vc0, torch.tensor([pos])], None)).abs().max() > 1e-3


from hypothesis import given, settings, strategies as st  # noqa: E402


@st.composite
def _dags(draw):
    """Random op DAGs: per op a task count (1-6) and dependencies on earlier ops."""
    n = draw(st.integers(1, 24))
    ops = []
    for o in range(n):
        deps = sorted(draw(st.sets(st.integers(0, o - 1), max_size=min(o, 4)))) if o else []
        ops.append((draw(st.integers(1, 6)), deps, draw(st.sampled_from([0, 50, 2000]))))
    return ops


@settings(max_examples=60, deadline=None)
@given(dag=_dags(), workers=st.integers(1, 4), adaptive=st.booleans(), steps=st.integers(1, 3))
def test_scheduler_runs_every_task_once_after_its_dependencies(dag, workers, adaptive, steps):
    """The scheduler (kernels/cpu/persistent.cpp) on random DAGs: every task of a step runs
    exactly once, and never before all tasks of the ops it depends on have finished."""
    from yirage.runtime.task_graph import _Segment, task_op

    lib = scheduler()
    fn = ctypes.cast(lib.yr_pk_test_task, ctypes.c_void_p).value
    count = torch.zeros(len(dag), dtype=torch.int64)
    need = torch.tensor([t for t, _, _ in dag], dtype=torch.int64)
    violations = torch.zeros(1, dtype=torch.int64)
    keep = []
    ops = []
    for o, (tasks, deps, spin) in enumerate(dag):
        d = torch.tensor(deps or [0], dtype=torch.int64)
        keep.append(d)
        ops.append(task_op(f"op{o}", fn, (count.data_ptr(), need.data_ptr(), o, len(deps), d.data_ptr(),
                                          violations.data_ptr(), spin), [(i, i + 1) for i in range(tasks)]))
    seg = _Segment(ops, [set(deps) for _, deps, _ in dag])
    pool = get_pool(workers, adaptive)
    for _ in range(steps):
        count.zero_()
        assert lib.yr_pk_run(pool.handle, seg.handle, 1, None) == 1
        assert count.tolist() == need.tolist()
    assert int(violations[0]) == 0


def test_a_task_held_by_a_preempted_worker_is_redone_and_its_late_result_dropped():
    """A GEMV-like (redoable) task whose worker stalls (sleeps 2 s, as a worker preempted by
    another process would) is redone by the other worker, so the step does not wait for it;
    when the stalled worker wakes, its result goes to its scratch and is dropped: the
    outputs are not written again (kernels/cpu/persistent.cpp execute/help)."""
    import threading
    import time

    from yirage.runtime.task_graph import WorkerPool, _Segment, task_op

    lib = scheduler()
    fn = ctypes.cast(lib.yr_pk_test_redo_task, ctypes.c_void_p).value
    n, tasks = 64, 8
    x = torch.arange(n, dtype=torch.int64)
    y, z = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    first_a, first_b = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    stalls = torch.zeros(1, dtype=torch.int64)
    stall_ns, tid = 2_000_000_000, threading.get_native_id()
    ranges = [(i * n // tasks, (i + 1) * n // tasks) for i in range(tasks)]

    def op(name, src, dst, first):
        return task_op(name, fn, (src.data_ptr(), dst.data_ptr(), first.data_ptr(), stall_ns, tid,
                                  stalls.data_ptr(), 200_000), ranges, redo_arg=1, elem=8)

    seg = _Segment([op("a", x, y, first_a), op("b", y, z, first_b)], [set(), {0}], [x, y, z])
    pool = WorkerPool(2, adaptive=False)
    try:
        for _ in range(20):   # until the second worker has taken (and stalled in) a task
            y.zero_(), z.zero_()
            t0 = time.monotonic()
            assert lib.yr_pk_run(pool.handle, seg.handle, 1, None) == 1
            took = time.monotonic() - t0
            assert y.tolist() == (2 * x + 1).tolist() and z.tolist() == (4 * x + 3).tolist()
            if int(stalls[0]):
                break
        assert int(stalls[0]) >= 1, "the second worker never took a task"
        assert took < stall_ns / 2e9, f"the step waited for the stalled worker ({took:.2f} s)"
        x.fill_(1000)          # were the stalled worker's result written late, it would differ
        time.sleep(stall_ns / 1e9 + 0.5)
        assert y.tolist() == (2 * torch.arange(n) + 1).tolist()
        assert z.tolist() == (4 * torch.arange(n) + 3).tolist()
    finally:
        del seg                # waits for the stalled worker, if it still runs
        pool.close()


@st.composite
def _redo_chains(draw):
    """Random DAGs of redoable ops: op o reads the output of one earlier op (or the input,
    -1) and may also wait on others; per op a task count and a stall (ns) for the first run
    of each of its slices on a worker thread."""
    n = draw(st.integers(1, 10))
    ops = []
    for o in range(n):
        src = draw(st.integers(-1, o - 1))
        extra = sorted(draw(st.sets(st.integers(0, o - 1), max_size=min(o, 2)))) if o else []
        ops.append((src, extra, draw(st.integers(1, 6)), draw(st.sampled_from([0, 0, 200_000, 2_000_000]))))
    return ops


@settings(max_examples=25, deadline=None)
@given(dag=_redo_chains(), workers=st.integers(2, 4), steps=st.integers(1, 3))
def test_redone_tasks_give_the_same_outputs_as_running_each_once(dag, workers, steps):
    """Redoable ops whose worker threads stall at random (as preempted workers do): every
    step's outputs equal the sequential result, whoever ran (or redid) each task."""
    import threading

    from yirage.runtime.task_graph import WorkerPool, _Segment, task_op

    lib = scheduler()
    fn = ctypes.cast(lib.yr_pk_test_redo_task, ctypes.c_void_p).value
    n = 48
    stalls = torch.zeros(1, dtype=torch.int64)
    outs = [torch.zeros(n, dtype=torch.int64) for _ in dag]
    firsts = [torch.zeros(n, dtype=torch.int64) for _ in dag]
    pool = WorkerPool(workers, adaptive=False)
    try:
        for step in range(steps):
            x = torch.arange(n, dtype=torch.int64) * (step + 1)
            ops, deps = [], []
            for o, (src, extra, tasks, stall) in enumerate(dag):
                ranges = [(i * n // tasks, (i + 1) * n // tasks) for i in range(tasks)]
                inp = x if src < 0 else outs[src]
                ops.append(task_op(f"op{o}", fn, (inp.data_ptr(), outs[o].data_ptr(), firsts[o].data_ptr(), stall,
                                                  threading.get_native_id(), stalls.data_ptr(), 2000),
                                   ranges, redo_arg=1, elem=8))
                deps.append(({src} if src >= 0 else set()) | set(extra))
            seg = _Segment(ops, deps, [x, *outs])
            for f in firsts:
                f.zero_()
            assert lib.yr_pk_run(pool.handle, seg.handle, 1, None) == 1
            want = []
            for src, _, _, _ in dag:
                want.append(2 * (x if src < 0 else want[src]) + 1)
            for o in range(len(dag)):
                assert outs[o].tolist() == want[o].tolist(), f"op {o}"
            del seg
    finally:
        pool.close()
