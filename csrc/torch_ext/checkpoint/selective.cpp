#include "torch_ext/checkpoint/selective.h"

#include <algorithm>
#include <charconv>
#include <mutex>
#include <string_view>
#include <unordered_set>
#include <utility>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/library.h>

#include "torch_ext/checkpoint/frame.h"

namespace torch_ext::checkpoint {

class SavePolicy {
 public:
  struct Group {
    std::string item;  // as spelled
    int64_t every = 1;
    std::vector<int64_t> occurrences;  // sorted; empty: all
    bool saves(int64_t occurrence) const {  // 0-based
      if (!occurrences.empty()) return std::binary_search(occurrences.begin(), occurrences.end(), occurrence);
      return (occurrence + 1) % every == 0;
    }
  };
  struct Rule {
    c10::OperatorHandle op;
    size_t group;
    std::optional<size_t> dropout_argument;  // the op's dropout_p, if it has one
    bool random = false;                     // a random in-place op (bernoulli_): its mask is kept
  };
  std::vector<Group> groups;
  std::vector<Rule> rules;

  const Rule* find(const c10::OperatorHandle& op) const {
    for (const auto& rule : rules) {
      if (rule.op == op) return &rule;
    }
    return nullptr;
  }
};

namespace {

thread_local SelectiveScope* active_scope = nullptr;

void selective_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::DispatchKeySet below = ks & c10::after_ADInplaceOrView_keyset;
  if (active_scope == nullptr) {
    op.redispatchBoxed(below, stack);
    return;
  }
  active_scope->handle(op, below, stack);
}

// The kernel of a savable random in-place op, in place of its ADInplaceOrView kernel: it does what
// that kernel does (runs the op below it, then bumps self's version) around the scope's work.
void random_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const at::Tensor self = (*stack)[stack->size() - op.schema().arguments().size()].toTensor();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    selective_kernel(op, ks, stack);
  }
  self.unsafeGetTensorImpl()->bump_version();
}

// bernoulli_ overwrites every element of self with a draw, so its result is a mask that can be
// kept compactly and copied back; other in-place random ops are not savable.
bool savable_random(const c10::OperatorHandle& op) {
  const auto& name = op.operator_name();
  return name.name == "aten::bernoulli_" && (name.overload_name == "float" || name.overload_name == "Tensor");
}

std::string qualified(const c10::OperatorName& name) {
  return name.name + "." + (name.overload_name.empty() ? std::string("default") : name.overload_name);
}

// The ops given the selective kernel (each once per process; kept for its lifetime).
struct Registry {
  std::mutex mutex;
  std::unordered_set<c10::OperatorName> ops;
  std::vector<std::unique_ptr<torch::Library>> libraries;
};
Registry& registry() {
  static auto* instance = new Registry();  // never destroyed: the dispatcher may outlive static destructors
  return *instance;
}

bool has_selective_kernel(const c10::OperatorHandle& op) {
  std::lock_guard<std::mutex> lock(registry().mutex);
  return registry().ops.count(op.operator_name()) != 0;
}

// Whether the op's output may alias an input (views, in-place ops): an ADInplaceOrView kernel not ours.
bool aliases_input(const c10::OperatorHandle& op) {
  return op.hasKernelForDispatchKey(c10::DispatchKey::ADInplaceOrView) && !has_selective_kernel(op);
}

// Drops the warning the dispatcher gives when random_kernel replaces an op's ADInplaceOrView kernel
// (it does that kernel's work itself).
struct QuietOverride : c10::WarningHandler {
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Overriding a previously registered kernel") == std::string::npos) {
      previous->process(warning);
    }
  }
  c10::WarningHandler* previous = c10::WarningUtils::get_warning_handler();
};

