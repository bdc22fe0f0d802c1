#include "zcore/thread_pool.h"

#include <unistd.h>

#include <atomic>
#include <cfenv>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace zcore {
namespace {

// Persistent workers that sleep on a condition variable between jobs. One job
// at a time: `run_mutex_` serialises callers. The pool is never destroyed
// (workers blocked in wait() must not be joined during static destruction),
// and a child process after fork() starts a fresh pool of its own: the
// parent's workers do not exist there.
class Pool {
 public:
  void run(std::int64_t count, int threads, const std::function<void(std::int64_t)>& task) {
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    const int helpers = threads - 1;
    std::unique_lock<std::mutex> lock(mutex_);
    grow(helpers);
    task_ = &task;
    count_ = count;
    next_.store(0);
    // The caller's rounding mode and flush-to-zero setting apply to every
    // task, whichever thread runs it.
    std::fegetenv(&fenv_);
    wanted_ = helpers;
    joined_ = 0;
    running_ = 0;
    ++generation_;
    lock.unlock();
    wake_.notify_all();
    work();
    lock.lock();
    // Helpers that have not woken up by now would find no task left: close
    // the job to them instead of waiting for them to wake.
    wanted_ = joined_;
    done_.wait(lock, [this] { return running_ == 0; });
    task_ = nullptr;
  }

 private:
  void grow(int helpers) {
    if (owner_pid_ != getpid()) {
      // After fork(): the std::thread objects name threads of the parent.
      // They can be neither joined nor destroyed, so they are abandoned.
      new std::vector<std::thread>(std::move(workers_));
      workers_.clear();
      owner_pid_ = getpid();
    }
    while (static_cast<int>(workers_.size()) < helpers) {
      workers_.emplace_back([this, gen = generation_] { loop(gen); });
    }
  }

  void work() {
    for (std::int64_t i = next_.fetch_add(1); i < count_; i = next_.fetch_add(1)) (*task_)(i);
  }

  void loop(std::uint64_t seen) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (joined_ >= wanted_) continue;  // this job wants fewer helpers
      ++joined_;
      ++running_;
      lock.unlock();
      std::fenv_t saved;
      std::fegetenv(&saved);
      std::fesetenv(&fenv_);
      work();
      std::fesetenv(&saved);
      lock.lock();
      if (--running_ == 0) done_.notify_one();
    }
  }

  std::mutex run_mutex_;
  std::mutex mutex_;  // guards everything below except next_
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  pid_t owner_pid_ = getpid();
  std::uint64_t generation_ = 0;
  const std::function<void(std::int64_t)>* task_ = nullptr;
  std::int64_t count_ = 0;
  std::atomic<std::int64_t> next_{0};
  std::fenv_t fenv_{};
  int wanted_ = 0;   // helpers this job wants
  int joined_ = 0;   // helpers that have taken it
  int running_ = 0;  // helpers that have taken it and not finished
};

Pool& pool() {
  static Pool* const instance = new Pool();
  return *instance;
}

}  // namespace

void parallel_for(std::int64_t count, int threads, const std::function<void(std::int64_t)>& task) {
  if (count <= 0) return;
  const std::int64_t useful = threads < count ? threads : count;
  if (useful <= 1) {
    for (std::int64_t i = 0; i < count; ++i) task(i);
    return;
  }
  pool().run(count, static_cast<int>(useful), task);
}

}  // namespace zcore
