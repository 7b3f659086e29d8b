"""Fuzz worker: runs mutants one by one, each in a forked child, and reports JSON lines.

    python tests/fuzz/worker.py SEEDS_DIR WORK_DIR TIMEOUT_S

Started by tests/fuzz/runner.py (never by hand, though it works by hand). At start it imports
torch, transformers and yirage and runs both unmutated seeds once in-process (so imports, the
tokenizer converters and the compiled C++ kernels are warm), then prints ``{"ready": true}``.
Then for each line ``{"recipe": {...}}`` on stdin it forks; the child

1. writes the mutant (``mutate.apply_recipe``) under WORK_DIR/<pid>-<id>/ with its own
   YIRAGE_CACHE_DIR there (the C++ kernel cache ``cpp`` is shared: a symlink),
2. caps its address space (RLIMIT_AS) so that a mutant asking for absurd amounts of memory
   fails (MemoryError) instead of taking the machine down,
3. runs ``load_model(path)`` and, if that works, ``yr.LLM(path, backend="cpu",
   max_seq_length=32).generate("hi", max_new_tokens=2)`` (greedy) and a prefill of the same
   prompt to check that the logits are finite,
4. writes one JSON result to a pipe and exits with ``os._exit``.

The parent waits at most TIMEOUT_S for the result; a child that takes longer is killed (a hang),
one that dies of a signal is a crash (its faulthandler traceback comes back as ``log``). One JSON
line per recipe goes to stdout: ``{"id", "status": "exception"|"loaded"|"crash"|"hang"|
"no_result"|"harness_error", ...}``; the runner classifies it.

Threads: OMP_NUM_THREADS=1 and TOKENIZERS_PARALLELISM=false (set by the runner), and
torch.set_num_threads(1), so that no thread pool exists when the worker forks.
"""
from __future__ import annotations

import faulthandler
import json
import os
import resource
import select
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: import fuzz.mutate

from fuzz import mutate  # noqa: E402

