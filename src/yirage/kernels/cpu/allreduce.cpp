// The shared-memory allreduce of tensor parallelism (runtime/distributed.py's
// SharedMemoryAllreduce): the ranks of one host share a mapping of a file in /dev/shm holding one
// flag per rank (int64, one 64-byte line each: flags[8 * r]) and two buffers [world, cap] float32.
// Allreduce number `step` uses buffer step % 2: a rank writes its x into its slot, publishes
// `step` in its flag (release), waits until every flag reaches `step` (acquire), then sums the
// slots in rank order into x, so every rank gets the same bits. A rank reaching step + 2 has seen
// every flag at step + 1, so every rank has finished reading step's buffer: two buffers suffice.
//
// The wait spins `spins` polls, then yields its core at every poll (a peer may be waiting for
// it); after `timeout_ns` it gives up and returns -(r + 1) for the first rank r whose flag is
// behind (died or hung), else 0. The atomics are GCC/Clang builtins: release/acquire order on
// x86-64 and aarch64 alike. No entry reads an index from memory, and the sizes passed are
// checked (1 <= world, 0 <= rank < world, 0 <= n <= cap): else it returns 1 and touches nothing.
#include "yirage_prelude.h"

#include <sched.h>

#include <chrono>
#include <cstring>

extern "C" int64_t yr_shm_allreduce_f32(int64_t* flags, float* data, int64_t rank, int64_t world, int64_t cap,
                                        int64_t step, float* x, int64_t n, int64_t spins, int64_t timeout_ns) {
    if (world < 1 || rank < 0 || rank >= world || n < 0 || n > cap || cap < 0 || step < 0) return 1;
    float* slots = data + (step & 1) * world * cap;
    std::memcpy(slots + rank * cap, x, (size_t)n * sizeof(float));
    __atomic_store_n(&flags[8 * rank], step, __ATOMIC_RELEASE);
    using clock = std::chrono::steady_clock;
    clock::time_point deadline{};
    bool timed = false;
    int64_t polls = 0;
    for (int64_t r = 0; r < world; ++r) {
        while (__atomic_load_n(&flags[8 * r], __ATOMIC_ACQUIRE) < step) {
            if (++polls < spins) continue;
            sched_yield();
            if (polls % 256 == 0) {
                clock::time_point now = clock::now();
                if (!timed) {
                    deadline = now + std::chrono::nanoseconds(timeout_ns);
                    timed = true;
                } else if (now > deadline) {
                    return -(r + 1);
                }
            }
        }
    }
    for (int64_t j = 0; j < n; ++j) {
        float acc = slots[j];
        for (int64_t r = 1; r < world; ++r) acc += slots[r * cap + j];
        x[j] = acc;
    }
    return 0;
}