void ensure_registered(const c10::OperatorHandle& op, const std::string& item) {
  const c10::OperatorName& name = op.operator_name();
  const std::string what = "checkpoint: save: " + item + " names " + qualified(name);
  const bool random = savable_random(op);
  TORCH_CHECK_VALUE(!op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd), what,
                    ", which decomposes before autograd (CompositeImplicitAutograd): name the ops it runs instead");
  TORCH_CHECK_VALUE(random || !aliases_input(op), what,
                    ", a view or in-place op: its output aliases an input, so saving it would keep that input");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!r.ops.insert(name).second) return;
  const auto separator = name.name.find("::");
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, name.name.substr(0, separator),
                                                  c10::DispatchKey::ADInplaceOrView, __FILE__, __LINE__);
  const std::string local = name.name.substr(separator + 2) + (name.overload_name.empty() ? "" : "." + name.overload_name);
  if (random) {
    QuietOverride quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    library->impl(local.c_str(), torch::CppFunction::makeFromBoxedFunction<&random_kernel>());
  } else {
    library->impl(local.c_str(), torch::CppFunction::makeFromBoxedFunction<&selective_kernel>());
  }
  r.libraries.push_back(std::move(library));
}

thread_local int64_t tracking_unsafe_views = 0;

// aten::_unsafe_view shares its input's storage but gives its output a version counter of its own
// (autograd does not treat it as a view). at::matmul returns a batched product's output that way,
// and torch's math attention then adds its mask to it in place: a saved bmm output would change
// unseen. While a forward saves outputs the unsafe view shares its input's counter, so that such a
// change shows on the saved output.
void unsafe_view_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::DispatchKeySet below = ks & c10::after_ADInplaceOrView_keyset;
  if (tracking_unsafe_views == 0) {
    op.redispatchBoxed(below, stack);
    return;
  }
  const at::Tensor self = (*stack)[stack->size() - op.schema().arguments().size()].toTensor();
  op.redispatchBoxed(below, stack);
  const at::Tensor& out = stack->back().toTensor();
  if (out.is_alias_of(self)) {
    out.unsafeGetTensorImpl()->set_version_counter(self.unsafeGetTensorImpl()->version_counter());
  }
}

void ensure_unsafe_views_tracked() {
  static const bool registered = [] {
    static auto* library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::ADInplaceOrView,
                                              __FILE__, __LINE__);  // never destroyed, as the Registry's
    library->impl("_unsafe_view", torch::CppFunction::makeFromBoxedFunction<&unsafe_view_kernel>());
    return true;
  }();
  (void)registered;
}

bool is_out_variant(const c10::FunctionSchema& schema) {
  for (const auto& argument : schema.arguments()) {
    if (argument.alias_info() != nullptr && argument.alias_info()->isWrite()) return true;
  }
  return false;
}

bool any_op_named(const std::string& full) {
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name == full) return true;
  }
  return false;
}

// The operators one op item names: "aten::mul.Tensor", "aten.mul.Tensor" (as torch.ops prints it),
// "mul.Tensor" (aten), or without an overload ("aten::mul", "aten.mul", "mul") every functional
// overload of the name.
std::vector<c10::OperatorHandle> ops_named(const std::string& spelled) {
  std::string ns = "aten", text = spelled;
  if (const auto colons = text.find("::"); colons != std::string::npos) {
    ns = text.substr(0, colons);
    text = text.substr(colons + 2);
  } else if (const auto dot = text.find('.'); dot != std::string::npos) {
    const std::string first = text.substr(0, dot), rest = text.substr(dot + 1);
    if (rest.find('.') != std::string::npos || any_op_named(first + "::" + rest)) {
      ns = first;
      text = rest;
    }
  }
  const auto dot = text.find('.');
  const std::string full = ns + "::" + text.substr(0, dot);
  std::vector<c10::OperatorHandle> found;
  if (dot != std::string::npos) {
    const std::string overload = text.substr(dot + 1);
    if (auto op = c10::Dispatcher::singleton().findOp({full, overload == "default" ? "" : overload})) {
      found.push_back(*op);
    }
    return found;
  }
  std::vector<c10::OperatorHandle> unsavable;  // named, so that the error says why
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name != full) continue;
    auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || !op->hasSchema() || (is_out_variant(op->schema()) && !savable_random(*op))) continue;
    const bool savable = (savable_random(*op) || !aliases_input(*op)) &&
                         !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
    (savable ? found : unsavable).push_back(*op);
  }
  return found.empty() ? unsavable : found;
}