PROMPT, MAX_SEQ, NEW_TOKENS = "hi", 32, 2
MEMORY_HEADROOM = 2 << 30  # bytes of address space a mutant may add to the warmed worker's
LOG_TAIL = 3000


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent process dies (no orphaned mutant runs or workers)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def check(path: str) -> dict:
    """Load, build and run the model at ``path``; the outcome as a dict (never raises)."""
    import torch

    import yirage as yr
    from yirage.errors import YirageError
    from yirage.models.loading import load_model

    stage = "load_model"
    try:
        load_model(path, progress=False)
        stage = "LLM"
        llm = yr.LLM(path, backend="cpu", max_seq_length=MAX_SEQ)
        stage = "generate"
        result = llm.generate(PROMPT, max_new_tokens=NEW_TOKENS)
        stage = "prefill"
        ids = llm.encode_prompt(PROMPT)
        logits, _ = llm.steps.run(ids, 0)
        finite = bool(torch.isfinite(logits.float()).all())
        return {"status": "loaded", "token_ids": list(result.token_ids), "finite": finite}
    except BaseException as exc:  # noqa: BLE001: everything is an outcome here
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        frames = [f"{f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_tb(exc.__traceback__)][-8:]
        return {"status": "exception", "stage": stage, "yirage": isinstance(exc, YirageError),
                "exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
                "message": str(exc)[:600], "frames": frames, "traceback": "".join(tb)[-2500:]}


def _child(recipe: dict, seeds: mutate.Seeds, mdir: Path, kernel_cache: Path, wfd: int, timeout: float) -> None:
    log = open(mdir / "log.txt", "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log, all_threads=True)
    # a hang: the stack shortly before the parent's SIGKILL shows where it hangs
    faulthandler.dump_traceback_later(max(0.5, timeout - 1.0), file=log)
    cache = mdir / "cache"
    cache.mkdir()
    (cache / "cpp").symlink_to(kernel_cache, target_is_directory=True)
    os.environ["YIRAGE_CACHE_DIR"] = str(cache)
    try:
        path = mutate.apply_recipe(recipe, seeds, mdir / "mutant")
    except Exception as exc:  # a bug of the fuzzer, not of yirage
        out = {"status": "harness_error", "message": f"apply_recipe: {type(exc).__name__}: {exc}"[:600],
               "traceback": traceback.format_exc()[-2500:]}
    else:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = _vm_size() + MEMORY_HEADROOM
        if hard == resource.RLIM_INFINITY or limit < hard:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        out = check(str(path))
    data = json.dumps(out, default=repr).encode()
    view = memoryview(data)
    while view:
        n = os.write(wfd, view)
        view = view[n:]
    os.close(wfd)
    log.flush()
    os._exit(0)


def _vm_size() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 8 << 30


def _tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-LOG_TAIL:].decode("utf-8", "replace")


def run_one(recipe: dict, seeds: mutate.Seeds, work: Path, kernel_cache: Path, timeout: float) -> dict:
    timeout = float(recipe.get("timeout", timeout))  # a recipe may ask for less (the runner's self-test)
    mdir = work / f"{os.getpid()}-{recipe.get('id', 'x')}-{time.monotonic_ns()}"
    mdir.mkdir(parents=True)
    rfd, wfd = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            die_with_parent()
            os.close(rfd)
            _child(recipe, seeds, mdir, kernel_cache, wfd, timeout)
        finally:
            os._exit(70)
    os.close(wfd)
    chunks, deadline, timed_out = [], t0 + timeout, False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([rfd], [], [], left)
        if ready:
            chunk = os.read(rfd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(rfd)
    elapsed = time.monotonic() - t0
    if timed_out:
        out = {"status": "hang", "message": f"no result after {timeout:.0f} s (killed)", "log": _tail(mdir / "log.txt")}
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        out = {"status": "crash", "signal": signal.Signals(sig).name if sig in signal.Signals._value2member_map_
               else str(sig), "log": _tail(mdir / "log.txt")}
    else:
        try:
            out = json.loads(b"".join(chunks))
        except ValueError:
            out = {"status": "no_result", "message": f"exit status {os.WEXITSTATUS(status)} without a result",
                   "log": _tail(mdir / "log.txt")}
    out.update(id=recipe.get("id"), seconds=round(elapsed, 3))
    shutil.rmtree(mdir, ignore_errors=True)
    return out


def _warm(seeds: mutate.Seeds) -> dict:
    """Run both seeds in-process: imports, converters and kernels are then warm in every fork."""
    refs = {}
    for target, path in (("gguf", seeds.gguf), ("hf", seeds.hf)):
        out = check(str(path))
        refs[target] = out
    return refs


def main(argv: list[str]) -> int:
    seeds_dir, work, timeout = Path(argv[1]), Path(argv[2]), float(argv[3])
    die_with_parent()
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # JSON lines go here; stray prints go to stderr
    os.dup2(2, 1)
    import torch

    torch.set_num_threads(1)
    from yirage.config import cache_dir

    kernel_cache = cache_dir() / "cpp"  # shared with every other run: the seeds' kernels are built once
    kernel_cache.mkdir(parents=True, exist_ok=True)
    seeds = mutate.Seeds(seeds_dir / "seed.gguf", seeds_dir / "seed-hf")
    work.mkdir(parents=True, exist_ok=True)
    own_cache = work / f"cache-{os.getpid()}"  # converted tokenizers/configs of the seeds: not in the user's cache
    own_cache.mkdir(exist_ok=True)
    if not (own_cache / "cpp").exists():
        (own_cache / "cpp").symlink_to(kernel_cache, target_is_directory=True)
    os.environ["YIRAGE_CACHE_DIR"] = str(own_cache)
    warm = _warm(seeds)
    proto.write(json.dumps({"ready": True, "warm": warm, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        recipe = json.loads(line)["recipe"]
        try:
            out = run_one(recipe, seeds, work, kernel_cache, timeout)
        except Exception as exc:  # fork/pipe failure: report, keep going
            out = {"id": recipe.get("id"), "status": "harness_error", "message": f"{type(exc).__name__}: {exc}"}
        proto.write(json.dumps(out, default=repr) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
