#pragma once
// LayerPager: keeps a source's tensors resident within a byte budget.
//
// acquire(id) returns the tensor (its own storage aliasing the pager's memory), loading it if
// needed; the caller's reference keeps it valid. Entries a caller still holds, pinned entries and
// entries being loaded are never evicted; when nothing else is left to evict the load goes ahead
// over budget and the statistics count it. When the last tensor a caller holds is released, the
// pager evicts at once until it is within its budget again (not only on the next miss). Policies: LRU, or scan-resistant
// (Belady's choice on the access order recorded over one pass, for cyclic sweeps such as
// forward passes; LRU until an order is known). A prefetch thread loads the next `prefetch`
// tensors of the recorded order within the budget. Device targets other than CPU load through
// pinned staging buffers and a non-blocking copy on a side stream (c10 device-generic APIs).
// CPU loads copy into pager-owned memory (own mmap'd pages that go back to the system when
// evicted, reusing an evicted tensor's of the same size), or, with zero_copy, map the source's file.
// Thread-safe: any thread may call any method; concurrent acquires of one id load it once; every
// wait is bounded (wait_timeout_seconds). Fork-safe: a forked child may use or destroy an inherited
// CPU pager (loads that were under way are redone, the prefetch thread restarts on first use);
// an accelerator pager raises in the child.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
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

#include "torch_ext/common/enum_names.h"
#include "torch_ext/common/fork.h"
#include "torch_ext/fields.h"
#include "torch_ext/paging/source.h"
#include "torch_ext/paging/streamed_blocks.h"

namespace c10 {
class IValue;
}

namespace torch_ext::paging {

// PagerOptions.budget_bytes: a byte count, or a share of the source's bytes ("30%") that the
// pager resolves. Parsed from ints, floats and strings such as "1GB", "512MiB", "1.5 GiB", "30%".
struct ByteBudget {
  int64_t bytes = 0;
  double percent = -1;  // >= 0: percent of the source's bytes, resolved by LayerPager

  ByteBudget(int64_t b = 0) : bytes(b) {}  // NOLINT: a byte count converts implicitly
  operator int64_t() const { return bytes; }  // NOLINT
  static ByteBudget of_percent(double percent);
  int64_t resolve(int64_t source_bytes) const;
  // Throws ValueError naming `option` for anything that is not a budget (negative, out of range,
  // not finite, an unknown unit or text).
  static ByteBudget parse(const c10::IValue& value, const std::string& option);
};

// auto: ScanResistant when the source's tensors exceed the budget (every pass would evict what
// the next one needs first under LRU), else LRU.
enum class EvictionPolicy { LRU, ScanResistant, Auto };

}  // namespace torch_ext::paging

