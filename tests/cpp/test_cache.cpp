#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <random>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/ScopeExit.h>
#include <torch/custom_class.h>

#include "torch_ext/cache/node_cache.h"
#include "reliability_helpers.h"

using torch_ext::cache::NodeCache;
using torch_ext::cache::Seen;

namespace {

constexpr int64_t kFloat = 4;

at::Tensor floats(int64_t n) { return at::ones({n}, at::kFloat); }

bool hit(NodeCache& cache, int64_t node, std::vector<c10::IValue> inputs) { return cache.get(node, inputs).has_value(); }

}  // namespace

TEST(Cache, HitReturnsTheSameOutputForTheSameInputs) {
  NodeCache cache;
  at::Tensor x = floats(8);
  at::Tensor y = x * 2;
  ASSERT_TRUE(cache.put(0, {x}, y, 1e-3));
  auto got = cache.get(0, {x});
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(got->toTensor().is_same(y));
  EXPECT_EQ(cache.stats().hits, 1);
  EXPECT_EQ(cache.stats().misses, 0);
}

TEST(Cache, AnotherTensorWithEqualValuesMisses) {
  NodeCache cache;
  at::Tensor x = floats(8);
  ASSERT_TRUE(cache.put(0, {x}, x * 2, 0));
  EXPECT_FALSE(hit(cache, 0, {floats(8)}));
  EXPECT_EQ(cache.stats().misses, 1);
  EXPECT_TRUE(hit(cache, 0, {x}));  // x may come again: its entry stays
}

TEST(Cache, InPlaceChangeOfAnInputMisses) {
  NodeCache cache;
  at::Tensor x = floats(8);
  ASSERT_TRUE(cache.put(0, {x}, x * 2, 0));
  x.add_(1);
  EXPECT_FALSE(hit(cache, 0, {x}));
}

TEST(Cache, AFreedInputCanNeverHitEvenAtAReusedAddress) {
  NodeCache cache;
  at::Tensor x = floats(1024);
  ASSERT_TRUE(cache.put(0, {x}, at::zeros({4}), 0));
  const void* freed_data = x.data_ptr();
  x.reset();
  // The allocator usually hands the same block to the next tensor of that size.
  for (int i = 0; i < 8; ++i) {
    at::Tensor again = floats(1024);
    EXPECT_FALSE(hit(cache, 0, {again})) << "data reused: " << (again.data_ptr() == freed_data);
    ASSERT_TRUE(cache.put(0, {again}, at::zeros({4}), 0));
  }
}

TEST(Cache, MetadataChangesWithoutAVersionBumpMiss) {
  NodeCache cache;
  at::Tensor x = floats(8);
  ASSERT_TRUE(cache.put(0, {x}, x * 2, 0));
  x.set_requires_grad(true);
  EXPECT_FALSE(hit(cache, 0, {x}));

  at::Tensor w = floats(8);
  ASSERT_TRUE(cache.put(1, {w}, w * 2, 0));
  // `w.data = other` in Python: swaps the storage, does not bump the version.
  w.set_data(at::zeros({8}));
  EXPECT_FALSE(hit(cache, 1, {w}));
}

TEST(Cache, WritesThroughDataAreNotSeenAndInvalidateNodeFixesThat) {
  NodeCache cache;
  at::Tensor w = floats(8);
  ASSERT_TRUE(cache.put(0, {w}, w * 2, 0));
  w.variable_data().add_(1);  // Python's `w.data.add_(1)`: no version bump, same storage
  EXPECT_TRUE(hit(cache, 0, {w}));  // documented limitation
  cache.invalidate_node(0);
  EXPECT_FALSE(hit(cache, 0, {w}));
}

TEST(Cache, GradModeAndAutocastArePartOfTheKey) {
  NodeCache cache;
  at::Tensor x = floats(8);
  {
    at::NoGradGuard no_grad;
    ASSERT_TRUE(cache.put(0, {x}, x * 2, 0));
    EXPECT_TRUE(hit(cache, 0, {x}));
  }
  EXPECT_FALSE(hit(cache, 0, {x}));

  ASSERT_TRUE(cache.put(1, {x}, x * 2, 0));
  at::autocast::set_autocast_enabled(at::kCPU, true);
  const bool hit_under_autocast = hit(cache, 1, {x});
  at::autocast::set_autocast_enabled(at::kCPU, false);
  EXPECT_FALSE(hit_under_autocast);
}

