// Threads of the hand-written kernels and of the generated ones: every parallel loop and region
// goes through the functions of namespace yr below, never through a raw `#pragma omp parallel`.
//
// With OpenMP (runtime/toolchain.py's openmp_flags: -fopenmp, or Homebrew's libomp for Apple's
// clang) each function is exactly the OpenMP construct it names, inlined: a pragma around a loop
// that calls the lambda. Without it (a compiler with no OpenMP runtime, or YIRAGE_OPENMP=0: the
// build has -fopenmp-simd alone, so `omp simd` loops still vectorize) they run on yirage's own
// pool of threads, one pool per shared library:
// - made at the first parallel region, of max_threads() threads: OMP_NUM_THREADS if set when
//   the library loads, else std::thread::hardware_concurrency(), at most MAX_THREADS. The
//   caller is rank 0; the others are workers that poll for the next region a while (kernels
//   come one after another), then sleep on a condition variable. Every thread of a team runs
//   concurrently (a kernel may wait on another thread's progress: EmbRowEpilogue::help in
//   embed_kernels.h); dynamic loops hand out iterations from an atomic counter.
// - a region entered inside an active one (nested), or while another thread's region holds the
//   pool, runs on the calling thread alone as a team of 1 (OpenMP's default for nested regions):
//   concurrent callers stay correct and never wait for each other.
// - a fork()ed child makes a new pool at its first region (threads do not survive fork).
//
// The functions (n: a count, f: a callable; n <= 0 runs nothing):
//   max_threads(), team_size(), team_rank()    omp_get_max_threads / _num_threads / _thread_num
//   parallel_for(n, cond, f)                   #pragma omp parallel for schedule(static) if (cond)
//   parallel_for_dynamic(n, cond, f)           #pragma omp parallel for schedule(dynamic, 1) if (cond)
//                                              (f(i) for every i < n, once)
//   parallel(cond, f), parallel(cond, limit, f) #pragma omp parallel if (cond) [num_threads(limit)]:
//                                              f() once on each thread of the team (limit <= 0: all)
//   parallel_chunks(n, cond, f)                a region calling f(lo, hi) once per team thread with
//                                              its contiguous, balanced slice of [0, n) (maybe empty)
//   for_static(n, f)                           #pragma omp for schedule(static) (ends at a barrier)
//   for_dynamic_nowait(n, f)                   #pragma omp for schedule(dynamic, 1) nowait
//   barrier()                                  #pragma omp barrier
// for_static, for_dynamic_nowait and barrier are called by every thread of a region (in the same
// order: OpenMP's rule for worksharing), or outside one, where the calling thread does it all.
#pragma once

#include <algorithm>
#include <cstdint>
#if defined(_OPENMP)
#include <omp.h>
#else
#include <pthread.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#endif

// hidden: each shared library keeps its own pool and its own copies of these inline functions
namespace yr __attribute__((visibility("hidden"))) {

namespace detail {
// [lo, hi): thread t's slice of [0, n) among nt threads (the first n % nt get one more).
inline void chunk(int64_t n, int64_t t, int64_t nt, int64_t& lo, int64_t& hi) {
    if (n <= 0 || nt <= 0) { lo = hi = 0; return; }
    const int64_t q = n / nt, r = n % nt;
    lo = t * q + std::min(t, r);
    hi = lo + q + (t < r ? 1 : 0);
}
}  // namespace detail

#if defined(_OPENMP)

inline int max_threads() { return omp_get_max_threads(); }
inline int team_size() { return omp_get_num_threads(); }
inline int team_rank() { return omp_get_thread_num(); }

template <typename F>
inline void parallel_for(int64_t n, bool cond, const F& f) {
#pragma omp parallel for schedule(static) if (cond)
    for (int64_t i = 0; i < n; ++i) f(i);
}

template <typename F>
inline void parallel_for_dynamic(int64_t n, bool cond, const F& f) {
#pragma omp parallel for schedule(dynamic, 1) if (cond)
    for (int64_t i = 0; i < n; ++i) f(i);
}

template <typename F>
inline void parallel(bool cond, const F& f) {
#pragma omp parallel if (cond)
    f();
}

template <typename F>
inline void parallel(bool cond, int limit, const F& f) {
    if (limit <= 0) return parallel(cond, f);
#pragma omp parallel if (cond) num_threads(limit)
    f();
}

template <typename F>
inline void parallel_chunks(int64_t n, bool cond, const F& f) {
#pragma omp parallel if (cond)
    {
        int64_t lo, hi;
        detail::chunk(n, omp_get_thread_num(), omp_get_num_threads(), lo, hi);
        f(lo, hi);
    }
}

template <typename F>
inline void for_static(int64_t n, const F& f) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) f(i);
}

