#pragma once
// LayerPager: keeps a source's tensors resident within a byte budget.
//
// acquire(id) returns (an alias of) the tensor, loading it if needed; the caller's reference
// keeps it valid (eviction only drops the pager's reference). Entries someone else still
// references, pinned entries and entries being loaded are never evicted; when nothing else is left to evict the
// load goes ahead over budget and the statistics count it. Policies: LRU, or scan-resistant
// (Belady's choice on the access order recorded over one pass, for cyclic sweeps such as
// forward passes; LRU until an order is known). A prefetch thread loads the next `prefetch`
// tensors of the recorded order within the budget. Device targets other than CPU load through
// pinned staging buffers and a non-blocking copy on a side stream (c10 device-generic APIs).
// CPU loads copy into pager-owned memory (reusing an evicted tensor's of the same size), or,
// with zero_copy, map the source's file.
// Thread-safe: any thread may call any method; concurrent acquires of one id load it once.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <torch/custom_class.h>

#include "torch_ext/fields.h"
#include "torch_ext/paging/source.h"

namespace torch_ext::paging {

// auto: ScanResistant when the source's tensors exceed the budget (every pass would evict what
// the next one needs first under LRU), else LRU.
enum class EvictionPolicy { LRU, ScanResistant, Auto };

EvictionPolicy parse_policy(const std::string& name);  // "lru" | "scan_resistant" | "auto"
std::string policy_name(EvictionPolicy policy);

}  // namespace torch_ext::paging

namespace torch_ext {
template <>
struct FieldCodec<paging::EvictionPolicy> {
  using Exposed = std::string;
  static std::string expose(paging::EvictionPolicy policy) { return paging::policy_name(policy); }
  static paging::EvictionPolicy parse(const std::string& name, const char* /*field*/) {
    return paging::parse_policy(name);
  }
};
}  // namespace torch_ext

namespace torch_ext::paging {

struct PagerStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t evictions = 0;
  int64_t bytes_loaded = 0;
  double load_seconds = 0;
  double stall_seconds = 0;
  int64_t prefetches = 0;
  int64_t prefetch_hits = 0;
  int64_t over_budget_loads = 0;
  bool pinned_over_budget = false;

  static constexpr auto fields() {
    return std::make_tuple(
        field("hits", &PagerStats::hits, "acquires that found the tensor loaded or being loaded"),
        field("misses", &PagerStats::misses, "acquires that had to load it"),
        field("evictions", &PagerStats::evictions, "tensors dropped to stay within the budget"),
        field("bytes_loaded", &PagerStats::bytes_loaded, "bytes read from the source"),
        field("load_seconds", &PagerStats::load_seconds, "time spent reading and copying (all threads)"),
        field("stall_seconds", &PagerStats::stall_seconds, "time acquire() callers waited for loads"),
        field("prefetches", &PagerStats::prefetches, "loads issued by the prefetch thread"),
        field("prefetch_hits", &PagerStats::prefetch_hits, "first acquires of a prefetched tensor"),
        field("over_budget_loads", &PagerStats::over_budget_loads,
              "loads that exceeded the budget: nothing evictable was left"),
        field("pinned_over_budget", &PagerStats::pinned_over_budget,
              "the pinned tensors alone are larger than the budget"));
  }
};

struct PagerOptions {
  int64_t budget_bytes = 0;
  std::vector<std::string> pinned;
  EvictionPolicy policy = EvictionPolicy::Auto;
  int64_t prefetch = 1;
  c10::Device device = c10::Device(c10::kCPU);
  bool zero_copy = false;

  static constexpr auto fields() {
    return std::make_tuple(
        field("budget_bytes", &PagerOptions::budget_bytes, "the most bytes of tensors to keep resident (>= 0)"),
        field("pinned", &PagerOptions::pinned, "ids of tensors never evicted"),
        field("policy", &PagerOptions::policy,
              "'lru', 'scan_resistant' (Belady's choice on the recorded order of a pass) or 'auto' "
              "(scan_resistant when the source's tensors exceed the budget, else lru)"),
        field("prefetch", &PagerOptions::prefetch,
              "tensors a background thread loads ahead of the recorded order's cursor; 0: no thread"),
        field("device", &PagerOptions::device,
              "where tensors live: cpu, or an accelerator (loaded through pinned staging buffers and a "
              "non-blocking copy on a side stream)"),
        field("zero_copy", &PagerOptions::zero_copy,
              "cpu only: serve views of the source's mapped file instead of copies; a load maps the pages "
              "in (MADV_POPULATE_READ), an eviction gives them back (MADV_DONTNEED), and resident bytes are "
              "the file's pages this process maps"));
  }
  // Throws naming `owner` (the source) for a negative budget or prefetch.
  void validate(const std::string& owner = "LayerPager") const;
};

