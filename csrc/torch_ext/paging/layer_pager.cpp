#include "torch_ext/paging/layer_pager.h"
#include "torch_ext/paging/streamed_blocks.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <new>
#include <sstream>
#include <unordered_set>

#include <ATen/core/ivalue.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/set.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "torch_ext/common/thread_name.h"

namespace torch_ext::paging {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

constexpr int64_t kFar = std::numeric_limits<int64_t>::max();

constexpr double kMaxBytes = 9223372036854775807.0;  // INT64_MAX, as the double 2^63

[[noreturn]] void bad_budget(const std::string& option, const std::string& shown) {
  TORCH_CHECK_VALUE(false, "LayerPager: ", option, "=", shown,
                    " is not a byte budget: expected a non-negative int or float (bytes, below 2**63) or a string "
                    "such as \"1GB\", \"512MiB\", \"1.5 GiB\" or \"30%\" (of the source's bytes)");
}

int64_t checked_bytes(double value, const std::string& option, const std::string& shown) {
  if (!std::isfinite(value) || value < 0 || value >= kMaxBytes) bad_budget(option, shown);
  return static_cast<int64_t>(value);
}

// "1GB", "512 MiB", "1.5gib", "1024", "30%": a number and an optional unit (decimal or binary).
ByteBudget parse_budget_text(const std::string& text, const std::string& option) {
  const std::string shown = "\"" + text + "\"";
  size_t pos = 0;
  double number = 0;
  try {
    number = std::stod(text, &pos);
  } catch (const std::exception&) {
    bad_budget(option, shown);
  }
  if (text.empty() || !(std::isdigit(static_cast<unsigned char>(text[0])) || text[0] == '.')) {
    bad_budget(option, shown);  // stod also reads "inf", "nan", hex, signs and leading spaces
  }
  std::string unit;
  for (; pos < text.size(); ++pos) {
    if (text[pos] != ' ') unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[pos])));
  }
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1.0}, {"b", 1.0}, {"kb", 1e3}, {"mb", 1e6}, {"gb", 1e9}, {"tb", 1e12},
      {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
  if (unit == "%") {
    if (!std::isfinite(number) || number < 0) bad_budget(option, shown);
    return ByteBudget::of_percent(number);
  }
  for (const auto& [name, scale] : kUnits) {
    if (unit == name) return ByteBudget(checked_bytes(number * scale, option, shown));
  }
  bad_budget(option, shown);
}

}  // namespace

ByteBudget ByteBudget::of_percent(double percent) {
  ByteBudget budget;
  budget.percent = percent;
  return budget;
}

int64_t ByteBudget::resolve(int64_t source_bytes) const {
  if (percent < 0) return bytes;
  const double value = std::floor(static_cast<double>(source_bytes) * percent / 100.0);
  return value >= kMaxBytes ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(value);
}

ByteBudget ByteBudget::parse(const c10::IValue& value, const std::string& option) {
  if (value.isInt()) {
    if (value.toInt() < 0) bad_budget(option, std::to_string(value.toInt()));
    return ByteBudget(value.toInt());
  }
  if (value.isDouble()) return ByteBudget(checked_bytes(value.toDouble(), option, std::to_string(value.toDouble())));
  if (value.isString()) return parse_budget_text(value.toStringRef(), option);
  bad_budget(option, "a value of type " + value.type()->str());
}

void PagerOptions::validate(const std::string& owner) const {
  TORCH_CHECK_VALUE(budget_bytes.percent >= 0 || budget_bytes.bytes >= 0, owner, ": budget_bytes must be >= 0, got ",
                    budget_bytes.bytes);
  TORCH_CHECK_VALUE(prefetch >= 0, owner, ": prefetch must be >= 0, got ", prefetch);
  TORCH_CHECK_VALUE(wait_timeout_seconds > 0 && std::isfinite(wait_timeout_seconds), owner,
                    ": wait_timeout_seconds must be a positive number, got ", wait_timeout_seconds);
  TORCH_CHECK_VALUE(!zero_copy.value_or(false) || device.type() == c10::kCPU, owner,
              ": zero_copy serves views of a mapped file and needs device cpu, got ", device.str());
}