TEST(Cache, AnOutputChangedInPlaceIsNotReturned) {
  NodeCache cache;
  at::Tensor x = floats(8);
  at::Tensor y = x * 2;
  ASSERT_TRUE(cache.put(0, {x}, y, 0));
  y.mul_(3);
  EXPECT_FALSE(hit(cache, 0, {x}));
}

TEST(Cache, NonTensorInputsCompareByValueAndContainersByElement) {
  NodeCache cache;
  at::Tensor x = floats(4);
  c10::List<int64_t> shape({2, 2});
  ASSERT_TRUE(cache.put(0, {x, int64_t{3}, 0.5, c10::IValue(shape), c10::IValue()}, x.view({2, 2}), 0));
  EXPECT_TRUE(hit(cache, 0, {x, int64_t{3}, 0.5, c10::IValue(c10::List<int64_t>({2, 2})), c10::IValue()}));
  EXPECT_FALSE(hit(cache, 0, {x, int64_t{4}, 0.5, c10::IValue(shape), c10::IValue()}));
  ASSERT_TRUE(cache.put(0, {x, -0.0}, x, 0));
  EXPECT_FALSE(hit(cache, 0, {x, 0.0}));  // -0.0 and 0.0 are told apart
  ASSERT_TRUE(cache.put(0, {x, 1.0}, x, 0));
  EXPECT_FALSE(hit(cache, 0, {x}));  // a different number of inputs
  EXPECT_FALSE(hit(cache, 0, {x, int64_t{1}}));  // int and float differ
}

TEST(Cache, InferenceTensorsAreNeverCached) {
  NodeCache cache;
  at::Tensor plain = floats(4);
  at::Tensor inference;
  {
    c10::InferenceMode guard;
    inference = floats(4);
    EXPECT_FALSE(cache.put(0, {inference}, plain, 0));  // untracked input
    EXPECT_FALSE(cache.put(1, {plain}, inference, 0));  // untracked output
  }
  EXPECT_EQ(cache.cached_count(), 0);
}

TEST(Cache, SharedStoragesAreCountedOnce) {
  NodeCache cache;
  at::Tensor x = floats(256);
  at::Tensor base = x * 2;
  ASSERT_TRUE(cache.put(0, {x}, base, 0));
  ASSERT_TRUE(cache.put(1, {base}, base.view({16, 16}), 0));
  ASSERT_TRUE(cache.put(2, {x}, c10::ivalue::Tuple::create({base.narrow(0, 0, 8), base.narrow(0, 8, 8)}), 0));
  EXPECT_EQ(cache.cached_bytes(), 256 * kFloat);
  EXPECT_EQ(cache.stats().cached_bytes, 256 * kFloat);
  cache.invalidate_node(0);
  cache.invalidate_node(1);
  EXPECT_EQ(cache.cached_bytes(), 256 * kFloat);  // node 2 still holds the storage
  cache.invalidate_node(2);
  EXPECT_EQ(cache.cached_bytes(), 0);
}

TEST(Cache, EvictionPrefersTheCheapestPerByteThenTheLeastRecent) {
  NodeCache cache({.capacity_bytes = 3 * 100 * kFloat});
  std::vector<at::Tensor> inputs{floats(1), floats(1), floats(1), floats(1), floats(1)};
  ASSERT_TRUE(cache.put(0, {inputs[0]}, floats(100), 5.0));  // expensive
  ASSERT_TRUE(cache.put(1, {inputs[1]}, floats(100), 0.1));  // cheap
  ASSERT_TRUE(cache.put(2, {inputs[2]}, floats(100), 1.0));
  EXPECT_EQ(cache.cached_count(), 3);
  ASSERT_TRUE(cache.put(3, {inputs[3]}, floats(100), 1.0));
  EXPECT_EQ(cache.cached_node_ids(), (std::vector<int64_t>{0, 2, 3}));  // node 1 was cheapest
  EXPECT_EQ(cache.stats().evictions, 1);
  // Equal cost per byte: the least recently used goes first.
  EXPECT_TRUE(hit(cache, 2, {inputs[2]}));
  ASSERT_TRUE(cache.put(4, {inputs[4]}, floats(100), 1.0));
  EXPECT_EQ(cache.cached_node_ids(), (std::vector<int64_t>{0, 2, 4}));
  // An entry cheaper per byte than everything held is not admitted, and nothing is evicted.
  EXPECT_FALSE(cache.put(5, {inputs[0]}, floats(100), 0.0));
  EXPECT_EQ(cache.cached_node_ids(), (std::vector<int64_t>{0, 2, 4}));
  // Larger than the whole capacity: not stored.
  EXPECT_FALSE(cache.put(6, {inputs[0]}, floats(400), 100.0));
  EXPECT_EQ(cache.cached_count(), 3);
  EXPECT_LE(cache.cached_bytes(), *cache.capacity_bytes());
}

