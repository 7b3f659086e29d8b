"""Precompiled models (yirage/dynamo/precompile.py): ``yr.compile(model)`` stores the graph it
compiled (dynamo's bytecode and guards, yirage's partitions), and a later ``yr.compile`` of the
same model, in this process or another, loads it without tracing; against eager every time.

An entry must never be used where it does not apply: a changed source, a changed function
reached through a guard torch cannot store, other shapes, train mode, a damaged file; and models
that cannot be precompiled (graph breaks, hooks, gradients) run through plain torch.compile."""
import importlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import yirage as yr
from yirage.dynamo import precompile

TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(autouse=True)
def _entries(tmp_path, monkeypatch):
    """Entries go to this test's own directory (the kernels' caches stay shared, so no C++
    is rebuilt); the counts start at zero."""
    d = tmp_path / "precompiled"
    d.mkdir()
    monkeypatch.setattr(precompile, "entry_path", lambda k, options: d / f"{k}.pt2")
    precompile.reset_stats()
    return d


class Block(nn.Module):
    def __init__(self, d=32, act=F.gelu):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 64), nn.Linear(64, d)
        self.act = act

    def forward(self, x):
        y = self.fc2(self.act(self.fc1(self.ln(x)))) + x
        return y * 2 if self.training else y


def _compiled(model, x):
    m = yr.compile(model)
    with torch.no_grad():
        y = m(x)
        torch.testing.assert_close(y, model(x), **TOL)
    return m


def test_a_second_compile_loads_the_entry_without_tracing():
    model, x = Block().eval(), torch.randn(2, 5, 32)
    first = _compiled(model, x)
    assert first.precompile_status.startswith("compiled and stored")
    assert len(first._yirage_backend.reports) == 1 and first._yirage_backend.reports[0].partitions
    second = _compiled(model, x)
    assert second.precompile_status.startswith("loaded"), second.precompile_status
    assert second._yirage_backend.reports == []        # the backend never ran: nothing was traced
    assert precompile.stats() == {"hits": 1, "misses": 1, "stores": 1, "rejected": 0, "declined": 0}
    assert second.fc1 is model.fc1 and second.training is False        # the model's attributes, as torch.compile's
    assert list(second.state_dict()) == ["_orig_mod." + k for k in model.state_dict()]


def test_calls_outside_the_guards_run_through_torch_compile():
    model = Block().eval()
    m = _compiled(model, torch.randn(2, 5, 32))
    with torch.no_grad():
        for shape in ((3, 7, 32), (1, 9, 32), (2, 5, 32)):
            x = torch.randn(*shape)
            torch.testing.assert_close(m(x), model(x), **TOL)
        model.train()                       # the guard on self.training fails: train-mode code runs
        x = torch.randn(2, 5, 32)
        torch.testing.assert_close(m(x), model(x), **TOL)
        assert torch.allclose(m(x), model.eval()(x) * 2, **TOL)


def test_ten_lengths_compile_at_most_three_times():
    """The precompiled first shape, then torch.compile's graphs for the others (dynamo's
    automatic dynamic shapes: the second length already compiles symbolically here, as dynamo
    saw the first one traced): at most 3 graphs for 10 sequence lengths, each call equal to
    eager."""
    model = Block().eval()
    m = yr.compile(model)
    with torch.no_grad():
        for length in range(3, 13):
            x = torch.randn(2, length, 32)
            torch.testing.assert_close(m(x), model(x), **TOL)
    assert len(m._yirage_backend.reports) <= 3


def test_a_changed_function_behind_an_unstorable_guard_is_not_loaded():
    """``self.act`` is a builtin: dynamo's guard on it cannot be stored, so the entry checks
    it by name; a model whose act is another function compiles afresh."""
    x = torch.randn(2, 5, 32)
    _compiled(Block(act=torch.relu).eval(), x)
    model = Block(act=torch.sigmoid).eval()
    m = _compiled(model, x)
    assert m.precompile_status.startswith("compiled and stored"), m.precompile_status
    assert precompile.stats()["rejected"] == 1


SOURCE = """
import torch.nn as nn

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x).relu() * {scale}
"""


def test_a_changed_source_is_not_loaded(tmp_path, monkeypatch):
    (tmp_path / "scaled_model.py").write_text(SOURCE.format(scale="2.0"))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("scaled_model")
    x = torch.randn(4, 16)
    model = mod.Scaled().eval()
    _compiled(model, x)
    (tmp_path / "scaled_model.py").write_text(SOURCE.format(scale="3.0"))
    os.utime(tmp_path / "scaled_model.py", ns=(1, 10**18))   # a new mtime, whatever the clock's resolution
    mod = importlib.reload(mod)
    changed = mod.Scaled().eval()
    changed.load_state_dict(model.state_dict())
    m = _compiled(changed, x)                 # the same key (class name, parameters); new code
    assert m.precompile_status.startswith("compiled and stored"), m.precompile_status
    with torch.no_grad():
        torch.testing.assert_close(m(x), model(x) * 1.5, **TOL)
    sys.modules.pop("scaled_model", None)


