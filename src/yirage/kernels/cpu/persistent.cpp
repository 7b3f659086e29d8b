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
//   net, 50 us where it may help, see below). A busy core therefore costs a waiting worker
//   no more than a few hundred microseconds of spinning.
// - The caller's thread is worker 0; workers 1..N-1 are std::threads that live as long as the
//   pool and sleep (futex) between steps. A step ends when every task has been committed,
//   not when every worker is back: there is no barrier between ops, nor at the end.
// - Preempted workers (another process shares the core) do not hold a step up for their
//   time slice. A waiting worker takes over tasks its claimer has not started (an atomic
//   start flag per task and step), and *redoes* a redoable task (a GEMV slice: it writes
//   out[lo, hi) of one output and reads nothing it writes) that has run for 3x its op's
//   mean task time: every run of a redoable task writes into its worker's scratch, and only
//   the first to commit (a compare-and-swap of the task's step number) copies it to the
//   output, so a worker that resumes late only computes into its scratch and drops it.
//   Claims carry the step number, so such a worker also never takes part in a later step
//   with a stale claim; a graph is freed only once no worker is inside one.
// - Adaptive width: now and then (every 256 steps, the interval doubling up to 4096 while
//   the choice holds) the pool times PROBE_STEPS steps with each candidate number of active
//   workers (N, N-1, 1) and keeps the fastest in total (the redo above covers GEMV slices
//   only: a preempted worker running a norm or attention task still holds its dependants
//   for its time slice, and where that costs more than the worker brings, fewer win).
// - The meta loop (yr_pk_run with a meta block) runs many decode steps without returning
//   to Python: before step s it writes ids[0] = tokens[s], start_pos[0] = s; after it,
//   tokens[s+1] = argmax (unless s+1 is still a prompt position), step = s+1, and it
//   stops at an EOS token, at the end of the
//   tokens buffer, or when a kernel reported an out-of-range index in the status buffer.
//   Whichever worker commits the last task of a step does this and starts the next step
//   (maybe_advance), so a preempted caller holds up no step either.
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
#include <mutex>
#include <set>
#include <cstdlib>
#include <pthread.h>
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

