#include "torch_ext/plan/plan_table.h"

#include <algorithm>
#include <mutex>
#include <new>
#include <utility>

#include "torch_ext/plan/plan.h"

namespace torch_ext::plan {

std::shared_ptr<PlanTable::Plan> PlanTable::find(const Bucket& bucket) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  auto it = plans_.find(bucket);
  return it == plans_.end() ? nullptr : it->second;
}

bool PlanTable::contains(const Bucket& bucket) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  return plans_.count(bucket) > 0;
}

bool PlanTable::empty() const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  return plans_.empty();
}

std::vector<std::shared_ptr<PlanTable::Plan>> PlanTable::plans() const {
  std::vector<std::shared_ptr<Plan>> out;
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    for (const auto& entry : plans_) out.push_back(entry.second);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a->bucket() < b->bucket(); });
  return out;
}

void PlanTable::touch(Plan& plan) {
  plan.last_used.store(clock_.fetch_add(1, std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

std::shared_ptr<PlanTable::Record> PlanTable::record(const Bucket& bucket) {
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    auto it = records_.find(bucket);
    if (it != records_.end()) return it->second;
  }
  std::unique_lock<std::shared_mutex> lock(mutex_);
  auto& slot = records_[bucket];
  if (!slot) slot = std::make_shared<Record>(bucket);
  return slot;
}

PlanTable::Claim PlanTable::claim(const Bucket& bucket, const PlanFuture& start) {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (auto it = plans_.find(bucket); it != plans_.end()) return {it->second, {}, false};
  if (auto it = pending_.find(bucket); it != pending_.end()) return {nullptr, it->second, false};
  if (!start.valid()) return {};
  pending_.emplace(bucket, start);
  return {nullptr, start, true};
}

void PlanTable::abandon(const Bucket& bucket) {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  pending_.erase(bucket);
}

void PlanTable::insert(const std::shared_ptr<Plan>& plan) {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  touch(*plan);
  auto& slot = plans_[plan->bucket()];
  if (slot) release_constants_locked(*slot);
  slot = plan;
  for (const auto& [storage, bytes] : plan->constants) {
    if (constant_plans_[storage]++ == 0) plan_bytes_ += bytes;
  }
  pending_.erase(plan->bucket());
  evict_locked(plan->bucket());
}

void PlanTable::attach_graph(Plan& plan, std::unique_ptr<CapturedGraph> graph) {
  std::unique_lock<std::shared_mutex> lock(mutex_);  // visit() reads plan.graph under the shared lock
  const int64_t bytes = graph->bytes();
  plan.graph = std::move(graph);
  auto it = plans_.find(plan.bucket());
  if (it == plans_.end() || it->second.get() != &plan) return;  // an evicted plan's bytes are no longer counted
  plan.constants.emplace(plan.graph.get(), bytes);
  plan.bytes += bytes;
  constant_plans_[plan.graph.get()] = 1;
  plan_bytes_ += bytes;
  evict_locked(plan.bucket());
}

void PlanTable::release_constants_locked(const Plan& plan) {
  for (const auto& [storage, bytes] : plan.constants) {
    auto it = constant_plans_.find(storage);
    if (--it->second == 0) {
      plan_bytes_ -= bytes;
      constant_plans_.erase(it);
    }
  }
}

void PlanTable::evict_locked(const Bucket& keep) {
  auto over = [this] {
    const auto count = static_cast<int64_t>(plans_.size());
    return (max_plans_ > 0 && count > max_plans_) || (max_bytes_ > 0 && plan_bytes_ > max_bytes_ && count > 1);
  };
  while (over()) {
    auto victim = plans_.end();
    for (auto it = plans_.begin(); it != plans_.end(); ++it) {
      if (it->first == keep) continue;
      if (victim == plans_.end() ||
          it->second->last_used.load(std::memory_order_relaxed) < victim->second->last_used.load(std::memory_order_relaxed)) {
        victim = it;
      }
    }
    if (victim == plans_.end()) break;
    release_constants_locked(*victim->second);
    victim->second->record->evictions.fetch_add(1, std::memory_order_relaxed);
    plans_.erase(victim);  // calls running it hold their own reference
  }
}

void PlanTable::clear() {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  plans_.clear();
  constant_plans_.clear();
  plan_bytes_ = 0;
}

void PlanTable::forget_builds() {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  pending_.clear();
}

void PlanTable::visit(const std::function<void(Record&, const Plan*)>& fn) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  for (const auto& [bucket, rec] : records_) {
    auto it = plans_.find(bucket);
    fn(*rec, it == plans_.end() ? nullptr : it->second.get());
  }
}

PlanTable::Totals PlanTable::totals() const {
  Totals out;
  std::shared_lock<std::shared_mutex> lock(mutex_);
  out.plans = static_cast<int64_t>(plans_.size());
  out.plan_bytes = plan_bytes_;
  for (const auto& entry : pending_) {
    if (!plans_.count(entry.first)) ++out.pending_builds;
  }
  return out;
}

bool PlanTable::has_builds() const { return !pending_.empty(); }

void PlanTable::fork_prepare() { mutex_.lock(); }

void PlanTable::fork_parent() { mutex_.unlock(); }

void PlanTable::fork_child() {
  // Made afresh rather than unlocked: glibc's rwlock knows its writer by thread id, which fork
  // changes, so an unlock here would be taken for a reader's and leave it locked.
  new (&mutex_) std::shared_mutex();
}

}  // namespace torch_ext::plan
