#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <ATen/core/Tensor.h>
#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <c10/core/GradMode.h>
#include <c10/util/ScopeExit.h>
#include <c10/util/irange.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/library.h>

#include "torch_ext/plan/batcher.h"
#include "torch_ext/plan/build_worker.h"
#include "torch_ext/common/sha256.h"
#include "torch_ext/plan/layout.h"
#include "torch_ext/plan/persistence.h"
#include "torch_ext/plan/plan.h"
#include "torch_ext/plan/plan_table.h"
#include "torch_ext/plan/router.h"
#include "torch_ext/plan/traffic.h"
#include "torch_ext/plan/plan_cache.h"
#include "reliability_helpers.h"

namespace plan = torch_ext::plan;
using plan::MissMode;
using plan::PlanCache;
using plan::PlanCacheOptions;

namespace {

constexpr int64_t kFeatures = 8;

torch::jit::Module make_module(const std::string& name, const std::string& source, bool training = false,
                               const torch::jit::ResolverPtr& resolver = nullptr) {
  torch::jit::Module m(name);
  m.register_attribute("training", c10::BoolType::get(), training);
  m.register_parameter("w", at::randn({kFeatures, kFeatures}), false);
  m.register_parameter("b", at::randn({kFeatures}), false);
  m.define(source, resolver);
  return m;
}

// Row-wise, correctly rounded math (mul, add, relu): each output row depends on its input row
// only and vectorised and scalar loops round alike, so plans at any size, padding and
// splitting must be bit-identical to the module.
torch::jit::Module rowwise() {
  return make_module("RowWise", R"JIT(
def forward(self, x):
    return torch.relu(x * self.b + 0.5) * 2.0
)JIT");
}

// A matmul and a tuple output: results agree up to GEMM rounding, which depends on the
// batch size (blocking) and on freezing (transposed weights).
torch::jit::Module linear() {
  return make_module("Linear", R"JIT(
def forward(self, x):
    y = torch.relu(torch.matmul(x, self.w) + self.b)
    return (y, y.sum(1))
)JIT");
}

// A module whose runs at 40 rows or more wait for the test: torch_ext_test::gate(x) returns a copy
// of x, and at such sizes first says it was entered, then blocks until the test opens it.
struct Gate {
  std::mutex mutex;
  std::condition_variable changed;
  bool entered = false;
  bool open = false;
};

Gate& gate() {
  static Gate g;
  return g;
}

at::Tensor gate_op(const at::Tensor& x) {
  if (x.size(0) >= 40) {
    Gate& g = gate();
    std::unique_lock lock(g.mutex);
    g.entered = true;
    g.changed.notify_all();
    g.changed.wait(lock, [&] { return g.open; });
  }
  return x.clone();
}

// Opens or closes the gate; closing it begins a new wait (nothing has entered yet).
void set_gate_open(bool open) {
  Gate& g = gate();
  {
    std::lock_guard lock(g.mutex);
    g.open = open;
    if (!open) g.entered = false;
  }
  g.changed.notify_all();
}

// Whether a run entered the closed gate within 60 s (the wait only bounds a hang).
bool gate_entered() {
  Gate& g = gate();
  std::unique_lock lock(g.mutex);
  return g.changed.wait_for(lock, std::chrono::seconds(60), [&] { return g.entered; });
}

// TorchScript's C++ compiler resolves `torch` only; this adds `torch_ext_test`, this file's ops.
struct TestOpsResolver : torch::jit::NativeResolver {
  std::shared_ptr<torch::jit::SugaredValue> resolveValue(const std::string& name, torch::jit::GraphFunction& m,
                                                         const torch::jit::SourceRange& loc) override {
    if (name == "torch_ext_test") return std::make_shared<torch::jit::BuiltinModule>(name);
    return NativeResolver::resolveValue(name, m, loc);
  }
};

torch::jit::Module gated_at_large_sizes() {
  return make_module("Gated", R"JIT(
def forward(self, x):
    return torch_ext_test.gate(x) * self.b
)JIT", /*training=*/false, std::make_shared<TestOpsResolver>());
}

// Cost a + b * n with a == 3b: splitting 2 into 1 + 1 costs 8b, padding it to 16 costs 19b;
// splitting 15 into ones costs 60b, padding it to 16 costs 19b. The loop only burns time:
// the output is the row-wise function, exact at every size.
torch::jit::Module linear_cost() {
  return make_module("LinearCost", R"JIT(
def forward(self, x):
    z = x.clone()
    for _ in range(90 + 30 * x.size(0)):
        z = z * 0.999 + 0.001
    return torch.relu(x * self.b + 0.5) * 2.0 + z * 0.0
)JIT");
}

at::Tensor input(int64_t n) { return at::randn({n, kFeatures}); }

at::Tensor reference(torch::jit::Module& m, const at::Tensor& x) {
  c10::AutoGradMode no_grad(false);
  return m.forward({x}).toTensor();
}

at::Tensor run(PlanCache& cache, const at::Tensor& x) { return cache.infer({x}).toTensor(); }

PlanCacheOptions options(MissMode mode = MissMode::exact) {
  PlanCacheOptions o;
  o.miss_mode = mode;
  o.warmup_calls = 2;
  return o;
}

const plan::SizeStats* size_stats(const plan::PlanCacheStats& s, int64_t n) {
  for (const auto& z : s.sizes) {
    if (z.batch_size == n) return &z;
  }
  return nullptr;
}

}  // namespace

TORCH_LIBRARY(torch_ext_test, m) { m.def("gate(Tensor x) -> Tensor", gate_op); }

TEST(Plan, ExactModeEqualsTheModuleAtEverySize) {
  auto m = rowwise();
  PlanCache cache(m, options());
  for (int64_t n : {1, 3, 8, 3, 1, 17}) {
    auto x = input(n);
    EXPECT_TRUE(at::equal(run(cache, x), reference(m, x))) << "batch size " << n;
  }
  EXPECT_EQ(cache.cached_sizes(), (std::vector<int64_t>{1, 3, 8, 17}));
  const auto s = cache.stats();
  EXPECT_EQ(s.calls, 6);
  EXPECT_EQ(s.misses, 4);
  EXPECT_EQ(s.hits, 2);
  EXPECT_EQ(s.builds, 4);
  EXPECT_GT(s.build_seconds, 0);
  EXPECT_GT(s.plan_bytes, 0);
  EXPECT_EQ(size_stats(s, 3)->calls, 2);
  EXPECT_EQ(size_stats(s, 3)->hits, 1);
  EXPECT_GT(s.hit_lookup_seconds, 0);
}

TEST(Plan, PlansWithAndWithoutShapeSpecialisationEqualTheModuleAndOnlySpecialisedOnesAreClones) {
  auto m = rowwise();
  for (bool specialize : {true, false}) {
    PlanCacheOptions o = options();
    o.specialize_shapes = specialize;
    PlanCache cache(m, o);
    for (int64_t n : {2, 5, 2}) {
      auto x = input(n);
      EXPECT_TRUE(at::equal(run(cache, x), reference(m, x))) << "specialize " << specialize << ", batch size " << n;
    }
    EXPECT_EQ(cache.stats().hits, 1);
    // Specialised plans are clones, a type each; the others share the optimised module.
    EXPECT_EQ(cache.plan_module(2)->type() == cache.plan_module(5)->type(), !specialize);
  }
}

TEST(Plan, TupleOutputsOfAMatmulModelAgree) {
  auto m = linear();
  PlanCache cache(m, options());
  for (int64_t n : {2, 5, 2}) {
    auto x = input(n);
    auto got = cache.infer({x}).toTupleRef().elements();
    c10::AutoGradMode no_grad(false);
    auto want = m.forward({x}).toTupleRef().elements();
    ASSERT_EQ(got.size(), 2u);
    EXPECT_TRUE(at::allclose(got[0].toTensor(), want[0].toTensor(), 1e-5, 1e-5));
    EXPECT_TRUE(at::allclose(got[1].toTensor(), want[1].toTensor(), 1e-5, 1e-5));
  }
}