void futex_wait(std::atomic<int32_t>* w, int32_t seen, int64_t timeout_ns = 1000000) {
#if defined(__linux__)
    struct timespec ts = {0, (long)timeout_ns};  // 1 ms: a lost wake-up costs at most this
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

// Time in ticks for the redo bookkeeping: the TSC where there is one (a few ns to read, and
// every task reads it twice), else the steady clock. ticks_per_us() is measured once.
inline int64_t ticks() {
#if defined(__x86_64__) || defined(__i386__)
    return (int64_t)__rdtsc();
#else
    return now_ns();
#endif
}

int64_t ticks_per_us() {
    static const int64_t v = [] {
        const int64_t n0 = now_ns(), t0 = ticks();
        while (now_ns() - n0 < 2000000) {}
        const int64_t dn = now_ns() - n0, dt = ticks() - t0;
        return std::max<int64_t>(1, dt * 1000 / std::max<int64_t>(dn, 1));
    }();
    return v;
}

constexpr int64_t HELP_SLEEP_NS = 50000;   // a worker that may help sleeps at most this
constexpr int MAX_REDO_ARGS = 64;      // argument block of a redoable task, at most
constexpr int64_t REDO_MIN_US = 30;    // a task is redone once it has run 3x its op's mean
constexpr int64_t REDO_FIRST_US = 2000;   // time plus this; before any mean is known: this

struct Task {
    TaskFn fn;
    const int64_t* args;
    int64_t lo, hi;
    int32_t op;
    int32_t nargs;      // length of args (redoable tasks)
    int32_t redo_arg;   // -1, or the argument holding the output pointer (see yr_pk_graph_create)
    int32_t elem;       // bytes per output element of a redoable task
};

// Per task: the epochs (step numbers) of its last commit, start and redo by a helper.
struct alignas(64) TaskState {
    std::atomic<int64_t> committed{-1};
    std::atomic<int64_t> started{-1};
    std::atomic<int64_t> start_t{0};      // ticks() when started
    std::atomic<int64_t> helped{-1};
};

struct Op {
    int32_t ntasks;
    int32_t dep_begin, dep_end;   // into Graph::deps
    int32_t task_begin;           // its tasks are [task_begin, task_begin + ntasks)
    bool redoable;                // every task of it is
};

struct Pool;

struct Graph {
    std::vector<Task> tasks;
    std::vector<Op> ops;
    std::vector<int32_t> deps;
    std::unique_ptr<Word[]> done;          // per op: tasks committed in this step
    std::unique_ptr<TaskState[]> state;    // per task
    std::unique_ptr<std::atomic<int64_t>[]> mean_ticks;   // per op: running mean task time
    Word finished;                         // tasks committed in this step
    std::atomic<int64_t> next{0};          // claims: (epoch & EPOCH_MASK) << 32 | task index
    std::atomic<int64_t> epoch{-1};        // the pool epoch of this graph's current/last step
    std::atomic<Pool*> pool{nullptr};      // the pool that last ran it
    // profiler: rows of {worker, step, task, start_ns, end_ns, op}; null when off
    int64_t* prof = nullptr;
    int64_t prof_cap = 0;
    std::atomic<int64_t> prof_n{0};
    int64_t steps = 0;                     // steps run so far (profiler step column)
};
constexpr int64_t EPOCH_MASK = 0x7fffffff;
// Step numbers, over every pool and graph of the process (a graph's task states hold the
// epoch of their last commit, so they must only grow, also across pools and forks).
std::atomic<int64_t> g_epoch{0};

// State of the decode loop of yr_pk_run (see run_loop).
struct Loop {
    const int64_t* meta = nullptr;
    int64_t max_steps = 0;
    int64_t ran = 0;     // steps run; these fields are touched by one advancing thread at a time
    int64_t t0 = 0;      // start of the current step (ns)
    std::atomic<Graph*> g{nullptr};
    std::atomic<int32_t> over{0};
};

struct Pool {
    int nworkers = 1;                      // including the caller
    std::atomic<int> active{1};            // workers taking part in the current step
    std::vector<std::thread> threads;
    Word gen;                              // low bits of the current epoch (workers wait on it)
    std::atomic<Graph*> graph{nullptr};    // the graph of the current step
    std::atomic<int32_t> busy{0};          // workers 1.. inside a graph
    std::atomic<bool> stop{false};
    Loop lp;                               // the decode loop (yr_pk_run with meta)
    std::atomic<bool> loop_on{false};      // while it runs
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

// Pools not yet destroyed (a graph may outlive the pool that ran it); emptied in a forked
// child, whose copies of the pools have no threads.
std::mutex g_pools_mu;
std::set<Pool*>& live_pools() {
    static std::set<Pool*>* s = new std::set<Pool*>();
    return *s;
}
void forget_pools_in_child() { live_pools().clear(); new (&g_pools_mu) std::mutex(); }

// This thread's output buffer for redoable tasks (64-byte aligned, grown on demand).
char* scratch(size_t bytes) {
    struct Buf {
        char* p = nullptr;
        size_t n = 0;
        ~Buf() { std::free(p); }
    };
    thread_local Buf b;
    if (b.n < bytes) {
        std::free(b.p);
        b.n = (bytes + 63) / 64 * 64;
        b.p = static_cast<char*>(std::aligned_alloc(64, b.n));
        if (!b.p) { b.n = 0; return nullptr; }
    }
    return b.p;
}

bool deps_done(const Graph* g, const Op& op) {
    for (int32_t d = op.dep_begin; d < op.dep_end; ++d) {
        const int32_t dep = g->deps[d];
        if (g->done[dep].v.load(std::memory_order_acquire) < g->ops[dep].ntasks) return false;
    }
    return true;
}

// The step (epoch) whose last task this thread committed; see advance().
thread_local int64_t tl_finished_epoch = -1;

// Runs task i of g for step `E` and commits it, unless another worker committed it first.
// A redoable task computes into this thread's scratch; only the worker that wins the commit
// (a compare-and-swap of the task's epoch) copies it to the real output, so a worker that
// resumes late (after a preemption, its task redone by another) never writes anything.
void execute(Graph* g, int32_t i, int64_t E, int worker, bool helper) {
    const Task& t = g->tasks[i];
    TaskState& s = g->state[i];
    if (s.committed.load(std::memory_order_acquire) >= E) return;
    const int64_t p0 = g->prof ? now_ns() : 0;
    const int64_t t0 = ticks();
    if (t.redo_arg < 0) {
        t.fn(t.args, t.lo, t.hi);
        s.committed.store(E, std::memory_order_release);
    } else {
        const size_t bytes = (size_t)(t.hi - t.lo) * (size_t)t.elem;
        char* buf = scratch(bytes);
        if (!buf) {   // no memory for the scratch: take the commit first, then write in place
            int64_t c = s.committed.load(std::memory_order_acquire);
            do {
                if (c >= E) return;
            } while (!s.committed.compare_exchange_weak(c, E, std::memory_order_acq_rel));
            t.fn(t.args, t.lo, t.hi);
        } else {
            int64_t a[MAX_REDO_ARGS];
            std::memcpy(a, t.args, sizeof(int64_t) * (size_t)t.nargs);
            a[t.redo_arg] = (int64_t)(reinterpret_cast<uintptr_t>(buf) - (uintptr_t)(t.lo * t.elem));
            t.fn(a, t.lo, t.hi);
            int64_t c = s.committed.load(std::memory_order_acquire);
            do {
                if (c >= E) return;          // another worker committed it: drop ours
            } while (!s.committed.compare_exchange_weak(c, E, std::memory_order_acq_rel));
            std::memcpy(reinterpret_cast<char*>(t.args[t.redo_arg]) + t.lo * t.elem, buf, bytes);
        }
    }
    if (!helper) {   // running mean of the op's task time (racy updates are harmless)
        std::atomic<int64_t>& m = g->mean_ticks[t.op];
        const int64_t d = ticks() - t0, old = m.load(std::memory_order_relaxed);
        m.store(old ? old + (d - old) / 8 : d, std::memory_order_relaxed);
    }
    if (g->prof) {
        const int64_t slot = g->prof_n.fetch_add(1);
        if (slot < g->prof_cap) {
            int64_t* row = g->prof + slot * 6;
            row[0] = worker; row[1] = g->steps; row[2] = i; row[3] = p0; row[4] = now_ns(); row[5] = t.op;
        }
    }
    g->done[t.op].v.fetch_add(1, std::memory_order_acq_rel);
    futex_wake(&g->done[t.op].v);
    if (g->finished.v.fetch_add(1, std::memory_order_acq_rel) + 1 == (int32_t)g->tasks.size()) {
        tl_finished_epoch = E;
        futex_wake(&g->finished.v);
    }
}

// Starts task i in step E unless another worker already has (it then returns false).
bool try_start(TaskState& s, int64_t E) {
    int64_t v = s.started.load(std::memory_order_acquire);
    do {
        if (v >= E) return false;
    } while (!s.started.compare_exchange_weak(v, E, std::memory_order_acq_rel));
    s.start_t.store(ticks(), std::memory_order_relaxed);
    return true;
}

// Called by a worker waiting on op o in step E, whose tasks have all been claimed. Once o's
// dependencies are done it runs one of o's tasks that its claimer has not started yet (the
// claimer is asleep or preempted: it will find the task taken), or redoes a redoable one
// that has run for 3x the op's mean task time plus REDO_MIN_US (its worker was most likely
// preempted). Returns true if it ran one.
bool help(Graph* g, int32_t o, int64_t E, int worker) {
    const Op& op = g->ops[o];
    if (!deps_done(g, op)) return false;
    const int64_t now = ticks();
    const int64_t mean = g->mean_ticks[o].load(std::memory_order_relaxed);
    const int64_t limit = mean ? 3 * mean + REDO_MIN_US * ticks_per_us() : REDO_FIRST_US * ticks_per_us();
    for (int32_t i = op.task_begin; i < op.task_begin + op.ntasks; ++i) {
        TaskState& s = g->state[i];
        if (s.committed.load(std::memory_order_acquire) >= E) continue;
        if (s.started.load(std::memory_order_acquire) < E) {
            if (!try_start(s, E)) continue;
            execute(g, i, E, worker, false);
            return true;
        }
        if (!op.redoable || now - s.start_t.load(std::memory_order_relaxed) < limit) continue;
        int64_t h = s.helped.load(std::memory_order_relaxed);
        if (h >= E || !s.helped.compare_exchange_strong(h, E)) continue;   // one helper per task
        execute(g, i, E, worker, true);
        return true;
    }
    return false;
}

// Waits until ready() holds: spin, then yield, then futex-sleep on w (whose value changes
// whenever ready() may have become true); helper() is called now and then (a true return
// means it did work: the wait starts over), at least every sleep_ns.
template <typename Ready, typename Helper>
void wait_until(std::atomic<int32_t>* w, Ready ready, Helper helper, int64_t sleep_ns = 1000000) {
    if (ready()) return;
    int64_t t0 = now_ns();
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            if (ready()) return;
            YR_PAUSE();
        }
        if (helper()) t0 = now_ns();
        if (now_ns() - t0 > SPIN_NS) break;
    }
    for (;;) {
        if (ready()) return;
        std::this_thread::yield();
        if (helper()) t0 = now_ns();
        if (now_ns() - t0 > SPIN_NS + YIELD_NS) break;
    }
    for (;;) {
        const int32_t seen = w->load();
        if (ready()) return;
        if (helper()) continue;
        g_sleepers.fetch_add(1);
        if (!ready()) futex_wait(w, seen, sleep_ns);
        g_sleepers.fetch_sub(1);
    }
}

