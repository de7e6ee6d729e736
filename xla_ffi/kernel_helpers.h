// KernelHelpers: the threads that help ParallelFor's caller (parallel.h) run a kernel's tasks. One per CPU of the
// process's affinity but the caller's (capped by FT_JAX_NUM_THREADS), started on first use, never stopped (executables
// may outlive static destruction).
//
// Why not XLA's thread pool: a decode step makes ~33 FFI calls, each a fraction of a millisecond, with XLA's own small
// ops between them. A pool thread sleeps between the calls, and on a VM a sleeping vCPU wakes 30-160 us after it is
// scheduled (a halted vCPU needs the host to run it again), so the helper joined a small projection's call late and
// the caller read most of its rows alone. A helper here stays awake for kHelperSpinMicros after its last task
// (polling with PAUSE) before it sleeps, or for as long after a call that ran on its caller alone (KeepAwake), which
// spans the gaps between the calls of a step, and sleeps between steps.
// Measured on the bench model, q4_0, 2 vCPUs: 15.6-16.1 ms per token against 16.6-17.8 (docs/DESIGN.md sec. 20.31).
// FT_JAX_HELPER_SPIN_US sets the time (0: sleep at once).
#ifndef FT_JAX_XLA_FFI_KERNEL_HELPERS_H_
#define FT_JAX_XLA_FFI_KERNEL_HELPERS_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ft_jax {

// How long a helper polls for its next job after its last one before it sleeps (microseconds).
constexpr int64_t kHelperSpinMicros = 50;
// The longest a helper polls after its last job when KeepAwake calls extend its poll, in poll times.
constexpr int64_t kKeepAwakePolls = 4;
// FT_JAX_HELPER_SPIN_US's largest value (0.1 s; ft_jax/kernels MAX_HELPER_SPIN_US).
constexpr int64_t kMaxHelperSpinMicros = 100000;

class KernelHelpers {
 public:
  // The process's helpers.
  static KernelHelpers& Shared();

  // Helpers 0 .. helpers - 1 each run job once, at once if awake. An offer, not a promise: a later Offer replaces a
  // job that a helper has not taken yet, so the caller must be able to finish the work alone (ParallelFor's caller
  // claims tasks too).
  void Offer(std::function<void()> job, int64_t helpers);

  // Helpers that are polling go on polling for their poll time (kHelperSpinMicros, FT_JAX_HELPER_SPIN_US) from now;
  // sleeping ones sleep on. A kernel call that runs on its caller alone calls it (RunOnCaller, parallel.h): the
  // step's next calls follow within tens of microseconds. Without it the o projection after the decode attention found its helper asleep: the q/k/v call's
  // end to the o call's start is ~57 us (RoPE, the KV cache update, attention), past the poll, and the helper then
  // joined the o call 41 us late (docs/DESIGN.md sec. 20.32). A helper polls at most kKeepAwakePolls poll times
  // after its last job, so a long run of small calls (a small model's step) does not keep it polling throughout.
  void KeepAwake();

 private:
  KernelHelpers(int64_t helpers, int64_t spin_micros);
  void Loop(int64_t index);

  std::mutex mu_;  // guards job_, job_helpers_; with cv_, the helpers' sleep
  std::condition_variable cv_;
  std::atomic<uint64_t> offers_{0};  // bumped by every Offer (under mu_)
  std::atomic<int64_t> sleepers_{0};
  std::atomic<int64_t> awake_until_ns_{0};  // KeepAwake's deadline (steady clock, nanoseconds since its epoch)
  std::function<void()> job_;
  int64_t job_helpers_ = 0;
  const int64_t spin_micros_;
  std::vector<std::thread> threads_;
};

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_KERNEL_HELPERS_H_