TEST(Plan, PadRoundsUpToTheSmallestCachedSizeAndSlices) {
  auto m = rowwise();
  PlanCache cache(m, options(MissMode::pad));
  cache.preload({4, 8, 16}, {input(2)});
  const auto builds = cache.stats().builds;
  auto x = input(5);
  EXPECT_TRUE(at::equal(run(cache, x), reference(m, x)));
  const auto s = cache.stats();
  EXPECT_EQ(s.builds, builds);  // served by the plan for 8
  EXPECT_EQ(s.padded_calls, 1);
  EXPECT_EQ(s.padded_elements, 3);
  EXPECT_EQ(size_stats(s, 8)->plan_runs, 1);
  // Above every cached size there is nothing to pad to: the exact plan is built.
  auto big = input(20);
  EXPECT_TRUE(at::equal(run(cache, big), reference(m, big)));
  EXPECT_TRUE(cache.contains(20));
}

TEST(Plan, SplitRunsASumOfCachedSizesLargestFirst) {
  auto m = rowwise();
  PlanCache cache(m, options(MissMode::split));
  cache.preload({1, 4}, {input(1)});
  auto x = input(11);  // 4 + 4 + 1 + 1 + 1
  EXPECT_TRUE(at::equal(run(cache, x), reference(m, x)));
  const auto s = cache.stats();
  EXPECT_EQ(s.split_calls, 1);
  EXPECT_EQ(size_stats(s, 4)->plan_runs, 2);
  EXPECT_EQ(size_stats(s, 1)->plan_runs, 3);
  EXPECT_FALSE(cache.contains(11));
}

TEST(Plan, SplitConcatenatesTupleOutputs) {
  auto m = linear();
  PlanCache cache(m, options(MissMode::split));
  cache.preload({2, 3}, {input(1)});
  auto x = input(7);  // 3 + 2 + 2: greedy 3 + 3 would leave 1 uncovered
  auto got = cache.infer({x}).toTupleRef().elements();
  c10::AutoGradMode no_grad(false);
  auto want = m.forward({x}).toTupleRef().elements();
  EXPECT_TRUE(at::allclose(got[0].toTensor(), want[0].toTensor(), 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(got[1].toTensor(), want[1].toTensor(), 1e-5, 1e-5));
  EXPECT_EQ(cache.stats().split_calls, 1);
}

// Which route auto takes depends on the latencies it measures (the user asked for measuring);
// PlanRouter's test checks the choice on given latencies. Here: every miss takes exactly one route
// and gives the module's values.
TEST(Plan, AutoServesEachMissByPaddingOrSplittingWithTheModulesValues) {
  auto m = linear_cost();
  PlanCacheOptions o = options(MissMode::auto_);
  o.warmup_calls = 3;  // the profiling executor optimises on the 2nd call: time the 3rd
  PlanCache cache(m, o);
  cache.preload({1, 16}, {input(1)});
  int64_t calls = 0;
  for (int64_t n : {2, 15, 7}) {
    auto x = input(n);
    EXPECT_TRUE(at::equal(run(cache, x), reference(m, x))) << n;
    const auto s = cache.stats();
    EXPECT_EQ(s.split_calls + s.padded_calls, ++calls) << n;
  }
}

TEST(Plan, BatchDimensionIsConfigurablePerInput) {
  torch::jit::Module m("TwoInputs");
  m.register_attribute("training", c10::BoolType::get(), false);
  m.define(R"JIT(
def forward(self, x, y, scale: float):
    return (x + y.t()) * scale
)JIT");
  PlanCacheOptions o = options(MissMode::pad);
  o.batch_dims = {0, 1, -1};
  PlanCache cache(m, o);
  cache.preload({4}, {at::randn({2, 3}), at::randn({3, 2}), c10::IValue(2.0)});
  auto x = at::randn({3, 3});
  auto y = at::randn({3, 3});
  auto got = cache.infer({x, y, c10::IValue(2.0)}).toTensor();
  EXPECT_TRUE(at::equal(got, (x + y.t()) * 2.0));
  EXPECT_EQ(cache.stats().padded_calls, 1);
}

TEST(Plan, BackgroundBuildServesByPadThenSwapsThePlanIn) {
  auto m = rowwise();
  PlanCacheOptions o = options(MissMode::pad);
  o.background_builds = true;
  PlanCache cache(m, o);
  cache.preload({8}, {input(1)});
  auto x = input(3);
  EXPECT_TRUE(at::equal(run(cache, x), reference(m, x)));
  EXPECT_EQ(cache.stats().padded_calls, 1);
  cache.wait_for_builds();
  EXPECT_TRUE(cache.contains(3));
  EXPECT_TRUE(at::equal(run(cache, x), reference(m, x)));
  const auto s = cache.stats();
  EXPECT_EQ(size_stats(s, 3)->hits, 1);
  EXPECT_EQ(size_stats(s, 3)->builds, 1);
}

TEST(Plan, BackgroundBuildWithNothingCachedFallsBackToTheModule) {
  auto m = rowwise();
  PlanCacheOptions o = options(MissMode::exact);
  o.background_builds = true;
  PlanCache cache(m, o);
  auto x = input(5);
  EXPECT_TRUE(at::equal(run(cache, x), reference(m, x)));
  EXPECT_EQ(cache.stats().fallback_calls, 1);
  cache.wait_for_builds();
  EXPECT_TRUE(cache.contains(5));
}

TEST(Plan, AdmissionBuildsOnlyAfterKSightings) {
  auto m = rowwise();
  PlanCacheOptions o = options();
  o.admit_after = 3;
  PlanCache cache(m, o);
  auto x = input(6);
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(at::equal(run(cache, x), reference(m, x)));
    EXPECT_FALSE(cache.contains(6));
  }
  EXPECT_TRUE(at::equal(run(cache, x), reference(m, x)));
  EXPECT_TRUE(cache.contains(6));
  const auto s = cache.stats();
  EXPECT_EQ(s.fallback_calls, 2);
  EXPECT_EQ(s.builds, 1);
}

TEST(Plan, MaxPlansEvictsTheLeastRecentlyUsed) {
  auto m = rowwise();
  PlanCacheOptions o = options();
  o.max_plans = 2;
  PlanCache cache(m, o);
  run(cache, input(1));
  run(cache, input(2));
  run(cache, input(1));  // 2 is now the least recently used
  run(cache, input(3));
  EXPECT_EQ(cache.cached_sizes(), (std::vector<int64_t>{1, 3}));
  const auto s = cache.stats();
  EXPECT_EQ(s.evictions, 1);
  EXPECT_EQ(size_stats(s, 2)->evictions, 1);
  EXPECT_EQ(s.plans, 2);
}

TEST(Plan, PlansShareWeightsTheByteBudgetCountsOnceAndEvictedPlansStayUsable) {
  auto m = rowwise();
  PlanCache probe(m, options());
  run(probe, input(1));
  const int64_t plan_bytes = probe.stats().plan_bytes;
  ASSERT_GT(plan_bytes, 0);
  // Plans are clones of one frozen, optimised module: they share its weights, counted once.
  PlanCache unbounded(m, options());
  for (int64_t n : {1, 2, 3}) run(unbounded, input(n));
  EXPECT_EQ(unbounded.stats().plans, 3);
  EXPECT_EQ(unbounded.stats().plan_bytes, plan_bytes);
  // A budget below the shared weights keeps only the most recent plan.
  PlanCacheOptions o = options();
  o.max_bytes = plan_bytes - 1;
  PlanCache cache(m, o);
  run(cache, input(1));
  auto held = cache.plan_module(1);
  ASSERT_TRUE(held.has_value());
  run(cache, input(2));
  run(cache, input(3));
  EXPECT_EQ(cache.stats().plans, 1);
  EXPECT_EQ(cache.stats().evictions, 2);
  EXPECT_EQ(cache.stats().plan_bytes, plan_bytes);
  EXPECT_TRUE(cache.contains(3));
  EXPECT_FALSE(cache.contains(1));
  // The evicted plan's module is still alive and correct for whoever holds it.
  auto x = input(1);
  c10::AutoGradMode no_grad(false);
  EXPECT_TRUE(at::equal(held->forward({x}).toTensor(), reference(m, x)));
}