template <typename Ready>
void wait_until(std::atomic<int32_t>* w, Ready ready) {
    wait_until(w, ready, [] { return false; });
}

// Claims and runs tasks of g until its task list is exhausted (or g's step E is over: a
// worker that resumes after a preemption finds its claims stale and returns).
void run_tasks(Graph* g, int worker) {
    const int32_t n = (int32_t)g->tasks.size();
    for (;;) {
        const int64_t v = g->next.fetch_add(1, std::memory_order_acq_rel);
        const int32_t i = (int32_t)(v & 0xffffffff);
        const int64_t E = g->epoch.load(std::memory_order_acquire);
        if (i >= n || (E & EPOCH_MASK) != (v >> 32)) return;   // exhausted, or a step ago
        TaskState& s = g->state[i];
        const Op& op = g->ops[g->tasks[i].op];
        for (int32_t d = op.dep_begin; d < op.dep_end; ++d) {
            const int32_t dep = g->deps[d];
            const int32_t need = g->ops[dep].ntasks;
            std::atomic<int32_t>* w = &g->done[dep].v;
            wait_until(w,
                       [&] {
                           return w->load(std::memory_order_acquire) >= need ||
                                  s.started.load(std::memory_order_acquire) >= E ||   // taken
                                  g->epoch.load(std::memory_order_acquire) != E;
                       },
                       [&] { return help(g, dep, E, worker); }, HELP_SLEEP_NS);
        }
        if (g->epoch.load(std::memory_order_acquire) != E) return;
        if (try_start(s, E)) execute(g, i, E, worker, false);
    }
}