std::vector<std::string> family(const std::string& name) {
  if (name == "matmul") return {"aten::mm.default", "aten::addmm.default", "aten::bmm.default", "aten::baddbmm.default"};
  if (name == "attention") {
    return {"aten::_scaled_dot_product_flash_attention_for_cpu.default",
            "aten::_scaled_dot_product_flash_attention.default",
            "aten::_scaled_dot_product_efficient_attention.default",
            "aten::_scaled_dot_product_cudnn_attention.default",
            "aten::_scaled_dot_product_fused_attention_overrideable.default",
            "aten::_flash_attention_forward.default",
            "aten::_efficient_attention_forward.default"};
  }
  if (name == "dropout") return {"aten::bernoulli_.float", "aten::bernoulli_.Tensor"};
  return {};
}

int64_t parse_count(std::string_view text, const std::string& item, const char* what) {
  int64_t value = -1;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  TORCH_CHECK_VALUE(error == std::errc() && end == text.data() + text.size() && value >= 0, "checkpoint: save: ",
                    item, ": ", what, " must be a non-negative integer, got '", std::string(text), "'");
  return value;
}

void add_item(SavePolicy& policy, const std::string& item) {
  std::string_view spelled = item;
  SavePolicy::Group group{item, 1, {}};
  if (const auto slash = spelled.find('/'); slash != std::string_view::npos) {
    group.every = parse_count(spelled.substr(slash + 1), item, "the period after '/'");
    TORCH_CHECK_VALUE(group.every >= 1, "checkpoint: save: ", item, ": the period after '/' must be at least 1");
    spelled = spelled.substr(0, slash);
  } else if (const auto hash = spelled.find('#'); hash != std::string_view::npos) {
    std::string_view list = spelled.substr(hash + 1);
    while (!list.empty()) {
      const auto comma = list.find(',');
      group.occurrences.push_back(parse_count(list.substr(0, comma), item, "an occurrence after '#'"));
      list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
    }
    TORCH_CHECK_VALUE(!group.occurrences.empty(), "checkpoint: save: ", item, ": no occurrence after '#'");
    std::sort(group.occurrences.begin(), group.occurrences.end());
    spelled = spelled.substr(0, hash);
  }
  std::vector<c10::OperatorHandle> ops;
  const auto members = family(std::string(spelled));
  for (const auto& member : members) {
    for (auto& op : ops_named(member)) ops.push_back(op);
  }
  if (members.empty()) ops = ops_named(std::string(spelled));
  TORCH_CHECK_VALUE(!ops.empty(), "checkpoint: save: '", item, "' names no operator; expected 'matmul', 'attention', "
                    "'dropout', 'torchtitan' or an op such as 'aten::mm' or 'aten.mul.Tensor', optionally with '/N' (every N-th "
                    "occurrence) or '#i,j' (those occurrences, from 0)");
  const size_t index = policy.groups.size();
  policy.groups.push_back(std::move(group));
  for (auto& op : ops) {
    TORCH_CHECK_VALUE(policy.find(op) == nullptr, "checkpoint: save: ", item, " names ", qualified(op.operator_name()),
                      ", which an earlier item names too");
    std::optional<size_t> dropout;
    const auto& arguments = op.schema().arguments();
    for (size_t i = 0; i < arguments.size(); ++i) {
      if (arguments[i].name() == "dropout_p") dropout = i;
    }
    const bool random = savable_random(op);
    TORCH_CHECK_VALUE(dropout || random || !op.hasTag(at::Tag::nondeterministic_seeded), "checkpoint: save: ", item,
                      " names ", qualified(op.operator_name()),
                      ", a random op: its replay must draw the forward's numbers again (of the random ops only "
                      "bernoulli_, 'dropout', can be saved)");
    ensure_registered(op, item);
    policy.rules.push_back({op, index, dropout, random});
  }
}

}  // namespace

SaveSpec::SaveSpec(std::vector<std::string> items) : items_(std::move(items)) {
  if (items_.empty()) return;
  ensure_unsafe_views_tracked();
  auto policy = std::make_shared<SavePolicy>();
  for (const auto& item : items_) {
    if (item == "torchtitan") {
      add_item(*policy, "attention");
      add_item(*policy, "matmul/2");
    } else {
      add_item(*policy, item);
    }
  }
  policy_ = std::move(policy);
}

std::vector<SaveRule> save_rules(const SaveSpec& spec) {
  std::vector<SaveRule> rules;
  if (!spec.policy()) return rules;
  for (const auto& rule : spec.policy()->rules) {
    const auto& group = spec.policy()->groups[rule.group];
    rules.push_back({qualified(rule.op.operator_name()), static_cast<int64_t>(rule.group), group.every,
                     group.occurrences});
  }
  return rules;
}