TEST(Plan, SelectBatchSizeAndInferBatch) {
  auto m = rowwise();
  PlanCacheOptions o = options();
  o.max_batch_size = 8;
  PlanCache cache(m, o);
  cache.preload({4, 8}, {input(4)});
  EXPECT_EQ(cache.select_batch_size(20), 8);
  EXPECT_EQ(cache.select_batch_size(6), 4);
  EXPECT_EQ(cache.select_batch_size(3), 3);
  auto x = input(21);  // 8 + 8 + 4 + 1
  EXPECT_TRUE(at::equal(cache.infer_batch({x}).toTensor(), reference(m, x)));
  EXPECT_THROW(run(cache, x), c10::Error);  // above max_batch_size
  EXPECT_THROW(cache.select_batch_size(0), c10::Error);
}

TEST(Plan, PreloadReportsProgress) {
  auto m = rowwise();
  PlanCache cache(m, options());
  std::vector<std::tuple<int64_t, int64_t, int64_t>> seen;
  cache.preload({2, 4, 2}, {input(1)}, [&](int64_t done, int64_t total, int64_t n) { seen.emplace_back(done, total, n); });
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen.back(), std::make_tuple(int64_t{3}, int64_t{3}, int64_t{2}));
  EXPECT_EQ(cache.cached_sizes(), (std::vector<int64_t>{2, 4}));  // the example's size is not built
  PlanCache empty(m, options());
  EXPECT_THROW(empty.preload({2}), c10::Error);  // no example yet
  // An example the module rejects does not become the cache's input signature.
  EXPECT_THROW(empty.preload({2}, {at::randn({1, kFeatures + 1})}), c10::Error);
  auto x = input(3);
  EXPECT_TRUE(at::equal(run(empty, x), reference(m, x)));
}

TEST(Plan, BadInputsGetClearErrorsAndTheCacheStaysUsable) {
  auto m = rowwise();
  PlanCache cache(m, options());
  // The module rejects the shape: the build fails, nothing is cached.
  try {
    run(cache, at::randn({4, kFeatures + 1}));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("batch size 4"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(cache.contains(4));
  EXPECT_EQ(cache.stats().build_failures, 1);
  auto x = input(4);
  EXPECT_TRUE(at::equal(run(cache, x), reference(m, x)));
  // After a success the non-batch dims are fixed: a mismatch names the input and shape.
  try {
    run(cache, at::randn({4, kFeatures + 2}));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("input 0 has shape [4, 10]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(run(cache, at::randn({0, kFeatures})), c10::Error);
  EXPECT_THROW(cache.infer({}), c10::Error);
  EXPECT_THROW(run(cache, at::randn({kFeatures}).to(at::kDouble)), c10::Error);
  EXPECT_THROW(run(cache, input(4).to(at::kDouble)), c10::Error);
  EXPECT_TRUE(at::equal(run(cache, x), reference(m, x)));
}

TEST(Plan, AnInputThatRequiresGradIsRefusedUnlessGradModeIsOff) {
  // Plans record no autograd: with grad mode on, such an input would silently get no gradient.
  auto m = rowwise();
  PlanCache cache(m, options());
  const auto x = input(4).requires_grad_();
  try {
    run(cache, x);
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("input 0 requires grad"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.stats().calls, 0);
  c10::AutoGradMode no_grad(false);
  EXPECT_TRUE(at::equal(run(cache, x), reference(m, x)));
}

TEST(Plan, InputsWithDifferentBatchSizesAreRejected) {
  torch::jit::Module m("Add");
  m.register_attribute("training", c10::BoolType::get(), false);
  m.define("def forward(self, x, y):\n    return x + y\n");
  PlanCache cache(m, options());
  try {
    cache.infer({at::randn({3, 2}), at::randn({4, 2})});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("input 0 has 3 and input 1 has 4"), std::string::npos) << e.what();
  }
  auto x = at::randn({3, 2});
  EXPECT_TRUE(at::equal(cache.infer({x, x}).toTensor(), x + x));
}

TEST(Plan, ModulesThatCannotBeFrozenAreRejected) {
  auto training = make_module("Training", "def forward(self, x):\n    return x\n", /*training=*/true);
  try {
    PlanCache cache(training, options());
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("training mode"), std::string::npos) << e.what();
  }
  auto m = rowwise();
  PlanCacheOptions o = options();
  o.method = "missing";
  EXPECT_THROW(PlanCache(m, o), c10::Error);
  o = options();
  o.admit_after = 0;
  EXPECT_THROW(PlanCache(m, o), c10::Error);
  EXPECT_THROW(torch_ext::enum_from_name<plan::MissMode>("sometimes"), c10::Error);
}

TEST(Plan, AMissDoesNotBlockHitsAtOtherSizes) {
  auto m = gated_at_large_sizes();
  PlanCache cache(m, options());
  auto small = input(1);
  const auto want = reference(m, small);
  run(cache, small);
  set_gate_open(false);
  // The miss at 40 builds on its own thread and stays inside the module until the gate opens.
  auto miss = std::async(std::launch::async, [&] { return run(cache, input(40)); });
  if (!gate_entered()) {
    set_gate_open(true);
    FAIL() << "the miss never ran the module";
  }
  auto hits = std::async(std::launch::async, [&] {
    for (int i = 0; i < 5; ++i) {
      if (!at::equal(run(cache, small), want)) return false;
    }
    return true;
  });
  // Five hits end while the build is held (the wait only bounds a hang).
  const bool hits_ended_during_build = hits.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  set_gate_open(true);
  EXPECT_TRUE(hits_ended_during_build) << "a hit waited for the build";
  EXPECT_TRUE(hits.get());
  EXPECT_EQ(miss.get().size(0), 40);
  EXPECT_EQ(cache.stats().builds, 2);
}

TEST(Plan, ConcurrentMissesOfOneSizeBuildOnce) {
  auto m = rowwise();
  PlanCache cache(m, options());
  std::vector<std::thread> threads;
  auto x = input(7);
  const auto want = reference(m, x);
  std::atomic<int> wrong{0};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&] {
      if (!at::equal(run(cache, x), want)) ++wrong;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(cache.stats().builds, 1);
}

TEST(Plan, ConcurrentStressWithEvictionsInEveryMode) {
  auto m = rowwise();
  for (MissMode mode : {MissMode::exact, MissMode::pad, MissMode::split, MissMode::auto_}) {
    for (bool background : {false, true}) {
      PlanCacheOptions o = options(mode);
      // Pad, split and auto serve most sizes from the cached ones: one plan forces evictions.
      o.max_plans = mode == MissMode::exact ? 2 : 1;
      o.background_builds = background;
      o.warmup_calls = 1;
      PlanCache cache(m, o);
      cache.preload({8}, {input(8)});
      std::atomic<int> wrong{0};
      std::mutex errors_mutex;
      std::vector<std::string> errors;
      std::vector<std::thread> threads;
      for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
          std::mt19937 rng(t);
          for (int i = 0; i < 30; ++i) {
            const int64_t n = 1 + static_cast<int64_t>(rng() % 10);
            auto x = input(n);
            try {
              if (!at::equal(run(cache, x), reference(m, x))) ++wrong;
            } catch (const std::exception& e) {
              std::lock_guard<std::mutex> lock(errors_mutex);
              errors.push_back(e.what());
            }
          }
        });
      }
      for (auto& t : threads) t.join();
      cache.wait_for_builds();
      const auto s = cache.stats();
      EXPECT_EQ(wrong, 0) << torch_ext::enum_name(mode) << " background " << background;
      EXPECT_TRUE(errors.empty()) << errors.size() << " errors, the first: " << errors.front();
      EXPECT_EQ(s.calls, 120);
      EXPECT_EQ(s.hits + s.misses, 120);
      EXPECT_LE(s.plans, o.max_plans);
      EXPECT_GT(s.evictions, 0) << torch_ext::enum_name(mode) << " background " << background;
    }
  }
}