void maybe_advance(Pool* pool);

void worker_main(Pool* pool, int id) {
    int32_t seen = 0;
    for (;;) {
        std::atomic<int32_t>* w = &pool->gen.v;
        wait_until(w, [&] { return pool->stop.load() || w->load() != seen; });
        if (pool->stop.load()) return;
        seen = w->load();
        if (id >= pool->active.load()) continue;
        pool->busy.fetch_add(1, std::memory_order_seq_cst);   // see yr_pk_graph_destroy
        Graph* g = pool->graph.load(std::memory_order_seq_cst);
        if (g) run_tasks(g, id);
        maybe_advance(pool);
        pool->busy.fetch_sub(1, std::memory_order_seq_cst);
    }
}

// Starts a step of graph g with `width` workers: resets its counters, gives it a new epoch
// and wakes the workers (always when `wake_all`: the decode loop's caller waits like them).
void begin_step(Pool* pool, Graph* g, int width, bool wake_all) {
    const int64_t E = g_epoch.fetch_add(1) + 1;
    for (size_t o = 0; o < g->ops.size(); ++o) g->done[o].v.store(0, std::memory_order_relaxed);
    g->finished.v.store(0, std::memory_order_relaxed);
    g->pool.store(pool);
    g->epoch.store(E, std::memory_order_seq_cst);
    g->next.store((E & EPOCH_MASK) << 32, std::memory_order_seq_cst);
    pool->active.store(width);
    pool->graph.store(g, std::memory_order_seq_cst);
    if (width > 1 || wake_all) {
        pool->gen.v.store((int32_t)E, std::memory_order_seq_cst);
        futex_wake(&pool->gen.v);
    }
}