template <typename F>
inline void for_dynamic_nowait(int64_t n, const F& f) {
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < n; ++i) f(i);
}

inline void barrier() {
#pragma omp barrier
}

#else  // yirage's own pool

namespace detail {

constexpr int MAX_THREADS = 1024;   // a pool's threads at most (the job word holds 16 bits)
constexpr int SLOTS = 8;            // dynamic loops a region runs at once (more wait for a slot)
// How long a thread polls before it sleeps: a worker for the next region (kernels come one
// after another), the others in a barrier or at a region's end.
constexpr std::chrono::microseconds WORKER_SPIN{200}, SPIN{50};

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#else
    std::this_thread::yield();
#endif
}

// Something to wait for: a waiter polls done() a few microseconds, then for `spin` more yields
// its core between polls (to another runtime's thread, say, spinning there), then sleeps until
// a notify() that follows the change.
struct Signal {
    std::mutex m;
    std::condition_variable cv;

    template <typename Done>
    void wait(const Done& done, std::chrono::microseconds spin) {
        for (int i = 0; i < 256; ++i) {
            if (done()) return;
            pause();
        }
        for (const auto end = std::chrono::steady_clock::now() + spin; std::chrono::steady_clock::now() < end;) {
            if (done()) return;
            std::this_thread::yield();
        }
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, done);
    }
    void notify() {
        { std::lock_guard<std::mutex> lock(m); }   // a waiter between its check and its sleep has slept
        cv.notify_all();
    }
};

// The counter of a dynamic loop: iterations handed out, threads done with it, and its lap (the
// loops of a region take slots in turn; a slot is free again once every thread left it).
struct alignas(64) Slot {
    std::atomic<int64_t> next{0}, lap{0};
    std::atomic<int> left{0};
};

struct Pool;

// This thread's team: its pool (null outside an active region), rank, size, dynamic loops seen.
struct Team {
    Pool* pool = nullptr;
    int rank = 0, size = 1;
    int64_t loops = 0;
};
inline thread_local Team tls;

struct Pool {
    int size = 1;                           // threads of a whole team: the workers and the caller
    std::atomic<bool> busy{false};          // a region holds the pool
    // (cache lines apart: the workers poll job, the team counts down left and meets at the barrier)
    alignas(64) std::atomic<uint64_t> job{0};   // (regions started << 16) | the team size of the last
    void (*call)(const void*) = nullptr;    // the region's body: call(fn)
    const void* fn = nullptr;
    alignas(64) std::atomic<int> left{0};   // workers still in the region
    alignas(64) std::atomic<int> arrived{0};    // threads at the barrier
    std::atomic<int64_t> phase{0};          // barriers passed
    Slot slots[SLOTS];
    Signal wake, sync;                      // workers wait on wake for a region, the rest on sync

    struct Worker {
        Pool* pool;
        int rank;
    };