TEST(Plan, SaveAndLoadSkipFreezingAndServeHits) {
  auto m = rowwise();
  const auto dir = (std::filesystem::temp_directory_path() / ("torch_ext_plan_" + std::to_string(::getpid()))).string();
  {
    PlanCache cache(m, options());
    cache.preload({2, 5}, {input(1)});
    cache.save(dir);
  }
  PlanCache restarted(m, options());
  EXPECT_EQ(restarted.load(dir), 2);
  EXPECT_EQ(restarted.cached_sizes(), (std::vector<int64_t>{2, 5}));
  auto x = input(5);
  EXPECT_TRUE(at::equal(run(restarted, x), reference(m, x)));
  EXPECT_EQ(restarted.stats().hits, 1);
  EXPECT_EQ(restarted.stats().misses, 0);
  // Plans saved from another module are refused.
  auto other = rowwise();
  PlanCache wrong(other, options());
  try {
    wrong.load(dir);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("different module"), std::string::npos) << e.what();
  }
  EXPECT_THROW(restarted.load(dir + "/missing"), c10::Error);
  PlanCache fresh(m, options());
  EXPECT_THROW(fresh.save(dir + "/nothing"), c10::Error);
  std::filesystem::remove_all(dir);
}

TEST(Plan, StaticRuntimePlansEqualTheModule) {
  auto m = rowwise();
  PlanCacheOptions o = options();
  o.static_runtime = true;
  PlanCache cache(m, o);
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int64_t n : {1, 4, 1, 4, 6}) {
        auto x = input(n);
        if (!at::equal(run(cache, x), reference(m, x))) ++wrong;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong, 0);
}

TEST(Plan, ResetStatsAndClear) {
  auto m = rowwise();
  PlanCache cache(m, options());
  run(cache, input(2));
  cache.reset_stats();
  EXPECT_EQ(cache.stats().calls, 0);
  EXPECT_EQ(cache.stats().builds, 0);
  EXPECT_EQ(cache.stats().plans, 1);
  cache.clear();
  EXPECT_EQ(cache.stats().plans, 0);
  EXPECT_EQ(cache.stats().plan_bytes, 0);
  auto x = input(2);
  EXPECT_TRUE(at::equal(run(cache, x), reference(m, x)));
}

TEST(Plan, CudaGraphsAreIgnoredOnCpuInputs) {
  auto m = rowwise();
  PlanCacheOptions o = options();
  o.cuda_graphs = true;
  PlanCache cache(m, o);
  auto x = input(3);
  EXPECT_TRUE(at::equal(run(cache, x), reference(m, x)));
  const auto s = cache.stats();
  EXPECT_EQ(s.cuda_graphs, 0);
  EXPECT_EQ(s.graph_capture_failures, 0);
  EXPECT_FALSE(size_stats(s, 3)->cuda_graph);
}

TEST(Plan, CudaGraphPlansReplayFreshInputsAndReturnCopies) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA device";
  auto m = rowwise();
  m.to(at::Device(at::kCUDA, 0));
  PlanCacheOptions o = options(MissMode::pad);
  o.cuda_graphs = true;
  PlanCache cache(m, o);
  auto cuda_input = [](int64_t n) { return input(n).to(at::kCUDA); };
  cache.preload({2, 8}, {cuda_input(1)});
  std::vector<std::pair<at::Tensor, at::Tensor>> held;
  for (int64_t n : {2, 8, 5, 2, 1, 8}) {
    auto x = cuda_input(n);
    held.emplace_back(run(cache, x), reference(m, x));
  }
  // Fused kernels of the plan and the eager module may round x * b + 0.5 differently (FMA).
  for (const auto& [got, want] : held) EXPECT_TRUE(at::allclose(got, want, 1e-6, 1e-6));
  const auto s = cache.stats();
  EXPECT_EQ(s.cuda_graphs, 2);
  EXPECT_EQ(s.graph_capture_failures, 0);
  EXPECT_EQ(size_stats(s, 8)->graph_replays, 3);  // 8, 5 (padded to 8), 8
  EXPECT_GT(size_stats(s, 2)->graph_bytes, 0);
  EXPECT_GE(s.plan_bytes, size_stats(s, 2)->graph_bytes + size_stats(s, 8)->graph_bytes);
}

// A cache of 16 rows at most that pads (the batcher tests' cache).
c10::intrusive_ptr<PlanCache> padding_cache(const torch::jit::Module& m) {
  PlanCacheOptions o = options(MissMode::pad);
  o.max_batch_size = 16;
  return c10::make_intrusive<PlanCache>(m, o);
}

// Batches of `rows` that run only when full (or on close): what the tests count does not depend on timing.
plan::BatcherOptions full_batches_of(int64_t rows) {
  plan::BatcherOptions b;
  b.max_batch_size = rows;
  b.max_delay_ms = 600000;
  return b;
}

TEST(Plan, BatcherRefusesAnInputThatRequiresGradOnlyWhereGradModeIsOnWhenItComes) {
  auto m = rowwise();
  auto cache = padding_cache(m);
  plan::Batcher batcher(cache, full_batches_of(2));
  const auto x = input(1).requires_grad_();
  EXPECT_THROW(batcher.submit({x}), c10::ValueError);
  c10::intrusive_ptr<plan::BatchResult> first;
  {
    c10::AutoGradMode no_grad(false);
    first = batcher.submit({x});
  }
  // The batch runs on this thread, grad mode on: its requests were checked as they came.
  const auto y = input(1);
  auto second = batcher.submit({y});
  EXPECT_TRUE(at::equal(first->result(60).toTensor(), reference(m, x)));
  EXPECT_TRUE(at::equal(second->result(60).toTensor(), reference(m, y)));
  EXPECT_EQ(batcher.stats().failed, 0);
}

TEST(Plan, BatcherGathersConcurrentRequestsAndHandsEachCallerItsRows) {
  auto m = rowwise();
  auto cache = padding_cache(m);
  plan::Batcher batcher(cache, full_batches_of(8));
  constexpr int kThreads = 8, kRounds = 5;
  std::atomic<int> wrong{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < kThreads; ++t) {
    clients.emplace_back([&] {
      for (int r = 0; r < kRounds; ++r) {
        auto x = input(1);
        if (!at::equal(batcher.infer({x}).toTensor(), reference(m, x))) ++wrong;
      }
    });
  }
  for (auto& c : clients) c.join();
  EXPECT_EQ(wrong.load(), 0);
  const auto s = batcher.stats();
  EXPECT_EQ(s.requests, kThreads * kRounds);
  EXPECT_EQ(s.batches, kRounds);  // every round's 8 requests ran as one batch
  EXPECT_EQ(s.max_batch_rows, 8);
  EXPECT_EQ(cache->stats().calls, kRounds);
}

