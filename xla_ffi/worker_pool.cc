#include "xla_ffi/worker_pool.h"

#include "xla_ffi/common.h"

#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <utility>

namespace ft_jax {

int64_t ProcessThreadCount() {
  int64_t cpus = 1;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = std::max(CPU_COUNT(&set), 1);
#endif
  return NumThreadsCap() ? std::min(cpus, NumThreadsCap()) : cpus;
}

WorkerPool::WorkerPool(int64_t num_threads) {
  threads_.reserve(static_cast<size_t>(std::max<int64_t>(num_threads, 1)));
  for (int64_t i = 0; i < std::max<int64_t>(num_threads, 1); ++i) threads_.emplace_back([this] { Loop(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

WorkerPool& WorkerPool::Shared() {
  // Leaked on purpose: host-function nodes of executables that outlive static destruction may still schedule.
  static WorkerPool* pool = new WorkerPool(ProcessThreadCount());
  return *pool;
}

void WorkerPool::Schedule(std::function<void()> f) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(f));
  }
  cv_.notify_one();
}

void WorkerPool::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace ft_jax