SelectiveScope::SelectiveScope(const SavePolicy* policy, SavedOutputs* saved, Mode mode, const std::string& segment)
    : policy_(policy), saved_(saved), mode_(mode), segment_(segment), enclosing_(active_scope) {
  const bool python_modes = c10::impl::dispatch_mode_enabled();
  if (mode_ == Mode::kRecord && saved_ != nullptr) {
    saved_->python_modes = python_modes;
  } else if (mode_ == Mode::kServe && saved_ != nullptr && saved_->python_modes != python_modes) {
    policy_ = nullptr;  // the ops may differ from the forward's: replay them all
  }
  if (policy_ != nullptr) counts_.assign(policy_->groups.size(), 0);
  active_scope = policy_ != nullptr ? this : nullptr;
  tracks_unsafe_views_ = policy_ != nullptr && saved_ != nullptr && mode_ != Mode::kServe;
  if (tracks_unsafe_views_) ++tracking_unsafe_views;
}

SelectiveScope::~SelectiveScope() {
  active_scope = enclosing_;
  if (!tracks_unsafe_views_) return;
  --tracking_unsafe_views;
  if (mode_ == Mode::kRecord) {
    saved_->release_changed();
    return;
  }
  for (size_t i = 0; i < saved_->probed.size(); ++i) {
    if (SavedOutputs::changed(saved_->entries[i])) std::get<2>(saved_->probed[i]) = -1;
  }
  saved_->entries.clear();
}

bool SavedOutputs::changed(const Entry& entry) {
  for (size_t i = 0; i < entry.outputs.size(); ++i) {
    const c10::IValue& value = entry.outputs[i];
    if (value.isTensor() && value.toTensor().defined() && value.toTensor()._version() != entry.versions[i]) return true;
  }
  return false;
}

void SavedOutputs::release_changed() {
  for (auto& entry : entries) {
    if (!entry.served && changed(entry)) {
      entry.outputs.clear();
      entry.served = true;  // the replay runs the op
    }
  }
}

void SelectiveScope::handle(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack) {
  const SavePolicy::Rule* rule = policy_->find(op);
  // Ops the op runs inside itself are not this segment's (torch's dispatch modes do not see them either).
  struct Pause {
    SelectiveScope* scope = active_scope;
    Pause() { active_scope = nullptr; }
    ~Pause() { active_scope = scope; }
  } pause;
  if (rule == nullptr) {  // registered for another policy
    op.redispatchBoxed(below, stack);
    return;
  }
  const int64_t occurrence = counts_[rule->group]++;
  const size_t n_arguments = op.schema().arguments().size();
  const c10::IValue* arguments = stack->data() + (stack->size() - n_arguments);
  if (mode_ == Mode::kProbe) {
    // What a save keeps: a random op's mask as bool, an op's output storages.
    int64_t bytes = rule->random ? arguments[0].toTensor().numel() : 0;
    op.redispatchBoxed(below, stack);
    for (size_t i = stack->size() - op.schema().returns().size(); !rule->random && i < stack->size(); ++i) {
      if ((*stack)[i].isTensor() && (*stack)[i].toTensor().defined()) {
        bytes += static_cast<int64_t>((*stack)[i].toTensor().storage().nbytes());
      }
    }
    saved_->probed.emplace_back(qualified(op.operator_name()), occurrence, bytes);
    if (rule->random) {
      saved_->entries.push_back({&op.schema(), {}, {}, false, std::nullopt});  // its mask is kept as a copy
    } else {
      record(op, *stack);  // to see whether a later op changes the output
    }
    return;
  }
  bool save = policy_->groups[rule->group].saves(occurrence);
  if (save && rule->dropout_argument) {
    const c10::IValue& p = arguments[*rule->dropout_argument];
    save = p.isDouble() && p.toDouble() == 0.0;
  }
  if (save && rule->random) {  // the default CPU generator's draw, replayed from the forward's state
    save = saved_->rng_replayed && arguments[0].toTensor().is_cpu() && arguments[n_arguments - 1].isNone();
  }
  if (!save) {
    op.redispatchBoxed(below, stack);
    return;
  }
  if (rule->random) {
    if (mode_ == Mode::kServe && serve_random(op, occurrence, *stack)) return;
    const at::Tensor self = arguments[0].toTensor();
    op.redispatchBoxed(below, stack);
    if (mode_ == Mode::kRecord) record_random(op, self);
    return;
  }
  if (mode_ == Mode::kServe && serve(op, occurrence, *stack)) {
    return;
  }
  op.redispatchBoxed(below, stack);  // the forward runs it (and records it); so does a replay that cannot serve it
  if (mode_ == Mode::kRecord) {
    record(op, *stack);
  }
}