    // Starts n - 1 workers (fewer where the system refuses a thread); 8 MiB stacks, as Linux's
    // main thread has (macOS gives other threads 512 KiB).
    explicit Pool(int n) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, (size_t)8 << 20);
        for (int r = 1; r < n; ++r) {
            pthread_t thread;
            Worker* w = new Worker{this, r};
            if (pthread_create(&thread, &attr, &Pool::worker_main, w) != 0) {
                delete w;
                break;
            }
            pthread_detach(thread);
            size = r + 1;
        }
        pthread_attr_destroy(&attr);
    }

    static void* worker_main(void* arg) {
        Pool* p = static_cast<Worker*>(arg)->pool;
        const int rank = static_cast<Worker*>(arg)->rank;
        delete static_cast<Worker*>(arg);
        for (uint64_t seen = 0, job = 0;; seen = job) {   // job 0: none yet
            p->wake.wait([&] { return (job = p->job.load(std::memory_order_acquire)) != seen; }, WORKER_SPIN);
            const int team = (int)(job & 0xffff);
            if (rank >= team) continue;
            tls = Team{p, rank, team, 0};
            p->call(p->fn);
            tls = Team{};
            if (p->left.fetch_sub(1, std::memory_order_acq_rel) == 1) p->sync.notify();
        }
        return nullptr;
    }

    // Runs call(fn) on a team of `team` threads (2 .. size), the caller as rank 0; the caller
    // holds the pool (busy) and releases it here.
    void run(int team, void (*c)(const void*), const void* f) {
        call = c;
        fn = f;
        for (Slot& s : slots) {
            s.next.store(0, std::memory_order_relaxed);
            s.lap.store(0, std::memory_order_relaxed);
            s.left.store(0, std::memory_order_relaxed);
        }
        left.store(team - 1, std::memory_order_relaxed);
        job.store(((job.load(std::memory_order_relaxed) >> 16) + 1) << 16 | (uint64_t)team, std::memory_order_release);
        wake.notify();
        const Team outer = tls;
        tls = Team{this, 0, team, 0};
        c(f);
        tls = outer;
        sync.wait([&] { return left.load(std::memory_order_acquire) == 0; }, SPIN);
        busy.store(false, std::memory_order_release);
    }
};

inline std::atomic<Pool*> g_pool{nullptr};
inline std::atomic<bool> g_making{false};

// fork()'s child: the parent's workers are gone; the next region makes a new pool.
inline void forget_pool_in_child() {
    g_pool.store(nullptr);
    g_making.store(false);
    tls = Team{};
}

// OMP_NUM_THREADS (its first number) if set and positive, else the hardware threads; 1 .. MAX_THREADS.
inline int threads_from_env() {
    const char* env = std::getenv("OMP_NUM_THREADS");
    long v = env ? std::strtol(env, nullptr, 10) : 0;
    if (v <= 0) v = (long)std::thread::hardware_concurrency();
    return (int)std::min<long>(std::max<long>(v, 1), MAX_THREADS);
}
// The pool's size, read as the library loads (libgomp too reads OMP_NUM_THREADS once, at its load).
inline const int g_size = threads_from_env();
inline int pool_size() { return g_size; }

// The pool, made on first use; null for a pool of one thread, or while another thread makes it.
inline Pool* pool() {
    Pool* p = g_pool.load(std::memory_order_acquire);
    if (p || pool_size() < 2 || g_making.exchange(true, std::memory_order_acquire)) return p;
    p = g_pool.load(std::memory_order_acquire);
    if (!p) {
        static bool registered = false;   // under g_making
        if (!registered) registered = pthread_atfork(nullptr, nullptr, &forget_pool_in_child) == 0;
        p = new Pool(pool_size());        // never freed: workers live as long as the process
        g_pool.store(p, std::memory_order_release);
    }
    g_making.store(false, std::memory_order_release);
    return p;
}

template <typename F>
void call(const void* f) { (*static_cast<const F*>(f))(); }

// f() on each thread of a team of at most `limit` threads (<= 0: the pool's size) when cond;
// else, or inside an active region, or while the pool is busy, on this thread alone.
template <typename F>
inline void region(bool cond, int64_t limit, const F& f) {
    const Team outer = tls;
    Pool* p = cond && outer.pool == nullptr && limit != 1 ? pool() : nullptr;
    if (p && p->size > 1 && !p->busy.exchange(true, std::memory_order_acquire)) {
        p->run(limit > 0 && limit < p->size ? (int)limit : p->size, &call<F>, &f);
        return;
    }
    tls = Team{};
    f();
    tls = outer;
}

}  // namespace detail