// One step of graph g on the pool with `width` workers, driven by the caller. It ends when
// every task has been committed, not when every worker is back: a preempted worker does not
// hold it up.
void step(Pool* pool, Graph* g, int width) {
    begin_step(pool, g, width, false);
    const int64_t E = g->epoch.load();
    run_tasks(g, 0);
    const int32_t n = (int32_t)g->tasks.size();
    std::atomic<int32_t>* w = &g->finished.v;
    wait_until(w, [w, n] { return w->load(std::memory_order_acquire) >= n; },
               [&] {
                   for (int32_t o = 0; o < (int32_t)g->ops.size(); ++o)
                       if (g->done[o].v.load(std::memory_order_acquire) < g->ops[o].ntasks && help(g, o, E, 0))
                           return true;
                   return false;
               },
               HELP_SLEEP_NS);
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

// The decode loop of yr_pk_run with a meta block (see there). Whichever worker commits the
// last task of a step ends it and starts the next (advance), so a caller that another
// process preempts holds up no step; the caller works like the other workers meanwhile.
// Its state is Pool::lp (struct Loop).

// Before a step: writes its inputs; false when the loop must end (no room for a token).
bool loop_prepare(Loop* L) {
    const int64_t* meta = L->meta;
    if (L->ran >= L->max_steps) return false;
    const int64_t* tokens = reinterpret_cast<const int64_t*>(meta[0]);
    const int64_t s = *reinterpret_cast<const int64_t*>(meta[2]);
    if (s < 0 || s + 1 >= meta[1]) return false;
    reinterpret_cast<int64_t*>(meta[3])[0] = tokens[s];
    reinterpret_cast<int64_t*>(meta[4])[0] = s;
    return true;
}

// After a step: counts it, stores its token; false when the loop ends with it (an index
// error reported by a kernel, or an EOS token).
bool loop_finish(Loop* L) {
    const int64_t* meta = L->meta;
    ++L->ran;
    const int64_t* status = reinterpret_cast<const int64_t*>(meta[6]);
    for (int64_t r = 0; r < meta[7]; ++r)
        if (status[r * 4] != 0) return false;
    int64_t* step_no = reinterpret_cast<int64_t*>(meta[2]);
    const int64_t s = *step_no;
    *step_no = s + 1;
    if (s + 1 < meta[10]) return true;                      // still inside the prompt
    const int64_t tok = reinterpret_cast<const int64_t*>(meta[5])[0];
    reinterpret_cast<int64_t*>(meta[0])[s + 1] = tok;
    const int64_t* eos = reinterpret_cast<const int64_t*>(meta[8]);
    for (int64_t e = 0; e < meta[9]; ++e)
        if (eos[e] == tok) return false;
    return true;
}

// Called by a thread back from run_tasks: if it committed the last task of the loop's
// current step, it ends that step and starts the next, or ends the loop.
void maybe_advance(Pool* pool) {
    if (tl_finished_epoch < 0 || !pool->loop_on.load(std::memory_order_acquire)) return;
    Loop* L = &pool->lp;
    Graph* g = L->g.load(std::memory_order_acquire);
    const int64_t E = tl_finished_epoch;
    tl_finished_epoch = -1;
    if (g->epoch.load(std::memory_order_acquire) != E ||
        g->finished.v.load(std::memory_order_acquire) < (int32_t)g->tasks.size())
        return;   // a flag left from a step of another graph or run
    record(pool, now_ns() - L->t0);
    ++g->steps;
    if (loop_finish(L) && loop_prepare(L)) {
        const int width = pick_width(pool);
        L->t0 = now_ns();
        begin_step(pool, g, width, true);
        return;
    }
    L->over.store(1, std::memory_order_release);
    pool->gen.v.fetch_add(1, std::memory_order_seq_cst);   // wake the caller
    futex_wake(&pool->gen.v);
}

int64_t run_loop(Pool* pool, Graph* g, int64_t max_steps, const int64_t* meta) {
    Loop& L = pool->lp;
    L.meta = meta, L.max_steps = max_steps, L.ran = 0;
    L.g.store(g);
    L.over.store(0);
    if (!loop_prepare(&L)) return 0;
    tl_finished_epoch = -1;
    pool->loop_on.store(true, std::memory_order_seq_cst);
    L.t0 = now_ns();
    begin_step(pool, g, pick_width(pool), true);
    std::atomic<int32_t>* w = &pool->gen.v;
    for (;;) {
        const int32_t seen = w->load(std::memory_order_acquire);
        run_tasks(g, 0);
        maybe_advance(pool);
        wait_until(w, [&] { return L.over.load(std::memory_order_acquire) || w->load() != seen; });
        if (L.over.load(std::memory_order_acquire)) break;
    }
    pool->loop_on.store(false, std::memory_order_seq_cst);
    return L.ran;
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
    ticks_per_us();   // calibrated once, outside any step
    static std::once_flag atfork;
    std::call_once(atfork, [] { pthread_atfork(nullptr, nullptr, forget_pools_in_child); });
    {
        std::lock_guard<std::mutex> lock(g_pools_mu);
        live_pools().insert(pool);
    }
    for (int i = 1; i < pool->nworkers; ++i) pool->threads.emplace_back(worker_main, pool, i);
    return pool;
}

void yr_pk_pool_destroy(void* p) {
    Pool* pool = static_cast<Pool*>(p);
    if (!pool) return;
    pool->stop.store(true);
    pool->gen.v.fetch_add(1);
    g_sleepers.fetch_add(1);   // force the wake-up syscall
    futex_wake(&pool->gen.v);
    g_sleepers.fetch_sub(1);
    for (auto& t : pool->threads) t.join();
    {
        std::lock_guard<std::mutex> lock(g_pools_mu);
        live_pools().erase(pool);
    }
    delete pool;
}

// Width the pool uses now (the adaptive choice), for reports.
int64_t yr_pk_pool_width(void* p) {
    Pool* pool = static_cast<Pool*>(p);
    return pool ? pool->chosen : 0;
}

// A task graph. tasks: int64 [n_tasks, 8] rows {fn, args, nargs, lo, hi, op, redo_arg, elem};
// ops: int64 [n_ops, 3] rows {ntasks, dep_begin, dep_end}; deps: int64 [n_deps] op ids. Tasks
// must be in an order where every task of an op comes after every task of the ops it
// depends on, and each op's ntasks must equal the number of its tasks.
// A task is *redoable* when redo_arg >= 0: args (nargs <= 64 int64) holds at index redo_arg
// the pointer of its only output, of which it writes elements [lo, hi) of elem bytes each
// (elem 1, 2, 4 or 8), and it reads no memory it writes. The scheduler may then run it on
// several workers (see execute, help); redo_arg = -1 otherwise (nargs and elem unused).
// Returns null if any of this does not hold (*error: 1 task, 2 op, 3 dep, 4 count).
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
        g->ops[o] = {(int32_t)r[0], (int32_t)r[1], (int32_t)r[2], 0, r[0] > 0};
        for (int64_t d = r[1]; d < r[2]; ++d)
            if (deps[d] < 0 || deps[d] >= o) { *error = 3; return nullptr; }   // deps point backwards
    }
    g->deps.assign(deps, deps + n_deps);
    std::vector<int32_t> seen((size_t)n_ops, 0);
    int32_t last_op = 0;
    g->tasks.resize((size_t)n_tasks);
    for (int64_t i = 0; i < n_tasks; ++i) {
        const int64_t* r = tasks + i * 8;
        const int64_t fn = r[0], args = r[1], nargs = r[2], lo = r[3], hi = r[4], op = r[5], redo = r[6],
                      elem = r[7];
        if (fn == 0 || op < 0 || op >= n_ops || op < last_op || hi < lo) { *error = 1; return nullptr; }
        if (redo != -1 && (args == 0 || nargs < 1 || nargs > MAX_REDO_ARGS || redo < 0 || redo >= nargs ||
                           (elem != 1 && elem != 2 && elem != 4 && elem != 8) || lo < 0 ||
                           hi - lo > (int64_t)1 << 40)) { *error = 1; return nullptr; }
        if (op != last_op || i == 0) g->ops[op].task_begin = (int32_t)i;
        last_op = (int32_t)op;
        ++seen[op];
        g->ops[op].redoable = g->ops[op].redoable && redo >= 0;
        g->tasks[i] = {reinterpret_cast<TaskFn>(fn), reinterpret_cast<const int64_t*>(args), lo, hi,
                       (int32_t)op, (int32_t)(redo >= 0 ? nargs : 0), (int32_t)redo, (int32_t)(redo >= 0 ? elem : 0)};
    }
    for (int64_t o = 0; o < n_ops; ++o)
        if (seen[o] != g->ops[o].ntasks) { *error = 4; return nullptr; }
    g->done.reset(new Word[std::max<int64_t>(n_ops, 1)]);
    g->state.reset(new TaskState[std::max<int64_t>(n_tasks, 1)]);
    g->mean_ticks.reset(new std::atomic<int64_t>[std::max<int64_t>(n_ops, 1)]);
    for (int64_t o = 0; o < n_ops; ++o) g->mean_ticks[o].store(0);
    g->next.store(EPOCH_MASK << 32 | 0x7fffffff);   // exhausted until its first step
    return g.release();
}