TEST(Plan, BatcherCancelTakesAQueuedRequestOutAndLeavesARunningOneToFinish) {
  auto m = gated_at_large_sizes();
  PlanCacheOptions o = options(MissMode::pad);
  o.max_batch_size = 64;
  auto cache = c10::make_intrusive<PlanCache>(m, o);
  auto b = full_batches_of(40);
  b.submit_runs_batch = false;  // the batcher's thread runs it: this one stays free to look
  plan::Batcher batcher(cache, b);
  set_gate_open(false);
  auto opens = c10::make_scope_exit([] { set_gate_open(true); });  // a failed assertion must not leave it shut
  const auto big = input(40);
  auto running = batcher.submit({big});  // fills its batch, which holds at the gate
  ASSERT_TRUE(gate_entered()) << "the batch never ran the module";
  EXPECT_TRUE(running->running());
  EXPECT_FALSE(batcher.cancel(running));  // taken by a batch: it runs to the end

  auto queued = batcher.submit({input(1)});
  int callbacks = 0;
  queued->future()->addCallback([&](c10::ivalue::Future& f) { callbacks += f.hasError(); });
  EXPECT_FALSE(queued->running());
  EXPECT_TRUE(batcher.cancel(queued));
  EXPECT_TRUE(queued->done());
  EXPECT_TRUE(queued->cancelled());
  EXPECT_FALSE(queued->running());
  EXPECT_EQ(callbacks, 1);
  try {
    queued->result(0);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the request was cancelled before a batch took it"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(batcher.cancel(queued));  // no longer queued
  EXPECT_EQ(batcher.stats().cancelled, 1);
  EXPECT_EQ(batcher.stats().queued, 0);

  const auto small = input(1);
  auto last = batcher.submit({small});
  set_gate_open(true);
  ASSERT_TRUE(running->wait(60));
  EXPECT_TRUE(at::equal(running->result(0).toTensor(), reference(m, big)));
  EXPECT_FALSE(running->running());
  EXPECT_FALSE(running->cancelled());
  batcher.close();  // runs the last request, alone: the cancelled one left no rows behind
  EXPECT_TRUE(at::equal(last->result(0).toTensor(), reference(m, small)));
  EXPECT_EQ(batcher.stats().batches, 2);
  EXPECT_EQ(batcher.stats().rows, 41);
}

TEST(Plan, BatcherQueueIsBoundedAndAFullQueueRaises) {
  auto m = rowwise();
  PlanCacheOptions o = options();
  o.max_batch_size = 16;
  auto cache = c10::make_intrusive<PlanCache>(m, o);
  plan::BatcherOptions b;
  b.max_delay_ms = 600000;
  b.max_queue = 3;
  auto batcher = std::make_unique<plan::Batcher>(cache, b);
  std::vector<at::Tensor> xs;
  std::vector<c10::intrusive_ptr<plan::BatchResult>> futures;
  for (int i = 0; i < 3; ++i) {
    xs.push_back(input(2));
    futures.push_back(batcher->submit({xs.back()}));
  }
  try {
    batcher->submit({input(1)});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the queue is full (3 requests waiting, max_queue=3)"), std::string::npos);
  }
  EXPECT_EQ(batcher->stats().rejected, 1);
  EXPECT_FALSE(futures[0]->wait(0.05));  // 6 rows of 16: the batch waits
  EXPECT_THROW(futures[0]->result(0.05), c10::Error);
  batcher->close();  // runs what was queued
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(futures[i]->done());
    EXPECT_TRUE(at::equal(futures[i]->result(0).toTensor(), reference(m, xs[i])));
  }
}

TEST(Plan, BatcherTheCallThatFillsABatchRunsItOnItsThreadUnlessASubmitLeavesItToTheBatchers) {
  auto m = rowwise();
  auto cache = padding_cache(m);
  const auto here = std::this_thread::get_id();
  enum class FilledBy { kInfer, kSubmit, kSubmitLeavingIt };
  for (const auto filled_by : {FilledBy::kInfer, FilledBy::kSubmit, FilledBy::kSubmitLeavingIt}) {
    auto options = full_batches_of(4);
    options.submit_runs_batch = filled_by != FilledBy::kSubmitLeavingIt;
    plan::Batcher batcher(cache, options);
    std::vector<at::Tensor> xs, outs(4);
    std::vector<std::thread::id> ran_on(4);
    std::vector<c10::intrusive_ptr<plan::BatchResult>> done;
    for (int i = 0; i < 4; ++i) {
      xs.push_back(input(1));
      if (filled_by == FilledBy::kInfer && i == 3) {
        outs[i] = batcher.infer({xs.back()}).toTensor();  // the 4th fills the batch and runs all four here
        ran_on[i] = here;
        continue;
      }
      auto result = c10::make_intrusive<plan::BatchResult>();
      done.push_back(result);
      batcher.submit({xs.back()}, [&, i, result](c10::IValue out, std::exception_ptr error) {
        ran_on[i] = std::this_thread::get_id();
        if (!error) outs[i] = out.toTensor();
        result->complete(c10::IValue(), error);
      });
    }
    for (auto& result : done) ASSERT_TRUE(result->wait(60));
    const bool by_caller = filled_by != FilledBy::kSubmitLeavingIt;
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(ran_on[i] == here, by_caller) << "request " << i << ", case " << static_cast<int>(filled_by);
      EXPECT_TRUE(at::equal(outs[i], reference(m, xs[i])));
    }
    const auto s = batcher.stats();
    EXPECT_EQ(s.batches, 1);
    EXPECT_EQ(s.client_batches, by_caller ? 1 : 0);
    EXPECT_EQ(s.max_batch_rows, 4);
  }
}

TEST(Plan, BatcherRunsAtMostMaxRunningBatchesAndTheFirstRunnerToFinishRunsTheNext) {
  // Batch 1 runs on `runner` and is held there (its first request's callback waits), while this
  // thread fills batch 2. Below the limit this thread runs batch 2 at once; at the limit batch 2
  // waits, and the runner runs it once batch 1 is done (no hand-off to the batcher's thread).
  auto m = rowwise();
  auto cache = padding_cache(m);
  const auto here = std::this_thread::get_id();
  for (const int64_t limit : {1, 2}) {
    auto options = full_batches_of(2);
    options.max_running_batches = limit;
    plan::Batcher batcher(cache, options);
    std::promise<void> first_running, release;
    auto released = release.get_future().share();
    std::vector<at::Tensor> xs;
    for (int i = 0; i < 4; ++i) xs.push_back(input(1));
    std::thread runner([&] {
      batcher.submit({xs[0]}, [&](c10::IValue, std::exception_ptr) {
        first_running.set_value();
        released.wait();
      });
      batcher.submit({xs[1]});  // fills batch 1, which runs here
    });
    first_running.get_future().wait();
    const auto third = batcher.submit({xs[2]});
    std::thread::id second_ran_on;
    auto second_done = c10::make_intrusive<plan::BatchResult>();
    at::Tensor fourth;
    batcher.submit({xs[3]}, [&](c10::IValue out, std::exception_ptr error) {  // fills batch 2
      second_ran_on = std::this_thread::get_id();
      if (!error) fourth = out.toTensor();
      second_done->complete(c10::IValue(), error);
    });
    EXPECT_EQ(third->done(), limit == 2) << "limit " << limit;  // at the limit, nothing may run batch 2 yet
    const auto runner_id = runner.get_id();
    release.set_value();
    runner.join();
    ASSERT_TRUE(second_done->wait(60));
    EXPECT_EQ(second_ran_on, limit == 2 ? here : runner_id) << "limit " << limit;
    EXPECT_TRUE(at::equal(third->result(0).toTensor(), reference(m, xs[2])));
    EXPECT_TRUE(at::equal(fourth, reference(m, xs[3])));
    const auto s = batcher.stats();
    EXPECT_EQ(s.batches, 2);
    EXPECT_EQ(s.client_batches, 2);
  }
}

TEST(Plan, BatcherRefusesANegativeMaxRunningBatches) {
  auto m = rowwise();
  auto options = full_batches_of(2);
  options.max_running_batches = -1;
  try {
    plan::Batcher batcher(padding_cache(m), options);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_running_batches must be >= 0 (0: one per core), got -1"),
              std::string::npos);
  }
}

TEST(Plan, BatcherStoresEveryResultOfABatchBeforeWakingAnyWaiter) {
  // A client waiting on several requests of one batch is woken once, and finds the rest done: the
  // torch Future of the first result completes (its callbacks run on the thread that runs the batch, now)
  // only after every result of the batch is in.
  auto m = rowwise();
  auto cache = padding_cache(m);
  plan::Batcher batcher(cache, full_batches_of(4));
  std::vector<at::Tensor> xs;
  std::vector<c10::intrusive_ptr<plan::BatchResult>> results;
  for (int i = 0; i < 3; ++i) {
    xs.push_back(input(1));
    results.push_back(batcher.submit({xs.back()}));
  }
  std::atomic<int> done_when_first_announced{-1};
  results[0]->future()->addCallback([&](c10::ivalue::Future&) {
    int done = 0;
    for (auto& result : results) done += result->done() ? 1 : 0;  // the three submitted before the batch
    done_when_first_announced = done;
  });
  const auto last = input(1);
  const auto filling = batcher.submit({last});  // fills the batch
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(results[i]->result(60).toTensor(), reference(m, xs[i])));
  EXPECT_TRUE(at::equal(filling->result(60).toTensor(), reference(m, last)));
  EXPECT_EQ(done_when_first_announced.load(), 3);
}

