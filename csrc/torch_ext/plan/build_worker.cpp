// The build worker's thread, its stop, and what fork() does to it.
#include "torch_ext/plan/build_worker.h"

#include <chrono>
#include <new>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "torch_ext/common/thread_name.h"

namespace torch_ext::plan {

namespace {

void abandon_all(std::vector<BuildWorker::Job>& jobs, const std::string& why) {
  for (auto& job : jobs) {
    if (job.abandon) job.abandon(std::make_exception_ptr(c10::Error(why + " (" + job.what + ")")));
  }
}

}  // namespace

BuildWorker::BuildWorker() {
  register_fork_participant(this);
  thread_ = std::make_unique<std::thread>([this] { loop(); });
}

BuildWorker::~BuildWorker() {
  unregister_fork_participant(this);
  stop();
}

void BuildWorker::push(Job job) {
  TORCH_CHECK(!forked_.load(std::memory_order_relaxed), "BuildWorker: this process was forked from the one that made "
              "the worker, whose thread a forked child does not have");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stopping_, "BuildWorker: stopped; ", job.what, " is not queued");
    queue_.push_back(std::move(job));
  }
  work_cv_.notify_one();
}

void BuildWorker::loop() {
  name_this_thread("torch_ext build");
  at::init_num_threads();  // jobs compute with torch's intra-op thread count
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    // A predicate wait: a job pushed before it is seen, one pushed after it notifies; the slices
    // only bound each wait.
    while (!work_cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stopping_ || !queue_.empty(); })) {
    }
    if (stopping_) break;
    running_ = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    running_->run();  // running_ is only reset by this thread (or a forked child, where it is absent)
    lock.lock();
    running_.reset();
    if (queue_.empty()) idle_cv_.notify_all();
  }
  std::vector<Job> left(std::make_move_iterator(queue_.begin()), std::make_move_iterator(queue_.end()));
  queue_.clear();
  idle_cv_.notify_all();
  lock.unlock();
  abandon_all(left, "PlanCache: the cache was destroyed before this plan was built");
}

bool BuildWorker::wait_idle(WaitClock::time_point deadline) {
  return wait_until(mutex_, idle_cv_, deadline, [this] { return (queue_.empty() && !running_) || stopping_; });
}

BuildWorker::Snapshot BuildWorker::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  Snapshot out;
  out.queued = static_cast<int64_t>(queue_.size());
  if (running_) out.running = running_->what;
  return out;
}

void BuildWorker::stop() {
  if (forked_.load(std::memory_order_relaxed)) {
    // A forked child: the thread is the parent's, absent here; its handle is dropped, never joined.
    (void)thread_.release();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  if (thread_ && thread_->joinable()) blocking_section([this] { thread_->join(); });
  thread_.reset();
}

bool BuildWorker::recover_after_fork() {
  if (!forked_.load(std::memory_order_relaxed)) return false;
  if (recovered_.exchange(true)) return true;
  std::vector<Job> left;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (running_) left.push_back(std::move(*running_));
    for (auto& job : queue_) left.push_back(std::move(job));
    running_.reset();
    queue_.clear();
    stopping_ = true;
  }
  abandon_all(left, "PlanCache: this plan was being built by a thread of the process this one was forked from; "
                    "that thread does not exist here");
  return true;
}

void BuildWorker::fork_prepare() { mutex_.lock(); }

void BuildWorker::fork_parent() { mutex_.unlock(); }

void BuildWorker::fork_child() {
  new (&mutex_) std::mutex();  // made afresh: the parent's forking thread holds it
  new (&work_cv_) std::condition_variable();
  new (&idle_cv_) std::condition_variable();
  forked_.store(true, std::memory_order_relaxed);
}

}  // namespace torch_ext::plan
