#pragma once
// PlanTable: a plan cache's plans by bucket, the builds in progress (one per bucket however many
// calls miss it), the per-bucket records behind the stats, and eviction: least recently used
// first, by a plan count (max_plans) and a byte budget over the plans' distinct constants
// (max_bytes; weights shared between plans count once). It holds plans; it neither builds nor
// runs them.
//
// Thread safety: every member may be called from many threads at once. Lookups take a shared
// lock; no member calls out of the table while holding its lock (visit's callback excepted, which
// must not call the table). Evicted plans stay alive in the calls that hold them. Fork: the owner
// calls fork_prepare / fork_parent / fork_child around fork() (its own locks are taken first).
#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "torch_ext/plan/plan_cache.h"

namespace torch_ext::plan {

class PlanTable {
 public:
  using Plan = PlanCache::Plan;
  using Record = PlanCache::SizeRecord;
  using PlanFuture = std::shared_future<std::shared_ptr<Plan>>;

  PlanTable(int64_t max_plans, int64_t max_bytes) : max_plans_(max_plans), max_bytes_(max_bytes) {}
  PlanTable(const PlanTable&) = delete;
  PlanTable& operator=(const PlanTable&) = delete;

  // The bucket's plan (null when none is cached).
  std::shared_ptr<Plan> find(const Bucket& bucket) const;
  bool contains(const Bucket& bucket) const;
  bool empty() const;
  // The cached plans, in bucket order.
  std::vector<std::shared_ptr<Plan>> plans() const;
  // Marks plan as used now (least recently used goes first).
  void touch(Plan& plan);
  // The bucket's record, made at its first sighting.
  std::shared_ptr<Record> record(const Bucket& bucket);

  // A build of bucket: its plan when cached; else the future of the build in progress; else, when
  // `start` is given, `start` becomes that future and the caller the builder (owner), who must end
  // with insert() or abandon(). A caller without `start` gets neither plan nor future.
  struct Claim {
    std::shared_ptr<Plan> plan;
    PlanFuture future;
    bool owner = false;
  };
  Claim claim(const Bucket& bucket, const PlanFuture& start);
  // The builder of bucket gave up: later calls may build it again.
  void abandon(const Bucket& bucket);
  // Caches plan (replacing its bucket's) and ends its bucket's build, then evicts what the limits
  // say, never plan itself.
  void insert(const std::shared_ptr<Plan>& plan);
  // Attaches plan's CUDA graph, whose memory counts as a constant of the plan while it is cached.
  void attach_graph(Plan& plan, std::unique_ptr<CapturedGraph> graph);
  void clear();  // drops every plan (builds in progress still insert theirs)
  void forget_builds();  // in a forked child: the parent's builds never end here

  // Under a shared lock: each record (its counters are atomics) with its bucket's cached plan (or
  // null). fn must not call the table.
  void visit(const std::function<void(Record&, const Plan*)>& fn) const;
  struct Totals {
    int64_t plans = 0;
    int64_t plan_bytes = 0;
    int64_t pending_builds = 0;
  };
  Totals totals() const;
  bool has_builds() const;  // without locking: for fork_child only

  void fork_prepare();
  void fork_parent();
  void fork_child();

 private:
  void release_constants_locked(const Plan& plan);
  void evict_locked(const Bucket& keep);

  const int64_t max_plans_;
  const int64_t max_bytes_;
  mutable std::shared_mutex mutex_;  // guards everything below but the clock
  std::unordered_map<Bucket, std::shared_ptr<Plan>, BucketHash> plans_;
  std::unordered_map<Bucket, PlanFuture, BucketHash> pending_;
  std::unordered_map<Bucket, std::shared_ptr<Record>, BucketHash> records_;
  int64_t plan_bytes_ = 0;                                    // distinct constants of the cached plans
  std::unordered_map<const void*, int64_t> constant_plans_;  // constant -> cached plans referencing it
  std::atomic<uint64_t> clock_{0};                            // LRU ticks
};

}  // namespace torch_ext::plan
