"""yirage's own thread pool (kernels/cpu/yr_threads.h), which runs every parallel loop of the C++
kernels where the build has no OpenMP (a compiler without it, or YIRAGE_OPENMP=0).

A probe library (data/thread_pool_probe.cpp) is built without OpenMP, its pool sized 3 threads
(more than this 2-core machine has: a team must run concurrently all the same), and with
OpenMP for the same meaning: every index of a loop runs exactly once, teams really run at
once, nested regions run as a team of 1, concurrent callers and a fork()ed child stay correct.
Then the library fixture's build without OpenMP, and a generated fused kernel and threadblock
kernel built under YIRAGE_OPENMP=0, against torch.
"""
import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import yirage as yr
from yirage.runtime import toolchain

PROBE = (Path(__file__).parent / "data" / "thread_pool_probe.cpp").read_text()
POOL_THREADS = 3
I64P = ctypes.POINTER(ctypes.c_int64)
I32P = ctypes.POINTER(ctypes.c_int32)


def _flags(openmp: bool) -> tuple[str, ...]:
    """The kernel build flags (``cxx_flags``' order) with OpenMP, or with -fopenmp-simd alone."""
    omp = toolchain.openmp_flags() if openmp else ("-fopenmp-simd",)
    base = toolchain.BASE_CXXFLAGS
    return (base[0], *toolchain.target_flags(), *omp, *base[1:])


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.probe_info.argtypes = [I64P]
    lib.probe_for.argtypes = [ctypes.c_int64] * 4 + [I32P, ctypes.c_int64, I32P, I64P]
    lib.probe_concurrent.argtypes = [ctypes.c_int64, I64P]
    lib.probe_region.argtypes = [ctypes.c_int64, ctypes.c_int64, I32P, ctypes.c_int64, I64P]
    lib.probe_nested.argtypes = [I64P]
    for fn in (lib.probe_info, lib.probe_for, lib.probe_concurrent, lib.probe_region, lib.probe_nested):
        fn.restype = None
    return lib


@pytest.fixture(scope="module", params=["pool", "openmp"])
def probe(request):
    """(kind, the probe library): 'pool' built without OpenMP and loaded with OMP_NUM_THREADS=3
    (the pool reads it as the library loads), 'openmp' with the compiler's OpenMP."""
    openmp = request.param == "openmp"
    if openmp and toolchain.openmp_flags() == ("-fopenmp-simd",):
        pytest.skip("the compiler has no OpenMP")
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(POOL_THREADS)
    try:
        lib = toolchain.load_library(PROBE, _flags(openmp))
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before
    return request.param, _bind(lib)


def _i64(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64)


def _p64(t: torch.Tensor):
    return ctypes.cast(t.data_ptr(), I64P)


def _p32(t: torch.Tensor):
    return ctypes.cast(t.data_ptr(), I32P)


def _run_for(lib, n: int, cond: bool, dynamic: bool, reps: int = 3):
    """(counts per index, runs per rank, largest team) of probe_for."""
    counts, ranks, team = torch.zeros(max(n, 1), dtype=torch.int32), torch.zeros(64, dtype=torch.int32), _i64(1)
    lib.probe_for(n, int(cond), int(dynamic), reps, _p32(counts), counts.numel(), _p32(ranks), _p64(team))
    return counts[:n], ranks, int(team[0])


def test_probe_builds(probe):
    kind, lib = probe
    out = _i64(2)
    lib.probe_info(_p64(out))
    assert out[1] == (kind == "openmp")
    if kind == "pool":
        assert out[0] == POOL_THREADS   # OMP_NUM_THREADS as the library loaded


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("cond", [True, False])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000])
def test_parallel_for_runs_every_index_once(probe, n, cond, dynamic):
    """parallel_for and parallel_for_dynamic call f(i) once for every i < n, on a team of
    min(threads, n) when cond holds (the static schedule: every rank a slice), else here."""
    kind, lib = probe
    counts, ranks, team = _run_for(lib, n, cond, dynamic)
    assert torch.equal(counts, torch.full((n,), 3, dtype=torch.int32))
    assert int(ranks.sum()) == 3 * n
    if kind == "pool":
        want = min(POOL_THREADS, n) if cond else min(1, n)
        assert team == want
        if not dynamic:
            assert int((ranks > 0).sum()) == want   # each rank of the team ran its slice
    if not cond:
        assert int(ranks[1:].sum()) == 0


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_a_team_runs_at_once(probe, limit):
    """Every thread of a region runs concurrently (each waits for all of the team at a
    rendezvous), and a dynamic loop hands its iterations to all of them; limit caps the team."""
    kind, lib = probe
    out = _i64(3)
    lib.probe_concurrent(limit, _p64(out))
    if kind == "pool":
        assert int(out[0]) == (limit or POOL_THREADS)
    assert int(out[0]) == int(out[1]) == int(out[2]) >= 1


def test_region_barriers_and_dynamic_loops(probe):
    """for_static ends at a barrier; 20 dynamic loops without barriers (more than the pool's
    8 counters, so they take turns) each run every index once; barrier() waits for all."""
    kind, lib = probe
    n, loops = 1000, 20
    counts, out = torch.zeros(n * (1 + loops), dtype=torch.int32), _i64(3)
    lib.probe_region(n, loops, _p32(counts), counts.numel(), _p64(out))
    assert torch.equal(counts, torch.ones_like(counts))
    assert out[0] == 0 and out[1] == 0
    if kind == "pool":
        assert out[2] == POOL_THREADS


def test_nested_regions_run_as_a_team_of_one(probe):
    kind, lib = probe
    out = _i64(3)
    lib.probe_nested(_p64(out))
    assert out[1] == 1 and out[2] == 64
    if kind == "pool":
        assert out[0] == POOL_THREADS