void SelectiveScope::record(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  SavedOutputs::Entry entry{&op.schema(), {}, {}, false, std::nullopt};
  const size_t n_returns = op.schema().returns().size();
  for (size_t i = stack.size() - n_returns; i < stack.size(); ++i) {
    const c10::IValue& value = stack[i];
    if (value.isTensor() && value.toTensor().defined()) {
      // An alias that shares the output's version counter (so a later in-place change shows) but
      // not its autograd history (which would keep the graph alive through this record). Made
      // without a dispatch: below autograd, detach() would not share the counter.
      c10::TensorImpl* impl = value.toTensor().unsafeGetTensorImpl();
      entry.outputs.emplace_back(at::Tensor(impl->shallow_copy_and_detach(impl->version_counter(), false)));
      entry.versions.push_back(impl->version_counter().current_version());
    } else {
      entry.outputs.push_back(value);
      entry.versions.push_back(0);
    }
  }
  saved_->entries.push_back(std::move(entry));
}

void SelectiveScope::record_random(const c10::OperatorHandle& op, const at::Tensor& self) {
  at::Tensor mask = self.to(at::kBool);
  const uint32_t version = mask._version();
  saved_->entries.push_back({&op.schema(), {c10::IValue(std::move(mask))}, {version}, false, CpuRng::now()});
}

bool SelectiveScope::serve_random(const c10::OperatorHandle& op, int64_t occurrence, torch::jit::Stack& stack) {
  SavedOutputs::Entry& entry = next_entry(op, occurrence);
  at::Tensor self = stack[stack.size() - op.schema().arguments().size()].toTensor();
  if (entry.served || !entry.rng_after || entry.outputs[0].toTensor().sizes() != self.sizes()) {
    return false;  // drawn again: the generator is where the forward's was before this draw
  }
  self.copy_(entry.outputs[0].toTensor());
  entry.rng_after->apply();
  entry.served = true;
  entry.outputs.clear();
  torch::jit::drop(stack, op.schema().arguments().size());
  stack.emplace_back(std::move(self));
  return true;
}

SavedOutputs::Entry& SelectiveScope::next_entry(const c10::OperatorHandle& op, int64_t occurrence) {
  if (cursor_ >= saved_->entries.size() || saved_->entries[cursor_].op != &op.schema()) {
    throw CheckpointError("checkpoint: the replay of " + segment_ + " departs from its forward at " +
                          qualified(op.operator_name()) + " (occurrence " + std::to_string(occurrence) +
                          "): the forward saved " +
                          (cursor_ < saved_->entries.size() ? "another op there" : "no more outputs") +
                          "; a segment must run the same ops on each call");
  }
  return saved_->entries[cursor_++];
}

bool SelectiveScope::serve(const c10::OperatorHandle& op, int64_t occurrence, torch::jit::Stack& stack) {
  SavedOutputs::Entry& entry = next_entry(op, occurrence);
  if (entry.served || SavedOutputs::changed(entry)) {  // a second replay (a retained graph) runs the op again
    return false;
  }
  // Handed over, not kept: the replay's graph holds the outputs until their backward, as torch's
  // policy pops them from its storage.
  entry.served = true;
  const std::vector<c10::IValue> outputs = std::move(entry.outputs);
  entry.outputs.clear();
  torch::jit::drop(stack, op.schema().arguments().size());
  for (const auto& value : outputs) {
    // A fresh alias for autograd to record the replayed op on, made without a dispatch (as torch's
    // policy returns its stored tensors: no op runs in the replay's place).
    stack.push_back(value.isTensor() && value.toTensor().defined() ? c10::IValue(value.toTensor().variable_data())
                                                                     : value);
  }
  return true;
}

}  // namespace torch_ext::checkpoint