// The deleter context of a tensor acquire() hands out: keeps the pager's memory alive (even
// past the pager) and tells the pager when the caller's last alias is gone.
struct LayerPager::Releases {
  std::mutex mutex;
  LayerPager* pager = nullptr;  // null once the pager is destroyed
};

struct LayerPager::Handout {
  c10::Storage backing;
  std::shared_ptr<Releases> releases;
  Entry* entry;  // entries_ never changes shape after construction
};

void LayerPager::release_handout(void* context) {
  const std::unique_ptr<Handout> handout(static_cast<Handout*>(context));  // freed after the lock below
  std::lock_guard<std::mutex> lock(handout->releases->mutex);
  if (handout->releases->pager != nullptr) handout->releases->pager->release(*handout->entry);
}

namespace {

struct OwnPages {
  void* data;
  size_t length;
};

void free_own_pages(void* context) {
  auto* pages = static_cast<OwnPages*>(context);
  ::munmap(pages->data, pages->length);
  delete pages;
}

}  // namespace

LayerPager::LayerPager(c10::intrusive_ptr<PagerSource> source, PagerOptions options)
    : source_(std::move(source)), options_(std::move(options)) {
  TORCH_CHECK(source_, "LayerPager: source is null");
  const std::string owner = "LayerPager(" + source_->describe() + ")";
  options_.validate(owner);
  int64_t source_bytes = 0;
  std::string largest;
  TORCH_CHECK(!options_.zero_copy.value_or(false) || source_->supports_views(), owner,
              ": zero_copy needs a source with views");
  options_.zero_copy = options_.zero_copy.value_or(options_.device.type() == c10::kCPU && source_->supports_views());
  bool copies = false;
  const std::unordered_set<std::string> float32(options_.keep_float32.begin(), options_.keep_float32.end());
  for (const auto& id : float32) {
    TORCH_CHECK_VALUE(source_->contains(id), owner, ": keep_float32 names \"", id, "\", which is not in the source");
  }
  for (const auto& name : source_->names()) {
    const TensorInfo& info = source_->info(name);
    Entry e;
    e.id = name;
    e.dtype = info.dtype;
    if (c10::isFloatingType(info.dtype) && float32.count(name)) {
      e.dtype = c10::kFloat;
    } else if (c10::isFloatingType(info.dtype) && options_.dtype) {
      e.dtype = *options_.dtype;
    }
    e.view = *options_.zero_copy && e.dtype == info.dtype && source_->has_view(name);
    copies = copies || !e.view;
    e.file_nbytes = info.nbytes;
    e.nbytes = e.dtype == info.dtype ? info.nbytes : info.nbytes / c10::elementSize(info.dtype) * c10::elementSize(e.dtype);
    e.streamable = e.dtype != info.dtype && gathers_rows(name);
    source_bytes += e.nbytes;
    if (e.nbytes > stats_.largest_tensor_bytes) {
      stats_.largest_tensor_bytes = e.nbytes;
      largest = name;
    }
    entries_.emplace(name, std::move(e));
  }
  budget_ = options_.budget_bytes.resolve(source_bytes);
  budget_below_source_ = budget_ < source_bytes;
  options_.budget_bytes = ByteBudget(budget_);
  if (options_.policy == EvictionPolicy::Auto) {
    options_.policy = source_bytes > budget_ ? EvictionPolicy::ScanResistant : EvictionPolicy::LRU;
  }
  int64_t pinned_bytes = 0;
  for (const auto& id : options_.pinned) {
    auto it = entries_.find(id);
    TORCH_CHECK(it != entries_.end(), owner, ": pinned tensor \"", id, "\" is not in the source");
    if (!it->second.pinned) pinned_bytes += it->second.nbytes;
    it->second.pinned = true;
  }
  stats_.pinned_over_budget = pinned_bytes > budget_;
  if (options_.device.type() != c10::kCPU) {
    try {
      c10::impl::VirtualGuardImpl impl(options_.device.type());
      if (!options_.device.has_index()) options_.device = impl.getDevice();
      copy_stream_ = impl.getStreamFromGlobalPool(options_.device, /*isHighPriority=*/false);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, owner, ": device ", options_.device.str(),
                  " cannot be a target (it needs streams for the copies): ", e.what_without_backtrace());
    }
  }
  recycle_ = options_.device.type() == c10::kCPU && copies && source_->reads_into_any_buffer();
  stats_.budget_below_largest_tensor = budget_ < stats_.largest_tensor_bytes;
  if (stats_.budget_below_largest_tensor) {
    TORCH_WARN(owner, ": budget_bytes=", budget_, " is smaller than the largest tensor, \"", largest, "\" (",
               stats_.largest_tensor_bytes, " bytes): loading it exceeds the budget (stats: budget_below_largest_tensor)");
  }
  releases_ = std::make_shared<Releases>();
  releases_->pager = this;
  register_fork_participant(this);
  try {
    if (options_.prefetch > 0) prefetcher_ = std::thread([this] { prefetch_loop(); });
  } catch (...) {
    unregister_fork_participant(this);
    throw;
  }
}

