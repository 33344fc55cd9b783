#pragma once
// NodeCache: outputs of graph nodes, reused only while their inputs are unchanged.
//
// An entry holds a node's output (any IValue) and the InputKey and ModeKey it was computed
// under. get() returns it only while every input is the same live tensor at the same version,
// data pointer, storage, sizes, strides, offset, dtype, device and requires_grad, the thread
// is in the same grad / inference / autocast mode, and the output tensors themselves have not
// been changed in place since put(). A node holds up to NodeCacheOptions::entries_per_node
// entries, one per set of inputs (a prompt and a negative prompt encoded by turns both stay);
// put() on a full node replaces its least recently used entry. An entry that can never match
// again (an input freed or changed in place) or whose outputs were changed is dropped when seen.
//
// Inputs are keyed as input_key.h describes, by content where NodeCacheOptions::keys_by_content
// says hashing pays. Bytes held: every storage referenced by a cached output (and the copies of
// content-keyed inputs), counted once however many
// outputs share it (a view of a parameter counts the parameter's storage: it is what the
// cache keeps alive). Tensors saved by a cached output's autograd graph are not counted.
// Over capacity, put() evicts entries whose inputs have been freed, then entries in order of
// measured cost per byte held (cost_seconds / bytes: cheapest to recompute per byte first),
// least recently used first among equals, and only entries cheaper per byte than the new
// one; if that cannot make room the new entry is not stored.
//
// Thread safety: every method may be called from any thread; one mutex guards all state (get()
// and observe() hash and compare content-keyed inputs under it: bytes the content-key rule bounds,
// each input hashed once per call).
// Values are released after the mutex is let go, so a value whose destructor takes another
// lock (a Python object and the GIL) cannot deadlock against the cache. Fork-safe: pthread_atfork
// handlers (torch_ext/common/fork.h) hold the mutex across fork(), so a child inherits whole state and a
// free mutex even when another thread was using the cache.
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "torch_ext/cache/input_key.h"
#include "torch_ext/fields.h"
#include "torch_ext/common/fork.h"

namespace torch_ext::cache {

struct CacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t tensors_recomputed = 0;
  int64_t evictions = 0;
  int64_t invalidations = 0;
  int64_t entries = 0;
  int64_t cached_bytes = 0;
  std::optional<int64_t> capacity_bytes;
  int64_t calls = 0;
  int64_t nodes_computed = 0;
  int64_t nodes_reused = 0;
  double hit_rate = 0;

  static constexpr auto fields() {
    return std::make_tuple(
        field("hits", &CacheStats::hits, "lookups answered from the cache"),
        field("misses", &CacheStats::misses, "lookups that found no valid entry"),
        field("tensors_recomputed", &CacheStats::tensors_recomputed,
              "tensors put for nodes that had been cached before (stale, invalidated or evicted entries)"),
        field("evictions", &CacheStats::evictions, "entries dropped to stay within capacity_bytes"),
        field("invalidations", &CacheStats::invalidations, "entries dropped by invalidate_node(s) / invalidate"),
        field("entries", &CacheStats::entries, "entries held now"),
        field("cached_bytes", &CacheStats::cached_bytes, "bytes held now (each storage once)"),
        field("capacity_bytes", &CacheStats::capacity_bytes, "the byte budget (None: unlimited)"),
        field("calls", &CacheStats::calls, "executor calls recorded with record_call()"),
        field("nodes_computed", &CacheStats::nodes_computed, "nodes those calls ran"),
        field("nodes_reused", &CacheStats::nodes_reused,
              "nodes those calls did not run: served by a lookup, or inside a subgraph whose frontier was"),
        field("hit_rate", &CacheStats::hit_rate, "nodes_reused / (nodes_reused + nodes_computed)"));
  }
};

struct NodeCacheOptions {
  std::optional<int64_t> capacity_bytes;
  bool content_keys = true;
  double content_key_fraction = 0.01;
  int64_t entries_per_node = 4;

  static constexpr auto fields() {
    return std::make_tuple(
        field("capacity_bytes", &NodeCacheOptions::capacity_bytes,
              "the most bytes of cached outputs to hold (None: no limit)"),
        field("content_keys", &NodeCacheOptions::content_keys,
              "key graph inputs by their bytes where that pays (content_key_fraction), so that an equal tensor "
              "in a new object hits; False: by identity only"),
        field("content_key_fraction", &NodeCacheOptions::content_key_fraction,
              "inputs are hashed only when their bytes are at most this fraction of the bytes of the weights "
              "(tensors keyed by identity: parameters, buffers) that the cached work reads (0: never; inf: always)"),
        field("entries_per_node", &NodeCacheOptions::entries_per_node,
              "the most entries a node holds, one per set of inputs (inputs that recur by turns, as a prompt and a "
              "negative prompt, each keep theirs), and the number of recent inputs observe() remembers per source"));
  }
  void validate() const;
  // The rule for content keys: hashing `hashed_bytes` of inputs pays for a cached subgraph that
  // reads `work_bytes` of weights. Deterministic: the hash reads each input byte once, the
  // subgraph each weight byte at least once, so hashing costs at most about this fraction of it.
  bool keys_by_content(int64_t hashed_bytes, int64_t work_bytes) const {
    return content_keys && hashed_bytes > 0 &&
           (std::isinf(content_key_fraction) ||
            static_cast<double>(hashed_bytes) <= content_key_fraction * static_cast<double>(work_bytes));
  }
};

// What observe() found: the inputs equal the last ones observed, equal earlier ones among the
// entries_per_node most recent, or are new.
enum class Seen : int8_t { kSame = 0, kRecurring = 1, kNew = 2 };

