// torch.classes.torch_ext.NodeCache / CacheStats: the node cache for TorchScript, Python and C++.
// The constructor takes NodeCacheOptions' options as keywords.
//
// `inputs` is Any: a list or tuple is keyed element by element, any other value as the one
// input. get() answers None on a miss (so None itself is not worth caching); lookup() answers
// (hit, value). Python code that caches Python objects (the LazyExecutor) reaches the same cache
// through torch_ext._C.cache.PythonValues.
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/List.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "torch_ext/cache/node_cache.h"
#include "torch_ext/class_fields.h"

namespace {

using torch_ext::cache::CacheStats;
using torch_ext::cache::NodeCache;
using torch_ext::cache::NodeCacheOptions;
using Self = c10::intrusive_ptr<NodeCache>;

std::vector<c10::IValue> as_inputs(const c10::IValue& inputs) {
  if (inputs.isList()) {
    const auto list = inputs.toListRef();
    // Parentheses: braces would pick the initializer_list constructor (two IValue(bool)s).
    return std::vector<c10::IValue>(list.begin(), list.end());
  }
  if (inputs.isTuple()) {
    const auto& elements = inputs.toTupleRef().elements();
    return std::vector<c10::IValue>(elements.begin(), elements.end());
  }
  return {inputs};
}

// Invalidation, accounting, stats and pickling: everything but the lookups.
void def_housekeeping(torch::class_<NodeCache>& cls) {
  cls.def("invalidate_node", &NodeCache::invalidate_node)
      .def("invalidate_nodes", [](const Self& self, std::vector<int64_t> node_ids) { self->invalidate_nodes(node_ids); })
      .def("invalidate", &NodeCache::invalidate)
      .def("cached_count", &NodeCache::cached_count)
      .def("cached_bytes", &NodeCache::cached_bytes)
      .def("cached_node_ids", &NodeCache::cached_node_ids)
      .def("set_capacity_bytes", &NodeCache::set_capacity_bytes,
           "Evict (cheapest per byte first) until the cache fits the new capacity (None: no limit)")
      .def(
          "memory_estimate",
          [](const Self& self, std::optional<std::vector<int64_t>> node_ids) {
            return node_ids ? self->memory_estimate(*node_ids) : self->memory_estimate();
          },
          "Bytes the nodes' outputs took when last put (all nodes when None)", {torch::arg("node_ids") = c10::IValue()})
      .def("record_call", &NodeCache::record_call, "Count an executor call in stats()")
      .def("stats", [](const Self& self) { return torch_ext::box(self->stats()); })
      .def("reset_stats", &NodeCache::reset_stats)
      // Test hook (process-wide): truncate content digests to `bits` bits to force collisions.
      .def_static("_set_digest_bits_for_testing", [](int64_t bits) {
        torch_ext::cache::set_digest_bits_for_testing(static_cast<int>(bits));
      })
      // A saved module keeps the options; cached outputs are not saved.
      .def_pickle(
          [](const Self& self) {
            const NodeCacheOptions options = self->options();
            return std::make_tuple(options.capacity_bytes, options.content_keys, options.content_key_fraction,
                                   options.entries_per_node);
          },
          [](std::tuple<std::optional<int64_t>, bool, double, int64_t> state) {
            auto [capacity_bytes, content_keys, content_key_fraction, entries_per_node] = std::move(state);
            return c10::make_intrusive<NodeCache>(
                NodeCacheOptions{capacity_bytes, content_keys, content_key_fraction, entries_per_node});
          });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  torch_ext::register_stats<CacheStats>(m, "CacheStats");
  auto cls = m.class_<NodeCache>("NodeCache");
  torch_ext::def_options_init<NodeCacheOptions>(
      cls, {}, [](NodeCacheOptions options) { return c10::make_intrusive<NodeCache>(options); },
      "Node outputs reused only while their inputs are unchanged (csrc/torch_ext/cache/node_cache.h)");
  torch_ext::def_option_properties<NodeCacheOptions>(cls, [](const Self& self) { return self->options(); });
  cls.def(
         "get",
         [](const Self& self, int64_t node_id, c10::IValue inputs) -> c10::IValue {
           auto value = self->get(node_id, as_inputs(inputs));
           return value ? std::move(*value) : c10::IValue();
         },
         "The cached output for these inputs, or None")
      .def(
          "lookup",
          [](const Self& self, int64_t node_id, c10::IValue inputs) -> std::tuple<bool, c10::IValue> {
            auto value = self->get(node_id, as_inputs(inputs));
            return value ? std::make_tuple(true, std::move(*value)) : std::make_tuple(false, c10::IValue());
          },
          "(True, output) when cached for these inputs, else (False, None)")
      .def(
          "put",
          [](const Self& self, int64_t node_id, c10::IValue inputs, c10::IValue value, double cost_seconds,
             int64_t content_inputs) {
            TORCH_CHECK_VALUE(content_inputs >= 0, "NodeCache.put: content_inputs must be >= 0, got ", content_inputs);
            return self->put(node_id, as_inputs(inputs), std::move(value), cost_seconds, std::nullopt,
                             static_cast<size_t>(content_inputs));
          },
          "Cache value for these inputs (the first content_inputs of them keyed by content where that pays); "
          "False when not stored",
          {torch::arg("node_id"), torch::arg("inputs"), torch::arg("value"), torch::arg("cost_seconds") = 0.0,
           torch::arg("content_inputs") = 0})
      .def(
          "observe",
          [](const Self& self, int64_t source_id, c10::IValue inputs, int64_t work_bytes) {
            return static_cast<int64_t>(self->observe(source_id, as_inputs(inputs), work_bytes));
          },
          "0 when inputs equal those last observed under source_id, 1 when they equal earlier ones among the "
          "entries_per_node most recent, 2 when new (by content where that pays for work_bytes of weights)",
          {torch::arg("source_id"), torch::arg("inputs"), torch::arg("work_bytes") = 0})
      .def(
          "keys_by_content",
          [](const Self& self, int64_t hashed_bytes, int64_t work_bytes) {
            return self->options().keys_by_content(hashed_bytes, work_bytes);
          },
          "The content-key rule (NodeCacheOptions::keys_by_content): whether hashing hashed_bytes of inputs pays "
          "for work that reads work_bytes of weights");
  def_housekeeping(cls);
}