TEST(Cache, EntriesOfFreedInputsAreEvictedFirst) {
  NodeCache cache({.capacity_bytes = 2 * 100 * kFloat});
  at::Tensor keep = floats(1);
  ASSERT_TRUE(cache.put(0, {keep}, floats(100), 0.0));  // cheap but live
  {
    at::Tensor gone = floats(1);
    ASSERT_TRUE(cache.put(1, {gone}, floats(100), 10.0));  // expensive but its input dies
  }
  ASSERT_TRUE(cache.put(2, {keep}, floats(100), 1.0));
  EXPECT_EQ(cache.cached_node_ids(), (std::vector<int64_t>{0, 2}));
}

TEST(Cache, SetCapacityEvictsDownToTheNewBudget) {
  NodeCache cache;
  at::Tensor x = floats(1);
  for (int64_t node = 0; node < 4; ++node) {
    ASSERT_TRUE(cache.put(node, {x}, floats(100), static_cast<double>(node)));
  }
  cache.set_capacity_bytes(2 * 100 * kFloat);
  EXPECT_EQ(cache.cached_node_ids(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(cache.capacity_bytes(), 2 * 100 * kFloat);
}

TEST(Cache, InvalidationMakesTheNextAccessAMissAndARecompute) {
  NodeCache cache;
  at::Tensor x = floats(4);
  ASSERT_TRUE(cache.put(0, {x}, c10::ivalue::Tuple::create({x * 2, x * 3}), 0));
  ASSERT_TRUE(cache.put(1, {x}, x * 4, 0));
  EXPECT_EQ(cache.stats().tensors_recomputed, 0);
  cache.invalidate_node(0);
  EXPECT_FALSE(hit(cache, 0, {x}));
  EXPECT_TRUE(hit(cache, 1, {x}));
  ASSERT_TRUE(cache.put(0, {x}, c10::ivalue::Tuple::create({x * 2, x * 3}), 0));
  EXPECT_EQ(cache.stats().tensors_recomputed, 2);
  cache.invalidate();
  EXPECT_EQ(cache.cached_count(), 0);
  EXPECT_EQ(cache.cached_bytes(), 0);
  EXPECT_FALSE(hit(cache, 1, {x}));
  const auto s = cache.stats();
  EXPECT_EQ(s.invalidations, 3);
  EXPECT_EQ(s.hits, 1);
  EXPECT_EQ(s.misses, 2);
  cache.reset_stats();
  EXPECT_EQ(cache.stats().hits, 0);
}

TEST(Cache, MemoryEstimateUsesMeasuredSizesAndOutlivesEntries) {
  NodeCache cache;
  at::Tensor x = floats(4);
  ASSERT_TRUE(cache.put(0, {x}, floats(10), 0));
  ASSERT_TRUE(cache.put(1, {x}, at::zeros({3}, at::kDouble), 0));
  EXPECT_EQ(cache.memory_estimate(std::vector<int64_t>{0}), 10 * kFloat);
  EXPECT_EQ(cache.memory_estimate(std::vector<int64_t>{0, 1, 7}), 10 * kFloat + 3 * 8);
  cache.invalidate();
  EXPECT_EQ(cache.memory_estimate(), 10 * kFloat + 3 * 8);
}

TEST(Cache, ObserveTellsChangedInputsFromStableOnes) {
  NodeCache cache;
  at::Tensor x = floats(4);
  EXPECT_EQ(cache.observe(0, {x}), Seen::kNew);
  EXPECT_EQ(cache.observe(0, {x}), Seen::kSame);
  x.add_(1);
  EXPECT_EQ(cache.observe(0, {x}), Seen::kNew);
  EXPECT_EQ(cache.observe(0, {x}), Seen::kSame);
  EXPECT_EQ(cache.observe(0, {floats(4)}), Seen::kNew);
  EXPECT_EQ(cache.cached_count(), 0);
}

TEST(Cache, ObserveRemembersTheMostRecentInputsPerSource) {
  NodeCache cache({.entries_per_node = 2});
  at::Tensor a = floats(4), b = floats(4), c = floats(4);
  EXPECT_EQ(cache.observe(0, {a}), Seen::kNew);
  EXPECT_EQ(cache.observe(0, {b}), Seen::kNew);
  EXPECT_EQ(cache.observe(0, {a}), Seen::kRecurring);  // a and b by turns
  EXPECT_EQ(cache.observe(0, {b}), Seen::kRecurring);
  EXPECT_EQ(cache.observe(0, {c}), Seen::kNew);        // forgets a, the least recent
  EXPECT_EQ(cache.observe(0, {a}), Seen::kNew);
  EXPECT_EQ(cache.observe(0, {c}), Seen::kRecurring);
  a.add_(1);
  EXPECT_EQ(cache.observe(0, {a}), Seen::kNew);  // changed in place: not the a seen before
  NodeCache one({.entries_per_node = 1});
  EXPECT_EQ(one.observe(0, {a}), Seen::kNew);
  EXPECT_EQ(one.observe(0, {b}), Seen::kNew);
  EXPECT_EQ(one.observe(0, {a}), Seen::kNew);
}

TEST(Cache, ANodeHoldsOneEntryPerSetOfInputsUpToItsLimit) {
  NodeCache cache({.entries_per_node = 2});
  at::Tensor a = floats(4), b = floats(4), c = floats(4);
  ASSERT_TRUE(cache.put(0, {a}, a * 2, 0));
  ASSERT_TRUE(cache.put(0, {b}, b * 3, 0));
  EXPECT_TRUE(at::equal(cache.get(0, {a})->toTensor(), a * 2));  // alternating inputs both hit
  EXPECT_TRUE(at::equal(cache.get(0, {b})->toTensor(), b * 3));
  EXPECT_TRUE(at::equal(cache.get(0, {a})->toTensor(), a * 2));
  EXPECT_EQ(cache.cached_count(), 2);
  EXPECT_EQ(cache.cached_node_ids(), std::vector<int64_t>{0});
  ASSERT_TRUE(cache.put(0, {c}, c * 4, 0));  // full: b, the least recently used, makes way
  EXPECT_FALSE(cache.get(0, {b}));
  EXPECT_TRUE(cache.get(0, {a}));
  EXPECT_TRUE(cache.get(0, {c}));
  EXPECT_EQ(cache.cached_bytes(), 2 * 4 * kFloat);  // a's and c's outputs
  a.add_(1);                                          // a's entry can never match again: dropped
  EXPECT_FALSE(cache.get(0, {a}));
  EXPECT_EQ(cache.cached_count(), 1);
  cache.invalidate_node(0);
  EXPECT_EQ(cache.cached_count(), 0);
  EXPECT_EQ(cache.cached_bytes(), 0);
  EXPECT_THROW(NodeCache({.entries_per_node = 0}), c10::Error);
}

TEST(Cache, BadArgumentsAreRejectedWithoutChangingState) {
  EXPECT_THROW(NodeCache({.capacity_bytes = -1}), c10::Error);
  NodeCache cache;
  at::Tensor x = floats(4);
  EXPECT_THROW(cache.put(0, {x}, x, -1.0), c10::Error);
  EXPECT_THROW(cache.put(0, {x}, x, std::nan("")), c10::Error);
  EXPECT_THROW(cache.set_capacity_bytes(-5), c10::Error);
  EXPECT_EQ(cache.cached_count(), 0);
  EXPECT_FALSE(cache.capacity_bytes().has_value());
}

TEST(Cache, ConcurrentUseKeepsCountsAndBudgetConsistent) {
  constexpr int kThreads = 4;
  constexpr int kIterations = 2000;
  NodeCache cache({.capacity_bytes = 8 * 64 * kFloat});
  std::vector<at::Tensor> inputs;
  for (int i = 0; i < 16; ++i) {
    inputs.push_back(floats(1));
  }
  std::atomic<int64_t> gets{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIterations; ++i) {
        const int node = (i * 7 + t) % 16;
        if (!cache.get(node, {inputs[node]})) {
          cache.put(node, {inputs[node]}, floats(64), 1e-6 * (node + 1));
        }
        ++gets;
        if (i % 97 == 0) {
          cache.invalidate_node(node);
        }
        EXPECT_LE(cache.cached_bytes(), 8 * 64 * kFloat);
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  const auto s = cache.stats();
  EXPECT_EQ(s.hits + s.misses, gets.load());
  EXPECT_EQ(s.cached_bytes, s.entries * 64 * kFloat);
}

TEST(Cache, RegisteredAsATorchScriptClass) {
  auto type = torch::getCustomClass("__torch__.torch.classes.torch_ext.NodeCache");
  ASSERT_TRUE(type);
  for (const char* method : {"get", "lookup", "put", "invalidate_node", "invalidate", "stats", "memory_estimate"}) {
    EXPECT_NE(type->findMethod(method), nullptr) << method;
  }
}

// ---------------------------------------------------------------- fork safety and stress (issue 16)

TEST(CacheFork, AChildCanUseAndDestroyACacheAnotherThreadWasUsingAtFork) {
  auto cache = c10::make_intrusive<NodeCache>();
  std::atomic<bool> stop{false};
  std::atomic<int64_t> calls{0};
  std::thread user([&] {
    std::vector<at::Tensor> inputs;
    for (int i = 0; i < 64; ++i) inputs.push_back(floats(16));
    for (int64_t i = 0; !stop; ++i) {  // the mutex is held for most of each call
      cache->put(i % 64, {inputs[i % 64]}, inputs[i % 64] * 2, 1e-3);
      cache->get((i + 7) % 64, {inputs[(i + 7) % 64]});
      ++calls;
    }
  });
  auto join = c10::make_scope_exit([&] {  // an assertion below must not leave the thread joinable
    stop = true;
    user.join();
  });
  // The first forks wait for the user's first call: torch initializes each CPU kernel on its first
  // use inside a function-local static, and a child forked while another thread was inside one
  // waits for it forever (seen in fill_'s DispatchStub). That hang is torch's, not the cache's.
  while (calls.load() == 0) std::this_thread::yield();
  for (int round = 0; round < 20; ++round) {
    const int code = torch_ext::testing::run_in_child([&] {
      at::Tensor x = floats(4);
      cache->put(1000, {x}, x + 1, 0);
      const bool ok = cache->get(1000, {x}).has_value() && cache->stats().entries >= 1;
      cache.reset();
      return ok ? 0 : 3;
    }, 20);
    ASSERT_EQ(code, 0) << "round " << round << " (-1: the child hung)";
  }
}

TEST(CacheStress, EightThreadsKeepCapacityValuesAndCounts) {
  constexpr int kThreads = 8;
  constexpr int64_t kCapacity = 64 * 64 * kFloat;
  NodeCache cache(torch_ext::cache::NodeCacheOptions{kCapacity});
  std::vector<at::Tensor> inputs;
  for (int i = 0; i < 128; ++i) inputs.push_back(at::arange(64, at::kFloat) + i);
  std::atomic<int64_t> gets{0};
  std::atomic<bool> failed{false};
  std::atomic<bool> done{false};
  const auto stop = std::chrono::steady_clock::now() + std::chrono::duration<double>(torch_ext::testing::stress_seconds());
  std::barrier phase(kThreads, [&]() noexcept {
    const auto s = cache.stats();
    if (s.cached_bytes > kCapacity || s.hits + s.misses != gets.load() || s.entries != cache.cached_count()) {
      failed = true;
    }
    if (std::chrono::steady_clock::now() > stop) done = true;
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      while (!done) {
        for (int op = 0; op < 100; ++op) {
          const int i = static_cast<int>(rng() % inputs.size());
          const int what = static_cast<int>(rng() % 100);
          if (what < 40) {
            cache.put(i, {inputs[i]}, inputs[i] * 3, 1e-6 * (1 + rng() % 100));
          } else if (what < 95) {
            ++gets;
            const auto got = cache.get(i, {inputs[i]});
            if (got && !at::equal(got->toTensor(), inputs[i] * 3)) failed = true;  // never another node's value
          } else if (what < 99) {
            cache.invalidate_node(i);
          } else {
            cache.invalidate();
          }
        }
        phase.arrive_and_wait();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_FALSE(failed) << "capacity, values or counts broken";
  EXPECT_GT(gets.load(), 0);
}

// ---- content keys ----
namespace {

using torch_ext::cache::NodeCacheOptions;

// Restores full digests however a test ends.
struct DigestBits {
  explicit DigestBits(int bits) { torch_ext::cache::set_digest_bits_for_testing(bits); }
  ~DigestBits() { torch_ext::cache::set_digest_bits_for_testing(128); }
};

// A key of one graph input and weights 1000 times its size: content keys pay at the default fraction.
std::vector<c10::IValue> keyed(const at::Tensor& input, const at::Tensor& weights) { return {input, weights}; }

}  // namespace

TEST(CacheContent, AnEqualTensorInANewObjectHitsAndOtherValuesMiss) {
  NodeCache cache;
  at::Tensor weights = floats(8000);
  at::Tensor x = at::arange(8, at::kLong);
  ASSERT_TRUE(cache.put(0, keyed(x, weights), x * 2, 0, std::nullopt, 1));
  auto got = cache.get(0, keyed(at::arange(8, at::kLong), weights));
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(got->toTensor().equal(x * 2));
  EXPECT_FALSE(hit(cache, 0, keyed(at::arange(8, at::kLong) + 1, weights)));
  // Same bytes, other dtype, shape or strides: different tensors.
  ASSERT_TRUE(cache.put(0, keyed(x, weights), x * 2, 0, std::nullopt, 1));
  EXPECT_FALSE(hit(cache, 0, keyed(at::arange(8, at::kDouble).view(at::kLong), weights)));
  ASSERT_TRUE(cache.put(0, keyed(x, weights), x * 2, 0, std::nullopt, 1));
  EXPECT_FALSE(hit(cache, 0, keyed(at::arange(8, at::kLong).view({2, 4}), weights)));
  // The weights stay keyed by identity.
  ASSERT_TRUE(cache.put(0, keyed(x, weights), x * 2, 0, std::nullopt, 1));
  EXPECT_FALSE(hit(cache, 0, keyed(x, floats(8000))));
}

TEST(CacheContent, TheEntryKeepsACopySoChangingOrFreeingTheInputIsSeen) {
  NodeCache cache;
  at::Tensor weights = floats(8000);
  at::Tensor x = at::arange(8, at::kLong);
  ASSERT_TRUE(cache.put(0, keyed(x, weights), x * 2, 0, std::nullopt, 1));
  const int64_t held = cache.cached_bytes();
  EXPECT_EQ(held, 2 * 8 * 8);  // the output and the copy of the input
  x.add_(1);  // in place: other values now
  EXPECT_FALSE(hit(cache, 0, keyed(x, weights)));
  ASSERT_TRUE(cache.put(0, keyed(x, weights), x * 2, 0, std::nullopt, 1));
  x.sub_(1);
  x.add_(1);  // another version, the same values: still a hit
  EXPECT_TRUE(hit(cache, 0, keyed(x, weights)));
  x = at::Tensor();  // freed: an equal tensor still hits, and the entry does not count as expired
  EXPECT_TRUE(hit(cache, 0, keyed(at::arange(8, at::kLong) + 1, weights)));
}

TEST(CacheContent, ACollisionOfDigestsIsAMissNeverAWrongValue) {
  DigestBits bits(0);  // every digest equal: each content match must be confirmed by the bytes
  NodeCache cache;
  at::Tensor weights = floats(8000);
  at::Tensor x = at::arange(8, at::kLong);
  ASSERT_TRUE(cache.put(0, keyed(x, weights), x * 2, 0, std::nullopt, 1));
  EXPECT_FALSE(hit(cache, 0, keyed(at::arange(8, at::kLong) + 5, weights)));
  ASSERT_TRUE(cache.put(0, keyed(x, weights), x * 2, 0, std::nullopt, 1));
  EXPECT_TRUE(hit(cache, 0, keyed(at::arange(8, at::kLong), weights)));
  EXPECT_EQ(cache.observe(1, {x}, 1 << 20), Seen::kNew);
  EXPECT_EQ(cache.observe(1, {x + 3}, 1 << 20), Seen::kNew);
  EXPECT_EQ(cache.observe(1, {x + 3}, 1 << 20), Seen::kSame);
  EXPECT_EQ(cache.observe(1, {at::arange(8, at::kLong)}, 1 << 20), Seen::kRecurring);
}

TEST(CacheContent, TheRuleHashesOnlyInputsSmallAgainstTheWeights) {
  NodeCacheOptions options;
  EXPECT_TRUE(options.keys_by_content(100, 10000));
  EXPECT_FALSE(options.keys_by_content(101, 10000));
  EXPECT_FALSE(options.keys_by_content(0, 10000));
  EXPECT_FALSE(NodeCacheOptions{.content_keys = false}.keys_by_content(1, 1 << 30));
  EXPECT_FALSE(NodeCacheOptions{.content_key_fraction = 0}.keys_by_content(1, 1 << 30));
  EXPECT_TRUE(NodeCacheOptions{.content_key_fraction = INFINITY}.keys_by_content(1 << 30, 0));
  EXPECT_THROW(NodeCache({.content_key_fraction = -1}), c10::Error);
  EXPECT_THROW(NodeCache({.content_key_fraction = NAN}), c10::Error);

  NodeCache cache;
  at::Tensor x = at::arange(8, at::kLong);
  at::Tensor small = floats(800);  // 64 bytes of input against 3200 of weights: 2%, over 1%
  ASSERT_TRUE(cache.put(0, keyed(x, small), x, 0, std::nullopt, 1));
  EXPECT_FALSE(hit(cache, 0, keyed(at::arange(8, at::kLong), small)));
  at::Tensor large = floats(1600);  // 1%: hashed
  ASSERT_TRUE(cache.put(0, keyed(x, large), x, 0, std::nullopt, 1));
  EXPECT_TRUE(hit(cache, 0, keyed(at::arange(8, at::kLong), large)));
  NodeCache always({.content_key_fraction = INFINITY});
  ASSERT_TRUE(always.put(0, {x}, x * 2, 0, std::nullopt, 1));
  EXPECT_TRUE(hit(always, 0, {at::arange(8, at::kLong)}));
  NodeCache never({.content_keys = false});
  ASSERT_TRUE(never.put(0, keyed(x, large), x * 2, 0, std::nullopt, 1));
  EXPECT_FALSE(hit(never, 0, keyed(at::arange(8, at::kLong), large)));
}

TEST(CacheContent, TensorsThatRequireGradOrAreViewsOfOtherValuesKeepIdentity) {
  NodeCache cache({.content_key_fraction = INFINITY});
  at::Tensor leaf = floats(8).requires_grad_();
  ASSERT_TRUE(cache.put(0, {leaf}, leaf * 2, 0, std::nullopt, 1));
  EXPECT_FALSE(hit(cache, 0, {floats(8).requires_grad_()}));  // a new leaf needs its own graph
  at::Tensor strided = at::arange(16, at::kFloat).view({4, 4}).t();
  ASSERT_TRUE(cache.put(0, {strided}, strided * 2, 0, std::nullopt, 1));
  EXPECT_FALSE(hit(cache, 0, {at::arange(16, at::kFloat).view({4, 4}).t()}));  // not contiguous
}

TEST(CacheContent, ObserveCountsAnEqualTensorAsUnchangedWhereHashingPays) {
  NodeCache cache;
  at::Tensor x = at::arange(8, at::kLong);
  EXPECT_EQ(cache.observe(0, {x}, 1 << 20), Seen::kNew);
  EXPECT_EQ(cache.observe(0, {at::arange(8, at::kLong)}, 1 << 20), Seen::kSame);
  EXPECT_EQ(cache.observe(0, {at::arange(8, at::kLong) + 1}, 1 << 20), Seen::kNew);
  EXPECT_EQ(cache.observe(0, {at::arange(8, at::kLong)}, 1 << 20), Seen::kRecurring);
  EXPECT_EQ(cache.observe(1, {x}, 0), Seen::kNew);  // no work: identity only
  EXPECT_EQ(cache.observe(1, {at::arange(8, at::kLong)}, 0), Seen::kNew);
  NodeCache off({.content_keys = false});
  EXPECT_EQ(off.observe(0, {x}, 1 << 20), Seen::kNew);
  EXPECT_EQ(off.observe(0, {at::arange(8, at::kLong)}, 1 << 20), Seen::kNew);
}
