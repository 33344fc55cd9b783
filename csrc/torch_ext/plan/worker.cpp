// The background worker: one thread that builds the plans of queued buckets, one at a time, and
// swaps each into the cache (background_builds); and what fork() does to it.
#include "torch_ext/plan/plan.h"

#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "torch_ext/common/wait.h"

namespace torch_ext::plan {

namespace {

std::exception_ptr error(const std::string& message) { return std::make_exception_ptr(c10::Error(message)); }

}  // namespace

void PlanCache::enqueue_build(const Bucket& bucket, std::vector<c10::IValue> example) {
  check_usable("infer");
  auto promise = std::make_shared<std::promise<std::shared_ptr<Plan>>>();
  {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    if (plans_.count(bucket) || pending_.count(bucket)) return;
    pending_.emplace(bucket, promise->get_future().share());
  }
  {
    std::lock_guard<std::mutex> lock(worker_mutex_);
    queue_.push_back(Job{bucket.vec(), std::move(example), std::move(promise)});
  }
  worker_cv_.notify_one();
}

void PlanCache::build_job(Job& job) {
  const Bucket bucket = Bucket::of(job.bucket);
  try {
    // No capture on this thread: a capture fails device-wide synchronisations in other
    // threads (a CUDA rule), and request threads may be synchronising right now.
    auto plan = build_plan(bucket, job.example, /*background=*/true);
    remember_example(job.example);
    insert_plan(plan);
    job.promise->set_value(plan);
  } catch (...) {
    {
      std::unique_lock<std::shared_mutex> cache_lock(mutex_);
      pending_.erase(bucket);
    }
    build_failures_.fetch_add(1, std::memory_order_relaxed);
    job.promise->set_exception(std::current_exception());
  }
}

void PlanCache::worker_loop() {
  at::init_num_threads();  // builds warm up and time plans with torch's intra-op thread count
  std::unique_lock<std::mutex> lock(worker_mutex_);
  while (true) {
    // A predicate wait: a job pushed (under worker_mutex_) before this wait is seen by the
    // predicate, one pushed after it notifies, so no wake-up is lost; the slices only bound
    // each wait, the thread idles here until it has work or is stopped.
    while (!worker_cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stopping_ || !queue_.empty(); })) {
    }
    if (stopping_) break;
    running_ = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    build_job(*running_);
    lock.lock();
    running_.reset();
    if (queue_.empty()) idle_cv_.notify_all();
  }
  // Buckets still queued are never built: forget them and fail whoever waits for them.
  std::unique_lock<std::shared_mutex> cache_lock(mutex_);
  for (auto& job : queue_) {
    pending_.erase(Bucket::of(job.bucket));
    job.promise->set_exception(error("PlanCache: the cache was destroyed before the plan for bucket " +
                                     Bucket::of(job.bucket).str() + " was built"));
  }
  queue_.clear();
  idle_cv_.notify_all();
}

void PlanCache::wait_for_builds(double timeout_seconds) {
  recover_after_fork();
  check_usable("wait_for_builds");
  const double limit = timeout_seconds < 0 ? options_.timeout_seconds : timeout_seconds;
  // The worker notifies idle_cv_ under worker_mutex_ whenever the queue drains, so the
  // predicate sees every change; the deadline bounds a build that never ends.
  const bool idle = wait_until(worker_mutex_, idle_cv_, deadline_after(limit),
                               [this] { return (queue_.empty() && !running_) || stopping_; });
  if (idle) return;
  std::lock_guard<std::mutex> lock(worker_mutex_);
  TORCH_CHECK(false, "PlanCache.wait_for_builds: builds still ", running_ ? "running" : "queued", " after ", limit,
              " s (", queue_.size(), " queued", running_ ? ", bucket " + Bucket::of(running_->bucket).str() + " building" : "",
              "); pass a longer timeout");
}

void PlanCache::stop_worker() {
  if (forked_.load(std::memory_order_relaxed)) {
    // A forked child: the worker is the parent's thread, absent here; its handle is dropped, never
    // joined (joining a thread that does not exist would never return).
    (void)worker_.release();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(worker_mutex_);
    stopping_ = true;
  }
  worker_cv_.notify_all();
  source_->cancel_builds();  // a compile in progress gives up rather than make the join wait for it
  if (worker_ && worker_->joinable()) blocking_section([this] { worker_->join(); });
}

void PlanCache::fork_prepare() {
  // Held across fork(), so the child's copies are never held by a thread it does not have. No
  // lock here is held while code that may fork runs (builds and callbacks run outside them).
  worker_mutex_.lock();
  mutex_.lock();
}

void PlanCache::fork_parent() {
  mutex_.unlock();
  worker_mutex_.unlock();
}

void PlanCache::fork_child() {
  // Made afresh rather than unlocked: glibc's rwlock knows its writer by thread id, which fork
  // changes, so an unlock here would be taken for a reader's and leave it locked. No thread of
  // the child holds or waits on any of them.
  new (&mutex_) std::shared_mutex();
  new (&worker_mutex_) std::mutex();
  new (&worker_cv_) std::condition_variable();
  new (&idle_cv_) std::condition_variable();
  if (worker_ || !pending_.empty()) forked_.store(true, std::memory_order_relaxed);
}

void PlanCache::recover_after_fork() {
  if (!forked_.load(std::memory_order_relaxed) || recovered_.exchange(true)) return;
  // The builds the parent's threads were running or had queued never finish here: fail their
  // waiters (with an error, not a hang) and forget them, so this process may build them itself.
  std::unique_lock<std::mutex> worker_lock(worker_mutex_);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  const auto failure = error("PlanCache: this plan was being built by a thread of the process this one was forked "
                             "from; that thread does not exist here");
  if (running_) running_->promise->set_exception(failure);
  for (auto& job : queue_) job.promise->set_exception(failure);
  running_.reset();
  queue_.clear();
  pending_.clear();  // also the builds of request threads of the parent: no thread here fulfils them
  stopping_ = true;
}

}  // namespace torch_ext::plan
