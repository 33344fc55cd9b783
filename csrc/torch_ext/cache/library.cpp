// torch.classes.torch_ext.NodeCache: the node cache for TorchScript and C++ users.
//
// `inputs` is Any: a list or tuple is keyed element by element, any other value as the one
// input. get() answers None on a miss (so None itself is not worth caching); lookup()
// answers (hit, value). stats() is a Dict[str, int] with CacheStats' field names.
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "torch_ext/cache/node_cache.h"

namespace {

using torch_ext::cache::NodeCache;
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

c10::Dict<std::string, int64_t> stats_dict(const Self& self) {
  const auto s = self->stats();
  c10::Dict<std::string, int64_t> d;
  d.insert("hits", s.hits);
  d.insert("misses", s.misses);
  d.insert("tensors_recomputed", s.tensors_recomputed);
  d.insert("evictions", s.evictions);
  d.insert("invalidations", s.invalidations);
  d.insert("entries", s.entries);
  d.insert("cached_bytes", s.cached_bytes);
  d.insert("capacity_bytes", s.capacity_bytes);
  return d;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  m.class_<NodeCache>("NodeCache")
      .def(torch::init<int64_t>(), "A node cache holding at most capacity_bytes of outputs",
           {torch::arg("capacity_bytes") = NodeCache::kUnlimited})
      .def(
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
          [](const Self& self, int64_t node_id, c10::IValue inputs, c10::IValue value, double cost_seconds) {
            return self->put(node_id, as_inputs(inputs), std::move(value), cost_seconds);
          },
          "Cache value for these inputs; False when not stored",
          {torch::arg("node_id"), torch::arg("inputs"), torch::arg("value"), torch::arg("cost_seconds") = 0.0})
      .def(
          "observe",
          [](const Self& self, int64_t source_id, c10::IValue inputs) {
            return self->observe(source_id, as_inputs(inputs));
          },
          "Whether inputs differ from those last observed under source_id")
      .def("invalidate_node", [](const Self& self, int64_t node_id) { self->invalidate_node(node_id); })
      .def("invalidate", [](const Self& self) { self->invalidate(); })
      .def("cached_count", [](const Self& self) { return self->cached_count(); })
      .def("cached_bytes", [](const Self& self) { return self->cached_bytes(); })
      .def("cached_node_ids", [](const Self& self) { return self->cached_node_ids(); })
      .def("capacity_bytes", [](const Self& self) { return self->capacity_bytes(); })
      .def("set_capacity_bytes", [](const Self& self, int64_t capacity) { self->set_capacity_bytes(capacity); })
      .def("memory_estimate",
           [](const Self& self, std::optional<std::vector<int64_t>> node_ids) {
             return node_ids ? self->memory_estimate(*node_ids) : self->memory_estimate();
           },
           "Bytes the nodes' outputs took when last put (all nodes when None)", {torch::arg("node_ids") = c10::IValue()})
      .def("stats", [](const Self& self) { return stats_dict(self); })
      .def("reset_stats", [](const Self& self) { self->reset_stats(); })
      // A saved module keeps the capacity; cached outputs are not saved.
      .def_pickle([](const Self& self) { return self->capacity_bytes(); },
                  [](int64_t capacity_bytes) { return c10::make_intrusive<NodeCache>(capacity_bytes); });
}