namespace torch_ext {
template <>
struct FieldCodec<paging::ByteBudget> {
  using Exposed = c10::IValue;  // Any: int, float or str
  static c10::IValue expose(const paging::ByteBudget& budget);
  static paging::ByteBudget parse(const c10::IValue& value, const char* field) {
    return paging::ByteBudget::parse(value, field);
  }
};

template <>
struct EnumNames<paging::EvictionPolicy> {
  static constexpr std::string_view owner = "LayerPager", what = "policy";
  static constexpr std::array<std::pair<paging::EvictionPolicy, std::string_view>, 3> names{
      {{paging::EvictionPolicy::LRU, "lru"}, {paging::EvictionPolicy::ScanResistant, "scan_resistant"},
       {paging::EvictionPolicy::Auto, "auto"}}};
};

// PagerOptions.dtype: the floating-point dtypes a pager converts weights to, by torch's names.
template <>
struct EnumNames<c10::ScalarType> {
  static constexpr std::string_view owner = "LayerPager", what = "dtype";
  static constexpr std::array<std::pair<c10::ScalarType, std::string_view>, 4> names{
      {{c10::kFloat, "float32"}, {c10::kHalf, "float16"}, {c10::kBFloat16, "bfloat16"}, {c10::kDouble, "float64"}}};
};

template <>
struct FieldCodec<std::optional<c10::ScalarType>> {
  using Exposed = std::optional<std::string>;  // torch's name of the dtype, or None
  static Exposed expose(const std::optional<c10::ScalarType>& dtype) {
    return dtype ? Exposed(std::string(enum_name(*dtype))) : std::nullopt;
  }
  static std::optional<c10::ScalarType> parse(const Exposed& name, const char* /*field*/) {
    return name ? std::optional<c10::ScalarType>(enum_from_name<c10::ScalarType>(*name)) : std::nullopt;
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
  int64_t largest_tensor_bytes = 0;
  bool budget_below_largest_tensor = false;
  int64_t release_evictions = 0;
  int64_t streamed_matmuls = 0;
  int64_t streamed_from_mapped_pages = 0;
  int64_t streamed_blocks_by_prefetcher = 0;
  int64_t unstreamed_shapes = 0;

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
              "the pinned tensors alone are larger than the budget"),
        field("largest_tensor_bytes", &PagerStats::largest_tensor_bytes, "the source's largest tensor"),
        field("budget_below_largest_tensor", &PagerStats::budget_below_largest_tensor,
              "the budget is smaller than the largest tensor, which is loaded over budget (warned once)"),
        field("release_evictions", &PagerStats::release_evictions,
              "evictions made when a caller released its tensors while the pager was over budget"),
        field("streamed_matmuls", &PagerStats::streamed_matmuls,
              "matmul() calls served block by block from the file, the weight never loaded whole"),
        field("streamed_from_mapped_pages", &PagerStats::streamed_from_mapped_pages,
              "streamed matmul() calls that found the weight's file pages kept mapped (no page faults)"),
        field("streamed_blocks_by_prefetcher", &PagerStats::streamed_blocks_by_prefetcher,
              "blocks of those products that the prefetch thread made (converted and multiplied) beside the caller"),
        field("unstreamed_shapes", &PagerStats::unstreamed_shapes,
              "matmul() shapes whose blocked result differed from the whole weight's in some bit: served by "
              "acquire() instead"));
  }
};

struct PagerOptions {
  ByteBudget budget_bytes = 0;
  std::vector<std::string> pinned;
  EvictionPolicy policy = EvictionPolicy::Auto;
  int64_t prefetch = 16;  // tensors, about a layer of a transformer or more: see docs/paging.md
  c10::Device device = c10::Device(c10::kCPU);
  std::optional<bool> zero_copy;  // unset: on where it can be (cpu, a source with views)
  std::optional<c10::ScalarType> dtype;
  std::vector<std::string> keep_float32;
  bool own_buffers = true;
  double wait_timeout_seconds = 600;

  static constexpr auto fields() {
    return std::make_tuple(
        field("budget_bytes", &PagerOptions::budget_bytes,
              "the most bytes of tensors to keep resident: an int or float (bytes), or a string such as "
              "'1GB', '512MiB' or '30%' (of the source's bytes); properties report it resolved, in bytes"),
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
              "the file's pages this process maps. None (default): on for a cpu pager over a source with "
              "views, off otherwise; tensors converted to `dtype` are copies in any case; properties report "
              "it resolved"),
        field("dtype", &PagerOptions::dtype,
              "convert floating-point tensors stored in another floating-point dtype to this one as they "
              "are loaded ('float32', 'float16', 'bfloat16', 'float64'; None: as stored); the budget counts "
              "the converted bytes"),
        field("keep_float32", &PagerOptions::keep_float32,
              "ids of floating-point tensors served in float32 whatever `dtype` says (the tensors "
              "transformers keeps in float32 in a float16 model, its _keep_in_fp32_modules)"),
        field("own_buffers", &PagerOptions::own_buffers,
              "cpu copy path: tensors of a page or more are read into buffers of their own pages (mmap), so "
              "an evicted tensor's memory goes back to the system at once; False: c10's CPU allocator, whose "
              "freed blocks glibc may keep (below its dynamic mmap threshold, up to 32 MiB each)"),
        field("wait_timeout_seconds", &PagerOptions::wait_timeout_seconds,
              "the longest acquire() waits for another thread's load of the same tensor before it raises "
              "(> 0)"));
  }
  // Throws naming `owner` (the source) for a negative prefetch, a non-positive wait timeout or
  // zero_copy=true on an accelerator.
  void validate(const std::string& owner = "LayerPager") const;
};

class LayerPager : public torch::CustomClassHolder, private ForkParticipant {
 public:
  LayerPager(c10::intrusive_ptr<PagerSource> source, PagerOptions options);
  ~LayerPager() override;
  LayerPager(const LayerPager&) = delete;
  LayerPager& operator=(const LayerPager&) = delete;

