// Intra-op parallelism of the CPU kernels: an OpenMP team pulling tile tasks from a shared queue.
//
// The library is compiled with OpenMP (CMakeLists.txt), the runtime LibTorch itself runs on, so
// inside the team the BLAS sees a parallel region and runs single-threaded, as under
// at::parallel_for. The queue hands out tasks one at a time instead of at::parallel_for's static
// split: causal tiles differ in cost by up to the number of key tiles. Without OpenMP (a compiler
// that lacks it) the tasks run on the calling thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

#include <ATen/Parallel.h>

namespace fox::cpu {

class TaskQueue {
 public:
  explicit TaskQueue(int64_t num_tasks) : num_tasks_(num_tasks) {}
  bool next(int64_t& task) {
    task = next_.fetch_add(1, std::memory_order_relaxed);
    return task < num_tasks_;
  }

 private:
  const int64_t num_tasks_;
  std::atomic<int64_t> next_{0};
};

// Calls worker(queue) once on each of up to at::get_num_threads() threads; the workers pull the
// task indices [0, num_tasks) from the queue. Each task must write its own outputs only. An
// exception thrown by a worker is rethrown on the calling thread (after the team has finished).
template <typename F>
void parallel_tasks(int64_t num_tasks, const F& worker) {
  if (num_tasks <= 0) return;
  TaskQueue queue(num_tasks);
  at::internal::lazy_init_num_threads();
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), num_tasks));
#ifdef _OPENMP
  if (threads > 1 && !at::in_parallel_region()) {
    std::atomic_flag failed = ATOMIC_FLAG_INIT;
    std::exception_ptr error;
#pragma omp parallel num_threads(threads)
    {
      try {
        worker(queue);
      } catch (...) {
        if (!failed.test_and_set()) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  worker(queue);
}

}  // namespace fox::cpu
