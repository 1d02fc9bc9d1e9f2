// Parallel loops for the CPU kernels, on OpenMP — the same runtime torch uses.
//
// torch's CPU wheel ships libgomp.so.1 and loads it before our extension
// (the op wrappers import torch first). Our extension links against the same
// soname, so the dynamic loader hands us torch's copy: one OpenMP runtime,
// one team of threads that runs torch's GEMMs and our kernels in turn.
// An own thread pool (our first design) was measured to fight torch's
// spinning OpenMP workers for the two cores: bf16 decode ran at ~1 tok/s
// under that contention, and ~10x faster with a single runtime.
//
//   ThreadPool::instance().parallel_for(n, [&](int64_t i) { ... });
//
// runs fn(i) for i in [0, n) with dynamic scheduling; the calling thread
// works too. Calls from inside a parallel region, or with n == 1, run inline.
// Threads: PYENGINE_NUM_THREADS, else OpenMP's default (OMP_NUM_THREADS or
// the CPUs available); set_num_threads() changes it at run time.
#pragma once

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>

namespace pyengine {

class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool pool;
    return pool;
  }

  int num_threads() const { return num_threads_.load(std::memory_order_relaxed); }
  void set_num_threads(int n) { num_threads_.store(n < 1 ? 1 : n, std::memory_order_relaxed); }

  template <class F>
  void parallel_for(int64_t n, F&& fn) {
    if (n <= 0) return;
    const int threads = num_threads();
    if (n == 1 || threads == 1 || omp_in_parallel()) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) fn(i);
  }

 private:
  ThreadPool() {
    const char* env = std::getenv("PYENGINE_NUM_THREADS");
    const int n = env ? std::atoi(env) : 0;
    num_threads_.store(n >= 1 ? n : omp_get_max_threads());
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  std::atomic<int> num_threads_{1};
};

}  // namespace pyengine