LayerPager::~LayerPager() {
  unregister_fork_participant(this);  // waits for a fork under way; no handler sees this pager after
  {
    std::lock_guard<std::mutex> lock(releases_->mutex);
    releases_->pager = nullptr;  // tensors still held stay valid and no longer call back
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  prefetch_wake_.notify_all();
  // The thread sees stop_ when it next holds the lock: at once when idle, after its current load
  // otherwise (one read of the source, which the join cannot shorten). In a forked child the
  // parent's thread does not exist and prefetcher_ was reset (fork_child), so nothing is joined.
  if (prefetcher_.joinable()) prefetcher_.join();
}

LayerPager::Entry& LayerPager::entry_locked(const std::string& id) {
  auto it = entries_.find(id);
  TORCH_CHECK(it != entries_.end(), "LayerPager(", source_->describe(), "): no tensor \"", id, "\" in the source");
  return it->second;
}

void LayerPager::check_usable_locked() {
  if (!forked_child_) return;
  TORCH_CHECK(options_.device.type() == c10::kCPU, "LayerPager(", source_->describe(), "): this pager targets ",
              options_.device.str(), " and was inherited through fork(); an accelerator cannot be used in a forked "
              "child (create the pager in the child, or start worker processes with the spawn method)");
  if (prefetcher_lost_ && !stop_) {  // the parent's prefetch thread does not exist here: start one
    prefetcher_lost_ = false;
    prefetcher_ = std::thread([this] { prefetch_loop(); });
  }
}

at::Tensor LayerPager::hand_out_locked(Entry& e) {
  const at::Tensor& t = e.tensor;
  if (copy_stream_) {
    // Device tensors are allocated on the copy stream: once freed, their memory must not be
    // reused there before the work this caller queues on its own stream has read them.
    c10::impl::VirtualGuardImpl impl(options_.device.type());
    e.tensor.record_stream(impl.getStream(options_.device));
  }
  auto handout = std::make_unique<Handout>(Handout{t.storage(), releases_, &e});
  at::Tensor out = at::for_blob(t.data_ptr(), t.sizes())
                       .strides(t.strides())
                       .context(handout.get(), &LayerPager::release_handout)
                       .options(t.options())
                       .make_tensor();
  handout.release();  // owned by the tensor's storage now
  ++e.holders;
  return out;
}

void LayerPager::release(Entry& e) {
  std::vector<at::Tensor> dead;  // freed after the lock
  std::lock_guard<std::mutex> lock(mutex_);
  --e.holders;
  if (resident_bytes_ > budget_) {
    const int64_t before = stats_.evictions;
    make_room_locked(0, 0, nullptr, dead);
    stats_.release_evictions += stats_.evictions - before;
  }
}

void LayerPager::wait_for_load_locked(std::unique_lock<std::mutex>& lock, Entry& e) {
  const auto start = Clock::now();
  const auto limit = std::chrono::duration<double>(std::min(options_.wait_timeout_seconds, 1e9));
  ++e.waiters;  // keeps the entry from being evicted before this caller takes its reference
  const bool loaded = loaded_.wait_until(lock, start + std::chrono::duration_cast<Clock::duration>(limit),
                                         [&] { return e.state != State::Loading; });
  --e.waiters;
  stats_.stall_seconds += seconds_since(start);
  TORCH_CHECK(loaded, "LayerPager(", source_->describe(), "): waited ", options_.wait_timeout_seconds,
              " s (wait_timeout_seconds) for tensor \"", e.id, "\", which another thread is still loading; "
              "its read of ", source_->describe(), " may be stuck");
}

void LayerPager::note_access_locked(Entry& e) {
  if (recording_) {
    recorded_.push_back(e.id);
    if (recorded_.size() > 16 * entries_.size() + 1024) {  // no second begin_pass(): stop recording
      recording_ = false;
      recorded_.clear();
    }
  }
  if (advance_cursor_locked(e.id)) work_changed_locked();
  e.last_use = ++clock_;
}

at::Tensor LayerPager::acquire(const std::string& id) {
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  Entry& e = entry_locked(id);
  note_access_locked(e);
  bool counted = false;
  while (true) {
    if (e.state == State::Ready) {
      if (!counted) {
        ++stats_.hits;
        if (e.prefetched) ++stats_.prefetch_hits;
      }
      e.prefetched = false;
      return hand_out_locked(e);
    }
    if (e.state == State::Loading) {
      if (!counted) {
        ++stats_.hits;
        if (e.prefetched) ++stats_.prefetch_hits;
        counted = true;
      }
      wait_for_load_locked(lock, e);
      if (e.state == State::Absent && e.error) std::rethrow_exception(e.error);
      continue;
    }
    if (!counted) {
      ++stats_.misses;
      counted = true;
    }
    const auto load_start = Clock::now();
    at::Tensor recycled;
    std::vector<at::Tensor> dead;
    forget_mapping_locked(e);  // the load converts from the pages, then gives them back
    if (!make_room_locked(e.nbytes, 0, recycle_ ? &recycled : nullptr, dead)) ++stats_.over_budget_loads;
    e.state = State::Loading;
    e.prefetched = false;
    e.error = nullptr;
    resident_bytes_ += e.nbytes;
    ++e.waiters;
    lock.unlock();
    dead.clear();
    at::Tensor tensor;
    std::exception_ptr error;
    try {
      tensor = load(e, std::move(recycled));
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    --e.waiters;
    finish_load_locked(e, std::move(tensor), error, seconds_since(load_start), false);
    stats_.stall_seconds += seconds_since(load_start);
    if (error) std::rethrow_exception(error);
  }
}

std::vector<at::Tensor> LayerPager::acquire_many(const std::vector<std::string>& ids) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(ids.size());
  for (const auto& id : ids) tensors.push_back(acquire(id));
  return tensors;
}

bool LayerPager::gathers_rows(const std::string& id) const {
  return options_.device.type() == c10::kCPU && source_->has_view(id) && source_->info(id).shape.size() == 2;
}

at::Tensor LayerPager::gather_rows(const std::string& id, const at::Tensor& indices) {
  c10::ScalarType dtype;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    check_usable_locked();
    dtype = entry_locked(id).dtype;
  }
  TORCH_CHECK(gathers_rows(id), "LayerPager(", source_->describe(), "): cannot gather rows of \"", id,
              "\" (it needs a 2-D tensor, device cpu and a source with views)");
  at::Tensor rows = at::embedding(source_->view(id), indices).to(dtype);
  std::lock_guard<std::mutex> lock(mutex_);
  const Entry& e = entry_locked(id);
  if ((!e.view || e.state == State::Absent) && e.mapped_bytes == 0) source_->release_pages(id);
  return rows;
}