def test_other_yirage_front_end_code_is_another_entry(monkeypatch):
    """The key carries a digest of yirage's rewrites, lowering and partitioning: an entry
    stored by other yirage code (its partitions chosen by the old rules) is not loaded; the
    model compiles afresh."""
    model, x = Block().eval(), torch.randn(2, 5, 32)
    _compiled(model, x)
    monkeypatch.setattr(precompile, "_front_end_digest", lambda: "other lowering code")
    m = _compiled(model, x)
    assert m.precompile_status.startswith("compiled and stored"), m.precompile_status


def test_a_damaged_entry_is_compiled_afresh(_entries):
    model, x = Block().eval(), torch.randn(2, 5, 32)
    _compiled(model, x)
    (path,) = _entries.glob("*.pt2")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    m = _compiled(model, x)
    assert m.precompile_status.startswith("compiled and stored")
    assert precompile.stats()["rejected"] == 1
    assert _compiled(model, x).precompile_status.startswith("loaded")


class Breaks(Block):
    def forward(self, x):
        y = self.fc1(self.ln(x))
        torch._dynamo.graph_break()
        return self.fc2(F.gelu(y)) + x


def test_models_that_cannot_be_precompiled_run_through_torch_compile():
    x = torch.randn(2, 5, 32)
    m = _compiled(Breaks().eval(), x)
    assert m.precompile_status.startswith("declined"), m.precompile_status
    assert len(m._yirage_backend.reports) == 2          # torch.compile's two graphs, both compiled

    calls = []
    hooked = Block().eval()
    hooked.register_forward_hook(lambda mod, args, out: calls.append(1))
    m = _compiled(hooked, x)
    assert m.precompile_status == "declined: the model has forward hooks" and len(calls) == 2

    model = Block().eval()
    m = yr.compile(model)
    with pytest.warns(yr.YirageFallbackWarning, match="needs gradients"):
        y = m(x)                                          # grad mode on: the graph runs eager
    torch.testing.assert_close(y, model(x), **TOL)
    assert m.precompile_status == "declined: the call needs gradients"
    assert precompile.stats()["declined"] == 3 and precompile.stats()["stores"] == 0


def test_concurrent_first_calls_get_the_answers_they_would_get_alone():
    model = Block().eval()
    xs = [torch.randn(2, 5, 32) for _ in range(4)]
    with torch.no_grad():
        expected = [model(x) for x in xs]
    m, got = yr.compile(model), [None] * 4

    def call(i):
        with torch.no_grad():
            got[i] = m(xs[i])
    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **TOL)
    assert precompile.stats()["misses"] == 1


KEY_SCRIPT = textwrap.dedent("""
    import torch
    from yirage.dynamo import precompile
    from yirage.dynamo.options import parse_options
    options = parse_options(None, {"torch_executed_ops": ["aten.gelu", "aten.add", "aten.mul", "aten.sub"]})
    print(precompile.key(torch.nn.Linear(4, 4), (torch.ones(2, 4),), {}, options, "cpu", None))
""")


def test_the_key_is_the_same_in_every_process():
    """Set-valued options (``torch_executed_ops``) enter the key sorted: string hashing, and so
    a set's order, differs between processes."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    keys = set()
    for seed in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-c", KEY_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        keys.add(proc.stdout.strip().splitlines()[-1])
    assert len(keys) == 1


SCRIPT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import torch, transformers as tf
    import yirage as yr
    from yirage.dynamo import precompile

    entries = Path(sys.argv[1])
    precompile.entry_path = lambda k, options: entries / f"{k}.pt2"
    torch.manual_seed(0)
    if sys.argv[2] == "bert":
        cfg = tf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=64)
        model = tf.BertModel(cfg).eval()
        kw = {"input_ids": torch.randint(0, 100, (2, 12))}
    else:   # its positional convolution is weight-normed (torch.nn.utils.parametrize)
        cfg = tf.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
        model = tf.Wav2Vec2Model(cfg).eval()
        kw = {"input_values": torch.randn(1, 2000)}
    m = yr.compile(model)
    with torch.no_grad():
        t = time.perf_counter()
        got = m(**kw).last_hidden_state
        seconds = time.perf_counter() - t
        err = (got - model(**kw).last_hidden_state).abs().max().item()
    print(json.dumps({"status": m.precompile_status, "traced": len(m._yirage_backend.reports), "err": err,
                      "seconds": seconds, "stats": precompile.stats()}))
""")


def _run(entries: Path, model: str = "bert") -> dict:
    env = dict(os.environ, YIRAGE_BACKEND="cpu")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(entries), model], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["bert", "wav2vec2"])
