"""Continuous batching: the batched-step ops against the single-sequence ops, and the
BatchEngine / ``llm.generate([...])`` against each prompt run alone and against transformers."""

import functools

import pytest
import torch

import yirage as yr
from yirage.engines.batching import BatchEngine, make_sampling
from yirage.tools.conformance import CASES, run_case

Hq, Hkv, Dh, S = 6, 2, 10, 24


def _compiled(g, inputs):
    return g.compile("cpu").plan(inputs).run()


# ---- ops ------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [c for c in CASES if c.op in ("rope_rows", "attention_rows")], ids=lambda c: c.id)
def test_conformance_cases_on_cpu(case):
    r = run_case(case, "cpu")
    assert r.status == "PASS", r.message


def _rope_graph(T, op):
    g = yr.new_kernel_graph()
    x, c, s = g.new_input((T, 3, Dh)), g.new_input((S, Dh // 2)), g.new_input((S, Dh // 2))
    n = T if op == "rope_rows" else 1
    g.mark_output(getattr(g, op)(x, c, s, g.new_input((n,), yr.int64)))
    return g


def test_rope_rows_equals_rope_at_each_position():
    freqs = torch.arange(S).float()[:, None] * torch.rand(Dh // 2)[None]
    cos, sin = freqs.cos(), freqs.sin()
    x = torch.randn(5, 3, Dh)
    pos = torch.tensor([7, 0, 23, 7, 2])
    got = _compiled(_rope_graph(5, "rope_rows"), [x, cos, sin, pos])[0]
    one = _rope_graph(1, "rope")
    for t in range(5):   # the single-sequence op, one row at a time, at that row's start_pos
        want = _compiled(one, [x[t:t + 1].clone(), cos, sin, pos[t:t + 1].clone()])[0]
        torch.testing.assert_close(got[t:t + 1], want, atol=0, rtol=0)
    # consecutive positions are rope at start_pos, the prefill case
    run = _compiled(_rope_graph(5, "rope_rows"), [x, cos, sin, torch.arange(4, 9)])[0]
    torch.testing.assert_close(run, _compiled(_rope_graph(5, "rope"), [x, cos, sin, torch.tensor([4])])[0])


def _rows_graph(T, window, Dh=Dh):
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((T, Hq, Dh)), g.new_input((T, Hkv, Dh)), g.new_input((T, Hkv, Dh))
    kc, vc = g.new_input((4, S, Hkv, Dh)), g.new_input((4, S, Hkv, Dh))
    g.mark_output(g.attention_rows(q, k, v, kc, vc, g.new_input((T,), yr.int64), g.new_input((T,), yr.int64),
                                   window=window))
    return g


def _single_graph(T, window, Dh=Dh):
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((T, Hq, Dh)), g.new_input((T, Hkv, Dh)), g.new_input((T, Hkv, Dh))
    kc, vc = g.new_input((S, Hkv, Dh)), g.new_input((S, Hkv, Dh))
    g.mark_output(g.attention(q, k, v, kc, vc, g.new_input((1,), yr.int64), window=window))
    return g


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("run", ["cpu", "triton-interpret", "reference"])
@pytest.mark.parametrize("head_dim", [Dh, 64])
def test_attention_rows_equals_attention_per_sequence(window, run, head_dim):
    """A decode row (slot 0 at 9), a prefill chunk (slot 2 at 3..7), a decode row near the end
    (slot 1 at 23) and a padding row (slot 3 at 0), against ``attention`` per sequence; at head
    dim 64 the C++ kernel computes each KV head's 3 query heads together (library.cpp
    attention_row_group), at 10 one at a time."""
    Dh = head_dim
    rows = [(0, 9), (2, 3), (2, 4), (2, 5), (2, 6), (2, 7), (1, 23), (3, 0)]
    T = len(rows)
    q, k, v = torch.randn(T, Hq, Dh), torch.randn(T, Hkv, Dh), torch.randn(T, Hkv, Dh)
    kc, vc = torch.randn(4, S, Hkv, Dh), torch.randn(4, S, Hkv, Dh)
    k0, v0 = kc.clone(), vc.clone()
    slots, pos = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
    g = _rows_graph(T, window, Dh)
    inputs = [q, k, v, kc, vc, slots, pos]
    got = g.interpret(inputs)[0] if run == "reference" else g.compile(run).plan(inputs).run()[0]
    for slot in range(4):
        idx = [t for t, r in enumerate(rows) if r[0] == slot]
        sc, sv = k0[slot].clone(), v0[slot].clone()
        want = _compiled(_single_graph(len(idx), window, Dh),
                         [q[idx].clone(), k[idx].clone(), v[idx].clone(), sc, sv, torch.tensor([rows[idx[0]][1]])])[0]
        torch.testing.assert_close(got[idx], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kc[slot], sc, atol=0, rtol=0)   # same cache writes
        torch.testing.assert_close(vc[slot], sv, atol=0, rtol=0)


@pytest.mark.parametrize("run", ["cpu", "triton-interpret", "reference"])
@pytest.mark.parametrize("bad,fragment", [((4, 0), "slot or position 4 is out of range \\[0, 4\\)"),
                                          ((1, S), f"slot or position {S} is out of range \\[0, {S}\\)"),
                                          ((-1, 0), "slot or position -1")])
def test_attention_rows_checks_slots_and_positions(run, bad, fragment):
    rows = [(0, 1), bad]
    g = _rows_graph(2, 0)
    kc = torch.randn(4, S, Hkv, Dh)
    before = kc.clone()
    inputs = [torch.randn(2, Hq, Dh), torch.randn(2, Hkv, Dh), torch.randn(2, Hkv, Dh), kc, kc.clone(),
              torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])]
    with pytest.raises(yr.IndexOutOfRangeError, match=fragment):
        g.interpret(inputs) if run == "reference" else g.compile(run).plan(inputs).run()
    assert torch.equal(kc, before)   # nothing written


@pytest.mark.parametrize("run", ["cpu", "triton-interpret", "reference"])
def test_rope_rows_checks_positions(run):
    g = _rope_graph(2, "rope_rows")
    inputs = [torch.randn(2, 3, Dh), torch.randn(S, Dh // 2), torch.randn(S, Dh // 2), torch.tensor([3, S])]
    with pytest.raises(yr.IndexOutOfRangeError, match=f"rope_rows: position {S} is out of range"):
        g.interpret(inputs) if run == "reference" else g.compile(run).plan(inputs).run()


# ---- the engine on the default model ----------------------------------------------------------

PROMPTS = ["What is the capital of France?", "Count to 5.", "Write a haiku about the ocean.", "hi",
           "Explain photosynthesis in one sentence, please, for a child of about seven years old.",
           "List three primary colors."]
MAX_NEW = [12, 20, 16, 6, 14, 18]


@pytest.fixture(scope="module")
def alone(smollm):
    """Each prompt run by itself with llm.generate (the single-sequence path), greedy."""
    return {(p, n, s): smollm.generate(p, max_new_tokens=n, stop=s) for p, n, s in
            [*zip(PROMPTS, MAX_NEW, [None] * 6), (PROMPTS[1], MAX_NEW[1], "3.")]}


@pytest.mark.slow
def test_batched_greedy_equals_each_prompt_alone(smollm, alone):
    """6 prompts of different lengths and limits on 4 slots with a 24-token budget (chunked
    prefill; the last two join as slots free up, while others decode); one has a stop string,
    one is cancelled midway. Token ids equal the single-sequence path's; slots are reused."""
    eng = BatchEngine(smollm, max_slots=4, max_batch_tokens=24)
    stops = [None, "3.", None, None, None, None]
    seqs = [eng.add(smollm.prompt_ids(p), max_new_tokens=n, stops=[s] if s else None)
            for p, n, s in zip(PROMPTS[:5], MAX_NEW, stops)]
    slots_seen, late, joined_while_decoding, pieces = {}, None, False, {}
    while eng.has_work():
        decoding = [s for s in eng.running if not s.in_prefill]
        for ev in eng.step():
            assert ev.seq.finished == (ev.finish is not None)
            pieces.setdefault(ev.seq.id, []).append(ev.seq.take_text())   # streaming, as a server does
        for s in eng.running:
            slots_seen.setdefault(s.id, s.slot)
        if late is None and eng.steps == 3:     # a request joins while others decode
            assert decoding
            late = eng.add(smollm.prompt_ids(PROMPTS[5]), max_new_tokens=MAX_NEW[5])
            seqs.append(late)
        if late is not None and late.slot is not None and any(not s.in_prefill for s in eng.running if s is not late):
            joined_while_decoding = True
        if len(seqs[4].token_ids) == 5:
            eng.cancel(seqs[4])
    assert joined_while_decoding
    for i, s in enumerate(seqs):
        if i == 4:
            assert s.finish_reason == "cancelled"
            full = alone[(PROMPTS[4], MAX_NEW[4], None)].token_ids
            assert len(s.token_ids) == 5 and full[:5] == s.token_ids
            continue
        want = alone[(PROMPTS[i], MAX_NEW[i], stops[i])]
        got = s.result()
        assert got.token_ids == want.token_ids, (i, got.token_ids, want.token_ids)
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason), i
        assert "".join(pieces[s.id]) == got.text
    assert seqs[1].finish_reason == "stop" and "3." not in seqs[1].text
    assert len(set(slots_seen.values())) == 4 and len(slots_seen) == 6   # 6 sequences on 4 slots
    assert not eng.has_work() and sorted(eng._free) == [0, 1, 2, 3]
    assert 0 < eng.solo_steps < eng.steps   # the tail's one-row steps ran on the persistent kernel


@pytest.mark.slow
def test_generate_list_equals_alone_and_transformers(smollm, hf_smollm, alone):
    results = smollm.generate(PROMPTS[:3], max_new_tokens=12)
    for p, r in zip(PROMPTS, results):
        assert r.token_ids == smollm.generate(p, max_new_tokens=12).token_ids
    ids = smollm.encode_prompt(PROMPTS[0])
    with torch.inference_mode():
        ref = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                 pad_token_id=2)[0, len(ids):].tolist()
    eos = set(smollm.eos_token_ids)
    ref = ref[:next((i for i, t in enumerate(ref) if t in eos), len(ref))]
    assert results[0].token_ids == ref
    # message lists and token-id lists are batches too; a list of messages stays one prompt
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    assert [r.token_ids for r in smollm.generate(msgs, max_new_tokens=12)] == [r.token_ids for r in results[:2]]
    by_ids = smollm.generate([smollm.encode_prompt(p) for p in PROMPTS[:2]], max_new_tokens=12)
    assert [r.token_ids for r in by_ids] == [r.token_ids for r in results[:2]]
    assert isinstance(smollm.generate(msgs[0], max_new_tokens=2), yr.GenerationResult)
    with pytest.raises(yr.GenerationError, match="stream=True takes one prompt"):
        smollm.generate(PROMPTS[:2], stream=True)


@pytest.mark.slow
def test_seeded_sampling_repeats_and_equals_alone(smollm):
    kw = dict(max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=11)
    a = smollm.generate(PROMPTS[:3], **kw)
    b = smollm.generate(PROMPTS[:3], **kw)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert a[2].token_ids == smollm.generate(PROMPTS[2], **kw).token_ids


def test_engine_rejects_bad_requests(smollm):
    eng = smollm.batch_engine()
    for bad in ([], [smollm.config.vocab_size], "hi", [1] * smollm.max_seq_length):
        with pytest.raises(yr.GenerationError):
            eng.add(bad)
    with pytest.raises(yr.GenerationError, match="max_new_tokens"):
        eng.add([1, 2], max_new_tokens=0)
    with pytest.raises(yr.GenerationError, match="stops must be"):
        eng.add([1, 2], stops="3.")
    with pytest.raises(yr.GenerationError, match="max_batch_tokens"):
        BatchEngine(smollm, max_slots=8, max_batch_tokens=4)
    s = eng.add([1, 2], make_sampling(0.0))
    eng.cancel(s)
    assert [(e.token, e.finish) for e in eng.step()] == [(None, "cancelled")] and not eng.has_work()


@pytest.mark.slow
def test_prefix_reuse_skips_the_shared_prefill_and_changes_no_token(smollm, alone):
    """On one slot, one after another: a prompt; the same conversation one turn further (its
    prompt starts with the first prompt, so only the rest is prefilled); an unrelated prompt
    (only the chat template's system prefix is shared); the first prompt again (all but its
    last token found). Every answer equals the prompt run alone."""
    eng = BatchEngine(smollm, max_slots=1, max_batch_tokens=16)

    def run(ids, n):
        seq = eng.add(ids, max_new_tokens=n)
        while eng.has_work():
            eng.step()
        return seq

    first_ids = smollm.prompt_ids(PROMPTS[0])
    first = run(first_ids, MAX_NEW[0])
    assert first.cached_tokens == 0 and first.token_ids == alone[(PROMPTS[0], MAX_NEW[0], None)].token_ids
    turn = [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": first.text},
            {"role": "user", "content": PROMPTS[3]}]
    turn_ids = smollm.prompt_ids(turn)
    # what the slot holds: every generated token was fed but the last one of a 'length' finish
    held = (first_ids + first.token_ids)[:len(first_ids) + len(first.token_ids) - (first.finish_reason == "length")]
    shared = next((i for i, (a, b) in enumerate(zip(held, turn_ids)) if a != b), min(len(held), len(turn_ids)))
    assert shared > len(first_ids) // 2
    second = run(turn_ids, 8)
    assert second.cached_tokens == min(shared, len(turn_ids) - 1)
    assert second.token_ids == smollm.generate(turn, max_new_tokens=8).token_ids
    other = run(smollm.prompt_ids(PROMPTS[2]), MAX_NEW[2])
    assert 0 < other.cached_tokens < len(first_ids) // 2 + 8
    assert other.token_ids == alone[(PROMPTS[2], MAX_NEW[2], None)].token_ids
    again = run(smollm.prompt_ids(PROMPTS[2]), MAX_NEW[2])
    assert again.cached_tokens == len(again.prompt_ids) - 1 and again.result().cached_tokens == again.cached_tokens
    assert again.token_ids == other.token_ids
    assert eng.solo_steps > 0   # one slot: its decode steps ran on the persistent kernel, over batch-written K/V


def _task_graph_step_equals_the_plan(llm, T: int, exact: bool = True) -> int:
    """Run a step of T rows (several slots, different positions, earlier keys in the caches)
    as a launch-per-op plan and as a task graph; assert equal logits, argmax and K/V caches
    (bit for bit with ``exact``, else within 1e-5: the plan's float32 linears use the provider
    chosen by measurement, the tasks the GEMV), and the same error (nothing written) for a bad
    slot. Returns the task graph's scheduler segments."""
    from yirage.runtime.task_graph import compiled_task_graph, get_pool
    m = llm.model
    caches = [m.new_batch_cache(4) for _ in range(2)]
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, llm.config.vocab_size, (T,), generator=g)
    positions, slots, sample = torch.arange(T) % 7 * 5, torch.arange(T) % 4, torch.arange(T - 1, -1, -1)
    outs, errors = [], []
    for cache, task_graph in zip(caches, (False, True)):
        for c in cache.k + cache.v:   # earlier keys to attend
            c.normal_(generator=torch.Generator().manual_seed(1))
        graph, tensors = m.build_batch_graph(T, T, cache)
        cg = graph.compile("cpu")
        inputs = [ids, positions, slots, sample, *tensors]
        plan = compiled_task_graph(cg, inputs, get_pool(None)) if task_graph else cg.plan(inputs)
        outs.append([o.clone() for o in plan.run()])
        before = cache.k[0].clone()
        slots[0] = 5   # 4 slots and the scratch slot
        with pytest.raises(yr.IndexOutOfRangeError, match="attention_rows") as err:
            plan.run()
        errors.append(str(err.value))
        assert torch.equal(cache.k[0], before)
        slots[0] = 0
    assert errors[0] == errors[1] and "5" in errors[0]
    same = torch.equal if exact else functools.partial(torch.allclose, atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[0][1], outs[1][1])   # argmax
    for a, b in [(outs[0][0], outs[1][0]), *zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v)]:
        assert same(a, b)
    return plan.segments