class NodeCache : public torch::CustomClassHolder, private ForkParticipant {
 public:
  explicit NodeCache(NodeCacheOptions options = {});
  ~NodeCache() override;
  NodeCache(const NodeCache&) = delete;
  NodeCache& operator=(const NodeCache&) = delete;

  // The node's cached output when its entry is valid for these inputs now; nullopt otherwise
  // (a miss; an invalid entry is dropped).
  std::optional<c10::IValue> get(int64_t node_id, c10::ArrayRef<c10::IValue> inputs);

  // Caches value as node_id's output for these inputs (a full node's least recently used entry
  // makes way). cost_seconds is
  // the measured time to compute it (>= 0). held_tensors: the tensors value holds, when
  // value is opaque to C++ (a Python object); otherwise they are found inside value.
  // Returns false, storing nothing, when an input or output tensor cannot be keyed (see
  // input_key.h) or no room can be made within capacity_bytes.
  // content_inputs: the leading inputs that are the cached work's inputs (the rest: its
  // weights); their tensors are keyed by content when options().keys_by_content(their bytes,
  // the other tensors' bytes) holds, with a private copy of their bytes held by the entry.
  bool put(int64_t node_id, c10::ArrayRef<c10::IValue> inputs, c10::IValue value, double cost_seconds,
           const std::optional<std::vector<at::Tensor>>& held_tensors = std::nullopt, size_t content_inputs = 0);

  // Records the key of inputs under source_id (a namespace apart from node ids, no entry is
  // created), remembering the entries_per_node most recent, and returns whether it is the key
  // recorded last (kSame), an earlier one of them (kRecurring) or none (kNew: also the first
  // time, and when the inputs cannot be keyed). Lets a caller tell inputs that vary from inputs
  // that stay or recur. work_bytes: the bytes of weights the work depending on these inputs
  // reads; where options().keys_by_content(their bytes, work_bytes) holds, an equal tensor in a
  // new object counts as seen (the observed tensors are held to confirm the bytes).
  Seen observe(int64_t source_id, c10::ArrayRef<c10::IValue> inputs, int64_t work_bytes = 0);

  // Drops node_id's entries: the next get() misses and the next put() counts as a recompute.
  void invalidate_node(int64_t node_id);
  void invalidate_nodes(c10::ArrayRef<int64_t> node_ids);
  // Drops every entry and every observed key.
  void invalidate();

  int64_t cached_count() const;
  int64_t cached_bytes() const;
  std::vector<int64_t> cached_node_ids() const;
  std::optional<int64_t> capacity_bytes() const;
  NodeCacheOptions options() const;
  // Evicts (cheapest per byte first) until the cache fits the new capacity (nullopt: unlimited).
  void set_capacity_bytes(std::optional<int64_t> capacity_bytes);

  // Bytes the given nodes' outputs took when last put (each node's distinct storages, one
  // entry per node; storages shared between nodes count per node).
  // Nodes never put count 0. Without node ids: every node ever put.
  int64_t memory_estimate(c10::ArrayRef<int64_t> node_ids) const;
  int64_t memory_estimate() const;

  // Counts one call of an executor that ran nodes_computed nodes and reused nodes_reused (stats).
  void record_call(int64_t nodes_computed, int64_t nodes_reused);

  CacheStats stats() const;
  // Zeroes the counters (hits through nodes_reused); entries, bytes and capacity stay.
  void reset_stats();

 private:
  struct HeldTensor {
    at::Tensor tensor;
    uint32_t version;
    const void* data;
  };
  struct Entry {
    InputKey inputs;
    ModeKey mode;
    c10::IValue value;
    std::vector<HeldTensor> outputs;
    std::vector<const void*> storages;  // distinct StorageImpls of outputs and of content-key copies
    int64_t bytes = 0;                  // their nbytes
    double cost_seconds = 0;
    uint64_t last_use = 0;
    int64_t tensor_count = 0;
  };
  struct StorageUse {
    int64_t nbytes = 0;
    int64_t users = 0;
  };
  struct NodeHistory {
    int64_t bytes = 0;       // entry bytes at the last put
    bool had_entry = false;  // an entry was put once: the next put is a recompute
  };

  void fork_prepare() override { mutex_.lock(); }
  void fork_parent() override { mutex_.unlock(); }
  void fork_child() override;

  bool outputs_unchanged(const Entry& entry) const;
  using Entries = std::unordered_multimap<int64_t, Entry>;
  // Moves the entry out (its storages released from the accounting); the caller destroys
  // it after unlocking.
  void remove_locked(Entries::iterator it, std::vector<Entry>& dead);
  // Before a put: the node's entries that can never match again go, then, when it still holds
  // entries_per_node, its least recently used one.
  void make_way_on_node_locked(int64_t node_id, std::vector<Entry>& dead);
  // Evicts entries per the policy until `incoming` fits with `incoming_storages`; returns
  // false (changing nothing) when it cannot.
  bool make_room_locked(int64_t limit, double incoming_score, const std::vector<const void*>& incoming_storages,
                        const std::vector<int64_t>& incoming_nbytes, std::vector<Entry>& dead);

  static constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

  const NodeCacheOptions content_options_;  // content keys and entries_per_node (immutable)
  mutable std::mutex mutex_;
  int64_t capacity_bytes_;  // kUnlimited: no limit
  int64_t cached_bytes_ = 0;
  uint64_t clock_ = 0;
  Entries entries_;
  std::unordered_map<const void*, StorageUse> storages_;
  std::unordered_map<int64_t, NodeHistory> history_;
  std::unordered_map<int64_t, std::vector<InputKey>> observed_;  // most recent first
  CacheStats stats_;
};

}  // namespace torch_ext::cache
