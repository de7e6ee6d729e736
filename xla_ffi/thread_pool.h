// Persistent worker pool for the host expert kernels.
//
// ParallelFor(n, fn) runs fn(0..n-1) on the workers and the calling thread and returns when all tasks are done.
// Tasks are handed out dynamically, so callers must make every task write disjoint outputs with a fixed order of
// arithmetic; then results do not depend on which thread ran which task (the expert kernel relies on this for
// determinism). If the pool is busy with another caller (two XLA threads at once), the second caller runs its tasks
// itself rather than waiting.
#ifndef FT_JAX_XLA_FFI_THREAD_POOL_H_
#define FT_JAX_XLA_FFI_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ft_jax {

class ThreadPool {
 public:
  // Process-wide pool. Size: env FT_JAX_NUM_THREADS if set (>= 1), else std::thread::hardware_concurrency().
  static ThreadPool& Global();

  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Threads that execute tasks, counting the caller.
  int num_threads() const;
  // Stops the workers and starts num_threads - 1 new ones (num_threads >= 1). Not safe while a ParallelFor runs.
  void Resize(int num_threads);
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void StartWorkers(int num_workers);
  void StopWorkers();
  void WorkerLoop(uint64_t seen);  // seen: the generation at StartWorkers
  void RunTasks();

  std::mutex run_mu_;  // held by the caller that owns the pool for one ParallelFor
  std::mutex mu_;
  std::condition_variable wake_cv_;
  std::condition_variable done_cv_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
  std::atomic<uint64_t> generation_{0};
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  std::atomic<int> active_workers_{0};
  std::atomic<int> num_workers_{0};  // workers_.size(), readable without run_mu_
};

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_THREAD_POOL_H_