  at::Tensor acquire(const std::string& id);
  // acquire() of each id in turn (one call for a module's tensors).
  std::vector<at::Tensor> acquire_many(const std::vector<std::string>& ids);
  // An embedding lookup: rows `indices` of the 2-D table `id`, in the served dtype, read from
  // the source's mapped file without loading the table (only the rows' pages are read, and given
  // back unless the table is resident as a view). Needs gathers_rows(id).
  at::Tensor gather_rows(const std::string& id, const at::Tensor& indices);
  // Whether gather_rows() can serve `id`: a 2-D tensor, a CPU pager, a source with views.
  bool gathers_rows(const std::string& id) const;
  // The product of `input` and the 2-D weight `id`, plus `bias`: torch.nn.functional.linear
  // (weight stored (out, in)), or, with `transposed`, transformers' Conv1D (weight stored (in,
  // out): addmm(bias, input, weight)). A weight converted from the file's dtype that is not
  // resident is streamed when the budget has no free room for it, or cannot hold the whole source
  // and the file's bytes are no more than the converted ones (a widening conversion): it is
  // converted block by block from the mapped file and multiplied (streamed_blocks.h), so it is
  // never loaded or converted whole and nothing is evicted for it; the prefetch thread, which has
  // nothing to load then, makes blocks too. A widened weight's file pages stay mapped for the
  // next product while the budget has free room for them (counted at the file's bytes, and
  // evicted like any tensor); otherwise they are given back. Streaming a shape is decided on its first
  // call, which acquire()s the weight and compares the two products: a shape is streamed only if
  // they are equal in every bit (a BLAS may block a narrower product differently; a transposed
  // weight then tries the conversion of whole rows, streamed_blocks.h), otherwise it
  // keeps acquire()ing, as do calls where autograd needs the weight. Where the budget cannot hold
  // the whole source, that first call compares even when the weight has room, and a widened
  // weight loaded only to compare is evicted after it.
  at::Tensor matmul(const std::string& id, const at::Tensor& input, const std::optional<at::Tensor>& bias,
                    bool transposed);
  // Whether matmul() can stream `id`: gathers_rows(id), and a tensor converted from the file's dtype.
  bool streams(const std::string& id) const;

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
  // Drops every unpinned entry nobody else references, and the streamed products' conversion
  // buffer (for tests and memory pressure).
  void evict_all();
  PagerStats stats() const;
  void reset_stats();
  const c10::intrusive_ptr<PagerSource>& source() const { return source_; }
  const PagerOptions& options() const { return options_; }  // budget_bytes resolved

 private:
  struct Releases;
  struct Handout;
  static void release_handout(void* context);
  enum class State { Absent, Loading, Ready };
  struct Entry {
    std::string id;
    int64_t nbytes = 0;       // resident bytes: in `dtype`
    int64_t file_nbytes = 0;  // the source's bytes: in the file's dtype
    c10::ScalarType dtype = c10::kFloat;  // as stored, or options_.dtype where it converts
    bool view = false;  // served as a view of the source (zero_copy and no conversion)
    bool pinned = false;
    State state = State::Absent;
    at::Tensor tensor;
    uint64_t last_use = 0;
    bool prefetched = false;  // loaded by the prefetcher and not yet acquired
    int64_t waiters = 0;      // acquire() calls loading it or waiting for it
    int64_t holders = 0;      // tensors handed out by acquire() and not yet released
    bool streamable = false;  // see streams(); fixed at construction
    bool streamed = false;    // matmul() streams it when absent: the prefetcher loads it only into free room
    // Absent and streamed: the file's pages kept mapped for the next product, counted in
    // resident_bytes_ (evicted like a ready entry: the pages are given back).
    int64_t mapped_bytes = 0;
    std::exception_ptr error;
  };

