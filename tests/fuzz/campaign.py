"""A long fuzzing campaign over model files; saves every failing input as a regression recipe.

    python -m tests.fuzz.campaign --mutants 20000            # what `make fuzz` runs
    python -m tests.fuzz.campaign --mutants 500 --seed 7 --categories hf_config hf_index

Mutants come from tests/fuzz/mutate.py (``make_recipes``; ``--seed`` picks them, a random seed
is drawn and printed when none is given) and run in tests/fuzz/runner.py's workers. Every
mutant that crashes, hangs or raises a non-yirage exception is saved under
tests/fuzz/regressions/ as ``<outcome>-<category>-<recipe key>.json`` holding the recipe (the
mutation, not the mutant file: a few hundred bytes), the outcome, the message and the seeds'
digests; at most ``--max-per-signature`` files per distinct failure (outcome + exception type +
message shape, or signal + crashing frame), counting those already saved. tests/test_fuzz_regressions.py
replays them all. Prints the per-category outcome table and the distinct failures at the end;
exits 1 when any mutant failed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from . import mutate, runner

REGRESSIONS = Path(__file__).with_name("regressions")


def _git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def saved_signatures(directory: Path) -> Counter:
    counts: Counter = Counter()
    for p in directory.glob("*.json"):
        try:
            counts[json.loads(p.read_text()).get("signature", "")] += 1
        except (OSError, ValueError):
            pass
    return counts


def regression_path(result: runner.Result, directory: Path) -> Path:
    recipe = {k: v for k, v in result.recipe.items() if k != "id"}
    return directory / f"{result.outcome}-{recipe['category']}-{mutate.recipe_key(recipe)}.json"


def save_regression(result: runner.Result, seeds: mutate.Seeds, directory: Path, campaign_seed: int) -> Path:
    recipe = {k: v for k, v in result.recipe.items() if k != "id"}
    path = regression_path(result, directory)
    record = {
        "recipe": recipe,
        "outcome": result.outcome,
        "signature": runner.failure_signature(result),
        "message": result.message(),
        "detail": {k: v for k, v in result.raw.items()
                   if k in ("exc_type", "stage", "signal", "frames", "log", "traceback")},
        "seeds": seeds.digest(),
        "campaign_seed": campaign_seed,
        "found": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _git_head(),
    }
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=repr) + "\n")
    return path


def load_regressions(directory: Path = REGRESSIONS) -> list[tuple[Path, dict]]:
    """Every saved regression (path, record), sorted by file name."""
    return [(p, json.loads(p.read_text())) for p in sorted(Path(directory).glob("*.json"))]


def replay_results(records: list[dict], workers: int | None = None, timeout: float = 20.0,
                   seeds_dir: Path | None = None) -> tuple[list[runner.Result], dict[str, str]]:
    """Run the recipes of saved regression records; (results in order, digests of the seeds
    they ran on: compare with a record's ``seeds`` when byte offsets look off)."""
    with tempfile.TemporaryDirectory(prefix="yirage-fuzz-seeds-") as tmp:
        seeds = mutate.build_seeds(seeds_dir or Path(tmp))
        digest = seeds.digest()
        recipes = [dict(rec["recipe"], id=i) for i, rec in enumerate(records)]
        with runner.FuzzRunner(seeds, workers=workers or min(2, max(1, len(recipes))), timeout=timeout) as pool:
            return pool.run(recipes), digest


def replay(files: list[Path], workers: int | None, timeout: float) -> int:
    records = [json.loads(Path(f).read_text()) for f in files]
    results, digest = replay_results(records, workers, timeout)
    bad = 0
    for f, rec, res in zip(files, records, results):
        failing = res.outcome in runner.FAILING
        bad += failing
        print(f"{'FAIL' if failing else 'ok  '} {f}: {res.describe()[:400]}"
              + (f"\n      (saved as: {rec.get('outcome')}: {rec.get('message', '')[:200]})" if failing else "")
              + (f"\n      (note: saved against seeds {rec.get('seeds')}, these are {digest})"
                 if rec.get("seeds") not in (None, digest) else ""))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutants", type=int, default=20000, help="total mutants (split evenly over categories)")
    ap.add_argument("--seed", type=int, default=None, help="mutation seed (default: random, printed)")
    ap.add_argument("--workers", type=int, default=None, help="worker processes (default: usable CPUs, <= 4)")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds before a mutant counts as a hang")
    ap.add_argument("--categories", nargs="*", default=None, choices=mutate.CATEGORIES)
    ap.add_argument("--save", type=Path, default=REGRESSIONS, help="where failing recipes are saved")
    ap.add_argument("--no-save", action="store_true", help="do not save failing recipes")
    ap.add_argument("--max-per-signature", type=int, default=2, help="saved files per distinct failure")
    ap.add_argument("--seeds-dir", type=Path, default=None, help="where the seed models are built (default: tmp)")
    ap.add_argument("--batch", type=int, default=500, help="mutants per progress report")
    ap.add_argument("--verbose", action="store_true", help="print every mutant's outcome")
    ap.add_argument("--replay", nargs="+", type=Path, default=None, metavar="FILE",
                    help="run saved regression files (tests/fuzz/regressions/*.json) instead of a campaign")
    args = ap.parse_args(argv)
    if args.replay:
        return replay(args.replay, args.workers, args.timeout)

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    cats = args.categories or mutate.CATEGORIES
    per_category = max(1, math.ceil(args.mutants / len(cats)))
    tmp = None
    if args.seeds_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="yirage-fuzz-seeds-")
        args.seeds_dir = Path(tmp.name)
    print(f"building seeds in {args.seeds_dir} ...", flush=True)
    seeds = mutate.build_seeds(args.seeds_dir)
    recipes = mutate.make_recipes(mutate.Context.from_seeds(seeds), per_category, seed=seed, categories=cats)
    again = f"--mutants {args.mutants} --seed {seed}" + (f" --categories {' '.join(cats)}" if args.categories else "")
    print(f"campaign seed {seed}: {len(recipes)} mutants over {len(cats)} categories "
          f"(reproduce: python -m tests.fuzz.campaign {again})", flush=True)

    have = saved_signatures(args.save)
    saved: list[Path] = []
    results: list[runner.Result] = []

    def on_result(res: runner.Result) -> None:
        if args.verbose or res.outcome in runner.FAILING:
            print(("FAIL " if res.outcome in runner.FAILING else "     ") + res.describe()[:400], flush=True)
        if res.outcome in runner.FAILING and not args.no_save:
            sig = runner.failure_signature(res)
            if have[sig] < args.max_per_signature and not regression_path(res, args.save).exists():
                have[sig] += 1
                saved.append(save_regression(res, seeds, args.save, seed))

    t0 = time.monotonic()
    with runner.FuzzRunner(seeds, workers=args.workers, timeout=args.timeout) as pool:
        print(f"{pool.workers_n} workers ready in {pool.startup_s:.1f} s", flush=True)
        t_run = time.monotonic()
        for start in range(0, len(recipes), args.batch):
            results += pool.run(recipes[start:start + args.batch], on_result=on_result)
            dt = time.monotonic() - t_run
            n_bad = len(runner.failures(results))
            print(f"... {len(results)}/{len(recipes)} mutants, {len(results) / dt:.1f}/s, {n_bad} failing", flush=True)
    elapsed = time.monotonic() - t_run
    print()
    print(runner.outcome_table(results))
    print(f"\n{len(results)} mutants in {elapsed:.1f} s ({len(results) / max(elapsed, 1e-9):.1f} mutants/s; "
          f"{time.monotonic() - t0:.1f} s with start-up)")
    bad = runner.failures(results)
    if bad:
        print(f"\n{len(bad)} failing mutants:\n{runner.failure_report(results, limit=5)}")
    if saved:
        print(f"\nsaved {len(saved)} regression recipes under {args.save}:")
        for p in saved:
            print("  ", p)
    if tmp is not None:
        tmp.cleanup()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
