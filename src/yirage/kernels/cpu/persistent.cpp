// yirage persistent kernel runtime for the CPU: runs a whole decode step (every layer) as
// one task graph on a pool of persistent worker threads.
//
// The design follows Mirage's persistent kernel (MPK, Cheng et al., "Mirage Persistent
// Kernel", 2025; mirage-project/mirage, include/mirage/persistent_kernel): the step is
// a list of tasks (a GEMV row slice, an attention (KV head, KV split) pair, a fused row
// kernel, ...), tasks of one op share an *event* (a counter of finished tasks), and a task
// starts when the events of the ops it depends on have fired. Here:
//
// - Tasks are stored in a topological order and handed out in that order from one atomic
//   counter, so every worker takes the next task as soon as it is free (dynamic balance),
//   and a task never waits on a task that has not been taken (no deadlock: the oldest
//   waiting task's dependencies are all running on other workers).
// - An op's event is the count of its finished tasks; a task whose dependencies have not
//   all fired waits on their counters: it spins (pause) for ~20 us, then yields for ~200 us,
//   then sleeps on a futex (woken by the finishing task, with a 1 ms timeout as a safety
//   net). A busy core therefore costs a waiting worker no more than a few hundred
//   microseconds of spinning.
// - The caller's thread is worker 0; workers 1..N-1 are std::threads that live as long as the
//   pool and sleep (futex) between steps. A step ends when every active worker has found
//   the task list exhausted; there is no barrier between ops.
// - Adaptive width: now and then (every 256 steps, the interval doubling up to 4096 while
//   the choice holds) the pool times PROBE_STEPS steps with each candidate number of active
//   workers (N, N-1, 1) and keeps the fastest in total. With one core
//   taken by another process a pool of 2 therefore falls back to 1 worker instead of
//   stalling on the descheduled one (a task held by a preempted thread blocks its
//   dependants for a whole scheduler time slice, several milliseconds).
// - The meta loop (yr_pk_run with a meta block) runs many decode steps without returning
//   to Python: before step s it writes ids[0] = tokens[s], start_pos[0] = s; after it,
//   tokens[s+1] = argmax (unless s+1 is still a prompt position), step = s+1, and it
//   stops at an EOS token, at the end of the
//   tokens buffer, or when a kernel reported an out-of-range index in the status buffer.
//
// Every task function has the signature void fn(const int64_t* args, int64_t lo, int64_t hi)
// (args: pointers and sizes as int64, [lo, hi): the slice of the op's work this task does);
// they come from library.cpp (yr_task_*) and from generated fused kernels (*_task).
//
// Every index read from the tables passed in (op of a task, dependency op ids) is checked
// by yr_pk_graph_create, which returns null (and a reason code) for a malformed graph.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <climits>
#include <ctime>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define YR_PAUSE() _mm_pause()
#else
#define YR_PAUSE() std::this_thread::yield()
#endif

namespace {

typedef void (*TaskFn)(const int64_t* args, int64_t lo, int64_t hi);

constexpr int64_t SPIN_NS = 20000;     // spin this long before yielding
constexpr int64_t YIELD_NS = 200000;   // then yield this long before sleeping
constexpr int PROBE_STEPS = 8;         // steps timed per candidate width (their mean counts;
                                       // the first probe takes half; a width whose steps are
                                       // 1.5x slower than the best so far stops at once)
constexpr int64_t PROBE_EVERY = 256;   // steps between two probes; doubled (up to
constexpr int64_t PROBE_EVERY_MAX = 4096;  // this) while the choice does not change

inline int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct alignas(64) Word {
    std::atomic<int32_t> v{0};
};

std::atomic<int32_t> g_sleepers{0};

void futex_wait(std::atomic<int32_t>* w, int32_t seen) {
#if defined(__linux__)
    struct timespec ts = {0, 1000000};  // 1 ms: a lost wake-up costs at most this
    syscall(SYS_futex, reinterpret_cast<int32_t*>(w), FUTEX_WAIT_PRIVATE, seen, &ts, nullptr, 0);
#else
    (void)w; (void)seen;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
}

void futex_wake(std::atomic<int32_t>* w) {
#if defined(__linux__)
    if (g_sleepers.load() > 0)
        syscall(SYS_futex, reinterpret_cast<int32_t*>(w), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
    (void)w;
#endif
}

// Waits until ready() holds: spin, then yield, then futex-sleep on w (whose value changes
// whenever ready() may have become true).
template <typename Ready>
void wait_until(std::atomic<int32_t>* w, Ready ready) {
    if (ready()) return;
    const int64_t t0 = now_ns();
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            if (ready()) return;
            YR_PAUSE();
        }
        if (now_ns() - t0 > SPIN_NS) break;
    }
    for (;;) {
        if (ready()) return;
        std::this_thread::yield();
        if (now_ns() - t0 > SPIN_NS + YIELD_NS) break;
    }
    for (;;) {
        const int32_t seen = w->load();
        if (ready()) return;
        g_sleepers.fetch_add(1);
        if (!ready()) futex_wait(w, seen);
        g_sleepers.fetch_sub(1);
    }
}

