// The launcher thread of asynchronous layer stacks (LaunchLayerStack in swap_core.h).
//
// Why a C++ thread: a Python launcher thread cost a load's first copy the hand-off to it
// and the GIL it shares with the forward pass; this one takes a checked job and needs
// neither.  Jobs run strictly in launch order, so the stream sees each stack's fences and
// groups contiguously: another stack's wait never lands between two groups of one stack.
#include "swap_core.h"

#include <climits>
#include <deque>
#include <thread>

namespace fdkv {

class StackLauncher {
 public:
  StackLauncher() : thread_([this] { Loop(); }) {}

  ~StackLauncher() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // An idle launcher lets the caller enqueue the job's fences and first groups itself (no
  // thread hand-off before the first copy); the rest goes to the front of the queue, so
  // nothing launched meanwhile overtakes it.
  void Enqueue(std::unique_ptr<StackJob> job, int64_t inline_groups) {
    std::unique_lock<std::mutex> lock(mu_);
    if (inline_groups <= 0 || busy_ || !queue_.empty()) {
      queue_.push_back(std::move(job));
      lock.unlock();
      cv_.notify_all();
      return;
    }
    busy_ = true;
    lock.unlock();
    const bool finished = RunStackJob(*job, inline_groups, false);
    lock.lock();
    if (!finished) queue_.push_front(std::move(job));
    busy_ = false;
    lock.unlock();
    cv_.notify_all();
  }

  bool WaitIdle(int64_t timeout_us) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::microseconds(timeout_us < 0 ? 0 : timeout_us),
                        [&] { return !busy_ && queue_.empty(); });
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return !busy_ && (!queue_.empty() || stop_); });
      if (queue_.empty()) return;  // stopping, and nothing is left
      std::unique_ptr<StackJob> job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      RunStackJob(*job, INT64_MAX, false, true);
      job.reset();  // drops its progress reference off the lock
      lock.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<StackJob>> queue_;
  bool busy_ = false;  // a thread (this one or a launching caller) is enqueuing a job
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

StackLauncher* NewStackLauncher() { return new StackLauncher(); }

void DeleteStackLauncher(StackLauncher* launcher) { delete launcher; }

bool StackLauncherWaitIdle(StackLauncher* launcher, int64_t timeout_us) { return launcher->WaitIdle(timeout_us); }

void LauncherEnqueue(StackLauncher* launcher, std::unique_ptr<StackJob> job, int64_t inline_groups) {
  launcher->Enqueue(std::move(job), inline_groups);
}

}  // namespace fdkv
