// Intra-op parallelism of the CPU kernels.
//
// at::parallel_for is a header template that only parallelizes in code compiled with -fopenmp.
// This library is compiled without it, so there at::parallel_for ran every range on the calling
// thread, and the BLAS (outside any parallel region) spread each small tile product over all
// cores: the kernels ran on one core plus OpenMP barrier overhead. So the kernels start the
// OpenMP team themselves, through the entry point that `#pragma omp parallel` compiles to
// (GOMP_parallel: libgomp, which LibTorch loads, or libomp's GNU compatibility layer). Inside the
// team the BLAS runs single-threaded, exactly as under a working at::parallel_for. Without that
// runtime (the weak symbol is null) the tasks run on the calling thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

#include <ATen/Parallel.h>

extern "C" void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads,
                              unsigned flags) __attribute__((weak));

namespace fox::cpu {

// Tasks handed out one at a time: the causal tiles differ in cost by up to the number of key
// tiles, so a static split of the task range can leave one core idle for a large fraction.
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
// task indices [0, num_tasks) from the queue. Each task must write its own outputs only.
template <typename F>
void parallel_tasks(int64_t num_tasks, const F& worker) {
  if (num_tasks <= 0) return;
  TaskQueue queue(num_tasks);
  at::internal::lazy_init_num_threads();
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  if (threads <= 1 || at::in_parallel_region() || GOMP_parallel == nullptr) {
    worker(queue);
    return;
  }
  struct Team {
    const F* worker;
    TaskQueue* queue;
    std::atomic_flag failed = ATOMIC_FLAG_INIT;
    std::exception_ptr error;
  } team{&worker, &queue};
  GOMP_parallel(
      [](void* data) {
        auto* t = static_cast<Team*>(data);
        try {
          (*t->worker)(*t->queue);
        } catch (...) {
          if (!t->failed.test_and_set()) t->error = std::current_exception();
        }
      },
      &team, static_cast<unsigned>(threads), 0);
  if (team.error) std::rethrow_exception(team.error);
}

}  // namespace fox::cpu
