#include "torch_ext/cache/node_cache.h"

#include <new>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <unordered_set>
#include <utility>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <c10/util/Exception.h>

namespace torch_ext::cache {

namespace {

void collect_tensors(const c10::IValue& value, std::vector<at::Tensor>& out) {
  if (value.isTensor()) {
    out.push_back(value.toTensor());
  } else if (value.isTuple()) {
    for (const auto& element : value.toTupleRef().elements()) {
      collect_tensors(element, out);
    }
  } else if (value.isList()) {
    for (const auto& element : value.toListRef()) {
      collect_tensors(element, out);
    }
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) {
      collect_tensors(entry.value(), out);
    }
  } else if (value.isPyObject()) {
    for (auto& tensor : value.toPyObjectHolder()->extractTensors()) {
      out.push_back(std::move(tensor));
    }
  }
}

// content_inputs where the rule says hashing their tensors pays for the rest (the weights), else 0.
size_t paying_content_inputs(const NodeCacheOptions& options, c10::ArrayRef<c10::IValue> inputs,
                             size_t content_inputs) {
  if (content_inputs == 0) {
    return 0;
  }
  const auto work = InputKey::tensor_bytes(inputs, content_inputs, inputs.size());
  const auto hashed = InputKey::tensor_bytes(inputs, 0, content_inputs);
  return options.keys_by_content(hashed.hashable, work.hashable + work.other) ? content_inputs : 0;
}

}  // namespace

void NodeCacheOptions::validate() const {
  TORCH_CHECK_VALUE(!capacity_bytes || *capacity_bytes >= 0, "NodeCache: capacity_bytes must be None or >= 0, got ",
                    *capacity_bytes);
  TORCH_CHECK_VALUE(content_key_fraction >= 0 && !std::isnan(content_key_fraction),
                    "NodeCache: content_key_fraction must be a number >= 0 (inf: always hash), got ",
                    content_key_fraction);
  TORCH_CHECK_VALUE(entries_per_node >= 1, "NodeCache: entries_per_node must be >= 1, got ", entries_per_node);
}

NodeCache::NodeCache(NodeCacheOptions options)
    : content_options_((options.validate(), options)), capacity_bytes_(options.capacity_bytes.value_or(kUnlimited)) {
  register_fork_participant(this);
}

NodeCache::~NodeCache() { unregister_fork_participant(this); }

void NodeCache::fork_child() {
  new (&mutex_) std::mutex();  // locked by fork_prepare() in the parent's forking thread
}

bool NodeCache::outputs_unchanged(const Entry& entry) const {
  for (const auto& held : entry.outputs) {
    const c10::TensorImpl* impl = held.tensor.unsafeGetTensorImpl();
    if (impl->version_counter().current_version() != held.version || impl->storage().data() != held.data) {
      return false;
    }
  }
  return true;
}

void NodeCache::remove_locked(Entries::iterator it, std::vector<Entry>& dead) {
  for (const void* storage : it->second.storages) {
    auto use = storages_.find(storage);
    if (use != storages_.end() && --use->second.users == 0) {
      cached_bytes_ -= use->second.nbytes;
      storages_.erase(use);
    }
  }
  dead.push_back(std::move(it->second));
  entries_.erase(it);
}

std::optional<c10::IValue> NodeCache::get(int64_t node_id, c10::ArrayRef<c10::IValue> inputs) {
  const ModeKey mode = ModeKey::current();
  DigestMemo digests;
  std::vector<Entry> dead;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(mutex_);
  auto [it, end] = entries_.equal_range(node_id);
  while (it != end) {
    Entry& entry = it->second;
    if (entry.mode == mode && entry.inputs.matches(inputs, &digests)) {
      if (!outputs_unchanged(entry)) {
        remove_locked(it, dead);
        break;
      }
      ++stats_.hits;
      entry.last_use = ++clock_;
      return entry.value;
    }
    const auto next = std::next(it);
    if (entry.inputs.stale() || !outputs_unchanged(entry)) {
      remove_locked(it, dead);  // can never be served again
    }
    it = next;
  }
  ++stats_.misses;
  return std::nullopt;
}

