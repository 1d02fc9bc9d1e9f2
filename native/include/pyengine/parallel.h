// Parallel loops for the CPU kernels: a small pool whose calling thread never waits for a helper
// that has not started.
//
//   ThreadPool::instance().parallel_for(n, [&](int64_t i) { ... });
//
// runs fn(i) for i in [0, n), the calling thread and num_threads() - 1 helper threads taking items
// in turn from a shared counter. The call returns once every item is done: it waits only for items a
// helper has taken and not finished, never for a helper to wake up. Calls from inside a parallel_for
// (or from inside an OpenMP region of torch's), with n == 1, or while another thread's parallel_for
// is running, run inline. Threads: PYENGINE_NUM_THREADS, else OpenMP's default (OMP_NUM_THREADS or
// the CPUs available); set_num_threads() changes it at run time.
//
// Why not an OpenMP loop (our previous design, on torch's libgomp team): an OpenMP region ends in a
// barrier that every team thread must reach, so each of the ~300 loops of a prompt step waits until
// the OS runs every helper. Where the cores are shared (another process, the server's event loop),
// a helper is often off its core, and a prompt step on 2 threads ran several times slower than on 1
// (docs/performance.md, "thread pool"). Here the calling thread takes the items no helper has taken, so a step is never slower than
// on one thread. Helpers spin for kSpin after their last item (the next loop of a step starts within
// microseconds), then sleep: a short spin, as libgomp's GOMP_SPINCOUNT=10000 that pyengine sets for
// torch's own team (pyengine/__init__.py), so neither starves the other of the cores.
#pragma once

#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>

namespace pyengine {

class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool* pool = new ThreadPool;  // never destroyed: its helpers run until the process exits
    return *pool;
  }

  int num_threads() const { return num_threads_.load(std::memory_order_relaxed); }
  void set_num_threads(int n) { num_threads_.store(n < 1 ? 1 : n, std::memory_order_relaxed); }

  template <class F>
  void parallel_for(int64_t n, F&& fn) {
    if (n <= 0) return;
    const int threads = num_threads();
    if (n == 1 || threads == 1 || n > kMaxItems || in_loop() || omp_in_parallel() || busy_.test_and_set()) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    struct Release {
      std::atomic_flag& flag;
      ~Release() { flag.clear(std::memory_order_release); }
    } release{busy_};
    using Fn = std::remove_reference_t<F>;
    run(n, static_cast<int>(std::min<int64_t>(threads, n)) - 1,
        [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); }, const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using Call = void (*)(void*, int64_t);
  static constexpr int64_t kMaxItems = 0xffffffff;  // the item counter is the claim word's low 32 bits
  static constexpr std::chrono::microseconds kSpin{50};

  ThreadPool() {
    const char* env = std::getenv("PYENGINE_NUM_THREADS");
    const int n = env ? std::atoi(env) : 0;
    num_threads_.store(n >= 1 ? n : omp_get_max_threads());
    pthread_atfork(nullptr, nullptr, [] { instance().after_fork(); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  static bool& in_loop() {
    static thread_local bool inside = false;
    return inside;
  }

  // The calling thread's side of a loop over n items with `helpers` helper threads.
  void run(int64_t n, int helpers, Call call, void* ctx) {
    while (spawned_ < helpers) std::thread([this, id = spawned_++] { helper(id); }).detach();
    // All seq_cst: a helper that read the last loop's claim word and this loop's n_ fails its CAS
    // (the claim word is 0, generation 0 is never used, before n_ changes).
    claim_.store(0);
    call_.store(call);
    ctx_.store(ctx);
    n_.store(n);
    helpers_.store(helpers);
    done_.store(0);
    error_ = nullptr;
    if (++gen_counter_ == 0) ++gen_counter_;
    const uint32_t g = gen_counter_;
    claim_.store(static_cast<uint64_t>(g) << 32);
    gen_.store(g);  // against helper()'s sleepers_: a sleeping helper is woken, or sees g
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    work(g);
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {  // items helpers hold
      if (spins < 1024) _mm_pause();
      else sched_yield();  // the helper may be waiting for this core
    }
    if (error_) std::rethrow_exception(error_);
  }

  // Takes and runs items of loop g until none is left (or the loop is over).
  void work(uint32_t g) {
    in_loop() = true;
    for (uint64_t c = claim_.load();;) {
      // n_, call_ and ctx_ are loop g's while an item of it is untaken: the caller waits for all of them
      if (c >> 32 != g || static_cast<int64_t>(c & 0xffffffff) >= n_.load()) break;
      if (!claim_.compare_exchange_weak(c, c + 1)) continue;
      try {
        call_.load()(ctx_.load(), static_cast<int64_t>(c & 0xffffffff));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_release);
      c = claim_.load();
    }
    in_loop() = false;
  }

  void helper(int id) {
    uint32_t seen = gen_.load();
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      for (int i = 0; gen_.load(std::memory_order_acquire) == seen; ++i) {
        _mm_pause();
        if (i % 64 == 63 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mutex_);
          ++sleepers_;
          wake_.wait(lock, [&] { return gen_.load() != seen; });
          --sleepers_;
        }
      }
      seen = gen_.load(std::memory_order_acquire);
      if (id < helpers_.load(std::memory_order_relaxed)) work(seen);
    }
  }

  // In a forked child only the forking thread exists: forget the helpers (new ones start on demand)
  // and the locks they may have held.
  void after_fork() {
    new (&mutex_) std::mutex;
    new (&wake_) std::condition_variable;
    sleepers_.store(0);
    spawned_ = 0;
    busy_.clear();
  }

  std::atomic<int> num_threads_{1};
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;  // a loop is running (held by its calling thread)
  int spawned_ = 0;                           // helpers started (the calling thread holds busy_)
  uint32_t gen_counter_ = 0;
  // The current loop: published by gen_ (helpers wait for it to change); claim_ = (generation << 32)
  // | next item; done_ counts finished items.
  std::atomic<Call> call_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> n_{0};
  std::atomic<int> helpers_{0};
  std::atomic<uint32_t> gen_{0};
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::exception_ptr error_;  // the loop's first exception (under mutex_), rethrown by its caller
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace pyengine