struct Task {
    TaskFn fn;
    const int64_t* args;
    int64_t lo, hi;
    int32_t op;
};

struct Op {
    int32_t ntasks;
    int32_t dep_begin, dep_end;   // into Graph::deps
};

struct Graph {
    std::vector<Task> tasks;
    std::vector<Op> ops;
    std::vector<int32_t> deps;
    std::unique_ptr<Word[]> done;          // per op: tasks finished in this step
    // profiler: rows of {worker, step, task, start_ns, end_ns, 0}; null when off
    int64_t* prof = nullptr;
    int64_t prof_cap = 0;
    std::atomic<int64_t> prof_n{0};
    int64_t steps = 0;                     // steps run so far (profiler step column)
};

struct Pool {
    int nworkers = 1;                      // including the caller
    int active = 1;                        // workers taking part in the current step
    std::vector<std::thread> threads;
    std::unique_ptr<Word[]> go;            // per worker: the step number it may start
    Word exited;                           // active workers 1.. that finished the step
    std::atomic<int32_t> next{0};          // next task to hand out
    std::atomic<bool> stop{false};
    Graph* graph = nullptr;
    int32_t epoch = 0;
    // adaptive width
    bool adaptive = true;
    std::vector<int> candidates;
    std::vector<int> order;                // the current probe's widths, the chosen one first
    std::vector<int64_t> best_ns;          // per candidate: total ns of its probe steps
    std::vector<int64_t> probe_n;          // per candidate: its probe steps so far
    int probe_steps = PROBE_STEPS;
    bool probed = false;
    int probe_idx = -1;                    // -1: not probing
    int probe_left = 0;
    int64_t until_probe = 0;
    int64_t probe_every = PROBE_EVERY;
    int chosen = 1;
};

void run_tasks(Pool* pool, int worker) {
    Graph* g = pool->graph;
    const int32_t n = (int32_t)g->tasks.size();
    for (;;) {
        const int32_t i = pool->next.fetch_add(1);
        if (i >= n) return;
        const Task& t = g->tasks[i];
        const Op& op = g->ops[t.op];
        for (int32_t d = op.dep_begin; d < op.dep_end; ++d) {
            const int32_t dep = g->deps[d];
            const int32_t need = g->ops[dep].ntasks;
            std::atomic<int32_t>* w = &g->done[dep].v;
            wait_until(w, [w, need] { return w->load(std::memory_order_acquire) >= need; });
        }
        const int64_t t0 = g->prof ? now_ns() : 0;
        t.fn(t.args, t.lo, t.hi);
        if (g->prof) {
            const int64_t slot = g->prof_n.fetch_add(1);
            if (slot < g->prof_cap) {
                int64_t* row = g->prof + slot * 6;
                row[0] = worker; row[1] = g->steps; row[2] = i; row[3] = t0; row[4] = now_ns(); row[5] = t.op;
            }
        }
        g->done[t.op].v.fetch_add(1);
        futex_wake(&g->done[t.op].v);
    }
}

void worker_main(Pool* pool, int id) {
    int32_t seen = 0;
    for (;;) {
        std::atomic<int32_t>* w = &pool->go[id].v;
        wait_until(w, [&] { return pool->stop.load() || w->load() != seen; });
        if (pool->stop.load()) return;
        seen = w->load();
        run_tasks(pool, id);
        pool->exited.v.fetch_add(1);
        futex_wake(&pool->exited.v);
    }
}