void LayerPager::work_changed_locked() {
  ++work_generation_;
  // Waking the thread costs a context switch; it is only worth it when the thread is idle and
  // a tensor ahead of the cursor is not loaded (a busy thread compares work_generation_ when it
  // finishes, and so never misses the change).
  if (!prefetcher_idle_ || order_.empty()) return;
  const int64_t n = static_cast<int64_t>(order_.size());
  for (int64_t k = 1; k <= std::min(options_.prefetch, n); ++k) {
    if (entries_.at(order_[(cursor_ + k) % n]).state == State::Absent) {
      prefetch_wake_.notify_all();  // see prefetch_loop() for why not notify_one
      return;
    }
  }
}

void LayerPager::finish_load_locked(Entry& e, at::Tensor tensor, std::exception_ptr error, double seconds,
                                    bool prefetch) {
  stats_.load_seconds += seconds;
  if (error) {
    e.state = State::Absent;
    e.error = error;
    e.prefetched = false;
    resident_bytes_ -= e.nbytes;
    // A failed acquire() frees its bytes for the prefetcher; its own failures leave the entry to
    // the next acquire() (it skips entries whose last load failed), so it never retries in a loop.
    if (!prefetch) work_changed_locked();
  } else {
    e.state = State::Ready;
    e.tensor = std::move(tensor);
    e.error = nullptr;
    stats_.bytes_loaded += e.nbytes;
  }
  loaded_.notify_all();
}