class LayerPager : public torch::CustomClassHolder {
 public:
  LayerPager(c10::intrusive_ptr<PagerSource> source, PagerOptions options);
  ~LayerPager() override;
  LayerPager(const LayerPager&) = delete;
  LayerPager& operator=(const LayerPager&) = delete;

  at::Tensor acquire(const std::string& id);
  // acquire() of each id in turn (one call for a module's tensors).
  std::vector<at::Tensor> acquire_many(const std::vector<std::string>& ids);

  // Marks the start of a pass (e.g. a forward). The accesses between the first two marks become
  // the recorded order that the scan-resistant policy and the prefetcher follow.
  void begin_pass();
  // Sets the order explicitly (ids must be in the source), replacing any recorded one.
  void set_order(const std::vector<std::string>& ids);
  std::vector<std::string> order() const;

  int64_t resident_bytes() const;
  int64_t resident_count() const;
  bool is_resident(const std::string& id) const;
  bool is_pinned(const std::string& id) const;
  // Drops every unpinned entry nobody else references (for tests and memory pressure).
  void evict_all();
  PagerStats stats() const;
  void reset_stats();
  const c10::intrusive_ptr<PagerSource>& source() const { return source_; }
  const PagerOptions& options() const { return options_; }

 private:
  enum class State { Absent, Loading, Ready };
  struct Entry {
    std::string id;
    int64_t nbytes = 0;
    bool pinned = false;
    State state = State::Absent;
    at::Tensor tensor;
    uint64_t last_use = 0;
    bool prefetched = false;  // loaded by the prefetcher and not yet acquired
    int64_t waiters = 0;      // acquire() calls loading it or waiting for it
    std::exception_ptr error;
  };

  Entry& entry_locked(const std::string& id);
  // Evicts until `incoming` more bytes fit; only entries whose next use is farther than
  // `protect_within` positions of the order may go. False if it did not fit. A victim of exactly
  // `incoming` bytes is handed over in *recycled (when not null) so the load reuses its memory.
  bool make_room_locked(int64_t incoming, int64_t protect_within, at::Tensor* recycled);
  bool evictable_locked(const Entry& e) const;
  int64_t next_use_distance_locked(const Entry& e) const;
  void advance_cursor_locked(const std::string& id);
  at::Tensor load(const std::string& id, at::Tensor recycled);  // no lock held
  void finish_load_locked(Entry& e, at::Tensor tensor, std::exception_ptr error, double seconds, bool prefetch);
  void wake_prefetcher_locked();
  void prefetch_loop();

  c10::intrusive_ptr<PagerSource> source_;
  PagerOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable loaded_;
  std::condition_variable prefetch_wake_;
  std::unordered_map<std::string, Entry> entries_;
  int64_t resident_bytes_ = 0;  // ready + loading entries
  uint64_t clock_ = 0;
  PagerStats stats_;

  // Recorded order: recording_ while the first pass runs, then frozen in order_.
  bool recording_ = false;
  int64_t passes_ = 0;
  std::vector<std::string> recorded_;
  std::vector<std::string> order_;
  std::unordered_map<std::string, std::vector<int64_t>> positions_;
  int64_t cursor_ = -1;  // position in order_ of the last acquire
  uint64_t cursor_generation_ = 0;

  bool recycle_ = false;  // CPU target and a source that reads into any buffer
  std::optional<c10::Stream> copy_stream_;
  bool stop_ = false;
  bool prefetcher_idle_ = false;  // the prefetch thread is waiting for the cursor to move
  std::thread prefetcher_;
};

}  // namespace torch_ext::paging
