#include "torch_ext/plan/traffic.h"

#include <algorithm>
#include <new>

#include <c10/util/Exception.h>

namespace torch_ext::plan {

void TrafficLog::add(const Bucket& sizes, int64_t count) {
  TORCH_CHECK(count > 0, "PlanCache: a traffic count must be positive, got ", count, " for sizes ", sizes.str());
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = counts_.find(sizes);
  if (it == counts_.end()) {
    if (counts_.size() >= kMaxSizes) {
      dropped_ += count;
      return;
    }
    it = counts_.emplace(sizes, 0).first;
  }
  it->second += count;
  requests_ += count;
}

std::vector<std::pair<Bucket, int64_t>> TrafficLog::sizes() const {
  std::vector<std::pair<Bucket, int64_t>> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    out.assign(counts_.begin(), counts_.end());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

std::vector<std::pair<Bucket, int64_t>> TrafficLog::within(const Bucket& lower, const Bucket& upper,
                                                           size_t limit) const {
  std::vector<std::pair<Bucket, int64_t>> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [sizes, count] : counts_) {
      bool inside = sizes.rank == upper.rank;
      for (int d = 0; inside && d < sizes.rank; ++d) inside = lower[d] <= sizes[d] && sizes[d] <= upper[d];
      if (inside) out.emplace_back(sizes, count);
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  if (out.size() > limit) out.resize(limit);
  return out;
}

size_t TrafficLog::distinct() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counts_.size();
}

int64_t TrafficLog::requests() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return requests_;
}

int64_t TrafficLog::dropped() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return dropped_;
}

void TrafficLog::fork_child() {
  new (&mutex_) std::mutex();  // made afresh, as the cache's other locks: no thread of the child holds it
}

void TrafficLog::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  counts_.clear();
  requests_ = 0;
  dropped_ = 0;
}

}  // namespace torch_ext::plan