bool NodeCache::make_room_locked(int64_t limit, double incoming_score, const std::vector<const void*>& incoming_storages,
                                 const std::vector<int64_t>& incoming_nbytes, std::vector<Entry>& dead) {
  int64_t total = cached_bytes_;
  for (size_t i = 0; i < incoming_storages.size(); ++i) {
    if (storages_.find(incoming_storages[i]) == storages_.end()) {
      total += incoming_nbytes[i];
    }
  }
  if (total <= limit) {
    return true;
  }
  struct Candidate {
    Entries::iterator entry;
    bool expired;
    double score;
    uint64_t last_use;
  };
  std::vector<Candidate> candidates;
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    const Entry& entry = it->second;
    const bool expired = entry.inputs.expired();
    const double score = entry.cost_seconds / static_cast<double>(std::max<int64_t>(entry.bytes, 1));
    if (entry.bytes > 0 && (expired || score <= incoming_score)) {
      candidates.push_back({it, expired, score, entry.last_use});
    }
  }
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.expired != b.expired) {
      return a.expired;
    }
    if (a.score != b.score) {
      return a.score < b.score;
    }
    return a.last_use < b.last_use;
  });
  const std::unordered_set<const void*> incoming(incoming_storages.begin(), incoming_storages.end());
  std::unordered_map<const void*, int64_t> released;
  size_t victims = 0;
  while (total > limit && victims < candidates.size()) {
    const Entry& entry = candidates[victims++].entry->second;
    for (const void* storage : entry.storages) {
      const StorageUse& use = storages_.at(storage);
      if (use.users - ++released[storage] == 0 && incoming.count(storage) == 0) {
        total -= use.nbytes;
      }
    }
  }
  if (total > limit) {
    return false;
  }
  for (size_t i = 0; i < victims; ++i) {
    remove_locked(candidates[i].entry, dead);
  }
  stats_.evictions += static_cast<int64_t>(victims);
  return true;
}

void NodeCache::make_way_on_node_locked(int64_t node_id, std::vector<Entry>& dead) {
  auto [it, end] = entries_.equal_range(node_id);
  std::optional<Entries::iterator> oldest;
  int64_t held = 0;
  while (it != end) {
    const auto next = std::next(it);
    if (it->second.inputs.stale()) {
      remove_locked(it, dead);
    } else {
      ++held;
      if (!oldest || it->second.last_use < (*oldest)->second.last_use) {
        oldest = it;
      }
    }
    it = next;
  }
  if (held >= content_options_.entries_per_node) {
    remove_locked(*oldest, dead);
  }
}

bool NodeCache::put(int64_t node_id, c10::ArrayRef<c10::IValue> inputs, c10::IValue value, double cost_seconds,
                    const std::optional<std::vector<at::Tensor>>& held_tensors, size_t content_inputs) {
  TORCH_CHECK(std::isfinite(cost_seconds) && cost_seconds >= 0, "NodeCache.put: node ", node_id,
              ": cost_seconds must be a finite number >= 0, got ", cost_seconds);
  TORCH_CHECK(content_inputs <= inputs.size(), "NodeCache.put: node ", node_id, ": content_inputs (", content_inputs,
              ") exceeds the number of inputs (", inputs.size(), ")");
  auto key = InputKey::make(inputs, paying_content_inputs(content_options_, inputs, content_inputs), ContentBytes::kCopy);
  if (!key) {
    return false;
  }
  std::vector<at::Tensor> tensors;
  if (held_tensors) {
    tensors = *held_tensors;
  } else {
    collect_tensors(value, tensors);
  }
  const std::vector<at::Tensor> key_copies = key->content_copies();
  Entry entry;
  entry.inputs = std::move(*key);
  entry.mode = ModeKey::current();
  entry.cost_seconds = cost_seconds;
  std::vector<int64_t> storage_nbytes;
  for (auto& tensor : tensors) {
    if (!tensor.defined()) {
      continue;
    }
    c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
    // In-place changes to the output must be visible (version counter) and its bytes countable.
    if (impl->is_inference() || !impl->has_storage() || impl->is_python_dispatch()) {
      return false;
    }
    const c10::Storage& storage = impl->storage();
    const void* storage_id = storage.unsafeGetStorageImpl();
    entry.outputs.push_back({tensor, impl->version_counter().current_version(), storage.data()});
    if (std::find(entry.storages.begin(), entry.storages.end(), storage_id) == entry.storages.end()) {
      entry.storages.push_back(storage_id);
      storage_nbytes.push_back(static_cast<int64_t>(storage.nbytes()));
      entry.bytes += storage_nbytes.back();
    }
  }
  for (const auto& copy : key_copies) {
    entry.storages.push_back(copy.storage().unsafeGetStorageImpl());
    storage_nbytes.push_back(static_cast<int64_t>(copy.storage().nbytes()));
    entry.bytes += storage_nbytes.back();
  }
  entry.tensor_count = static_cast<int64_t>(entry.outputs.size());
  entry.value = std::move(value);
  const double score = cost_seconds / static_cast<double>(std::max<int64_t>(entry.bytes, 1));

  std::vector<Entry> dead;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(mutex_);
  make_way_on_node_locked(node_id, dead);
  NodeHistory& history = history_[node_id];
  history.bytes = entry.bytes;
  if (!make_room_locked(capacity_bytes_, score, entry.storages, storage_nbytes, dead)) {
    return false;
  }
  for (size_t i = 0; i < entry.storages.size(); ++i) {
    StorageUse& use = storages_[entry.storages[i]];
    if (use.users++ == 0) {
      use.nbytes = storage_nbytes[i];
      cached_bytes_ += use.nbytes;
    }
  }
  if (history.had_entry) {
    stats_.tensors_recomputed += entry.tensor_count;
  }
  history.had_entry = true;
  entry.last_use = ++clock_;
  entries_.emplace(node_id, std::move(entry));
  return true;
}

