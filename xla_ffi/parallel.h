// ParallelFor: a kernel's tasks on its calling thread and the KernelHelpers threads (kernel_helpers.h), as many
// threads in all as the pool it is given allows: the caller's XLA thread pool (the FFI's Ctx<ThreadPool>) or a
// WorkerPool (worker_pool.h); Pool is any type with num_threads(). With it, how the kernels split a call into tasks:
// kParallelMinBytes, TaskBytes and RowsPerTask.
//
// ParallelFor(pool, n, fn) runs fn(0), ..., fn(n-1) and returns when every task has returned. The calling thread
// claims tasks too, so the loop finishes even when every helper is busy elsewhere; helpers are an offer, never
// waited for, and touch only the reference-counted shared state. Tasks are handed out dynamically: callers make every
// task write disjoint outputs with a fixed order of arithmetic, so results do not depend on the threads.
//
// A task that throws: the exception is caught on the thread that ran it, the tasks not yet started are skipped (the
// ones running finish), and once every task is accounted for ParallelFor rethrows, on the caller, the exception of
// the lowest-numbered failing task (deterministic whatever the scheduling). Handlers turn it into an FFI error
// (common.h Guarded): a throwing task never leaves its caller waiting.
#ifndef FT_JAX_XLA_FFI_PARALLEL_H_
#define FT_JAX_XLA_FFI_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>

#include "xla_ffi/common.h"
#include "xla_ffi/kernel_helpers.h"

namespace ft_jax {

// Threads a loop may use: the pool's size capped by FT_JAX_NUM_THREADS (common.h); at least 1.
template <typename Pool>
int64_t LoopThreads(Pool& pool) {
  const int64_t n = std::max<int64_t>(pool.num_threads(), 1);
  return NumThreadsCap() ? std::min(n, NumThreadsCap()) : n;
}

// Below this many weight bytes per call a kernel runs on the calling thread (waking helpers costs more).
constexpr size_t kParallelMinBytes = size_t{1} << 20;
// Weight bytes per task of a compute-bound call (many tokens per weight row: prefill): small enough to balance the
// threads when tasks differ in tokens, large enough to amortise the hand-out.
constexpr size_t kTaskBytes = size_t{256} << 10;
// A memory-bound call (decode: fewer than kStreamMaxTokens tokens per matrix on average) takes tasks as long as the
// balance allows (kTasksPerThread): each thread then reads its rows as a few long sequential streams, which the
// hardware prefetchers follow. Measured (profile_decode.py, bench model, bf16 host-all, 2 threads, the builds
// alternated over 3 rounds; docs/DESIGN.md sec. 16): decode +10-15 % tok/s at batch 1, +4 % at batch 8. Prefill keeps
// kTaskBytes (long tasks cost q8_0 experts at 64 tokens 15-25 %).
constexpr size_t kStreamTaskBytes = size_t{16} << 20;
constexpr int64_t kStreamMaxTokens = 8;
// The fewest tasks per thread a call is split into (RowsPerTask), for balance. 3 rather than 4 (sec. 16's choice):
// with each prefetch kept among its loads (dot_kernels.h PrefetchAhead), fewer, longer tasks read faster. Measured
// in-process on the bench model, 2 threads, decode alternated over 6-10 rounds (docs/DESIGN.md sec. 20.33): q4_0
// 1.018-1.023x the tok/s of 4 per thread (2 per thread: 1.018-1.028x, 8: 0.967x, 16: 0.94x), q8_0 1.009x, bf16 1.005x.
constexpr int64_t kTasksPerThread = 3;

// Target weight bytes per task of a call that applies `matrices` weight matrices to `tokens` token rows in all.
inline size_t TaskBytes(int64_t tokens, int64_t matrices) {
  return tokens < kStreamMaxTokens * matrices ? kStreamTaskBytes : kTaskBytes;
}

// Rows per task: task_bytes of rows of row_bytes, at least kTasksPerThread tasks per thread, rounded up to `multiple`.
inline int64_t RowsPerTask(size_t row_bytes, int64_t rows, int64_t multiple, int64_t threads, size_t task_bytes) {
  int64_t r = static_cast<int64_t>(task_bytes / std::max<size_t>(row_bytes, 1));
  const int64_t cap = (rows + kTasksPerThread * threads - 1) / (kTasksPerThread * threads);
  r = std::max<int64_t>(1, std::min(r, cap));
  return (r + multiple - 1) / multiple * multiple;
}

namespace internal {

// The state a ParallelFor shares with its helpers (kept alive by them until they return).
template <typename Fn>
struct ParallelShared {
  ParallelShared(int64_t n, const Fn* fn) : n(n), fn(fn) {}
  const int64_t n;
  const Fn* fn;  // valid until done == n (the caller waits for that before returning)
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex mu;  // guards error, error_task; with cv, the caller's wait
  std::condition_variable cv;
  std::exception_ptr error;
  int64_t error_task = -1;

  void Fail(int64_t task, std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (error_task < 0 || task < error_task) {
      error = std::move(e);
      error_task = task;
    }
    failed.store(true, std::memory_order_release);
  }
  // Claims and runs tasks until none is left (after a failure: claims and skips them); true if this call
  // accounted for the last task.
  bool Work() {
    int64_t finished = 0;
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      if (!failed.load(std::memory_order_acquire)) {
        try {
          (*fn)(i);
        } catch (...) {
          Fail(i, std::current_exception());
        }
      }
      ++finished;
    }
    return finished && done.fetch_add(finished, std::memory_order_acq_rel) + finished == n;
  }
};

}  // namespace internal

// How long ParallelFor's caller waits awake for its helpers before it sleeps (microseconds).
constexpr int64_t kSpinWaitMicros = 200;

// fn(0), ..., fn(n-1) on the calling thread alone (a call too small to share), keeping the kernel helpers that are
// polling awake for the step's next call (KernelHelpers::KeepAwake).
template <typename Fn>
void RunOnCaller(int64_t n, const Fn& fn) {
  KernelHelpers::Shared().KeepAwake();
  for (int64_t i = 0; i < n; ++i) fn(i);
}

template <typename Pool, typename Fn>
void ParallelFor(Pool& pool, int64_t n, const Fn& fn) {
  const int64_t threads = std::min(LoopThreads(pool), n);
  if (threads <= 1) return RunOnCaller(n, fn);
  auto shared = std::make_shared<internal::ParallelShared<Fn>>(n, &fn);
  KernelHelpers::Shared().Offer(
      [shared] {
        if (shared->Work()) {
          std::lock_guard<std::mutex> lock(shared->mu);
          shared->cv.notify_all();
        }
      },
      threads - 1);
  shared->Work();
  // The helper is finishing its last task (tens of microseconds in a decode call): wait for it awake first, as a
  // sleep on the condition variable costs a wake-up of the caller per call (~33 calls per decode step). Measured on
  // the bench model, q4_0, batch 1, 2 threads: 13.3-14.2 ms per step against 14.4-15.4 sleeping at once (4
  // alternated processes, docs/DESIGN.md sec. 20.20).
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinWaitMicros);
  while (shared->done.load(std::memory_order_acquire) != n && std::chrono::steady_clock::now() < spin_until) {
    CpuRelax();
  }
  if (shared->done.load(std::memory_order_acquire) != n) {
    std::unique_lock<std::mutex> lock(shared->mu);
    shared->cv.wait(lock, [&] { return shared->done.load(std::memory_order_acquire) == n; });
  }
  std::lock_guard<std::mutex> lock(shared->mu);
  if (shared->error) std::rethrow_exception(shared->error);
}

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_PARALLEL_H_