// One step of graph g on the pool with `width` workers.
void step(Pool* pool, Graph* g, int width) {
    for (size_t o = 0; o < g->ops.size(); ++o) g->done[o].v.store(0, std::memory_order_relaxed);
    pool->graph = g;
    pool->active = width;
    pool->next.store(0);
    pool->exited.v.store(0);
    ++pool->epoch;
    for (int i = 1; i < width; ++i) {
        pool->go[i].v.store(pool->epoch);
        futex_wake(&pool->go[i].v);
    }
    run_tasks(pool, 0);
    std::atomic<int32_t>* w = &pool->exited.v;
    const int32_t need = width - 1;
    wait_until(w, [w, need] { return w->load() >= need; });
    ++g->steps;
}

// The width for the next step, and whether this step is a probe to time.
int pick_width(Pool* pool) {
    if (!pool->adaptive || pool->candidates.size() < 2) return pool->nworkers;
    if (pool->probe_idx < 0 && pool->until_probe <= 0) {   // start a probe: the current width first
        pool->order.assign(1, pool->chosen);                // (the others can then stop early)
        for (int c : pool->candidates)
            if (c != pool->chosen) pool->order.push_back(c);
        pool->probe_idx = 0;
        pool->probe_steps = pool->probed ? PROBE_STEPS : PROBE_STEPS / 2;   // the first one is short
        pool->probe_left = pool->probe_steps;
        std::fill(pool->best_ns.begin(), pool->best_ns.end(), 0);
        std::fill(pool->probe_n.begin(), pool->probe_n.end(), 0);
    }
    return pool->probe_idx >= 0 ? pool->order[pool->probe_idx] : pool->chosen;
}

// Mean step time of candidate c in the current probe.
double probe_mean(const Pool* pool, size_t c) {
    return pool->probe_n[c] ? (double)pool->best_ns[c] / (double)pool->probe_n[c] : 1e300;
}

void record(Pool* pool, int64_t ns) {
    if (pool->probe_idx < 0) {
        --pool->until_probe;
        return;
    }
    const size_t c = (size_t)pool->probe_idx;
    pool->best_ns[c] += ns;   // the mean, not the best step: a worker sharing a busy core has
    ++pool->probe_n[c];       // fast steps now and then, slow ones mostly
    double best_mean = 1e300;
    for (size_t d = 0; d < c; ++d) best_mean = std::min(best_mean, probe_mean(pool, d));
    const bool hopeless = probe_mean(pool, c) > 1.5 * best_mean;   // stop early: a step that slow
    if (--pool->probe_left > 0 && !hopeless) return;
    if (++pool->probe_idx < (int)pool->order.size()) {
        pool->probe_left = pool->probe_steps;
        return;
    }
    size_t best = 0;
    for (size_t d = 1; d < pool->order.size(); ++d) {
        const double m = probe_mean(pool, d), mb = probe_mean(pool, best);
        if (m < mb * 0.97 || (m < mb * 1.03 && pool->order[d] > pool->order[best])) best = d;  // ties: more workers
    }
    pool->probe_every = pool->order[best] == pool->chosen
                            ? std::min(PROBE_EVERY_MAX, pool->probe_every * 2) : PROBE_EVERY;
    pool->chosen = pool->order[best];
    pool->probed = true;
    pool->probe_idx = -1;
    pool->until_probe = pool->probe_every;
}

}  // namespace