@pytest.mark.slow
@pytest.mark.parametrize("T", [2, 5, 16])
def test_task_graph_step_equals_the_launch_per_op_plan(smollm, T):
    """A step of T rows as one task graph on the persistent kernel's workers (what the engine
    runs for up to TASK_GRAPH_MAX_ROWS rows) computes what the launch-per-op plan computes. On
    the default model's q4_1/q8_0 weights every op has a task form (one scheduler segment)
    where the library has the row tiles for T rows, below the rows where a vendor GEMM is
    measured against them (from 16 the projections whose class MKL won are launched)."""
    from yirage.backends.cpu.library import _task_linear_rows
    from yirage.backends.cpu.providers import VENDOR_QUANT_MIN_M
    segments = _task_graph_step_equals_the_plan(smollm, T)
    if T <= _task_linear_rows()[0] and T < VENDOR_QUANT_MIN_M:
        assert segments == 1


def test_task_graph_step_launches_float32_gemms(tmp_path, save_tiny_model):
    """float32 weights: at 8 rows the projections are launched (their packed GEMM) between
    task-graph segments, bit for bit the plan; at 2 rows they are GEMV tasks (one segment)."""
    save_tiny_model("llama", tmp_path)
    llm = yr.LLM(str(tmp_path), backend="cpu", max_seq_length=64, dtype="float32")
    assert _task_graph_step_equals_the_plan(llm, 8) > 1
    assert _task_graph_step_equals_the_plan(llm, 2, exact=False) == 1


