#pragma once
// TrafficLog: how many requests a plan cache served at each size (a size per dynamic dimension,
// batch first), what its plans are chosen from: the buckets (torch_ext/plan/traffic.py) and, for
// plan_shapes='auto', the sizes a bucket's static and dynamic plans are timed at. Bounded: past
// kMaxSizes distinct sizes, requests at a size not yet seen are only counted as dropped.
//
// Thread safety: every member may be called from many threads at once (one mutex, held for a
// lookup; requests at different sizes contend only for that). Fork: the owner calls
// fork_prepare / fork_parent / fork_child around fork(), so a child never inherits it held.
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torch_ext/plan/plan_cache.h"

namespace torch_ext::plan {

class TrafficLog {
 public:
  static constexpr size_t kMaxSizes = 4096;

  // `count` more requests at `sizes` (count > 0).
  void add(const Bucket& sizes, int64_t count = 1);
  // Every size seen with its count, sizes ascending.
  std::vector<std::pair<Bucket, int64_t>> sizes() const;
  // The sizes within the box [lower, upper] (each dimension inclusive), the most requested first
  // (ties: the smaller size first), at most `limit` of them.
  std::vector<std::pair<Bucket, int64_t>> within(const Bucket& lower, const Bucket& upper, size_t limit) const;
  size_t distinct() const;   // sizes logged
  int64_t requests() const;  // counted at a logged size
  int64_t dropped() const;   // at a size not logged (the log was full)
  void clear();

  void fork_prepare() { mutex_.lock(); }
  void fork_parent() { mutex_.unlock(); }
  void fork_child();

 private:
  mutable std::mutex mutex_;
  std::unordered_map<Bucket, int64_t, BucketHash> counts_;
  int64_t requests_ = 0;
  int64_t dropped_ = 0;
};

}  // namespace torch_ext::plan
