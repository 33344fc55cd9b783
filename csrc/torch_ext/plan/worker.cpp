// The background worker: one thread that builds the plans of queued sizes, one at a time, and
// swaps each into the cache (background_builds).
#include "torch_ext/plan/plan_cache.h"

#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <c10/util/Exception.h>

namespace torch_ext::plan {

void PlanCache::enqueue_build(int64_t batch_size, std::vector<c10::IValue> example) {
  auto promise = std::make_shared<std::promise<std::shared_ptr<Plan>>>();
  {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    if (plans_.count(batch_size) || pending_.count(batch_size)) return;
    pending_.emplace(batch_size, promise->get_future().share());
  }
  {
    std::lock_guard<std::mutex> lock(worker_mutex_);
    queue_.push_back(Job{batch_size, std::move(example), std::move(promise)});
  }
  worker_cv_.notify_one();
}

void PlanCache::worker_loop() {
  std::unique_lock<std::mutex> lock(worker_mutex_);
  while (true) {
    worker_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_) break;
    Job job = std::move(queue_.front());
    queue_.pop_front();
    worker_busy_ = true;
    lock.unlock();
    try {
      // No capture on this thread: a capture fails device-wide synchronisations in other
      // threads (a CUDA rule), and request threads may be synchronising right now.
      auto plan = build_plan(job.batch_size, job.example);
      remember_example(job.example, job.batch_size);
      insert_plan(plan);
      job.promise->set_value(plan);
    } catch (...) {
      {
        std::unique_lock<std::shared_mutex> cache_lock(mutex_);
        pending_.erase(job.batch_size);
      }
      build_failures_.fetch_add(1, std::memory_order_relaxed);
      job.promise->set_exception(std::current_exception());
    }
    lock.lock();
    worker_busy_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
  // Sizes still queued are never built: forget them and fail whoever waits for them.
  std::unique_lock<std::shared_mutex> cache_lock(mutex_);
  for (auto& job : queue_) {
    pending_.erase(job.batch_size);
    job.promise->set_exception(std::make_exception_ptr(
        c10::Error("PlanCache: the cache was destroyed before the plan for batch size " +
                       std::to_string(job.batch_size) + " was built")));
  }
  queue_.clear();
  worker_busy_ = false;
  idle_cv_.notify_all();
}

void PlanCache::wait_for_builds() {
  std::unique_lock<std::mutex> lock(worker_mutex_);
  idle_cv_.wait(lock, [this] { return (queue_.empty() && !worker_busy_) || stopping_; });
}

void PlanCache::stop_worker() {
  {
    std::lock_guard<std::mutex> lock(worker_mutex_);
    stopping_ = true;
  }
  worker_cv_.notify_all();
  if (worker_.joinable()) {
    worker_.join();
  }
}

}  // namespace torch_ext::plan