def test_concurrent_callers(probe):
    """Four Python threads (ctypes releases the GIL) run regions at once: each gets the pool or
    runs alone, and every result is right; none waits for ever."""
    _, lib = probe
    results, n, reps = {}, 1000, 200

    def caller(k):
        results[k] = _run_for(lib, n, True, k % 2 == 1, reps)[0]

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for k in range(4):
        assert torch.equal(results[k], torch.full((n,), reps, dtype=torch.int32))


_FORK_SCRIPT = r"""
import ctypes, os, sys, time
lib = ctypes.CDLL(sys.argv[1])
lib.probe_concurrent.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
def team():
    out = (ctypes.c_int64 * 3)()
    lib.probe_concurrent(0, out)
    return list(out)
assert team() == [3, 3, 3], team()          # the parent's pool exists now
pid = os.fork()
if pid == 0:                                  # the child: a fresh pool, its own threads
    os._exit(0 if team() == [3, 3, 3] and team() == [3, 3, 3] else 1)
deadline = time.time() + 60
while time.time() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    sys.exit("the child hung")
assert os.waitstatus_to_exitcode(status) == 0, status
assert team() == [3, 3, 3]                   # and the parent's pool still works
print("ok")
"""


def test_fork_then_use_in_the_child(probe):
    """A fork()ed child has none of the parent's workers: its first region makes a new pool
    (pthread_atfork), where without that it would wait for ever for threads that are gone."""
    kind, lib = probe
    if kind != "pool":
        pytest.skip("OpenMP runtimes do not promise a usable team after fork()")
    path = toolchain.library_path(PROBE, _flags(False))
    proc = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, str(path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": str(POOL_THREADS)})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ---- the kernels without OpenMP -----------------------------------------------------------

def _imports_openmp(lib: ctypes.CDLL) -> bool:
    """Whether the shared library calls libgomp (its dynamic symbols name GOMP_parallel)."""
    return b"GOMP_parallel" in Path(lib._name).read_bytes()


@pytest.mark.parametrize("lib", ["scalar"], indirect=True)
def test_the_scalar_library_build_runs_on_the_pool(lib):
    """The ``lib`` fixture's scalar build is the one without OpenMP (so every kernel test runs
    on the pool), and the native build keeps OpenMP where the compiler has it."""
    from yirage.backends.cpu.native import library

    assert not _imports_openmp(lib)
    if "-fopenmp" in toolchain.openmp_flags() and sys.platform.startswith("linux"):
        assert _imports_openmp(library())


def test_yirage_openmp_0_builds_without_openmp(monkeypatch):
    monkeypatch.setenv("YIRAGE_OPENMP", "0")
    assert toolchain.openmp_flags() == ("-fopenmp-simd",)
    assert "-fopenmp-simd" in toolchain.cxx_flags() and "-fopenmp" not in toolchain.cxx_flags()
    monkeypatch.setenv("YIRAGE_OPENMP", "1")
    assert toolchain.openmp_flags() == toolchain._openmp_flags(toolchain.find_compiler()[0])


@pytest.fixture
def without_openmp(monkeypatch):
    """YIRAGE_OPENMP=0 and a pool of 2 threads for the libraries built meanwhile; yields the
    libraries ``load_library`` built or loaded meanwhile, as (source, flags) pairs."""
    monkeypatch.setenv("YIRAGE_OPENMP", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    loaded, real = [], toolchain._load_library

    def spy(source, flags, symbols):
        loaded.append((source, flags))
        return real(source, flags, symbols)

    spy.cache_clear = real.cache_clear
    monkeypatch.setattr(toolchain, "_load_library", spy)
    return loaded


def test_fused_kernel_without_openmp_equals_torch(without_openmp):
    """A generated fused row kernel (softmax of a sum over 300 x 520: over the 32768 elements
    that start a team) built under YIRAGE_OPENMP=0 computes what torch does, on the pool."""
    g = yr.new_kernel_graph()
    x, y = g.new_input((300, 520)), g.new_input((300, 520))
    g.mark_output(g.softmax(g.add(x, y), -1))
    a, b = torch.randn(300, 520), torch.randn(300, 520)
    out = g(inputs=[a, b], backend="cpu")[0]
    torch.testing.assert_close(out, torch.softmax(a + b, -1), atol=1e-6, rtol=1e-5)
    fused = [(s, f) for s, f in without_openmp if "yr::parallel_chunks" in str(s)]
    assert fused and all("-fopenmp-simd" in f and "-fopenmp" not in f for _, f in fused)


def test_threadblock_kernel_without_openmp_equals_the_reference(without_openmp):
    """A generated threadblock kernel (grid 4 x 3 x 2: the blocks of all three dims on one
    static loop) built under YIRAGE_OPENMP=0 equals run_threadblock."""
    from yirage.ir.threadblock import run_threadblock
    from yirage.runtime.threadblock_kernels import bind_threadblock, compile_threadblock

    g = yr.new_kernel_graph()
    X = g.new_input(dims=(8, 6, 4, 16), dtype=yr.float32)
    tb = yr.new_threadblock_graph((4, 3, 2), forloop_range=2)
    tb.new_output(tb.forloop_accum(tb.exp(tb.new_input(X, (0, 1, 2), 3))), (0, 1, 2))
    xs = [torch.randn(8, 6, 4, 16)]
    want = run_threadblock(tb, xs)[0]
    got = torch.empty_like(want)
    bind_threadblock(compile_threadblock(tb, 0), xs, got)()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert any("yr::for_static(24," in str(s) and "-fopenmp" not in f for s, f in without_openmp)
