// WorkerPool: a fixed set of CPU threads for work handed over from outside XLA's own thread pools (the CUDA
// host_experts path: a cudaLaunchHostFunc node schedules the host expert GEMV here and returns at once). Sized from
// the process's CPU affinity (what taskset / cgroup cpusets allow), capped by FT_JAX_NUM_THREADS; idle workers sleep
// on a condition variable. num_threads() matches xla::ffi::ThreadPool's, so ParallelFor takes either for its thread
// count.
#ifndef FT_JAX_XLA_FFI_WORKER_POOL_H_
#define FT_JAX_XLA_FFI_WORKER_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ft_jax {

// Threads the process's CPU work uses: the CPUs it may run on (sched_getaffinity; 1 if the call fails or on other
// systems), capped by FT_JAX_NUM_THREADS. The size of WorkerPool::Shared, and the caller plus the kernel helpers.
int64_t ProcessThreadCount();

class WorkerPool {
 public:
  explicit WorkerPool(int64_t num_threads);  // num_threads >= 1
  ~WorkerPool();                             // finishes the queued tasks, then joins the workers
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // The process-wide pool: ProcessThreadCount() threads, started on first use.
  static WorkerPool& Shared();

  int64_t num_threads() const { return static_cast<int64_t>(threads_.size()); }
  // Queues f to run on a worker; never runs it on the caller (the caller may be a CUDA host-function thread).
  void Schedule(std::function<void()> f);

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_WORKER_POOL_H_