namespace {

// A tensor over anonymous pages of its own, unmapped when it dies; undefined when the system
// refuses the mapping (out of memory, or vm.max_map_count mappings reached with many resident
// tensors): c10's allocator may still serve it.
at::Tensor own_pages(const std::vector<int64_t>& shape, c10::ScalarType dtype, int64_t nbytes) {
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t length = (static_cast<size_t>(nbytes) + page - 1) / page * page;
  void* data = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) return at::Tensor();
  auto* pages = new OwnPages{data, length};
  at::Tensor out;
  try {
    out = at::for_blob(data, shape).context(pages, &free_own_pages).options(at::TensorOptions().dtype(dtype)).make_tensor();
  } catch (...) {
    free_own_pages(pages);
    throw;
  }
  if (length >= (4u << 20)) ::madvise(data, length, MADV_HUGEPAGE);  // advisory: 2 MiB faults
  return out;
}

}  // namespace

at::Tensor LayerPager::load_on_cpu(const Entry& e, at::Tensor recycled) {
  const TensorInfo& info = source_->info(e.id);
  at::Tensor out;
  if (recycled.defined()) {
    // Reuse an evicted tensor's memory: no fresh pages to fault in and zero.
    out = at::empty({0}, at::TensorOptions().dtype(e.dtype));
    out.set_(recycled.storage(), 0, info.shape);
  } else if (options_.own_buffers && source_->reads_into_any_buffer() && e.nbytes >= ::sysconf(_SC_PAGESIZE)) {
    out = own_pages(info.shape, e.dtype, e.nbytes);
  }
  if (e.dtype != info.dtype) {
    if (!out.defined()) out = at::empty(info.shape, at::TensorOptions().dtype(e.dtype));
    source_->convert_into(e.id, out);
    return out;
  }
  if (!out.defined()) return source_->load(e.id, /*pin_memory=*/false);
  source_->read_into(e.id, out.data_ptr());  // on error `out` frees its memory
  return out;
}

at::Tensor LayerPager::load(const Entry& e, at::Tensor recycled) {
  if (e.view) {
    at::Tensor view = source_->view(e.id);
    source_->populate(e.id);
    return view;
  }
  if (options_.device.type() == c10::kCPU) return load_on_cpu(e, std::move(recycled));
  // Pinned staging buffer, then a non-blocking copy (converting to the entry's dtype) on the side
  // stream. The destination is allocated on that stream too, so the allocator orders the copy
  // after earlier uses of the memory on it; acquire() records each caller's stream on the tensor
  // for its later reuse.
  at::Tensor staging = source_->load(e.id, /*pin_memory=*/true);
  at::Tensor out;
  {
    c10::StreamGuard guard(*copy_stream_);
    out = at::empty(staging.sizes(), staging.options().pinned_memory(false).device(options_.device).dtype(e.dtype));
    out.copy_(staging, /*non_blocking=*/true);
    c10::Event done(options_.device.type());
    done.record(*copy_stream_);
    done.synchronize();  // the staging buffer may be freed and `out` used on any stream after this
  }
  return out;
}