def test_a_second_process_loads_a_transformers_model(_entries, model):
    """transformers' decorated forwards (closures over the wrapped function) and the globals
    dynamo installs for its bytecode are found again in a fresh interpreter; so is a module
    with parametrizations (wav2vec2's weight-normed convolution), whose class torch makes anew
    in every process and refuses to pickle."""
    first = _run(_entries, model)
    assert first["status"].startswith("compiled and stored") and first["traced"] == 1 and first["err"] < 1e-4
    second = _run(_entries, model)
    assert second["status"].startswith("loaded"), second["status"]
    assert second["traced"] == 0 and second["err"] < 1e-4
    assert second["stats"]["hits"] == 1 and second["stats"]["rejected"] == 0


def _shared_forward(forward):
    """A decorator whose wrapper is one code object for every class it decorates, as
    transformers' output-handling decorators are for its models' ``forward``."""
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)
    return wrapper


class Embedder(nn.Module):
    def __init__(self, padding_idx, p):
        super().__init__()
        self.emb, self.drop, self.fc = nn.Embedding(50, 32, padding_idx=padding_idx), nn.Dropout(p), nn.Linear(32, 32)

    @_shared_forward
    def forward(self, ids):
        return self.fc(F.gelu(self.drop(self.emb(ids))))


def test_models_behind_one_shared_forward_are_each_precompiled():
    """Dynamo's automatic dynamic shapes keep their record per code object, so two models
    behind one shared wrapper saw each other's attributes: after RoBERTa (padding_idx 1,
    dropout 0.1), ALBERT's (0 and 0.0) were marked dynamic, the symbolic dropout probability
    made dynamo restart its analysis, and ALBERT's precompile was declined. Each precompile
    now starts from a record of its own."""
    ids = torch.randint(0, 50, (2, 7))
    for padding_idx, p in ((1, 0.1), (0, 0.0), (3, 0.2)):
        model = Embedder(padding_idx, p).eval()
        m = yr.compile(model)
        with torch.no_grad():
            torch.testing.assert_close(m(ids), model(ids), **TOL)
        assert m.precompile_status.startswith("compiled and stored"), (padding_idx, p, m.precompile_status)


def test_fingerprints_of_configs_and_their_parts():
    """What an encoder-decoder's guards reach through ``self.config``: the config by content,
    dicts (id2label has integer keys), a field's dataclass and its ``int | None`` type."""
    import dataclasses
    from transformers import BartConfig
    fp = precompile.fingerprint
    a, b, c = BartConfig(d_model=32), BartConfig(d_model=32), BartConfig(d_model=32, scale_embedding=True)
    assert fp(a) is not None and fp(a) == fp(b) and fp(a) != fp(c)
    assert fp({0: "LABEL_0", 1: "LABEL_1"}) == fp({1: "LABEL_1", 0: "LABEL_0"}) != fp({0: "LABEL_0"})
    assert fp([1, (2, "x")]) != fp((1, (2, "x"))) and fp([1, object()]) is None
    field = next(f for f in dataclasses.fields(BartConfig) if f.name == "encoder_layers")
    assert fp(field) == fp(field) and fp(int | None) != fp(int | str) and fp(object()) is None
    # a field without a default: no object address (another process would differ) in it
    assert fp(dataclasses.field()) == fp(dataclasses.field()) and fp(dataclasses.field(default=object())) is None


def test_an_encoder_decoder_is_precompiled_and_a_changed_config_is_not_loaded():
    """BART hands ``self.config`` to helpers dynamo inlines, which guard its identity: it was
    declined ("a guard that cannot be stored (self.config)"). An entry now checks the config's
    class and content, so a config that changes the trace (``scale_embedding``: the same
    shapes, another graph) compiles afresh."""
    from transformers import BartConfig, BartModel
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 9))
    kw = dict(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
              decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)
    statuses = []
    for scale in (False, False, True):
        model = BartModel(BartConfig(scale_embedding=scale, **kw)).eval()
        m = yr.compile(model)
        with torch.no_grad():
            out = m(input_ids=ids, decoder_input_ids=ids[:, :5]).last_hidden_state
            torch.testing.assert_close(out, model(input_ids=ids, decoder_input_ids=ids[:, :5]).last_hidden_state, **TOL)
        statuses.append(m.precompile_status.split(" ")[0])
    assert statuses == ["compiled", "loaded", "compiled"], statuses
    assert precompile.stats()["rejected"] == 1


def test_a_parametrized_module_is_checked_by_the_class_it_parametrizes():
    """The class torch.nn.utils.parametrize makes for a module is fingerprinted as the class it
    parametrizes, so another process's (another class object) matches it, and a plain module of
    that class does not."""
    plain, normed = nn.Conv1d(4, 4, 3), nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3))
    again = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3))
    assert type(normed) is not type(again)
    assert precompile.fingerprint(type(normed)) == precompile.fingerprint(type(again)) == (
        "parametrized class", nn.Conv1d.__module__, nn.Conv1d.__qualname__)
    assert precompile.fingerprint(type(plain)) != precompile.fingerprint(type(normed))
