"""Mutation fuzzing of model loading (GitHub issue 6): no model file may crash the process, hang,
or raise anything but yirage's own exceptions (yirage/errors.py).

A fixed-seed budget of mutants (tests/fuzz/mutate.py: 12 categories over a tiny GGUF seed with
the default model's metadata and tokenizer, and a tiny sharded safetensors Llama) runs through
tests/fuzz/runner.py: each mutant is loaded (``load_model``), built (``yr.LLM(path,
backend="cpu", max_seq_length=32)``) and run (greedy ``generate("hi", max_new_tokens=2)``) in a
forked child process, so a SIGSEGV/SIGBUS/abort is an outcome, not the end of the test run.
The test fails on any crash, hang (20 s) or non-yirage exception and lists every failing
mutant (category, mutation, outcome, message). ``make fuzz`` runs a long campaign of the same.
"""
from __future__ import annotations

import json
import shutil
import time

import pytest

from fuzz import mutate, runner

pytestmark = pytest.mark.slow  # the GGUF seed copies the default model's metadata and tokenizer

PER_CATEGORY = 50  # x 12 categories = 600 mutants; about 40-70 s on 2 cores
SEED = 0
TIMEOUT = 20.0


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return mutate.build_seeds(tmp_path_factory.mktemp("fuzz-seeds"))


@pytest.fixture(scope="module")
def context(seeds):
    return mutate.Context.from_seeds(seeds)


# ---- the harness itself (fast)

def test_gguf_parser_round_trips_the_seed(context):
    lay = context.layout
    kvs, tensors = mutate.gguf_parts(context.gguf, lay)
    assert mutate.write_gguf(lay.version, kvs, tensors) == context.gguf
    assert len(lay.tensors) == 2 + 9 * 2 and lay.kv("general.architecture").value == "llama"


def test_recipes_are_deterministic_and_cover_every_category(context):
    a = mutate.make_recipes(context, 20, seed=SEED)
    b = mutate.make_recipes(context, 20, seed=SEED)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert {r["category"] for r in a} == set(mutate.CATEGORIES)
    assert json.dumps(mutate.make_recipes(context, 20, seed=SEED + 1)) != json.dumps(a)


def test_every_recipe_of_the_budget_applies(context, seeds, tmp_path):
    """A recipe that cannot be applied would show up as harness_error; catch it here, fast."""
    for recipe in mutate.make_recipes(context, PER_CATEGORY, seed=SEED):
        out = mutate.apply_recipe(recipe, seeds, tmp_path / "m")
        assert out.exists(), recipe
        shutil.rmtree(tmp_path / "m")


# ---- the fuzzing run

def test_mutated_models_fail_cleanly(seeds, context):
    recipes = mutate.make_recipes(context, PER_CATEGORY, seed=SEED)
    assert len(recipes) >= 500
    t0 = time.monotonic()
    with runner.FuzzRunner(seeds, timeout=TIMEOUT) as pool:  # one worker per usable CPU (at most 4)
        # the runner sees what it must see: a SIGSEGV, an abort, a hang, a broken mutant
        probes = [dict(r, id=-1 - i, timeout=3.0) for i, r in enumerate(mutate.selftest_recipes())]
        seen = [(r.outcome, r.raw.get("signal")) for r in pool.run(probes)]
        assert seen == [("crash", "SIGSEGV"), ("crash", "SIGABRT"), ("hang", None), ("harness_error", None)], seen
        results = pool.run(recipes)
    elapsed = time.monotonic() - t0
    table = runner.outcome_table(results)
    print(f"\n{table}\n{len(results)} mutants in {elapsed:.1f} s")
    bad = runner.failures(results)
    assert not bad, (f"{len(bad)} of {len(results)} mutated models crashed, hung or raised a non-yirage "
                     f"exception\n{table}\n\n{runner.failure_report(results)}")
