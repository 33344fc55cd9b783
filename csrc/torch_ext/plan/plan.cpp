// Plans, whatever runs them: building one (its executable from the source; with
// plan_shapes="auto", every kind the bucket can have measured on it, the fastest kept),
// warming it up at its bucket's sizes, running it (padded to its sizes, by its CUDA graph where
// it has one), and capturing that graph once the plan is cached.
#include "torch_ext/plan/plan.h"

#include <algorithm>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "torch_ext/plan/plan_table.h"
#include "torch_ext/plan/traffic.h"

namespace torch_ext::plan {

namespace {

// plan_shapes="auto" times a bucket's plans at most at this many of its logged sizes.
constexpr size_t kTrafficProbes = 8;

std::string shapes_of(const std::vector<c10::IValue>& example) {
  std::ostringstream shapes;
  for (size_t i = 0; i < example.size(); ++i) {
    shapes << (i ? ", " : "");
    if (example[i].isTensor()) shapes << example[i].toTensor().sizes(); else shapes << example[i].tagKind();
  }
  return shapes.str();
}

// A run on an accelerator returns once its kernels are queued; a timing waits for them (and, before
// it starts, for what was queued earlier), so a plan is timed by what it costs the device.
void wait_for_device(const std::vector<c10::IValue>& inputs) {
  for (const auto& v : inputs) {
    if (v.isTensor() && v.toTensor().defined() && !v.toTensor().is_cpu()) {
      const c10::Device device = v.toTensor().device();
      c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
      return;
    }
  }
}

}  // namespace

// The fastest of `calls` runs after the first (which may profile, compile or fill caches); the
// only one when calls is 1.
int64_t fastest_run(Executable& exec, const std::vector<c10::IValue>& inputs, int64_t calls) {
  int64_t best = 0;
  for (int64_t i = 0; i < calls; ++i) {
    wait_for_device(inputs);
    const auto start = Clock::now();
    exec.run_single(inputs);
    wait_for_device(inputs);
    const int64_t ns = elapsed_ns(start);
    if (i == 1 || calls == 1 || (i > 1 && ns < best)) best = ns;
  }
  return best;
}

void PlanCache::make_executable(Plan& plan, const std::vector<c10::IValue>& example) {
  int64_t compiles = 0;
  const bool ranged = source_->builds_dynamic() && !(plan.spec.lower == plan.spec.upper);
  const bool scripts = source_->builds_script();
  const PlanShapes shapes = options_.plan_shapes;
  TORCH_CHECK(shapes != PlanShapes::script || scripts, "plan_shapes='script' is for an exported program's cache that has "
              "the module the program was exported from, scripted (set_script_module; torch_ext.PlanCache sets it "
              "for an nn.Module that torch.jit.script takes)");
  // The candidates: a static plan (where a bucket is one size, or plan_shapes asks for it), a
  // dynamic one over the bucket's range, a TorchScript one (any size runs as it is).
  bool fixed = shapes == PlanShapes::static_ || shapes == PlanShapes::auto_ || (shapes == PlanShapes::dynamic && !ranged);
  const bool over_range = ranged && (shapes == PlanShapes::dynamic || shapes == PlanShapes::auto_);
  const bool scripted = scripts && (shapes == PlanShapes::script || shapes == PlanShapes::auto_);
  // A static plan serves a bucket's smaller sizes padded: not along a dimension never padded.
  for (int k = 1; k < plan.spec.upper.rank; ++k) {
    if (plan.spec.lower[k] < plan.spec.upper[k] && !layout_->pads(k)) {
      TORCH_CHECK(over_range || scripted, "the bucket spans ", layout_->name(k), " sizes ", plan.spec.lower[k], "..",
                  plan.spec.upper[k], ", which a static plan serves only padded, and ", layout_->name(k),
                  " is not padded (no pad_values): give pad_values, use plan_shapes='dynamic', or bucket every ",
                  layout_->name(k), " size on its own");
      fixed = false;
    }
  }
  std::vector<PlanSpec> candidates;
  for (const auto& [wanted, dynamic, script] : {std::tuple{fixed, false, false}, std::tuple{over_range, true, false},
                                                std::tuple{scripted, true, true}}) {
    if (!wanted) continue;
    candidates.push_back(plan.spec);
    candidates.back().dynamic = dynamic;
    candidates.back().script = script;
  }
  if (candidates.size() == 1) {
    plan.spec = candidates[0];
    plan.exec = source_->build(plan.spec, example, compiles);
  } else {
    // Each candidate, timed on the same probe sizes: the sizes the traffic log has in the bucket
    // (its most requested), each weighted by its requests; with none, the bucket's smallest,
    // middle and largest sizes, alike. A static plan runs every probe padded to the largest
    // sizes, the others run each as it is. The fastest serves; stats keep every figure.
    std::vector<std::pair<Bucket, int64_t>> probes = traffic_->within(plan.spec.lower, plan.spec.upper, kTrafficProbes);
    plan.probe_sizes = static_cast<int64_t>(probes.size());
    if (probes.empty()) {
      for (int probe = 0; probe < 3; ++probe) {
        Bucket sizes = plan.spec.upper;
        for (int k = 0; k < sizes.rank; ++k) {
          const int64_t lo = plan.spec.lower[k], hi = plan.spec.upper[k];
          sizes[k] = probe == 0 ? lo : probe == 1 ? lo + (hi - lo) / 2 : hi;
        }
        probes.emplace_back(sizes, 1);
      }
    }
    c10::AutoGradMode no_grad(false);
    int64_t best_ns = 0;
    for (const PlanSpec& spec : candidates) {
      auto exec = source_->build(spec, example, compiles);
      int64_t ns = 0;
      if (!spec.dynamic) {
        ns = fastest_run(*exec, example, options_.warmup_calls);
      } else {
        double weighted_ns = 0, requests = 0;
        for (const auto& [sizes, count] : probes) {
          weighted_ns += static_cast<double>(count) *
                         static_cast<double>(fastest_run(*exec, layout_->resize(example, sizes), options_.warmup_calls));
          requests += static_cast<double>(count);
        }
        ns = static_cast<int64_t>(weighted_ns / requests);
      }
      (spec.script ? plan.script_ns : spec.dynamic ? plan.dynamic_ns : plan.static_ns) = ns;
      if (!plan.exec || ns < best_ns) {
        best_ns = ns;
        plan.spec = spec;
        plan.exec = std::move(exec);
      }
    }
  }
  plan.record->compiles.fetch_add(compiles, std::memory_order_relaxed);
}

std::shared_ptr<PlanCache::Plan> PlanCache::build_plan(const Bucket& bucket, const std::vector<c10::IValue>& example,
                                                       bool background) {
  const auto start = Clock::now();
  auto plan = std::make_shared<Plan>();
  plan->spec.upper = bucket;
  plan->spec.lower = layout_->lower_of(bucket);
  plan->spec.background = background;
  plan->record = table_->record(bucket);
  try {
    make_executable(*plan, example);
    plan->constants = plan->exec->constants();
    for (const auto& [storage, bytes] : plan->constants) plan->bytes += bytes;
    c10::AutoGradMode no_grad(false);
    plan->warm_ns = fastest_run(*plan->exec, example, options_.warmup_calls);
    // Captured once the plan is cached: by get_or_build on the building thread, or by the plan's
    // first run when the background worker built it.
    if (options_.cuda_graphs && on_cuda(example)) plan->capture_pending.store(true, std::memory_order_relaxed);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "PlanCache: building the plan for ", layout_->describe(bucket), " failed on inputs of shape (",
                shapes_of(example), "): ", message_of(e));
  }
  plan->build_ns = elapsed_ns(start);
  plan->record->builds.fetch_add(1, std::memory_order_relaxed);
  plan->record->build_ns.fetch_add(plan->build_ns, std::memory_order_relaxed);
  return plan;
}