Seen NodeCache::observe(int64_t source_id, c10::ArrayRef<c10::IValue> inputs, int64_t work_bytes) {
  const bool by_content =
      work_bytes > 0 &&
      content_options_.keys_by_content(InputKey::tensor_bytes(inputs, 0, inputs.size()).hashable, work_bytes);
  DigestMemo digests;
  auto key = InputKey::make(inputs, by_content ? inputs.size() : 0, ContentBytes::kReference, &digests);
  std::vector<InputKey> forgotten;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<InputKey>& recent = observed_[source_id];
  if (!key) {
    forgotten.swap(recent);
    return Seen::kNew;
  }
  size_t found = 0;
  while (found < recent.size() && !recent[found].matches(inputs, &digests)) {
    ++found;
  }
  const Seen seen = found == 0 && !recent.empty() ? Seen::kSame : found < recent.size() ? Seen::kRecurring : Seen::kNew;
  if (found == recent.size()) {
    if (recent.size() >= static_cast<size_t>(content_options_.entries_per_node)) {
      forgotten.push_back(std::move(recent.back()));
      recent.pop_back();
    }
    recent.emplace_back(std::move(*key));
    found = recent.size() - 1;
  } else {
    forgotten.push_back(std::exchange(recent[found], std::move(*key)));  // the latest tensors confirm the bytes
  }
  std::rotate(recent.begin(), recent.begin() + static_cast<std::ptrdiff_t>(found),
              recent.begin() + static_cast<std::ptrdiff_t>(found) + 1);
  return seen;
}

void NodeCache::invalidate_node(int64_t node_id) { invalidate_nodes(c10::ArrayRef<int64_t>(node_id)); }

void NodeCache::invalidate_nodes(c10::ArrayRef<int64_t> node_ids) {
  std::vector<Entry> dead;
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t node_id : node_ids) {
    auto [it, end] = entries_.equal_range(node_id);
    while (it != end) {
      remove_locked(it++, dead);
      ++stats_.invalidations;
    }
  }
}

void NodeCache::invalidate() {
  Entries dead_entries;
  std::unordered_map<int64_t, std::vector<InputKey>> dead_keys;
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.invalidations += static_cast<int64_t>(entries_.size());
  dead_entries.swap(entries_);
  dead_keys.swap(observed_);
  storages_.clear();
  cached_bytes_ = 0;
}

int64_t NodeCache::cached_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(entries_.size());
}

int64_t NodeCache::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached_bytes_;
}

std::vector<int64_t> NodeCache::cached_node_ids() const {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ids.reserve(entries_.size());
    for (const auto& [node_id, entry] : entries_) {
      ids.push_back(node_id);
    }
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

NodeCacheOptions NodeCache::options() const {
  NodeCacheOptions options = content_options_;
  options.capacity_bytes = capacity_bytes();
  return options;
}

std::optional<int64_t> NodeCache::capacity_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return capacity_bytes_ == kUnlimited ? std::nullopt : std::optional<int64_t>(capacity_bytes_);
}

void NodeCache::set_capacity_bytes(std::optional<int64_t> capacity_bytes) {
  NodeCacheOptions{capacity_bytes}.validate();
  std::vector<Entry> dead;
  std::lock_guard<std::mutex> lock(mutex_);
  capacity_bytes_ = capacity_bytes.value_or(kUnlimited);
  // Nothing incoming: every entry is a candidate (an infinite score admits all).
  const bool fits = make_room_locked(capacity_bytes_, std::numeric_limits<double>::infinity(), {}, {}, dead);
  TORCH_INTERNAL_ASSERT(fits, "NodeCache.set_capacity_bytes: evicting every entry must fit");
}

int64_t NodeCache::memory_estimate(c10::ArrayRef<int64_t> node_ids) const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t total = 0;
  for (int64_t node_id : node_ids) {
    auto it = history_.find(node_id);
    if (it != history_.end()) {
      total += it->second.bytes;
    }
  }
  return total;
}

int64_t NodeCache::memory_estimate() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t total = 0;
  for (const auto& [node_id, history] : history_) {
    total += history.bytes;
  }
  return total;
}

void NodeCache::record_call(int64_t nodes_computed, int64_t nodes_reused) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.calls += 1;
  stats_.nodes_computed += nodes_computed;
  stats_.nodes_reused += nodes_reused;
}

CacheStats NodeCache::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  CacheStats s = stats_;
  s.entries = static_cast<int64_t>(entries_.size());
  s.cached_bytes = cached_bytes_;
  if (capacity_bytes_ != kUnlimited) s.capacity_bytes = capacity_bytes_;
  const int64_t done = s.nodes_reused + s.nodes_computed;
  s.hit_rate = done > 0 ? static_cast<double>(s.nodes_reused) / static_cast<double>(done) : 0.0;
  return s;
}

void NodeCache::reset_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_ = CacheStats{};
}

}  // namespace torch_ext::cache