TEST(Plan, CompletionsListEveryWatchedRequestOfABatchAndWriteThePipeOnceForThem) {
  auto m = rowwise();
  auto cache = padding_cache(m);
  plan::Batcher batcher(cache, full_batches_of(4));
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  auto closes = c10::make_scope_exit([&] {
    ::close(fds[0]);
    ::close(fds[1]);
  });
  plan::Completions completions(fds[1]);
  std::vector<c10::intrusive_ptr<plan::BatchResult>> results;
  for (int64_t key = 0; key < 3; ++key) {
    results.push_back(batcher.submit({input(1)}));
    completions.watch(*results.back(), 10 + key);
  }
  EXPECT_TRUE(completions.take().empty());  // queued: none is done
  results.push_back(batcher.submit({input(1)}));  // fills the batch and runs it here
  completions.watch(*results.back(), 13);       // done already: listed at once, no second byte
  char bytes[8];
  EXPECT_EQ(::read(fds[0], bytes, sizeof(bytes)), 1);
  EXPECT_EQ(completions.take(), (std::vector<int64_t>{10, 11, 12, 13}));
  EXPECT_TRUE(completions.take().empty());

  // Once closed, a request done later is neither listed nor written.
  auto late = batcher.submit({input(1)});
  completions.watch(*late, 20);
  completions.close();
  for (int i = 0; i < 3; ++i) batcher.submit({input(1)});  // the batch of `late` runs
  ASSERT_TRUE(late->wait(60));
  EXPECT_TRUE(completions.take().empty());
  ASSERT_EQ(::fcntl(fds[0], F_SETFL, O_NONBLOCK), 0);
  EXPECT_EQ(::read(fds[0], bytes, sizeof(bytes)), -1);  // nothing written: EAGAIN
}

TEST(Plan, BatcherCallsACallbackOnceTheBatchIsStoredAndOneThatRaisesStopsNothing) {
  // A callback is a result's too: it runs after every result of its batch is stored, and one that
  // raises leaves the batch's other requests and the batcher's next batches running.
  auto m = rowwise();
  auto cache = padding_cache(m);
  auto options = full_batches_of(4);
  options.submit_runs_batch = false;  // the callback runs on the batcher's thread, while this one submits
  plan::Batcher batcher(cache, options);
  std::vector<c10::intrusive_ptr<plan::BatchResult>> results;
  results.reserve(7);  // never moved while the callback reads the first three
  std::atomic<int> stored_when_called{-1};
  at::Tensor called_with;
  const auto first = input(1);
  std::mutex submitting;  // the callback reads results[0..2] once they are in
  std::unique_lock<std::mutex> first_batch(submitting);
  batcher.submit({first}, [&](c10::IValue out, std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(submitting);
    int stored = 0;
    for (int i = 0; i < 3; ++i) stored += results[i]->done() ? 1 : 0;
    stored_when_called = stored;
    if (!error) called_with = out.toTensor();
    throw std::runtime_error("a callback's own error");
  });
  std::vector<at::Tensor> xs;
  for (int i = 0; i < 7; ++i) {  // three fill the first batch, four the second
    xs.push_back(input(1));
    results.push_back(batcher.submit({xs.back()}));
    if (i == 2) first_batch.unlock();
  }
  for (int i = 0; i < 7; ++i) EXPECT_TRUE(at::equal(results[i]->result(60).toTensor(), reference(m, xs[i])));
  EXPECT_EQ(stored_when_called.load(), 3);
  EXPECT_TRUE(at::equal(called_with, reference(m, first)));
  EXPECT_EQ(batcher.stats().batches, 2);
  EXPECT_EQ(batcher.stats().failed, 0);
}

TEST(Plan, BatcherADeadlineThatCannotBeMetFailsAtOnceAndOneThatPassesInTheQueueIsNotRun) {
  auto m = rowwise();
  auto cache = padding_cache(m);
  const plan::BatcherOptions b = full_batches_of(2);
  {
    // A deadline that passed as it was given: refused at once, nothing queued.
    plan::Batcher batcher(cache, b);
    try {
      batcher.submit({input(1)}, 0.0);
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("deadline of 0 ms cannot be met: it has already passed"), std::string::npos)
          << e.what();
    }
    EXPECT_EQ(batcher.stats().requests, 0);
    EXPECT_EQ(batcher.stats().expired, 1);
    // Once a batch has run, a deadline below the fastest batch is refused too (no batch runs in 1 ns).
    auto x = input(1);
    auto first = batcher.submit({x}, 600000.0);
    batcher.infer({input(1)});  // fills the batch: runs it here
    EXPECT_TRUE(at::equal(first->result(0).toTensor(), reference(m, x)));
    try {
      batcher.submit({input(1)}, 1e-6);
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("cannot be met: no batch has run in under"), std::string::npos) << e.what();
    }
    EXPECT_EQ(batcher.stats().expired, 2);
  }
  {
    // No batch has run, so a 1 us deadline is taken; it passes while the request waits, and the
    // request fails without running.
    plan::Batcher batcher(cache, b);
    auto late = batcher.submit({input(1)}, 1e-3);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // at least 2 ms: the deadline has passed
    batcher.close();  // runs (here: fails) what is queued
    ASSERT_TRUE(late->done());
    try {
      late->result(0);
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("ms in the queue; it was not run"), std::string::npos) << e.what();
    }
    const auto s = batcher.stats();
    EXPECT_EQ(s.expired, 1);
    EXPECT_EQ(s.batches, 0);
  }
}

