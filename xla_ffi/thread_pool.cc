#include "xla_ffi/thread_pool.h"

#include <pthread.h>

#include <chrono>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FT_JAX_CPU_RELAX() _mm_pause()
#else
#define FT_JAX_CPU_RELAX() std::this_thread::yield()
#endif

namespace ft_jax {

namespace {
// Workers spin this long for the next job before sleeping: consecutive MoE layers call the kernel within
// microseconds, and a condition-variable wake-up costs tens of microseconds.
constexpr auto kSpin = std::chrono::microseconds(50);

int DefaultThreads() {
  if (const char* env = std::getenv("FT_JAX_NUM_THREADS")) {
    int n = std::atoi(env);
    if (n >= 1) return n;
  }
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}
}  // namespace

namespace {
std::atomic<ThreadPool*> global_pool{nullptr};

// A forked child has none of the parent's worker threads: drop (leak) the parent's pool so the child starts a
// fresh one on first use instead of waiting forever for workers that do not exist.
void ForgetPoolInChild() { global_pool.store(nullptr, std::memory_order_release); }
}  // namespace

ThreadPool& ThreadPool::Global() {
  // Leaked on purpose: joining threads during static destruction at interpreter exit can deadlock.
  ThreadPool* pool = global_pool.load(std::memory_order_acquire);
  if (pool != nullptr) return *pool;
  static const bool atfork_registered = pthread_atfork(nullptr, nullptr, ForgetPoolInChild) == 0;
  (void)atfork_registered;
  auto* fresh = new ThreadPool(DefaultThreads());
  if (global_pool.compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;  // another thread won the race
  return *pool;
}

ThreadPool::ThreadPool(int num_threads) { StartWorkers(num_threads < 1 ? 0 : num_threads - 1); }

ThreadPool::~ThreadPool() { StopWorkers(); }

int ThreadPool::num_threads() const { return num_workers_.load(std::memory_order_relaxed) + 1; }

void ThreadPool::Resize(int num_threads) {
  std::lock_guard<std::mutex> run_lock(run_mu_);
  StopWorkers();
  StartWorkers(num_threads < 1 ? 0 : num_threads - 1);
}

void ThreadPool::StartWorkers(int num_workers) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = false;
  }
  workers_.reserve(num_workers);
  // Each worker starts from the generation current now, not the one it reads once it gets scheduled: a worker
  // thread that starts late would otherwise read a generation a ParallelFor already published, never run it, and
  // leave active_workers_ > 0 (that ParallelFor then waits forever).
  const uint64_t start_generation = generation_.load(std::memory_order_acquire);
  for (int i = 0; i < num_workers; ++i) {
    workers_.emplace_back([this, start_generation] { WorkerLoop(start_generation); });
  }
  num_workers_.store(num_workers, std::memory_order_relaxed);
}

void ThreadPool::StopWorkers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
  num_workers_.store(0, std::memory_order_relaxed);
}

void ThreadPool::RunTasks() {
  const auto& fn = *fn_;
  for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n_;
       i = next_.fetch_add(1, std::memory_order_relaxed)) {
    fn(i);
  }
}

void ThreadPool::WorkerLoop(uint64_t seen) {
  while (true) {
    // Spin briefly, then sleep until the generation changes.
    auto deadline = std::chrono::steady_clock::now() + kSpin;
    while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < deadline) {
      FT_JAX_CPU_RELAX();
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      if (stop_) return;
      seen = generation_.load(std::memory_order_acquire);
    }
    RunTasks();
    if (active_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_one();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  std::unique_lock<std::mutex> run_lock(run_mu_, std::try_to_lock);
  if (!run_lock.owns_lock() || n <= 1 || workers_.empty()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    active_workers_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_cv_.notify_all();
  RunTasks();
  // Wait for every worker to leave RunTasks (they may still hold fn_): spin briefly, then sleep.
  auto deadline = std::chrono::steady_clock::now() + kSpin;
  while (active_workers_.load(std::memory_order_acquire) != 0 && std::chrono::steady_clock::now() < deadline) {
    FT_JAX_CPU_RELAX();
  }
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return active_workers_.load(std::memory_order_acquire) == 0; });
}

}  // namespace ft_jax