/// Threads a parallel region gets at most (OpenMP's omp_get_max_threads).
inline int max_threads() { return detail::pool_size(); }
/// Threads of the calling thread's team (1 outside a region).
inline int team_size() { return detail::tls.size; }
/// The calling thread's rank in its team, 0 .. team_size() - 1 (0 outside a region).
inline int team_rank() { return detail::tls.rank; }

/// f(i) for i < n, each thread of a region one contiguous slice, when cond (else here).
template <typename F>
inline void parallel_for(int64_t n, bool cond, const F& f) {
    if (n <= 0) return;
    detail::region(cond, n, [&] {
        int64_t lo, hi;
        detail::chunk(n, detail::tls.rank, detail::tls.size, lo, hi);
        for (int64_t i = lo; i < hi; ++i) f(i);
    });
}

template <typename F>
inline void for_dynamic_nowait(int64_t n, const F& f);

/// f(i) for i < n, handed out one at a time to the threads of a region, when cond (else here).
template <typename F>
inline void parallel_for_dynamic(int64_t n, bool cond, const F& f) {
    if (n <= 0) return;
    detail::region(cond, n, [&] { for_dynamic_nowait(n, f); });
}

/// f() once on each thread of a region when cond (else once here).
template <typename F>
inline void parallel(bool cond, const F& f) { detail::region(cond, 0, f); }

/// parallel(cond, f) on at most `limit` threads (limit <= 0: all of them).
template <typename F>
inline void parallel(bool cond, int limit, const F& f) { detail::region(cond, limit > 0 ? limit : 0, f); }

/// f(lo, hi) once on each thread of a region (when cond) with its contiguous slice of [0, n).
template <typename F>
inline void parallel_chunks(int64_t n, bool cond, const F& f) {
    detail::region(cond, std::max<int64_t>(n, 1), [&] {
        int64_t lo, hi;
        detail::chunk(n, detail::tls.rank, detail::tls.size, lo, hi);
        f(lo, hi);
    });
}

/// Waits until every thread of the region is here (nothing outside a region).
inline void barrier() {
    const detail::Team t = detail::tls;
    if (t.size < 2) return;
    detail::Pool& p = *t.pool;
    const int64_t phase = p.phase.load(std::memory_order_acquire);
    if (p.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == t.size) {
        p.arrived.store(0, std::memory_order_relaxed);
        p.phase.store(phase + 1, std::memory_order_release);
        p.sync.notify();
    } else {
        p.sync.wait([&] { return p.phase.load(std::memory_order_acquire) != phase; }, detail::SPIN);
    }
}

/// Inside a region: f(i) for i < n, each team thread one contiguous slice, then a barrier.
template <typename F>
inline void for_static(int64_t n, const F& f) {
    const detail::Team t = detail::tls;
    int64_t lo, hi;
    detail::chunk(n, t.rank, t.size, lo, hi);
    for (int64_t i = lo; i < hi; ++i) f(i);
    barrier();
}

/// Inside a region: f(i) for i < n, handed out one at a time to the team's threads; no barrier.
template <typename F>
inline void for_dynamic_nowait(int64_t n, const F& f) {
    detail::Team& t = detail::tls;
    const int size = t.size;
    if (size < 2) {
        for (int64_t i = 0; i < n; ++i) f(i);
        return;
    }
    detail::Pool& p = *t.pool;
    const int64_t lap = t.loops / detail::SLOTS;
    detail::Slot& s = p.slots[t.loops++ % detail::SLOTS];
    if (s.lap.load(std::memory_order_acquire) != lap)   // a slower thread is still in the slot's last loop
        p.sync.wait([&] { return s.lap.load(std::memory_order_acquire) == lap; }, detail::SPIN);
    for (int64_t i; (i = s.next.fetch_add(1, std::memory_order_relaxed)) < n;) f(i);
    if (s.left.fetch_add(1, std::memory_order_acq_rel) + 1 == size) {
        s.next.store(0, std::memory_order_relaxed);
        s.left.store(0, std::memory_order_relaxed);
        s.lap.store(lap + 1, std::memory_order_release);
        p.sync.notify();
    }
}

#endif  // _OPENMP

}  // namespace yr