bool LayerPager::evictable_locked(const Entry& e) const {
  // A handed-out tensor has its own storage over the entry's memory; holders counts those alive.
  return (e.state == State::Ready || e.mapped_bytes > 0) && !e.pinned && e.waiters == 0 && e.holders == 0;
}

void LayerPager::forget_mapping_locked(Entry& e) {
  resident_bytes_ -= e.mapped_bytes;
  e.mapped_bytes = 0;
}

int64_t LayerPager::next_use_distance_locked(const Entry& e) const {
  const auto it = positions_.find(e.id);
  if (it == positions_.end()) return kFar;
  const auto& pos = it->second;
  const int64_t n = static_cast<int64_t>(order_.size());
  const auto next = std::upper_bound(pos.begin(), pos.end(), cursor_);
  return next != pos.end() ? *next - cursor_ : pos.front() + n - cursor_;
}

bool LayerPager::advance_cursor_locked(const std::string& id) {
  if (order_.empty()) return false;
  const int64_t n = static_cast<int64_t>(order_.size());
  const int64_t expected = (cursor_ + 1) % n;
  if (order_[expected] == id) {
    cursor_ = expected;
  } else {
    const auto it = positions_.find(id);
    if (it == positions_.end()) return false;  // not part of the recorded order
    const auto next = std::upper_bound(it->second.begin(), it->second.end(), cursor_);
    cursor_ = next != it->second.end() ? *next : it->second.front();
  }
  ++cursor_generation_;
  return true;
}

void LayerPager::evict_locked(Entry& e, std::vector<at::Tensor>& dead) {
  if (e.mapped_bytes > 0) {  // a streamed weight's pages (state Absent)
    source_->release_pages(e.id);
    forget_mapping_locked(e);
    ++stats_.evictions;
    return;
  }
  if (e.tensor.defined()) dead.push_back(std::move(e.tensor));
  e.tensor = at::Tensor();
  if (e.view) source_->release_pages(e.id);
  e.state = State::Absent;
  e.prefetched = false;
  resident_bytes_ -= e.nbytes;
  ++stats_.evictions;
}

bool LayerPager::make_room_locked(int64_t incoming, int64_t protect_within, at::Tensor* recycled,
                                  std::vector<at::Tensor>& dead) {
  const bool use_order = !order_.empty() && (options_.policy == EvictionPolicy::ScanResistant || protect_within > 0);
  bool evicted = false;
  bool fits = true;
  while (resident_bytes_ + incoming > budget_) {
    Entry* victim = nullptr;
    int64_t victim_distance = -1;
    for (auto& [id, e] : entries_) {
      if (!evictable_locked(e)) continue;
      const int64_t distance = use_order ? next_use_distance_locked(e) : 0;
      if (protect_within > 0 && distance <= protect_within) continue;
      bool better;
      if (victim == nullptr) {
        better = true;
      } else if (options_.policy == EvictionPolicy::ScanResistant && use_order) {
        better = distance > victim_distance || (distance == victim_distance && e.last_use < victim->last_use);
      } else {
        better = e.last_use < victim->last_use;
      }
      if (better) {
        victim = &e;
        victim_distance = distance;
      }
    }
    if (victim == nullptr) {
      fits = false;
      break;
    }
    // Only memory the pager owns is reused: a view's pages are the mapped file's.
    if (recycled != nullptr && !recycled->defined() && !victim->view && victim->tensor.defined() &&
        victim->nbytes == incoming && victim->tensor.storage().nbytes() == static_cast<size_t>(incoming)) {
      *recycled = std::move(victim->tensor);
    }
    evict_locked(*victim, dead);
    evicted = true;
  }
  if (evicted) work_changed_locked();  // a victim may be one of the tensors it should load ahead
  return fits;
}