// Persistence alone: a manifest written and read back whole, a listed file checked by its
// SHA-256, and a pinned digest that refuses another manifest before parsing it.
TEST(PlanManifest, RoundTripsChecksFilesAndRefusesAManifestThatIsNotThePinnedOne) {
  const auto dir = std::filesystem::temp_directory_path() / ("torch_ext_manifest_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "weights.bin") << "some bytes";
  plan::Manifest written;
  written.kind = "export";
  written.values["fingerprint"] = "abc";
  written.add_file(dir.string(), "weights.bin");
  written.layout.buckets = {{4, 8}};
  plan::ManifestPlan entry;
  entry.upper = plan::Bucket::of({8});
  entry.lower = plan::Bucket::of({5});
  entry.dynamic = true;
  entry.file = "weights.bin";
  entry.sha256 = written.files["weights.bin"];
  written.plans.push_back(entry);
  plan::write_manifest(dir.string(), written);
  const std::string digest = torch_ext::sha256_file((dir / "manifest.txt").string());
  const plan::Manifest read = plan::read_manifest(dir.string(), digest);
  EXPECT_EQ(read.kind, "export");
  EXPECT_EQ(read.value("fingerprint"), "abc");
  EXPECT_EQ(read.layout.buckets, written.layout.buckets);
  ASSERT_EQ(read.plans.size(), 1u);
  EXPECT_EQ(read.plans[0].upper, entry.upper);
  EXPECT_EQ(read.plans[0].lower, entry.lower);
  EXPECT_TRUE(read.plans[0].dynamic);
  EXPECT_EQ(read.checked_file(dir.string(), "weights.bin"), (dir / "weights.bin").string());
  std::ofstream(dir / "weights.bin") << "other bytes";
  EXPECT_THROW(read.checked_file(dir.string(), "weights.bin"), c10::Error);
  // A manifest with another digest is refused before it is parsed (here it would not parse at all).
  std::ofstream(dir / "manifest.txt", std::ios::app) << "not a manifest line\n";
  try {
    plan::read_manifest(dir.string(), digest);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not the manifest_sha256 this cache trusts"), std::string::npos) << e.what();
  }
  EXPECT_THROW(plan::read_manifest(dir.string()), c10::Error);  // unpinned, it is parsed, and refused as malformed
  std::filesystem::remove_all(dir);
}

// The router alone, over plain plan descriptions: pad to the smallest run that holds the
// request, split into the fewest pieces, auto by the estimated seconds, nothing when none serves.
namespace {

// A plan as the table sees it: a bucket, its constants (storage -> bytes) and its record.
std::shared_ptr<PlanCache::Plan> table_plan(plan::PlanTable& table, int64_t batch, plan::Constants constants = {}) {
  auto p = std::make_shared<PlanCache::Plan>();
  p->spec.upper = p->spec.lower = plan::Bucket::of({batch});
  p->constants = std::move(constants);
  p->record = table.record(p->spec.upper);
  return p;
}

}  // namespace

TEST(PlanTable, MaxPlansEvictsTheLeastRecentlyUsedNeverTheOneInserted) {
  plan::PlanTable table(/*max_plans=*/2, /*max_bytes=*/0);
  auto a = table_plan(table, 1), b = table_plan(table, 2), c = table_plan(table, 4);
  table.insert(a);
  table.insert(b);
  table.touch(*a);  // b is now the least recently used
  table.insert(c);
  EXPECT_TRUE(table.contains(a->bucket()));
  EXPECT_FALSE(table.contains(b->bucket()));
  EXPECT_TRUE(table.contains(c->bucket()));
  EXPECT_EQ(b->record->evictions.load(), 1);
  EXPECT_EQ(table.find(b->bucket()), nullptr);
  ASSERT_EQ(table.plans().size(), 2u);
  EXPECT_EQ(table.plans()[0], a);  // in bucket order
  EXPECT_EQ(table.totals().plans, 2);
}

TEST(PlanTable, SharedConstantsCountOnceAndTheByteBudgetEvictsUntilItHolds) {
  static const int w = 0, x = 0, y = 0;
  plan::PlanTable table(/*max_plans=*/0, /*max_bytes=*/150);
  auto a = table_plan(table, 1, {{&w, 100}}), b = table_plan(table, 2, {{&w, 100}, {&x, 40}});
  table.insert(a);
  table.insert(b);
  EXPECT_EQ(table.totals().plan_bytes, 140);  // w once
  // 200 bytes with c: evicting a frees nothing (b still holds w), so b goes too.
  auto c = table_plan(table, 4, {{&y, 60}});
  table.insert(c);
  EXPECT_EQ(table.totals().plans, 1);
  EXPECT_EQ(table.totals().plan_bytes, 60);
  EXPECT_TRUE(table.contains(c->bucket()));
  // A plan over the budget on its own is kept: the table never evicts the plan it inserts.
  static const int z = 0;
  auto big = table_plan(table, 8, {{&z, 500}});
  table.insert(big);
  EXPECT_TRUE(table.contains(big->bucket()));
  EXPECT_EQ(table.totals().plan_bytes, 500);
  table.clear();
  EXPECT_TRUE(table.empty());
  EXPECT_EQ(table.totals().plan_bytes, 0);
}

TEST(PlanTable, OneBuilderPerBucketOthersGetItsFutureAndAnAbandonedBuildCanStartAgain) {
  plan::PlanTable table(0, 0);
  const auto bucket = plan::Bucket::of({8});
  std::promise<std::shared_ptr<PlanCache::Plan>> first, second, third;
  auto claim = table.claim(bucket, first.get_future().share());
  EXPECT_TRUE(claim.owner);
  EXPECT_EQ(table.totals().pending_builds, 1);
  auto waiter = table.claim(bucket, second.get_future().share());
  EXPECT_FALSE(waiter.owner);
  EXPECT_EQ(waiter.plan, nullptr);
  auto peek = table.claim(bucket, {});  // no start: the build in progress, never a new one
  EXPECT_FALSE(peek.owner);
  EXPECT_TRUE(peek.future.valid());
  table.abandon(bucket);
  EXPECT_EQ(table.totals().pending_builds, 0);
  EXPECT_FALSE(table.claim(bucket, {}).future.valid());
  auto again = table.claim(bucket, third.get_future().share());
  EXPECT_TRUE(again.owner);
  auto plan = table_plan(table, 8);
  table.insert(plan);  // ends the build
  EXPECT_EQ(table.totals().pending_builds, 0);
  first.set_value(plan);
  EXPECT_EQ(waiter.future.get(), plan);  // the first builder's future, which its waiter holds
  auto hit = table.claim(bucket, {});
  EXPECT_EQ(hit.plan, plan);
  EXPECT_FALSE(hit.owner);
}

TEST(PlanTable, VisitSeesEveryRecordWithItsCachedPlan) {
  plan::PlanTable table(0, 0);
  auto cached = table_plan(table, 2);
  table.insert(cached);
  auto seen_only = table.record(plan::Bucket::of({3}));
  EXPECT_EQ(table.record(plan::Bucket::of({3})), seen_only);  // one record a bucket
  std::vector<std::pair<int64_t, bool>> visited;
  table.visit([&](PlanCache::SizeRecord& rec, const PlanCache::Plan* p) {
    visited.emplace_back(rec.bucket[0], p == cached.get());
  });
  std::sort(visited.begin(), visited.end());
  EXPECT_EQ(visited, (std::vector<std::pair<int64_t, bool>>{{2, true}, {3, false}}));
}

TEST(PlanTraffic, CountsBySizeAnswersABoxMostRequestedFirstAndDropsPastItsLimit) {
  plan::TrafficLog log;
  log.add(plan::Bucket::of({4, 32}), 3);
  log.add(plan::Bucket::of({2, 16}));
  log.add(plan::Bucket::of({2, 16}));
  log.add(plan::Bucket::of({8, 64}), 5);
  EXPECT_EQ(log.requests(), 10);
  const auto all = log.sizes();  // ascending
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0], std::make_pair(plan::Bucket::of({2, 16}), int64_t{2}));
  EXPECT_EQ(all[2], std::make_pair(plan::Bucket::of({8, 64}), int64_t{5}));
  // The box [1..4] x [1..32]: 4x32 (3 requests) before 2x16 (2); 8x64 is outside it.
  const auto box = log.within(plan::Bucket::of({1, 1}), plan::Bucket::of({4, 32}), 8);
  ASSERT_EQ(box.size(), 2u);
  EXPECT_EQ(box[0].first, plan::Bucket::of({4, 32}));
  EXPECT_EQ(box[1].first, plan::Bucket::of({2, 16}));
  EXPECT_EQ(log.within(plan::Bucket::of({1, 1}), plan::Bucket::of({8, 64}), 1).front().first, plan::Bucket::of({8, 64}));
  EXPECT_THROW(log.add(plan::Bucket::of({1, 1}), 0), c10::Error);
  for (int64_t n = 1; log.sizes().size() < plan::TrafficLog::kMaxSizes; ++n) log.add(plan::Bucket::of({100, n}));
  log.add(plan::Bucket::of({101, 1}), 7);  // a new size, no room: dropped
  log.add(plan::Bucket::of({2, 16}));      // a size it holds: counted
  EXPECT_EQ(log.dropped(), 7);
  EXPECT_EQ(log.sizes().front().second, 3);
  log.clear();
  EXPECT_EQ(log.requests(), 0);
  EXPECT_TRUE(log.sizes().empty());
}

TEST(PlanTraffic, AChildForkedWhileTheLogIsHeldCanUseIt) {
  plan::TrafficLog log;
  log.add(plan::Bucket::of({2}));
  log.fork_prepare();  // as the cache does before fork(): the log's lock is held across it
  const int code = torch_ext::testing::run_in_child([&] {
    log.fork_child();  // the child's copy of the held lock is made afresh
    log.add(plan::Bucket::of({2}));
    return log.requests() == 2 ? 0 : 1;
  }, 10);
  log.fork_parent();
  EXPECT_EQ(code, 0);  // -1: the child hung on the lock
  log.add(plan::Bucket::of({3}));
  EXPECT_EQ(log.requests(), 2);
}

TEST(PlanTraffic, ConcurrentAddsAreAllCounted) {
  plan::TrafficLog log;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&log, t] {
      for (int i = 0; i < 5000; ++i) log.add(plan::Bucket::of({1 + (i + t) % 7}));
    });
  }
  for (auto& thread : threads) thread.join();
  int64_t total = 0;
  for (const auto& [sizes, count] : log.sizes()) total += count;
  EXPECT_EQ(total, 20000);
  EXPECT_EQ(log.requests(), 20000);
}