  Entry& entry_locked(const std::string& id);
  // An access to `e` in the recorded order: recording, the cursor and the LRU clock.
  void note_access_locked(Entry& e);
  // Whether a streamable `e` streams even with room for it: the budget is below the source and
  // its file pages cost no more than the converted weight (bf16 or fp16 served as fp32).
  bool prefers_streaming_locked(const Entry& e) const;
  // Whether matmul() may stream this call (`e` absent and not pinned, the served dtype, and
  // prefers_streaming_locked() or no room for `e`); marks `e` as streamed.
  bool stream_matmul_locked(Entry& e, const at::Tensor& input);
  // After a streamed product: whether `e`'s file pages stay mapped (they were, or `e` prefers
  // streaming and the budget has free room for them now: they are counted from here on).
  bool keep_mapped_locked(Entry& e);
  // Evicts until `incoming` more bytes fit; only entries whose next use is farther than
  // `protect_within` positions of the order may go. False if it did not fit. A victim of exactly
  // `incoming` bytes is handed over in *recycled (when not null) so the load reuses its memory.
  // Evicted tensors go to `dead`, for the caller to free after unlocking (munmap is not free).
  bool make_room_locked(int64_t incoming, int64_t protect_within, at::Tensor* recycled, std::vector<at::Tensor>& dead);
  void evict_locked(Entry& e, std::vector<at::Tensor>& dead);
  void forget_mapping_locked(Entry& e);  // stops counting e's kept pages (does not give them back)
  at::Tensor hand_out_locked(Entry& e);
  void release(Entry& e);  // the last alias of a handed-out tensor died
  void wait_for_load_locked(std::unique_lock<std::mutex>& lock, Entry& e);  // throws after wait_timeout_seconds
  void check_usable_locked();
  bool evictable_locked(const Entry& e) const;
  int64_t next_use_distance_locked(const Entry& e) const;
  bool advance_cursor_locked(const std::string& id);  // true when the cursor moved
  // No lock held: reads only the entry's immutable fields (id, nbytes, dtype, view).
  at::Tensor load(const Entry& e, at::Tensor recycled);
  at::Tensor load_on_cpu(const Entry& e, at::Tensor recycled);
  void finish_load_locked(Entry& e, at::Tensor tensor, std::exception_ptr error, double seconds, bool prefetch);
  // Something the prefetcher may act on changed (the cursor moved, an entry was evicted or a
  // load failed): counts it, and wakes the thread when it is idle and has work ahead.
  void work_changed_locked();
  void prefetch_loop();
  // Lets the prefetch thread help make `blocks` (a streamed product the caller is about to make),
  // unless another product has it or there is no thread. The first call of a shape, which checks
  // the blocked product against the whole one, makes its blocks alone.
  void offer_to_prefetcher(const std::shared_ptr<StreamedBlocks>& blocks);
  void prefetch_ahead_locked(std::unique_lock<std::mutex>& lock);

  // ForkParticipant (torch_ext/common/fork.h): pthread_atfork handlers.
  void fork_prepare() override;
  void fork_parent() override;
  void fork_child() override;

  c10::intrusive_ptr<PagerSource> source_;
  PagerOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable loaded_;
  std::condition_variable prefetch_wake_;
  std::unordered_map<std::string, Entry> entries_;
  int64_t budget_ = 0;          // options_.budget_bytes, resolved
  bool budget_below_source_ = false;  // some tensor may find no room: matmul() may stream
  int64_t resident_bytes_ = 0;  // ready + loading entries
  uint64_t clock_ = 0;
  PagerStats stats_;

  // Recorded order: recording_ while the first pass runs, then frozen in order_.
  bool recording_ = false;
  std::vector<std::string> recorded_;
  std::vector<std::string> order_;
  std::unordered_map<std::string, std::vector<int64_t>> positions_;
  int64_t cursor_ = -1;  // position in order_ of the last acquire
  uint64_t cursor_generation_ = 0;
  uint64_t work_generation_ = 0;  // counts work_changed_locked() calls
  // matmul(): shape -> the blocking whose product equals the whole weight's (nullopt: none does)
  std::unordered_map<std::string, std::optional<Blocking>> exact_shapes_;
  std::shared_ptr<StreamedBlocks> helped_blocks_;  // offered to the prefetch thread, not yet taken
  // A streamed transposed weight's conversion buffer, kept for the next product (its pages stay
  // faulted in): at most the largest such weight in the served dtype. Taken by one product at a
  // time; evict_all() frees it.
  at::Tensor conversion_scratch_;

  bool recycle_ = false;  // CPU target, copies, and a source that reads into any buffer
  std::optional<c10::Stream> copy_stream_;
  bool stop_ = false;
  bool prefetcher_idle_ = false;  // the prefetch thread is waiting for work
  bool prefetcher_lost_ = false;  // a forked child: the thread is the parent's; restart on use
  bool forked_child_ = false;
  std::shared_ptr<Releases> releases_;
  std::thread prefetcher_;
};

}  // namespace torch_ext::paging