void LayerPager::begin_pass() {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable_locked();
  if (recording_ && !recorded_.empty()) {
    std::vector<std::string> recorded = std::move(recorded_);
    recorded_.clear();
    recording_ = false;
    order_ = std::move(recorded);
    positions_.clear();
    for (int64_t i = 0; i < static_cast<int64_t>(order_.size()); ++i) positions_[order_[i]].push_back(i);
  } else if (order_.empty() && !recording_) {
    recording_ = true;
    recorded_.clear();
  }
  if (!order_.empty()) {
    cursor_ = static_cast<int64_t>(order_.size()) - 1;  // the pass starts at position 0
    ++cursor_generation_;
    work_changed_locked();
  }
}

void LayerPager::set_order(const std::vector<std::string>& ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable_locked();
  for (const auto& id : ids) entry_locked(id);
  order_ = ids;
  positions_.clear();
  for (int64_t i = 0; i < static_cast<int64_t>(order_.size()); ++i) positions_[order_[i]].push_back(i);
  recording_ = false;
  recorded_.clear();
  cursor_ = order_.empty() ? -1 : static_cast<int64_t>(order_.size()) - 1;
  ++cursor_generation_;
  work_changed_locked();
}

std::vector<std::string> LayerPager::order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return order_;
}

void LayerPager::prefetch_loop() {
  name_this_thread("torch_ext fetch");
  std::unique_lock<std::mutex> lock(mutex_);
  uint64_t handled = work_generation_ - 1;  // look once at start
  while (true) {
    // Idle until there is work. Untimed, and no wake-up can be lost: the predicate is read under
    // mutex_, every change that can give this thread work (the cursor moving, an eviction, a
    // failed acquire, a new order) bumps work_generation_ under mutex_ and notifies while the
    // thread is idle, and the destructor sets stop_ under mutex_ and notifies. notify_all, not
    // notify_one: glibc's pthread_cond_signal can lose a wake-up (sourceware bug 25847; Debian 12
    // has glibc 2.36), the likely cause of what the former 50 ms poll papered over;
    // pthread_cond_broadcast is not affected, and this condition has one waiter.
    prefetcher_idle_ = true;
    prefetch_wake_.wait(lock, [&] { return stop_ || work_generation_ != handled || helped_blocks_; });
    prefetcher_idle_ = false;
    if (stop_) return;
    if (helped_blocks_) {  // a streamed product under way: help its caller make the blocks
      std::shared_ptr<StreamedBlocks> blocks = std::move(helped_blocks_);  // leaves helped_blocks_ empty
      lock.unlock();
      blocks->help();
      blocks.reset();  // unlocked: the last reference frees the caller's tensors, which may be the pager's
      lock.lock();
      continue;
    }
    handled = work_generation_;
    prefetch_ahead_locked(lock);
  }
}

// Loads the tensors ahead of the cursor that are absent, within the budget, until the cursor moves.
void LayerPager::prefetch_ahead_locked(std::unique_lock<std::mutex>& lock) {
  if (order_.empty()) return;
  const uint64_t cursor_generation = cursor_generation_;
  const int64_t n = static_cast<int64_t>(order_.size());
  for (int64_t k = 1; k <= std::min(options_.prefetch, n) && !stop_; ++k) {
    if (cursor_generation_ != cursor_generation) return;  // the caller moved on: start from its new position
    Entry& e = entries_.at(order_[(cursor_ + k) % n]);
    if (e.state != State::Absent || e.error) continue;
    // matmul() streams it: evict nothing for it, and load it whole only into free room where that
    // costs no more than its pages.
    if (e.streamed && (prefers_streaming_locked(e) || resident_bytes_ + e.nbytes > budget_)) continue;
    // Only evict entries needed later than this one; otherwise prefetching would cost a miss.
    at::Tensor recycled;
    std::vector<at::Tensor> dead;
    if (!make_room_locked(e.nbytes, k, recycle_ ? &recycled : nullptr, dead)) return;
    e.state = State::Loading;
    e.prefetched = true;
    resident_bytes_ += e.nbytes;
    ++stats_.prefetches;
    lock.unlock();
    dead.clear();
    at::Tensor tensor;
    std::exception_ptr error;
    const auto start = Clock::now();
    try {
      tensor = load(e, std::move(recycled));
    } catch (...) {
      error = std::current_exception();
    }
    const double seconds = seconds_since(start);
    lock.lock();
    finish_load_locked(e, std::move(tensor), error, seconds, true);
  }
}

