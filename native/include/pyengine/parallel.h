// A small persistent thread pool for the CPU kernels.
//
// Why not OpenMP: torch's CPU wheel ships its own libgomp. A second OpenMP
// runtime in the same process brings a second team of threads that spin
// after each region and fight torch's team for the same cores. One pool of
// our own, whose workers spin only briefly before sleeping, shares the
// machine with torch instead.
//
//   ThreadPool::instance().parallel_for(n, [&](int64_t i) { ... });
//
// runs fn(i) for i in [0, n) with dynamic scheduling (an atomic counter);
// the calling thread works too. Calls from inside a parallel region, or
// with n == 1, run inline. Concurrent callers are serialized.
// Size: PYENGINE_NUM_THREADS, else the CPUs this process may run on.
#pragma once

#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define PYENGINE_CPU_RELAX() _mm_pause()
#else
#define PYENGINE_CPU_RELAX() std::this_thread::yield()
#endif

namespace pyengine {

class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool pool;
    return pool;
  }

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  void set_num_threads(int n) {
    std::lock_guard<std::mutex> call_lock(call_mutex_);
    stop_workers();
    start_workers(n < 1 ? 1 : n);
  }

  template <class F>
  void parallel_for(int64_t n, F&& fn) {
    if (n <= 0) return;
    if (n == 1 || workers_.empty() || in_region()) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    using Fn = std::remove_reference_t<F>;
    std::lock_guard<std::mutex> call_lock(call_mutex_);
    invoke_ = [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); };
    ctx_ = const_cast<void*>(static_cast<const void*>(&fn));
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_cv_.notify_all();
    in_region() = true;
    run_items();
    in_region() = false;
    while (pending_.load(std::memory_order_acquire) != 0) PYENGINE_CPU_RELAX();
  }

  ~ThreadPool() { stop_workers(); }

 private:
  ThreadPool() { start_workers(default_threads()); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  static int default_threads() {
    if (const char* env = std::getenv("PYENGINE_NUM_THREADS")) {
      int n = std::atoi(env);
      if (n >= 1) return n;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
    unsigned hw = std::thread::hardware_concurrency();
    return hw ? static_cast<int>(hw) : 1;
  }

  static bool& in_region() {
    static thread_local bool flag = false;
    return flag;
  }

  void run_items() {
    for (int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n_;) invoke_(ctx_, i);
  }

  // `seen` is the generation at spawn time: read inside the thread it could already include a
  // region started meanwhile, whose pending_ count would then never drop (deadlock at first use).
  void worker_loop(uint64_t seen) {
    in_region() = true;
    for (;;) {
      // Spin briefly (kernels come in bursts within a layer), then sleep.
      for (int spin = 0; spin < kSpinIters && generation_.load(std::memory_order_acquire) == seen; ++spin)
        PYENGINE_CPU_RELAX();
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(wake_mutex_);
        wake_cv_.wait(lock, [&] { return stop_ || generation_.load(std::memory_order_acquire) != seen; });
      }
      if (stop_) return;
      seen = generation_.load(std::memory_order_acquire);
      run_items();
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  void start_workers(int total_threads) {
    stop_.store(false);
    const uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int t = 1; t < total_threads; ++t) workers_.emplace_back([this, gen] { worker_loop(gen); });
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      stop_.store(true);
    }
    wake_cv_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }

  static constexpr int kSpinIters = 20000;  // ~ tens of microseconds of pause

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;
  std::mutex wake_mutex_;
  std::condition_variable wake_cv_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> pending_{0};
  int64_t n_ = 0;
  void (*invoke_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
};

}  // namespace pyengine