extern "C" {

// A pool of num_workers workers (the caller plus num_workers-1 threads); adaptive != 0
// lets it narrow itself when fewer cores are free (see the header). Returns null when
// num_workers is outside 1..1024.
void* yr_pk_pool_create(int64_t num_workers, int64_t adaptive) {
    if (num_workers < 1 || num_workers > 1024) return nullptr;
    Pool* pool = new Pool();
    pool->nworkers = (int)num_workers;
    pool->adaptive = adaptive != 0;
    // Adaptive pools start by timing one worker, so that a wider step slowed by a busy core
    // is dropped after one step of the first probe.
    pool->chosen = pool->adaptive ? 1 : pool->nworkers;
    for (int c : {pool->nworkers, pool->nworkers - 1, 1})
        if (c >= 1 && std::find(pool->candidates.begin(), pool->candidates.end(), c) == pool->candidates.end())
            pool->candidates.push_back(c);
    pool->best_ns.assign(pool->candidates.size(), 0);
    pool->probe_n.assign(pool->candidates.size(), 0);
    pool->go.reset(new Word[pool->nworkers]);
    for (int i = 1; i < pool->nworkers; ++i) pool->threads.emplace_back(worker_main, pool, i);
    return pool;
}

void yr_pk_pool_destroy(void* p) {
    Pool* pool = static_cast<Pool*>(p);
    if (!pool) return;
    pool->stop.store(true);
    for (int i = 1; i < pool->nworkers; ++i) {
        pool->go[i].v.fetch_add(1);
        g_sleepers.fetch_add(1);   // force the wake-up syscall
        futex_wake(&pool->go[i].v);
        g_sleepers.fetch_sub(1);
    }
    for (auto& t : pool->threads) t.join();
    delete pool;
}

// Width the pool uses now (the adaptive choice), for reports.
int64_t yr_pk_pool_width(void* p) {
    Pool* pool = static_cast<Pool*>(p);
    return pool ? pool->chosen : 0;
}

// A task graph. tasks: int64 [n_tasks, 5] rows {fn, args, lo, hi, op}; ops: int64 [n_ops, 3]
// rows {ntasks, dep_begin, dep_end}; deps: int64 [n_deps] op ids. Tasks must be in an order
// where every task of an op comes after every task of the ops it depends on, and each op's
// ntasks must equal the number of its tasks. Returns null if any of this does not hold
// (*error = 1 + the index of the failing row kind: 1 task, 2 op, 3 dep, 4 count).
void* yr_pk_graph_create(const int64_t* tasks, int64_t n_tasks, const int64_t* ops, int64_t n_ops,
                         const int64_t* deps, int64_t n_deps, int64_t* error) {
    *error = 0;
    if (n_tasks < 0 || n_ops < 0 || n_deps < 0 || n_tasks > INT32_MAX / 2 || n_ops > INT32_MAX / 2 ||
        n_deps > INT32_MAX / 2) { *error = 4; return nullptr; }
    std::unique_ptr<Graph> g(new Graph());
    g->ops.resize((size_t)n_ops);
    for (int64_t o = 0; o < n_ops; ++o) {
        const int64_t* r = ops + o * 3;
        if (r[0] < 0 || r[1] < 0 || r[2] < r[1] || r[2] > n_deps) { *error = 2; return nullptr; }
        g->ops[o] = {(int32_t)r[0], (int32_t)r[1], (int32_t)r[2]};
        for (int64_t d = r[1]; d < r[2]; ++d)
            if (deps[d] < 0 || deps[d] >= o) { *error = 3; return nullptr; }   // deps point backwards
    }
    g->deps.assign(deps, deps + n_deps);
    std::vector<int32_t> seen((size_t)n_ops, 0);
    int32_t last_op = 0;
    g->tasks.resize((size_t)n_tasks);
    for (int64_t i = 0; i < n_tasks; ++i) {
        const int64_t* r = tasks + i * 5;
        if (r[0] == 0 || r[4] < 0 || r[4] >= n_ops || r[4] < last_op || r[3] < r[2]) { *error = 1; return nullptr; }
        last_op = (int32_t)r[4];
        ++seen[r[4]];
        g->tasks[i] = {reinterpret_cast<TaskFn>(r[0]), reinterpret_cast<const int64_t*>(r[1]), r[2], r[3],
                       (int32_t)r[4]};
    }
    for (int64_t o = 0; o < n_ops; ++o)
        if (seen[o] != g->ops[o].ntasks) { *error = 4; return nullptr; }
    g->done.reset(new Word[std::max<int64_t>(n_ops, 1)]);
    return g.release();
}

void yr_pk_graph_destroy(void* g) { delete static_cast<Graph*>(g); }

// Profiler buffer: int64 [capacity, 6] rows {worker, step, task, start_ns, end_ns, op}
// (steady clock); null turns profiling off. yr_pk_graph_profiled returns the rows written.
void yr_pk_graph_set_profiler(void* gp, int64_t* buf, int64_t capacity) {
    Graph* g = static_cast<Graph*>(gp);
    g->prof = capacity > 0 ? buf : nullptr;
    g->prof_cap = capacity > 0 ? capacity : 0;
    g->prof_n.store(0);
}

int64_t yr_pk_graph_profiled(void* gp) {
    Graph* g = static_cast<Graph*>(gp);
    return std::min<int64_t>(g->prof_n.load(), g->prof_cap);
}

// Runs graph g on pool p for up to max_steps steps. meta == null: one plain step (the
// caller set the inputs). Otherwise meta = {tokens*, tokens_len, step*, ids*, start_pos*,
// argmax_out*, status*, status_rows, eos*, n_eos, prompt_len}: the decode loop described in
// the header; positions s + 1 < prompt_len keep their (prompt) token and never stop the loop.
// Returns the number of steps run; a step whose kernels reported an index error (status
// row with a nonzero first field) ends the loop and is counted.
int64_t yr_pk_run(void* p, void* gp, int64_t max_steps, const int64_t* meta) {
    Pool* pool = static_cast<Pool*>(p);
    Graph* g = static_cast<Graph*>(gp);
    if (!meta) max_steps = std::min<int64_t>(max_steps, 1);
    int64_t ran = 0;
    for (; ran < max_steps; ++ran) {
        int64_t s = 0;
        if (meta) {
            int64_t* tokens = reinterpret_cast<int64_t*>(meta[0]);
            s = *reinterpret_cast<int64_t*>(meta[2]);
            if (s < 0 || s + 1 >= meta[1]) break;          // no room for the next token
            reinterpret_cast<int64_t*>(meta[3])[0] = tokens[s];
            reinterpret_cast<int64_t*>(meta[4])[0] = s;
        }
        const int width = pick_width(pool);
        const int64_t t0 = now_ns();
        step(pool, g, width);
        record(pool, now_ns() - t0);
        if (!meta) { ++ran; break; }
        const int64_t* status = reinterpret_cast<const int64_t*>(meta[6]);
        bool bad = false;
        for (int64_t r = 0; r < meta[7]; ++r) bad = bad || status[r * 4] != 0;
        if (bad) { ++ran; break; }
        *reinterpret_cast<int64_t*>(meta[2]) = s + 1;
        if (s + 1 < meta[10]) continue;                    // still inside the prompt
        const int64_t tok = reinterpret_cast<const int64_t*>(meta[5])[0];
        reinterpret_cast<int64_t*>(meta[0])[s + 1] = tok;
        const int64_t* eos = reinterpret_cast<const int64_t*>(meta[8]);
        bool stop = false;
        for (int64_t e = 0; e < meta[9]; ++e) stop = stop || eos[e] == tok;
        if (stop) { ++ran; break; }
    }
    return ran;
}

// A task for testing the scheduler (tests/runtime/test_persistent_kernel.py): a = {count*,
// need*, op, n_deps, deps*, violations*, spin}: counts one violation for every dependency
// op whose count has not reached its need when the task starts, spins `spin` iterations,
// then adds 1 to count[op].
void yr_pk_test_task(const int64_t* a, int64_t, int64_t) {
    int64_t* count = reinterpret_cast<int64_t*>(a[0]);
    const int64_t* need = reinterpret_cast<const int64_t*>(a[1]);
    const int64_t* deps = reinterpret_cast<const int64_t*>(a[4]);
    int64_t* violations = reinterpret_cast<int64_t*>(a[5]);
    for (int64_t d = 0; d < a[3]; ++d)
        if (__atomic_load_n(&count[deps[d]], __ATOMIC_ACQUIRE) < need[deps[d]])
            __atomic_fetch_add(violations, 1, __ATOMIC_RELAXED);
    volatile int64_t sink = 0;
    for (int64_t i = 0; i < a[6]; ++i) sink = sink + i;
    __atomic_fetch_add(&count[a[2]], 1, __ATOMIC_RELEASE);
}

}  // extern "C"