TEST(PlanRouter, PadsToTheSmallestHoldingRunSplitsIntoFewestPiecesAndAutoTakesTheCheaper) {
  EXPECT_EQ(plan::fewest_pieces({2, 3, 8}, 13), (std::vector<int64_t>{8, 3, 2}));
  EXPECT_EQ(plan::fewest_pieces({4, 8}, 6), (std::vector<int64_t>{}));
  EXPECT_EQ(plan::fewest_pieces({2, 4}, 6), (std::vector<int64_t>{4, 2}));
  const plan::Layout layout{PlanCacheOptions{}};  // the batch only
  auto stat = [](int64_t n, double seconds) {
    return plan::RoutePlan{plan::Bucket::of({n}), plan::Bucket::of({n}), false, seconds};
  };
  const std::vector<plan::RoutePlan> cached = {stat(2, 1.0), stat(4, 1.5), stat(8, 10.0)};
  const auto six = plan::Bucket::of({6});
  auto pad = plan::choose_route(layout, MissMode::pad, cached, six);
  ASSERT_TRUE(pad && pad->pad);
  EXPECT_EQ(pad->plans, (std::vector<std::size_t>{2}));  // 8 holds 6; 4 and 2 do not
  EXPECT_EQ(pad->target, plan::Bucket::of({8}));
  auto split = plan::choose_route(layout, MissMode::split, cached, six);
  ASSERT_TRUE(split && !split->pad);
  EXPECT_EQ(split->pieces, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(split->plans, (std::vector<std::size_t>{1, 0}));
  // auto: pad costs 10 s, split 1.5 + 1 s; with the 8's run at 2 s, pad is the cheaper.
  EXPECT_FALSE(plan::choose_route(layout, MissMode::auto_, cached, six)->pad);
  auto cheap = cached;
  cheap[2].seconds = 2.0;
  EXPECT_TRUE(plan::choose_route(layout, MissMode::auto_, cheap, six)->pad);
  // A dynamic plan over 5..8 runs a 6 as it is.
  const std::vector<plan::RoutePlan> ranged = {{plan::Bucket::of({8}), plan::Bucket::of({5}), true, 1.0}};
  EXPECT_EQ(plan::choose_route(layout, MissMode::pad, ranged, six)->target, six);
  // Nothing cached, or nothing that holds a 9 nor sums to it: no route.
  EXPECT_FALSE(plan::choose_route(layout, MissMode::pad, {}, six));
  EXPECT_FALSE(plan::choose_route(layout, MissMode::pad, {stat(8, 1.0)}, plan::Bucket::of({9})));
  EXPECT_FALSE(plan::choose_route(layout, MissMode::split, {stat(4, 1.0)}, plan::Bucket::of({9})));
}

// The build worker alone: jobs in order on its thread, bounded idle waits, queued jobs abandoned
// (never run) when it stops or in a forked child.
TEST(PlanBuildWorker, RunsJobsInOrderAndAbandonsWhatCanNeverRun) {
  auto worker = std::make_unique<plan::BuildWorker>();
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::mutex mutex;
  std::vector<std::string> log;
  auto job = [&](const std::string& name, bool block) {
    plan::BuildWorker::Job j;
    j.what = name;
    j.run = [&, name, block] {
      if (block) released.wait();
      std::lock_guard<std::mutex> lock(mutex);
      log.push_back("ran " + name);
    };
    j.abandon = [&, name](std::exception_ptr error) {
      try {
        std::rethrow_exception(error);
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mutex);
        log.push_back("abandoned " + name + ": " + e.what_without_backtrace());
      }
    };
    return j;
  };
  worker->push(job("a", false));
  worker->push(job("b", false));
  ASSERT_TRUE(worker->wait_idle(torch_ext::deadline_after(60)));
  EXPECT_EQ(log, (std::vector<std::string>{"ran a", "ran b"}));
  // c blocks; d and e wait behind it. An idle wait that ends at once says so.
  worker->push(job("c", true));
  worker->push(job("d", false));
  worker->push(job("e", false));
  EXPECT_FALSE(worker->wait_idle(torch_ext::deadline_after(0)));
  const auto state = worker->snapshot();
  EXPECT_EQ(state.queued + (state.running ? 1 : 0), 3);
  // A forked child abandons the jobs its parent queued or ran: none of them runs there.
  const int code = torch_ext::testing::run_in_child([&] {
    if (!worker->recover_after_fork()) return 1;
    bool abandoned = true;
    for (const char* name : {"c", "d", "e"}) {
      bool found = false;
      for (const auto& line : log) found |= line.rfind(std::string("abandoned ") + name, 0) == 0;
      abandoned &= found;
    }
    return abandoned ? 0 : 3;
  });
  EXPECT_EQ(code, 0);
  EXPECT_FALSE(worker->recover_after_fork());  // the parent is no forked child
  // Stopping abandons what is queued; the running job finishes first.
  std::thread stopper([&] { worker->stop(); });
  while (true) {  // until stop() has begun: push() then refuses
    try {
      worker->push(job("late", false));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("stopped"), std::string::npos);
      break;
    }
  }
  release.set_value();
  stopper.join();
  std::lock_guard<std::mutex> lock(mutex);
  ASSERT_GE(log.size(), 5u);
  EXPECT_EQ(log[2], "ran c");
  int abandoned = 0;
  for (size_t i = 3; i < log.size(); ++i) {
    EXPECT_EQ(log[i].rfind("abandoned", 0), 0u) << log[i];  // nothing queued behind c ran
    abandoned += log[i].find("destroyed before this plan was built") != std::string::npos;
  }
  EXPECT_EQ(abandoned, static_cast<int>(log.size()) - 3);
}

// Issue 16's stress run for the plan cache (TORCH_EXT_STRESS_SECONDS; `bash .ci/run sanitize`
// runs it 30 s under ASan+UBSan and TSan): 8 threads over caches in every mode, bounded to force
// evictions and background builds, and a batcher in front of one of them. Every output equals the
// module's; the counts add up and the bounds hold.
TEST(PlanStress, EightThreadsOverEveryModeAndABatcherKeepOutputsCountsAndBounds) {
  auto m = rowwise();
  std::vector<c10::intrusive_ptr<PlanCache>> caches;
  for (MissMode mode : {MissMode::exact, MissMode::pad, MissMode::split, MissMode::auto_}) {
    PlanCacheOptions o = options(mode);
    o.max_plans = 3;
    o.background_builds = mode != MissMode::exact;
    o.max_batch_size = 16;
    o.warmup_calls = 1;
    caches.push_back(c10::make_intrusive<PlanCache>(m, o));
    caches.back()->preload({8}, {input(8)});
  }
  plan::BatcherOptions b;
  b.max_batch_size = 8;
  b.max_delay_ms = 1;
  auto batcher = std::make_unique<plan::Batcher>(caches[1], b);
  std::atomic<int64_t> wrong{0}, direct_calls[4] = {0, 0, 0, 0}, batched{0};
  std::mutex errors_mutex;
  std::vector<std::string> errors;
  const auto stop = std::chrono::steady_clock::now() + std::chrono::duration<double>(torch_ext::testing::stress_seconds());
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      while (std::chrono::steady_clock::now() < stop) {
        const int which = static_cast<int>(rng() % 5);
        const int64_t n = 1 + static_cast<int64_t>(rng() % (which == 4 ? 4 : 12));
        auto x = input(n);
        try {
          at::Tensor y = which == 4 ? batcher->infer({x}).toTensor() : run(*caches[which], x);
          if (!at::equal(y, reference(m, x))) ++wrong;
          ++(which == 4 ? batched : direct_calls[which]);
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(errors_mutex);
          errors.push_back(e.what());
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  batcher->close();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_TRUE(errors.empty()) << errors.size() << " errors, the first: " << errors.front();
  const auto bs = batcher->stats();
  EXPECT_EQ(bs.requests, batched.load());
  EXPECT_EQ(bs.failed, 0);
  EXPECT_LE(bs.max_batch_rows, 8);
  for (int i = 0; i < 4; ++i) {
    caches[i]->wait_for_builds();
    const auto s = caches[i]->stats();
    if (i == 1) {
      EXPECT_GE(s.calls, direct_calls[i].load() + bs.batches);  // a batch may run as several calls
    } else {
      EXPECT_EQ(s.calls, direct_calls[i].load()) << "cache " << i;
    }
    EXPECT_EQ(s.hits + s.misses, s.calls) << "cache " << i;
    EXPECT_LE(s.plans, 3) << "cache " << i;
    EXPECT_EQ(s.build_failures, 0) << "cache " << i;
  }
}
