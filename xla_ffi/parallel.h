// ParallelFor over the caller's XLA thread pool (the FFI's Ctx<ThreadPool>: on the CPU backend, XLA's intra-op
// pool, sized by XLA from the process's CPU affinity) or over a WorkerPool (worker_pool.h: the CUDA host_experts
// path). Pool is any type with num_threads() and Schedule(callable), as both have.
//
// ParallelFor(pool, n, fn) runs fn(0), ..., fn(n-1) and returns when all n calls have returned. The calling thread
// claims tasks too, so the loop finishes even when every pool thread is busy elsewhere (for example with another
// FFI call of the same step that XLA runs concurrently): helpers are only an offer, never waited for. Helpers that
// start after the work is gone find nothing to claim and return; they touch only the reference-counted shared
// state, never the caller's stack. Tasks are handed out dynamically, so callers must make every task write
// disjoint outputs with a fixed order of arithmetic; then results do not depend on the number of threads or on
// which thread ran which task (the kernels rely on this for determinism).
//
// FT_JAX_NUM_THREADS (read once per process, >= 1) caps the threads used per loop, the caller included.
#ifndef FT_JAX_XLA_FFI_PARALLEL_H_
#define FT_JAX_XLA_FFI_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ft_jax {

// Threads a loop may use: XLA's pool size (0 if it has none) capped by FT_JAX_NUM_THREADS; at least 1.
template <typename Pool>
int64_t LoopThreads(Pool& pool) {
  static const int64_t cap = [] {
    const char* env = std::getenv("FT_JAX_NUM_THREADS");
    const long v = env ? std::strtol(env, nullptr, 10) : 0;
    return v >= 1 ? static_cast<int64_t>(v) : int64_t{0};
  }();
  int64_t n = std::max<int64_t>(pool.num_threads(), 1);
  return cap ? std::min(n, cap) : n;
}

template <typename Pool, typename Fn>
void ParallelFor(Pool& pool, int64_t n, const Fn& fn) {
  const int64_t threads = std::min(LoopThreads(pool), n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct Shared {
    explicit Shared(int64_t n, const Fn* fn) : n(n), fn(fn) {}
    const int64_t n;
    const Fn* fn;  // valid until done == n (the caller waits for that before returning)
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
    // Claims and runs tasks until none is left; returns true if this call finished the last task.
    bool Work() {
      int64_t finished = 0;
      for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
           i = next.fetch_add(1, std::memory_order_relaxed)) {
        (*fn)(i);
        ++finished;
      }
      return finished && done.fetch_add(finished, std::memory_order_acq_rel) + finished == n;
    }
  };
  auto shared = std::make_shared<Shared>(n, &fn);
  for (int64_t t = 1; t < threads; ++t) {
    pool.Schedule([shared] {
      if (shared->Work()) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->cv.notify_all();
      }
    });
  }
  shared->Work();
  if (shared->done.load(std::memory_order_acquire) == n) return;
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load(std::memory_order_acquire) == n; });
}

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_PARALLEL_H_