// Frees a graph; first waits until no worker of any pool is inside a graph (a worker preempted during a task that another worker redid may still be running
// it into its scratch, reading the graph and the tensors it points to).
void yr_pk_graph_destroy(void* gp) {
    Graph* g = static_cast<Graph*>(gp);
    if (!g) return;
    if (g->pool.load()) {   // it ran: no worker of any pool may still be inside it
        std::lock_guard<std::mutex> lock(g_pools_mu);
        for (Pool* pool : live_pools()) {
            Graph* expect = g;
            pool->graph.compare_exchange_strong(expect, nullptr, std::memory_order_seq_cst);
        }
        for (Pool* pool : live_pools())
            while (pool->busy.load(std::memory_order_seq_cst) > 0) std::this_thread::yield();
    }
    delete g;
}

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
    if (meta) return max_steps > 0 ? run_loop(pool, g, max_steps, meta) : 0;
    if (max_steps < 1) return 0;
    const int width = pick_width(pool);
    const int64_t t0 = now_ns();
    step(pool, g, width);
    record(pool, now_ns() - t0);
    return 1;
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

// A redoable task for testing (tests/runtime/test_persistent_kernel.py): a = {in*, out*,
// first*, stall_ns, stall_tid, stalls*, spin} (int64 arrays): spins `spin` iterations, then
// out[j] = 2 * in[j] + 1 for j in [lo, hi). The first run of the slice (first[lo] was 0) on a
// thread other than stall_tid (the caller's Linux thread id) first sleeps stall_ns and counts
// one stall, as a worker preempted mid-task would.
void yr_pk_test_redo_task(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t* in = reinterpret_cast<const int64_t*>(a[0]);
    int64_t* out = reinterpret_cast<int64_t*>(a[1]);
    int64_t* first = reinterpret_cast<int64_t*>(a[2]);
    volatile int64_t sink = 0;
    for (int64_t i = 0; i < a[6]; ++i) sink = sink + i;
#if defined(__linux__)
    const bool other = (int64_t)syscall(SYS_gettid) != a[4];
#else
    const bool other = false;
#endif
    if (other && __atomic_exchange_n(&first[lo], 1, __ATOMIC_ACQ_REL) == 0) {
        __atomic_fetch_add(reinterpret_cast<int64_t*>(a[5]), 1, __ATOMIC_ACQ_REL);
        std::this_thread::sleep_for(std::chrono::nanoseconds(a[3]));
    }
    for (int64_t j = lo; j < hi; ++j) out[j] = 2 * in[j] + 1;
}

}  // extern "C"
