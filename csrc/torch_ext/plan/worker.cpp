// Background builds (background_builds): the cache's jobs on its BuildWorker (build_worker.h),
// each building one bucket's plan and swapping it in; and what fork() does to the cache.
#include "torch_ext/plan/plan.h"

#include <exception>
#include <memory>
#include <future>
#include <new>
#include <shared_mutex>
#include <string>
#include <utility>

#include <c10/util/Exception.h>

#include "torch_ext/common/wait.h"
#include "torch_ext/plan/build_worker.h"
#include "torch_ext/plan/plan_table.h"
#include "torch_ext/plan/traffic.h"

namespace torch_ext::plan {

void PlanCache::enqueue_build(const Bucket& bucket, std::vector<c10::IValue> example) {
  check_usable("infer");
  auto promise = std::make_shared<std::promise<std::shared_ptr<Plan>>>();
  if (!table_->claim(bucket, promise->get_future().share()).owner) return;  // cached, or building already
  BuildWorker::Job job;
  job.what = "bucket " + bucket.str();
  job.run = [this, bucket, example = std::move(example), promise] { build_job(bucket, example, *promise); };
  job.abandon = [this, bucket, promise](std::exception_ptr error) {
    table_->abandon(bucket);
    promise->set_exception(error);
  };
  worker_->push(std::move(job));
}

void PlanCache::build_job(const Bucket& bucket, const std::vector<c10::IValue>& example,
                          std::promise<std::shared_ptr<Plan>>& promise) {
  try {
    // No capture on this thread: a capture fails device-wide synchronisations in other
    // threads (a CUDA rule), and request threads may be synchronising right now.
    auto plan = build_plan(bucket, example, /*background=*/true);
    remember_example(example);
    table_->insert(plan);
    promise.set_value(plan);
  } catch (...) {
    table_->abandon(bucket);
    build_failures_.fetch_add(1, std::memory_order_relaxed);
    promise.set_exception(std::current_exception());
  }
}

void PlanCache::wait_for_builds(double timeout_seconds) {
  recover_after_fork();
  check_usable("wait_for_builds");
  if (!worker_) return;  // no background builds
  const double limit = timeout_seconds < 0 ? options_.timeout_seconds : timeout_seconds;
  if (worker_->wait_idle(deadline_after(limit))) return;  // the deadline bounds a build that never ends
  const auto state = worker_->snapshot();
  TORCH_CHECK(false, "PlanCache.wait_for_builds: builds still ", state.running ? "running" : "queued", " after ", limit,
              " s (", state.queued, " queued", state.running ? ", " + *state.running + " building" : "",
              "); pass a longer timeout");
}

void PlanCache::stop_worker() {
  if (!worker_) return;
  source_->cancel_builds();  // a compile in progress gives up rather than make the join wait for it
  worker_->stop();           // queued buckets are never built: their waiters fail
}

void PlanCache::fork_prepare() {
  // Held across fork(), so the child's copies are never held by a thread it does not have; in
  // the order the cache takes them (its example's lock, then the table's). They are not held
  // while code that may fork runs (builds and callbacks run outside them).
  example_mutex_.lock();
  table_->fork_prepare();
  traffic_->fork_prepare();
}

void PlanCache::fork_parent() {
  traffic_->fork_parent();
  table_->fork_parent();
  example_mutex_.unlock();
}

void PlanCache::fork_child() {
  // Made afresh rather than unlocked: glibc's rwlock knows its writer by thread id, which fork
  // changes, so an unlock here would be taken for a reader's and leave it locked. No thread of
  // the child holds or waits on them.
  table_->fork_child();
  traffic_->fork_child();
  new (&example_mutex_) std::shared_mutex();
  if (worker_ || table_->has_builds()) forked_.store(true, std::memory_order_relaxed);
}

void PlanCache::recover_after_fork() {
  if (!forked_.load(std::memory_order_relaxed) || recovered_.exchange(true)) return;
  // The builds the parent's threads were running or had queued never finish here: the worker
  // fails their waiters (with an error, not a hang), and they are forgotten, so this process may
  // build them itself.
  if (worker_) worker_->recover_after_fork();
  table_->forget_builds();  // also the builds of request threads of the parent: no thread here fulfils them
}

}  // namespace torch_ext::plan