@pytest.mark.slow
def test_one_row_steps_on_each_slot_with_one_kernel_kept(smollm, alone, monkeypatch):
    """With one decode kernel kept, one-row steps on two slots (each sequence alone in turn,
    then the longer one's tail) rebuild it for each slot; every answer equals the prompt
    run alone."""
    import yirage.engines.batching as batching
    monkeypatch.setattr(batching, "MAX_SOLO_KERNELS", 1)
    eng = BatchEngine(smollm, max_slots=2, max_batch_tokens=16)
    # the second request takes slot 0 (the prefix the first left there), the third slot 1 and outlasts it
    keys = [(PROMPTS[3], MAX_NEW[3], None), (PROMPTS[0], MAX_NEW[0], None), (PROMPTS[1], MAX_NEW[1], None)]
    seqs = [eng.add(smollm.prompt_ids(keys[0][0]), max_new_tokens=keys[0][1])]
    while eng.has_work():
        eng.step()
    seqs += [eng.add(smollm.prompt_ids(p), max_new_tokens=n) for p, n, _ in keys[1:]]
    slot_of = {}
    while eng.has_work():
        eng.step()
        slot_of.update({s.id: s.slot for s in eng.running})
    assert [slot_of[s.id] for s in seqs[1:]] == [0, 1] and list(eng._solo) == [1] and eng.solo_steps > MAX_NEW[3]
    for key, seq in zip(keys, seqs):
        assert seq.token_ids == alone[key].token_ids, key