c10::IValue PlanCache::run_plan(Plan& plan, const std::vector<c10::IValue>& inputs) {
  const auto start = Clock::now();
  c10::AutoGradMode no_grad(false);
  c10::IValue output;
  if (plan.capture_pending.load(std::memory_order_acquire)) capture_graph(plan, inputs);
  try {
    if (!plan.capture_pending.load(std::memory_order_acquire) && plan.graph && plan.graph->serves(inputs)) {
      output = plan.graph->replay(inputs);
      plan.record->graph_replays.fetch_add(1, std::memory_order_relaxed);
    } else {
      output = plan.exec->run(inputs);
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "PlanCache: the plan for ", layout_->describe(plan.bucket()), " failed: ", message_of(e));
  }
  plan.record->plan_runs.fetch_add(1, std::memory_order_relaxed);
  plan.record->plan_ns.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  return output;
}

c10::IValue PlanCache::run_on(Plan& plan, const std::vector<c10::IValue>& inputs, const Bucket& sizes,
                              SizeRecord& rec) {
  const Bucket target = plan.target(sizes);
  if (target == sizes) {
    c10::IValue output = run_plan(plan, inputs);
    layout_->check_output(output, sizes, plan.bucket());
    return output;
  }
  rec.padded_elements.fetch_add(static_cast<int64_t>(target.volume() - sizes.volume()), std::memory_order_relaxed);
  return layout_->slice_output(run_plan(plan, layout_->pad(inputs, sizes, target)), sizes, target);
}

void PlanCache::capture_graph(Plan& plan, const std::vector<c10::IValue>& inputs) {
  std::unique_lock<std::mutex> capturing(plan.capture_mutex, std::try_to_lock);
  // Another thread is capturing it: this call runs the plan's executable meanwhile.
  if (!capturing.owns_lock() || !plan.capture_pending.load(std::memory_order_acquire)) return;
  const auto start = Clock::now();
  std::unique_ptr<CapturedGraph> graph;
  try {
    // Captured at the plan's largest sizes, which every static plan's runs have.
    const auto example = layout_->resize(inputs, plan.bucket());
    graph = capture_cuda_graph([&plan](const std::vector<c10::IValue>& in) { return plan.exec->run_single(in); },
                               example);
  } catch (const std::exception& e) {
    graph_capture_failures_.fetch_add(1, std::memory_order_relaxed);
    TORCH_WARN("PlanCache: the plan for ", layout_->describe(plan.bucket()), " runs without a CUDA graph: ",
               message_of(e));
  }
  plan.record->build_ns.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  if (graph) table_->attach_graph(plan, std::move(graph));
  plan.capture_pending.store(false, std::memory_order_release);
}

c10::IValue PlanCache::run_source(const std::vector<c10::IValue>& inputs) {
  c10::AutoGradMode no_grad(false);
  return source_->run_source(inputs);
}

}  // namespace torch_ext::plan
