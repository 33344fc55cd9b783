#pragma once
// BuildWorker: one thread that runs queued jobs (a plan cache's background builds) one at a time,
// oldest first. It owns its lock, condition variable and thread and knows nothing of plans.
// A job that will never run is abandoned instead: its `abandon` is called with an error saying
// why (the worker stopped; or, in a forked child, where the worker's thread does not exist, the
// jobs the parent queued or was running, on the child's first call that recovers).
//
// Thread safety: every member may be called from any thread. Jobs and abandon callbacks run with
// no lock of the worker held. Every wait is bounded. Fork: a ForkParticipant.
#include <atomic>
#include <cstdint>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "torch_ext/common/fork.h"
#include "torch_ext/common/wait.h"

namespace torch_ext::plan {

class BuildWorker final : private ForkParticipant {
 public:
  struct Job {
    std::string what;                                    // names the job in messages ("bucket 8 x 64")
    std::function<void()> run;                           // must not throw (report errors through the job)
    std::function<void(std::exception_ptr)> abandon;     // the job will never run
  };

  BuildWorker();  // starts the thread
  ~BuildWorker();
  BuildWorker(const BuildWorker&) = delete;
  BuildWorker& operator=(const BuildWorker&) = delete;

  // Queues a job; raises once the worker is stopped or in a forked child.
  void push(Job job);
  // Waits until nothing is queued or running, or `deadline`; false when that passes first.
  bool wait_idle(WaitClock::time_point deadline);
  // What a wait that timed out waited for.
  struct Snapshot {
    int64_t queued = 0;
    std::optional<std::string> running;  // the running job's `what`
  };
  Snapshot snapshot() const;
  // Abandons the queued jobs, waits for a running one, joins the thread. Idempotent.
  void stop();
  // In a forked child: abandons (once) the jobs the parent had queued or was running. Returns
  // whether this process is such a child.
  bool recover_after_fork();

 private:
  void loop();
  void fork_prepare() override;
  void fork_parent() override;
  void fork_child() override;

  mutable std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::deque<Job> queue_;       // guarded by mutex_
  std::optional<Job> running_;  // guarded by mutex_: the job the thread runs, so a forked child can abandon it
  bool stopping_ = false;       // guarded by mutex_
  std::unique_ptr<std::thread> thread_;
  std::atomic<bool> forked_{false};
  std::atomic<bool> recovered_{false};
};

}  // namespace torch_ext::plan