int64_t LayerPager::resident_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return resident_bytes_;
}

int64_t LayerPager::resident_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t count = 0;
  for (const auto& [id, e] : entries_) count += e.state == State::Ready;
  return count;
}

bool LayerPager::is_resident(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = entries_.find(id);
  TORCH_CHECK(it != entries_.end(), "LayerPager(", source_->describe(), "): no tensor \"", id, "\" in the source");
  return it->second.state == State::Ready;
}

bool LayerPager::is_pinned(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = entries_.find(id);
  TORCH_CHECK(it != entries_.end(), "LayerPager(", source_->describe(), "): no tensor \"", id, "\" in the source");
  return it->second.pinned;
}

void LayerPager::evict_all() {
  // The prefetcher is not woken: this is for memory pressure, and the next acquire() moves the
  // cursor (which wakes it) anyway.
  std::vector<at::Tensor> dead;  // freed after the lock
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [id, e] : entries_) {
    if (evictable_locked(e)) evict_locked(e, dead);
  }
  if (conversion_scratch_.defined()) dead.push_back(std::move(conversion_scratch_));
}

PagerStats LayerPager::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void LayerPager::reset_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  PagerStats fresh;
  fresh.pinned_over_budget = stats_.pinned_over_budget;
  fresh.largest_tensor_bytes = stats_.largest_tensor_bytes;
  fresh.budget_below_largest_tensor = stats_.budget_below_largest_tensor;
  stats_ = fresh;
}

// pthread_atfork: fork_prepare() takes this pager's locks (Releases first, the order release()
// takes them in), so the child gets its state whole; fork_parent() gives them back.
void LayerPager::fork_prepare() {
  releases_->mutex.lock();
  mutex_.lock();
}

void LayerPager::fork_parent() {
  mutex_.unlock();
  releases_->mutex.unlock();
}

void LayerPager::fork_child() {
  // Only the forking thread exists here, and it is in fork(), not in a pager method: make the
  // locks and conditions new (their waiters are threads of the parent), and redo nothing that
  // other threads had under way: loads they had started never finish here.
  new (&releases_->mutex) std::mutex();
  new (&mutex_) std::mutex();
  new (&loaded_) std::condition_variable();
  new (&prefetch_wake_) std::condition_variable();
  for (auto& [id, e] : entries_) {
    if (e.state == State::Loading) {
      e.state = State::Absent;
      e.prefetched = false;
      resident_bytes_ -= e.nbytes;
    }
    e.waiters = 0;
  }
  // A product another thread of the parent was making: its state may be mid-change, so forget it
  // without destroying it.
  new (&helped_blocks_) std::shared_ptr<StreamedBlocks>();
  if (prefetcher_.joinable()) {
    new (&prefetcher_) std::thread();  // the parent's thread: forget it, never join or detach it
    prefetcher_lost_ = true;
  }
  prefetcher_idle_ = false;
  forked_child_ = true;
}

}  // namespace torch_ext::paging

namespace torch_ext {

c10::IValue FieldCodec<paging::ByteBudget>::expose(const paging::ByteBudget& budget) {
  if (budget.percent < 0) return budget.bytes;
  std::ostringstream out;
  out << budget.percent << "%";
  return out.str();
}

}  // namespace torch_ext
