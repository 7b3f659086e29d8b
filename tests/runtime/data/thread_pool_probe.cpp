// Probes of kernels/cpu/yr_threads.h for tests/runtime/test_thread_pool.py, built with or
// without OpenMP. Every entry counts with atomics and reports what it saw. Buffers: counts of
// counts_len int32 (an entry that would index past it does nothing), ranks of 64 int32, out of
// 3 int64.
#include <atomic>
#include <chrono>
#include <cstdint>

#include "yr_threads.h"

namespace {

inline void bump(int32_t* p) { __atomic_add_fetch(p, 1, __ATOMIC_RELAXED); }

// *p = max(*p, v), atomically.
inline void raise_to(int64_t* p, int64_t v) {
    int64_t seen = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (seen < v && !__atomic_compare_exchange_n(p, &seen, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

// Whether counts[lo .. hi) are all 1.
bool all_ones(const int32_t* counts, int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
        if (__atomic_load_n(counts + i, __ATOMIC_RELAXED) != 1) return false;
    return true;
}

// Waits (at most 10 s) until *count reaches want; true if it did.
bool rendezvous(std::atomic<int>& count, int want) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (count.load() < want)
        if (std::chrono::steady_clock::now() > end) return false;
    return true;
}

}  // namespace

extern "C" {

// out[0] = yr::max_threads(), out[1] = 1 with OpenMP, else 0.
void probe_info(int64_t* out) {
    out[0] = yr::max_threads();
#if defined(_OPENMP)
    out[1] = 1;
#else
    out[1] = 0;
#endif
}

// reps times: counts[i] += 1 for i < n with parallel_for (dynamic: its dynamic form) if cond;
// ranks[r] += 1 for each rank r (< 64) that ran an iteration, team = the largest team seen.
void probe_for(int64_t n, int64_t cond, int64_t dynamic, int64_t reps, int32_t* counts, int64_t counts_len,
               int32_t* ranks, int64_t* team) {
    if (n > counts_len) return;
    for (int64_t rep = 0; rep < reps; ++rep) {
        const auto body = [&](int64_t i) {
            bump(counts + i);
            const int r = yr::team_rank();
            if (r < 64) bump(ranks + r);
            raise_to(team, yr::team_size());
        };
        if (dynamic) yr::parallel_for_dynamic(n, cond != 0, body);
        else yr::parallel_for(n, cond != 0, body);
    }
}

// A region of at most `limit` threads (0: all): out[0] = its team size, out[1] = the threads that
// arrived at a rendezvous of the whole team within 10 s (== out[0] only if they all ran at once),
// out[2] = iterations of a dynamic loop of team_size() iterations that met in a rendezvous of the
// team (each blocks until all have started: needs every thread at once, one iteration each).
void probe_concurrent(int64_t limit, int64_t* out) {
    std::atomic<int> arrived{0}, started{0}, met{0};
    yr::parallel(true, (int)limit, [&] {
        if (yr::team_rank() == 0) out[0] = yr::team_size();
        arrived.fetch_add(1);
        rendezvous(arrived, yr::team_size());
        yr::barrier();
        yr::for_dynamic_nowait(yr::team_size(), [&](int64_t) {
            started.fetch_add(1);
            if (rendezvous(started, yr::team_size())) met.fetch_add(1);
        });
    });
    out[1] = arrived.load();
    out[2] = met.load();
}

// One region: for_static then `loops` dynamic loops without barriers (more than the pool's slots)
// and a barrier. counts: n * (1 + loops) of them (each must end at 1); out[0]: threads that saw an
// iteration of the static loop undone after it (its barrier failed), out[1]: the same for the
// dynamic loops after barrier(), out[2]: the team size.
void probe_region(int64_t n, int64_t loops, int32_t* counts, int64_t counts_len, int64_t* out) {
    if (n < 0 || loops < 0 || n > counts_len / (1 + loops)) return;
    yr::parallel(true, [&] {
        yr::for_static(n, [&](int64_t i) { bump(counts + i); });
        if (!all_ones(counts, 0, n)) __atomic_add_fetch(out, 1, __ATOMIC_RELAXED);
        for (int64_t l = 1; l <= loops; ++l) yr::for_dynamic_nowait(n, [&](int64_t i) { bump(counts + l * n + i); });
        yr::barrier();
        if (!all_ones(counts, n, n * (1 + loops))) __atomic_add_fetch(out + 1, 1, __ATOMIC_RELAXED);
        if (yr::team_rank() == 0) out[2] = yr::team_size();
    });
}

// A region inside a region, and a parallel_for inside a parallel_for: out[0] = the outer team,
// out[1] = the largest inner team seen (1: nested regions run on their thread alone), out[2] =
// inner iterations run (outer n x inner n = 8 x 8 = 64).
void probe_nested(int64_t* out) {
    yr::parallel(true, [&] {
        if (yr::team_rank() == 0) out[0] = yr::team_size();
        yr::parallel(true, [&] { raise_to(out + 1, yr::team_size()); });
    });
    yr::parallel_for(8, true, [&](int64_t) {
        yr::parallel_for(8, true, [&](int64_t) {
            raise_to(out + 1, yr::team_size());
            __atomic_add_fetch(out + 2, 1, __ATOMIC_RELAXED);
        });
    });
}

}  // extern "C"
