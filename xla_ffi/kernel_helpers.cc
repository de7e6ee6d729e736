#include "xla_ffi/kernel_helpers.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <utility>

#include "xla_ffi/common.h"
#include "xla_ffi/worker_pool.h"

namespace ft_jax {
namespace {

int64_t SteadyNanos(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// FT_JAX_HELPER_SPIN_US (checked at launch by ft_jax.kernels.environment_problem); the default when malformed.
int64_t SpinMicros() { return EnvInteger("FT_JAX_HELPER_SPIN_US", 0, kMaxHelperSpinMicros, kHelperSpinMicros); }

}  // namespace

KernelHelpers& KernelHelpers::Shared() {
  // Leaked on purpose, as WorkerPool::Shared.
  static KernelHelpers* helpers = new KernelHelpers(ProcessThreadCount() - 1, SpinMicros());
  return *helpers;
}

KernelHelpers::KernelHelpers(int64_t helpers, int64_t spin_micros) : spin_micros_(spin_micros) {
  for (int64_t i = 0; i < helpers; ++i) threads_.emplace_back([this, i] { Loop(i); });
}

void KernelHelpers::Offer(std::function<void()> job, int64_t helpers) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = std::move(job);
    job_helpers_ = helpers;
    offers_.fetch_add(1, std::memory_order_release);
  }
  // A helper that is about to sleep counts itself under mu_ before it checks offers_, so none is missed.
  if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
}

void KernelHelpers::KeepAwake() {
  awake_until_ns_.store(SteadyNanos(std::chrono::steady_clock::now()) + spin_micros_ * 1000,
                        std::memory_order_relaxed);
}

void KernelHelpers::Loop(int64_t index) {
  const auto spin = std::chrono::microseconds(spin_micros_);
  uint64_t seen = 0;
  auto idle_since = std::chrono::steady_clock::now();
  for (;;) {
    if (offers_.load(std::memory_order_acquire) != seen) {
      std::function<void()> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = offers_.load(std::memory_order_relaxed);
        if (index < job_helpers_) job = job_;
      }
      if (job) job();
      idle_since = std::chrono::steady_clock::now();
      continue;
    }
    for (int i = 0; i < 64 && offers_.load(std::memory_order_relaxed) == seen; ++i) CpuRelax();
    const auto now = std::chrono::steady_clock::now();
    if (offers_.load(std::memory_order_relaxed) != seen || now - idle_since < spin ||
        (SteadyNanos(now) < awake_until_ns_.load(std::memory_order_relaxed) &&
         now - idle_since < kKeepAwakePolls * spin)) {
      continue;
    }
    std::unique_lock<std::mutex> lock(mu_);
    sleepers_.fetch_add(1, std::memory_order_acq_rel);
    cv_.wait(lock, [&] { return offers_.load(std::memory_order_acquire) != seen; });
    sleepers_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace ft_jax
