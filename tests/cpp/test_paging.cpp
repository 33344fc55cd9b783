#include <gtest/gtest.h>

#include <ftw.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <random>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include "torch_ext/paging/layer_pager.h"
#include "torch_ext/paging/source.h"
#include "torch_ext/paging/streamed_blocks.h"
#include "reliability_helpers.h"

namespace pg = torch_ext::paging;

namespace {

// POSIX rather than std::filesystem: the CUDA wheels of torch export their own copy of
// std::filesystem from libtorch.so, which crashes when a program built elsewhere calls it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = "/tmp/torch_ext_paging_XXXXXX";
    EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    ::nftw(path_.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
           FTW_DEPTH | FTW_PHYS);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string with_length(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + header + data;
}

// A valid safetensors file of float32, bfloat16 or float16 tensors, written the way the format specifies.
std::string safetensors_bytes(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::string& metadata = "") {
  std::string header = "{";
  std::string data;
  if (!metadata.empty()) header += "\"__metadata__\":" + metadata + ",";
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    std::string shape;
    for (int64_t d = 0; d < t.dim(); ++d) shape += (d ? "," : "") + std::to_string(t.size(d));
    const size_t begin = data.size();
    data.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
    const std::string dtype = pg::safetensors_dtype_name(t.scalar_type());
    header += (i ? "," : "") + std::string("\"") + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":[" + shape +
              "],\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(data.size()) + "]}";
  }
  header += "}";
  while ((8 + header.size()) % 8 != 0) header += ' ';
  return with_length(header, data);
}

at::Tensor values(int64_t n, float start) { return at::arange(start, start + static_cast<float>(n), at::kFloat); }

// n tensors "t0".."t{n-1}" of `floats` float32 each.
std::vector<std::pair<std::string, at::Tensor>> layers(int n, int64_t floats) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (int i = 0; i < n; ++i) out.emplace_back("t" + std::to_string(i), values(floats, 1000.0f * i));
  return out;
}

using torch_ext::testing::expect_error;

c10::intrusive_ptr<pg::SafetensorsSource> open(const std::string& path) {
  return c10::make_intrusive<pg::SafetensorsSource>(path);
}

c10::intrusive_ptr<pg::LayerPager> make_pager(const c10::intrusive_ptr<pg::SafetensorsSource>& source,
                                              int64_t budget, pg::EvictionPolicy policy = pg::EvictionPolicy::LRU,
                                              int64_t prefetch = 0, std::vector<std::string> pinned = {}) {
  pg::PagerOptions options;
  options.budget_bytes = budget;
  options.policy = policy;
  options.prefetch = prefetch;
  options.pinned = std::move(pinned);
  options.zero_copy = false;  // the copy path; zero_copy (the cpu default) has tests of its own
  return c10::make_intrusive<pg::LayerPager>(source, options);
}

}  // namespace

TEST(PagingSource, ReadsNamesShapesDataAndMetadata) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes({{"b", values(6, 1).view({2, 3})}, {"a", values(4, -3)}}, R"({"format":"pt"})"));
  auto source = open(path);
  EXPECT_EQ(source->names(), (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ(source->info("b").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(source->info("b").nbytes, 24);
  EXPECT_EQ(source->total_bytes(), 40);
  EXPECT_EQ(source->metadata().at("format"), "pt");
  EXPECT_TRUE(at::equal(source->load("b"), values(6, 1).view({2, 3})));
  EXPECT_TRUE(at::equal(source->view("a"), values(4, -3)));
  // A view outlives the source object: it keeps the mapping alive.
  at::Tensor view = source->view("b");
  source.reset();
  EXPECT_TRUE(at::equal(view, values(6, 1).view({2, 3})));
  expect_error([&] { open(path)->info("zz"); }, {"m.safetensors", "zz"});
}

TEST(PagingSource, CompositionsStackAndConcatenateStoredTensorsAndPageLikeThem) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  // two experts' gate (w1) and up (w3) projections, stored one tensor each, as Mixtral's checkpoints
  std::vector<std::pair<std::string, at::Tensor>> stored;
  for (int e = 0; e < 2; ++e) {
    stored.emplace_back("e" + std::to_string(e) + ".w1", values(6, 100.0f * e).view({2, 3}));
    stored.emplace_back("e" + std::to_string(e) + ".w3", values(6, 100.0f * e + 50).view({2, 3}));
  }
  stored.emplace_back("norm", values(3, -1));
  write_bytes(path, safetensors_bytes(stored));
  auto composed = open(path)->composed(
      {{"gate_up",
        {"tensor e0.w1", "tensor e1.w1", "stack 0 2", "tensor e0.w3", "tensor e1.w3", "stack 0 2", "cat 1 2"}},
       {"up_t", {"tensor e1.w3", "transpose 0 1"}}});
  const at::Tensor gate_up = at::cat({at::stack({stored[0].second, stored[2].second}),
                                      at::stack({stored[1].second, stored[3].second})}, 1);
  EXPECT_EQ(composed->names(), (std::vector<std::string>{"gate_up", "up_t", "norm"}));
  EXPECT_EQ(composed->info("gate_up").shape, (std::vector<int64_t>{2, 4, 3}));
  EXPECT_FALSE(composed->has_view("gate_up"));
  EXPECT_TRUE(composed->has_view("norm"));
  EXPECT_TRUE(at::equal(composed->load("gate_up"), gate_up));
  EXPECT_TRUE(at::equal(composed->load("up_t"), stored[3].second.t()));
  expect_error([&] { composed->view("gate_up"); }, {"gate_up", "composition"});
  for (const bool zero_copy : {false, true}) {
    pg::PagerOptions options;
    options.budget_bytes = composed->info("gate_up").nbytes;
    options.zero_copy = zero_copy;
    auto pager = c10::make_intrusive<pg::LayerPager>(composed, options);
    EXPECT_TRUE(at::equal(pager->acquire("gate_up"), gate_up));
    EXPECT_TRUE(at::equal(pager->acquire("norm"), stored[4].second));
    EXPECT_TRUE(at::equal(pager->acquire("gate_up"), gate_up));
    EXPECT_LE(pager->resident_bytes(), composed->info("gate_up").nbytes);
  }
  expect_error([&] { open(path)->composed({{"x", {"tensor e0.w1", "tensor norm", "cat 0 2"}}}); },
               {"composition \"x\"", "does not apply"});
}

TEST(PagingSource, DequantizeCompositionsServeFp8WeightsInPlaceOfTheStoredOnes) {
  TempDir dir;
  const auto path = dir.file("q.safetensors");
  // an FP8 weight of 4x8 in two 4x4 blocks, with one float32 scale a block, as FP8 checkpoints store them
  const at::Tensor weight = values(32, -16).view({4, 8}).to(at::kFloat8_e4m3fn);
  const at::Tensor scales = at::tensor({2.0f, 0.25f}).view({1, 2});
  write_bytes(path, safetensors_bytes({{"w", weight}, {"w_scale_inv", scales}, {"norm", values(3, -1)}}));
  auto composed = open(path)->composed({{"w", {"tensor w", "tensor w_scale_inv", "dequantize"}}});
  const at::Tensor expected = weight.to(at::kFloat).mul(at::cat({at::full({4, 4}, 2.0f), at::full({4, 4}, 0.25f)}, 1));
  EXPECT_EQ(composed->names(), (std::vector<std::string>{"w", "norm"}));
  EXPECT_EQ(composed->info("w").dtype, at::kFloat);
  EXPECT_FALSE(composed->has_view("w"));
  EXPECT_TRUE(at::equal(composed->load("w"), expected));
  for (const bool zero_copy : {false, true}) {
    pg::PagerOptions options;
    options.budget_bytes = composed->info("w").nbytes;
    options.zero_copy = zero_copy;
    auto pager = c10::make_intrusive<pg::LayerPager>(composed, options);
    EXPECT_TRUE(at::equal(pager->acquire("w"), expected));
    EXPECT_TRUE(at::equal(pager->acquire("norm"), values(3, -1)));
    EXPECT_TRUE(at::equal(pager->acquire("w"), expected));
  }
  expect_error([&] { open(path)->composed({{"norm", {"tensor w", "tensor w_scale_inv", "dequantize"}}}); },
               {"composition \"norm\"", "holds a tensor of that name"});
  expect_error([&] { open(path)->composed({{"x", {"tensor norm", "tensor w_scale_inv", "dequantize"}}}); },
               {"\"dequantize\"", "the quantized tensor has 1 dims"});
}

TEST(PagingSource, DirectIoReadsTheSameBytes) {
  TempDir dir;
  const auto path = dir.file("d.safetensors");
  write_bytes(path, safetensors_bytes(layers(3, 3001)));
  c10::intrusive_ptr<pg::SafetensorsSource> source;
  try {
    source = c10::make_intrusive<pg::SafetensorsSource>(path, pg::SourceOptions{.direct_io = true});
  } catch (const c10::Error& e) {
    GTEST_SKIP() << "O_DIRECT unsupported on " << path << ": " << e.what_without_backtrace();
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(at::equal(source->load("t" + std::to_string(i)), values(3001, 1000.0f * i)));
  }
}

TEST(PagingSource, ShardedIndexIsOneSource) {
  TempDir dir;
  write_bytes(dir.file("s1.safetensors"), safetensors_bytes({{"x", values(3, 0)}}));
  write_bytes(dir.file("s2.safetensors"), safetensors_bytes({{"y", values(5, 7)}, {"z", values(2, 9)}}));
  write_bytes(dir.file("model.safetensors.index.json"),
              R"({"metadata": {"total_size": 40}, "weight_map": {"x": "s1.safetensors", "y": "s2.safetensors", "z": "s2.safetensors"}})");
  for (const auto& path : {dir.file("model.safetensors.index.json"), dir.file("")}) {
    auto source = open(path);
    EXPECT_EQ(source->names().size(), 3u);
    EXPECT_TRUE(at::equal(source->load("y"), values(5, 7)));
    EXPECT_TRUE(at::equal(source->load("x"), values(3, 0)));
  }
  write_bytes(dir.file("bad.index.json"), R"({"weight_map": {"x": "s2.safetensors"}})");
  expect_error([&] { open(dir.file("bad.index.json")); }, {"bad.index.json", "\"x\"", "s2.safetensors"});
  write_bytes(dir.file("missing.index.json"), R"({"weight_map": {"x": "nope.safetensors"}})");
  expect_error([&] { open(dir.file("missing.index.json")); }, {"nope.safetensors", "cannot open"});
  write_bytes(dir.file("escape.index.json"), R"({"weight_map": {"x": "../s1.safetensors"}})");
  expect_error([&] { open(dir.file("escape.index.json")); }, {"escape.index.json", "relative path"});
}

TEST(PagingSource, BadFilesRaiseNamingFileAndTensor) {
  TempDir dir;
  const auto path = dir.file("bad.safetensors");
  const std::string data(16, '\0');
  auto check = [&](const std::string& bytes, const std::vector<std::string>& needles) {
    write_bytes(path, bytes);
    auto all = needles;
    all.push_back("bad.safetensors");
    expect_error([&] { open(path); }, all);
  };
  const std::string good = safetensors_bytes({{"w", values(4, 0)}});
  check(good.substr(0, 5), {"truncated"});
  check(good.substr(0, good.size() - 3), {"\"w\"", "out of range"});
  std::string absurd = good;
  std::memset(absurd.data(), 0xFF, 8);
  check(absurd, {"absurd header length"});
  std::string too_long = good;
  too_long[0] = static_cast<char>(200);
  check(too_long, {"exceeds"});
  check(with_length("{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]", data), {"malformed JSON"});
  check(with_length(R"({"w":{"dtype":"F33","shape":[4],"data_offsets":[0,16]}})", data), {"\"w\"", "unknown dtype", "F33"});
  check(with_length(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,32]}})", data), {"\"w\"", "out of range"});
  check(with_length(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[-1,15]}})", data), {"\"w\"", "out of range"});
  check(with_length(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", data), {"\"w\"", "need 12"});
  check(with_length(R"({"w":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", data), {"\"w\"", "non-negative"});
  check(with_length(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", data),
        {"\"a\"", "\"b\"", "overlapping"});
  check(with_length(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", data),
        {"\"b\"", "holes"});
  check(with_length(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data), {"trailing"});
  check(with_length(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16],"extra":1}})", data), {"\"w\"", "extra"});
  check(with_length(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}})", data), {"\"w\"", "overflow"});
  check(with_length(R"({"__metadata__":{"k":1}})", ""), {"__metadata__"});
  check(with_length("[1]", ""), {"must start with '{'"});
  expect_error([&] { open(dir.file("absent.safetensors")); }, {"absent.safetensors", "cannot open"});
}

TEST(Paging, AcquireLoadsExactDataAndKeepsTheBudget) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(6, 256)));
  auto pager = make_pager(open(path), 3 * 1024);
  EXPECT_EQ(pager->options().budget_bytes, 3 * 1024);
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < 6; ++i) {
      EXPECT_TRUE(at::equal(pager->acquire("t" + std::to_string(i)), values(256, 1000.0f * i)));
      EXPECT_LE(pager->resident_bytes(), 3 * 1024);
    }
  }
  EXPECT_EQ(pager->resident_count(), 3);
  EXPECT_TRUE(pager->is_resident("t5"));
  EXPECT_FALSE(pager->is_resident("t0"));
  const auto s = pager->stats();
  EXPECT_EQ(s.misses, 12);  // LRU on a cyclic sweep larger than the budget never hits
  EXPECT_EQ(s.hits, 0);
  EXPECT_EQ(s.evictions, 9);
  EXPECT_EQ(s.bytes_loaded, 12 * 1024);
  EXPECT_FALSE(s.pinned_over_budget);
  expect_error([&] { pager->acquire("nope"); }, {"m.safetensors", "nope"});
}

TEST(Paging, AcquireManyAcquiresEachIdInTurn) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(4, 256)));
  auto pager = make_pager(open(path), 2 * 1024);
  auto tensors = pager->acquire_many({"t2", "t0", "t2"});
  ASSERT_EQ(tensors.size(), 3u);
  EXPECT_TRUE(at::equal(tensors[0], values(256, 2000.0f)));
  EXPECT_TRUE(at::equal(tensors[1], values(256, 0.0f)));
  EXPECT_TRUE(at::equal(tensors[2], values(256, 2000.0f)));
  EXPECT_EQ(pager->stats().misses, 2);
  EXPECT_EQ(pager->stats().hits, 1);
  tensors.clear();
  // An unknown id fails the call after the ids before it were acquired; nothing is left loading.
  expect_error([&] { pager->acquire_many({"t1", "nope"}); }, {"m.safetensors", "nope"});
  EXPECT_EQ(pager->stats().misses, 3);
  EXPECT_LE(pager->resident_bytes(), 2 * 1024);
}

TEST(Paging, HeldTensorsStayValidAndAreNotEvicted) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(4, 256)));
  auto pager = make_pager(open(path), 1024);
  at::Tensor held = pager->acquire("t0");
  at::Tensor t1 = pager->acquire("t1");  // t0 is held: loading t1 goes over budget
  EXPECT_TRUE(pager->is_resident("t0"));
  EXPECT_EQ(pager->stats().over_budget_loads, 1);
  t1.reset();
  pager->acquire("t2");  // t1 is free to go; t0 is still held
  EXPECT_TRUE(pager->is_resident("t0"));
  EXPECT_FALSE(pager->is_resident("t1"));
  held.add_(0);  // still valid
  EXPECT_TRUE(at::equal(held, values(256, 0)));
  held.reset();
  pager->acquire("t3");
  EXPECT_FALSE(pager->is_resident("t0"));
  EXPECT_EQ(pager->resident_bytes(), 1024);
}

TEST(Paging, PinnedTensorsAreNeverEvicted) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(5, 256)));
  auto pager = make_pager(open(path), 2048, pg::EvictionPolicy::LRU, 0, {"t0"});
  EXPECT_TRUE(pager->is_pinned("t0"));
  EXPECT_FALSE(pager->is_pinned("t1"));
  for (int pass = 0; pass < 3; ++pass) {
    for (int i = 0; i < 5; ++i) pager->acquire("t" + std::to_string(i));
    EXPECT_TRUE(pager->is_resident("t0"));
  }
  pager->evict_all();
  EXPECT_TRUE(pager->is_resident("t0"));
  EXPECT_EQ(pager->resident_bytes(), 1024);
  EXPECT_FALSE(pager->stats().pinned_over_budget);
  expect_error([&] { make_pager(open(path), 1, pg::EvictionPolicy::LRU, 0, {"zz"}); }, {"pinned", "zz"});
}

TEST(Paging, PinnedOverBudgetIsBestEffortWithoutError) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(4, 256)));
  auto pager = make_pager(open(path), 1500, pg::EvictionPolicy::LRU, 0, {"t0", "t1"});
  EXPECT_TRUE(pager->stats().pinned_over_budget);
  for (int i = 0; i < 4; ++i) pager->acquire("t" + std::to_string(i));
  // Every unpinned candidate went, the last one as soon as its caller released it; the pinned
  // ones stay, over budget.
  EXPECT_TRUE(pager->is_resident("t0"));
  EXPECT_TRUE(pager->is_resident("t1"));
  EXPECT_EQ(pager->resident_count(), 2);
  EXPECT_GT(pager->stats().over_budget_loads, 0);
  EXPECT_GT(pager->stats().release_evictions, 0);
}

TEST(Paging, ScanResistantPolicyHitsWhereLruDoesNot) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(8, 256)));
  auto run = [&](pg::EvictionPolicy policy) {
    auto pager = make_pager(open(path), 4 * 1024, policy);
    for (int pass = 0; pass < 5; ++pass) {
      pager->begin_pass();
      if (pass == 2) pager->reset_stats();
      for (int i = 0; i < 8; ++i) pager->acquire("t" + std::to_string(i));
    }
    return pager->stats();
  };
  const auto lru = run(pg::EvictionPolicy::LRU);
  const auto scan = run(pg::EvictionPolicy::ScanResistant);
  EXPECT_EQ(lru.hits, 0);
  // Belady on the recorded cycle keeps budget-1 entries resident: 3 hits in each of 3 passes.
  EXPECT_EQ(scan.hits, 9);
  EXPECT_EQ(scan.misses, 15);
}

TEST(Paging, RecordedOrderAndSetOrder) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(3, 4)));
  auto pager = make_pager(open(path), 1 << 20, pg::EvictionPolicy::ScanResistant);
  pager->begin_pass();
  for (const char* id : {"t2", "t0", "t2"}) pager->acquire(id);
  pager->begin_pass();
  EXPECT_EQ(pager->order(), (std::vector<std::string>{"t2", "t0", "t2"}));
  pager->set_order({"t1", "t0"});
  EXPECT_EQ(pager->order(), (std::vector<std::string>{"t1", "t0"}));
  expect_error([&] { pager->set_order({"t9"}); }, {"t9"});
}

TEST(Paging, PrefetchLoadsAheadWithinTheBudget) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(8, 4096)));
  const int64_t budget = 4 * 16384;
  auto pager = make_pager(open(path), budget, pg::EvictionPolicy::ScanResistant, /*prefetch=*/2);
  for (int pass = 0; pass < 6; ++pass) {
    pager->begin_pass();
    for (int i = 0; i < 8; ++i) {
      EXPECT_TRUE(at::equal(pager->acquire("t" + std::to_string(i)), values(4096, 1000.0f * i)));
      EXPECT_LE(pager->resident_bytes(), budget);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // "compute"
    }
  }
  const auto s = pager->stats();
  EXPECT_GT(s.prefetches, 0);
  EXPECT_GT(s.prefetch_hits, 10);
  EXPECT_EQ(s.over_budget_loads, 0);
  EXPECT_LE(pager->resident_bytes(), budget);
}

TEST(Paging, ZeroCopyServesTheMappedFileWithinTheBudget) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(6, 4096)));
  auto source = open(path);
  pg::PagerOptions options;
  options.budget_bytes = 2 * 16384;
  options.policy = pg::EvictionPolicy::ScanResistant;
  options.prefetch = 1;
  options.zero_copy = true;
  auto pager = c10::make_intrusive<pg::LayerPager>(source, options);
  for (int pass = 0; pass < 3; ++pass) {
    pager->begin_pass();
    for (int i = 0; i < 6; ++i) {
      const std::string id = "t" + std::to_string(i);
      at::Tensor t = pager->acquire(id);
      EXPECT_EQ(t.data_ptr(), source->view(id).data_ptr());
      EXPECT_TRUE(at::equal(t, values(4096, 1000.0f * i)));
      EXPECT_LE(pager->resident_bytes(), options.budget_bytes);
    }
  }
  EXPECT_EQ(pager->stats().over_budget_loads, 0);
  options.device = c10::Device(c10::kMeta);
  expect_error([&] { c10::make_intrusive<pg::LayerPager>(source, options); }, {"zero_copy", "cpu"});
}

TEST(Paging, ZeroCopyIsTheCpuDefault) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(2, 1024)));
  auto source = open(path);
  pg::PagerOptions options;
  options.budget_bytes = 1 << 20;
  auto pager = c10::make_intrusive<pg::LayerPager>(source, options);
  EXPECT_EQ(pager->options().zero_copy, std::optional<bool>(true));  // resolved
  EXPECT_EQ(pager->acquire("t1").data_ptr(), source->view("t1").data_ptr());
  options.zero_copy = false;
  auto copier = c10::make_intrusive<pg::LayerPager>(source, options);
  EXPECT_NE(copier->acquire("t1").data_ptr(), source->view("t1").data_ptr());
  EXPECT_TRUE(at::equal(copier->acquire("t1"), pager->acquire("t1")));
}

TEST(Paging, DtypeConvertsTensorsAsTheyLoadAndTheBudgetCountsConvertedBytes) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(6, 256)));  // float32: 1024 bytes each, 512 in bfloat16
  auto source = open(path);
  pg::PagerOptions options;
  options.budget_bytes = 3 * 512;
  options.dtype = at::kBFloat16;
  options.keep_float32 = {"t0"};
  auto pager = c10::make_intrusive<pg::LayerPager>(source, options);
  EXPECT_EQ(pager->stats().largest_tensor_bytes, 1024);  // t0, kept in float32
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 1; i < 6; ++i) {
      const std::string id = "t" + std::to_string(i);
      at::Tensor t = pager->acquire(id);
      EXPECT_EQ(t.scalar_type(), at::kBFloat16);
      EXPECT_TRUE(at::equal(t, values(256, 1000.0f * i).to(at::kBFloat16)));
      EXPECT_NE(t.data_ptr(), source->view(id).data_ptr());  // a converted copy, never a view
      EXPECT_LE(pager->resident_bytes(), 3 * 512);
    }
  }
  EXPECT_EQ(pager->resident_count(), 3);
  EXPECT_EQ(pager->stats().bytes_loaded, 10 * 512);
  at::Tensor kept = pager->acquire("t0");
  EXPECT_EQ(kept.scalar_type(), at::kFloat);
  EXPECT_EQ(kept.data_ptr(), source->view("t0").data_ptr());  // no conversion: still a view
  options.zero_copy = false;  // the copy path converts too, into memory it owns
  options.keep_float32 = {};
  auto copier = c10::make_intrusive<pg::LayerPager>(source, options);
  EXPECT_TRUE(at::equal(copier->acquire("t0"), values(256, 0.0f).to(at::kBFloat16)));
  options.keep_float32 = {"nope"};
  expect_error([&] { c10::make_intrusive<pg::LayerPager>(source, options); }, {"keep_float32", "nope"});
  expect_error([&] { torch_ext::enum_from_name<c10::ScalarType>("int8"); }, {"dtype", "'float32'", "'int8'"});
}

TEST(Paging, GatherRowsReadsRowsInTheServedDtypeWithoutLoadingTheTable) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes({{"table", values(64 * 4, 0.5f).reshape({64, 4})}, {"flat", values(8, 0.0f)}}));
  pg::PagerOptions options;
  options.budget_bytes = 1 << 20;
  options.dtype = at::kBFloat16;
  auto pager = c10::make_intrusive<pg::LayerPager>(open(path), options);
  at::Tensor ids = at::empty({2, 2}, at::kLong);
  auto id = ids.accessor<int64_t, 2>();
  id[0][0] = 63, id[0][1] = 0, id[1][0] = 5, id[1][1] = 5;
  const at::Tensor rows = pager->gather_rows("table", ids);
  EXPECT_EQ(rows.sizes(), at::IntArrayRef({2, 2, 4}));
  EXPECT_EQ(rows.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(rows, values(64 * 4, 0.5f).reshape({64, 4}).to(at::kBFloat16).index_select(0, ids.flatten())
                                  .reshape({2, 2, 4})));
  EXPECT_FALSE(pager->is_resident("table"));
  EXPECT_EQ(pager->stats().bytes_loaded, 0);
  EXPECT_FALSE(pager->gathers_rows("flat"));
  expect_error([&] { pager->gather_rows("flat", ids); }, {"cannot gather rows", "\"flat\"", "2-D"});
  expect_error([&] { pager->gather_rows("nope", ids); }, {"nope"});
}

TEST(Paging, MatmulStreamsAConvertedWeightWithoutLoadingItAndEqualsTheWholeProduct) {
  // Stored float32, served bfloat16: "w" (out, in) as nn.Linear keeps it, "t" (in, out) as
  // transformers' Conv1D; several 512 KiB blocks each. The budget holds neither.
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  const at::Tensor w = at::randn({4096, 96}), t = at::randn({96, 3000}), bias = at::randn({3000});
  write_bytes(path, safetensors_bytes({{"w", w}, {"t", t}, {"flat", values(8, 0.0f)}}));
  pg::PagerOptions options;
  options.budget_bytes = 4096;
  options.dtype = at::kBFloat16;
  auto pager = c10::make_intrusive<pg::LayerPager>(open(path), options);
  EXPECT_TRUE(pager->streams("w") && pager->streams("t") && !pager->streams("flat"));
  const at::Tensor x = at::randn({2, 5, 96}).to(at::kBFloat16);
  const at::Tensor conv1d = at::addmm(bias.to(at::kBFloat16), x.view({-1, 96}), t.to(at::kBFloat16)).view({2, 5, 3000});
  int64_t loaded_by_first_calls = 0;
  for (int pass = 0; pass < 2; ++pass) {  // the first call of a shape acquires the weight and compares
    EXPECT_TRUE(at::equal(pager->matmul("w", x, std::nullopt, false), at::linear(x, w.to(at::kBFloat16))));
    EXPECT_TRUE(at::equal(pager->matmul("t", x, bias.to(at::kBFloat16), true), conv1d));
    if (pass == 0) loaded_by_first_calls = pager->stats().bytes_loaded;
  }
  const auto stats = pager->stats();
  EXPECT_EQ(stats.streamed_matmuls, 2 - stats.unstreamed_shapes);  // but shapes this BLAS blocks differently
  EXPECT_GT(loaded_by_first_calls, 0);
  if (stats.unstreamed_shapes == 0) {
    EXPECT_EQ(stats.bytes_loaded, loaded_by_first_calls);
    EXPECT_FALSE(pager->is_resident("w") || pager->is_resident("t"));
  }
  expect_error([&] { pager->matmul("nope", x, std::nullopt, false); }, {"nope"});
  // A float32 input is not the served dtype: acquired, and at::linear raises torch's error.
  EXPECT_ANY_THROW(pager->matmul("w", at::randn({2, 96}), std::nullopt, false));
}

TEST(Paging, StreamedBlocksMadeByAHelperThreadGiveTheCallersProduct) {
  // Stored bfloat16, served float32, in both layouts and both blockings, 6 to 7 blocks of 512 KiB
  // each. A product whose blocks the helper made, all or some, equals in every bit the one the
  // caller made alone.
  const at::Tensor x = at::randn({3, 64});
  const at::Tensor bias = at::randn({13000});
  using Blocking = pg::Blocking;
  for (const auto& [transposed, blocking] : {std::pair{false, Blocking::kOutputFeatures},
                                             std::pair{true, Blocking::kOutputFeatures},
                                             std::pair{true, Blocking::kWholeRows}}) {
    const at::Tensor stored = (transposed ? at::randn({64, 13000}) : at::randn({13000, 64})).to(at::kBFloat16);
    // Copies: clang before 16 cannot capture structured bindings.
    const auto blocks_of = [&, transposed = transposed, blocking = blocking] {
      return std::make_shared<pg::StreamedBlocks>(stored, x, std::optional<at::Tensor>(bias), transposed, blocking);
    };
    const auto alone = blocks_of();
    const at::Tensor expected = alone->multiply();
    EXPECT_EQ(alone->made_by_helper(), 0);
    ASSERT_GE(alone->blocks(), 6);

    const auto helped_first = blocks_of();  // the helper claims every block before the caller starts
    std::thread([&] { helped_first->help(); }).join();
    EXPECT_TRUE(at::equal(helped_first->multiply(), expected));
    EXPECT_EQ(helped_first->made_by_helper(), helped_first->blocks());

    const auto together = blocks_of();  // both at once: any split
    std::thread helper([&] { together->help(); });
    const at::Tensor both = together->multiply();
    helper.join();
    EXPECT_TRUE(at::equal(both, expected));
  }
}

TEST(Paging, AStreamedWeightsFilePagesStayMappedWithinTheBudgetAndAreEvictedLikeATensor) {
  // "w" is stored bfloat16 (192 KiB) and served float32 (384 KiB); the 200 KiB budget is below the
  // source, so w streams and never loads whole after its first call. Its file pages stay mapped
  // while the budget has room for them, counted at the file's bytes, until a load needs the room.
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  const at::Tensor w = at::randn({1024, 96}).to(at::kBFloat16);
  write_bytes(path, safetensors_bytes({{"w", w}, {"other", values(40000, 1.0f)}}));
  pg::PagerOptions options;
  options.budget_bytes = 200 << 10;
  options.prefetch = 0;
  options.dtype = at::kFloat;
  auto pager = c10::make_intrusive<pg::LayerPager>(open(path), options);
  const at::Tensor x = at::randn({1, 96}), expected = at::linear(x, w.to(at::kFloat));
  const int64_t file_bytes = 1024 * 96 * 2;
  EXPECT_TRUE(at::equal(pager->matmul("w", x, std::nullopt, false), expected));  // loads whole, compares
  if (pager->stats().unstreamed_shapes > 0) GTEST_SKIP() << "this BLAS blocks the product differently";
  EXPECT_FALSE(pager->is_resident("w"));  // loaded only to compare
  EXPECT_EQ(pager->resident_bytes(), 0);
  EXPECT_TRUE(at::equal(pager->matmul("w", x, std::nullopt, false), expected));  // streams; pages kept
  EXPECT_EQ(pager->resident_bytes(), file_bytes);
  EXPECT_EQ(pager->stats().streamed_from_mapped_pages, 0);
  EXPECT_TRUE(at::equal(pager->matmul("w", x, std::nullopt, false), expected));
  EXPECT_EQ(pager->stats().streamed_from_mapped_pages, 1);
  EXPECT_FALSE(pager->is_resident("w"));

  const int64_t evictions = pager->stats().evictions;
  EXPECT_TRUE(at::equal(pager->acquire("other"), values(40000, 1.0f)));  // needs the room: w's pages go
  EXPECT_EQ(pager->stats().evictions, evictions + 1);
  EXPECT_EQ(pager->resident_bytes(), 160000);
  EXPECT_TRUE(at::equal(pager->matmul("w", x, std::nullopt, false), expected));  // no room: given back
  EXPECT_EQ(pager->stats().streamed_from_mapped_pages, 1);
  EXPECT_EQ(pager->resident_bytes(), 160000);
  EXPECT_EQ(pager->stats().streamed_matmuls, 3);
}

TEST(Paging, StreamedConv1DWeightsGatherRunsOfOutputFeaturesFromEveryRow) {
  // A transposed (Conv1D) weight blocked by output features gathers each block's columns from
  // every row of the file (13 blocks of 64 columns, the last one short): the product is torch's
  // addmm over the converted weight (to the last bit where this BLAS blocks columns alike).
  const at::Tensor x = at::randn({5, 2100}), bias = at::randn({800});
  const at::Tensor stored = at::randn({2100, 800}).to(at::kBFloat16);
  const at::Tensor expected = at::addmm(bias, x, stored.to(at::kFloat));
  pg::StreamedBlocks blocks(stored, x, bias, true, pg::Blocking::kOutputFeatures);
  EXPECT_EQ(blocks.blocks(), 13);
  EXPECT_TRUE(blocks.multiply().allclose(expected, 1e-5, 1e-5));
  EXPECT_FALSE(blocks.scratch().defined());  // each thread's block buffer, no whole-weight buffer
}

TEST(Paging, EachThreadKeepsItsBlockBufferForItsNextProduct) {
  // A new buffer each product would be faulted in page by page each time; a narrower product
  // reuses the wider one's, a wider one replaces it, and another thread has its own.
  const at::Tensor x = at::randn({1, 256});
  const auto buffer_of = [&](int64_t out) {
    return pg::StreamedBlocks(at::randn({out, 256}).to(at::kBFloat16), x, std::nullopt, false,
                              pg::Blocking::kOutputFeatures)
        .block_buffer();
  };
  void* other = nullptr;
  std::thread([&] {  // a thread of its own: this one's buffer may be sized by earlier tests
    const at::Tensor first = buffer_of(128);  // one block of 128 rows of 256
    EXPECT_EQ(buffer_of(128).data_ptr(), first.data_ptr());
    EXPECT_EQ(buffer_of(64).data_ptr(), first.data_ptr());
    const at::Tensor wider = buffer_of(512);  // 512 KiB blocks: 512 rows of 256
    EXPECT_GT(wider.numel(), first.numel());
    EXPECT_EQ(buffer_of(128).data_ptr(), wider.data_ptr());
    std::thread([&] { other = buffer_of(128).data_ptr(); }).join();
    EXPECT_NE(other, wider.data_ptr());
  }).join();
  EXPECT_NE(other, nullptr);
  EXPECT_FALSE(pg::StreamedBlocks(at::randn({256, 512}).to(at::kBFloat16), x, std::nullopt, true,
                                  pg::Blocking::kWholeRows)
                   .block_buffer()
                   .defined());
}

TEST(Paging, StreamedConv1DWeightsConvertWholeRowsIntoAReusedBuffer) {
  // A transposed (Conv1D) weight converts into one buffer of the whole weight: a scratch buffer
  // with room is used (the next product's faults are spared), one without room is not, and the
  // product is torch's addmm over the converted weight, to the last bit.
  const at::Tensor x = at::randn({2, 64}), bias = at::randn({3000});
  const at::Tensor stored = at::randn({64, 3000}).to(at::kBFloat16);
  const at::Tensor expected = at::addmm(bias, x, stored.to(at::kFloat));
  const at::Tensor roomy = at::empty({64 * 3000 + 7}), small = at::empty({64 * 2999});
  pg::StreamedBlocks with_room(stored, x, bias, true, pg::Blocking::kWholeRows, roomy);
  EXPECT_TRUE(at::equal(with_room.multiply(), expected));
  EXPECT_EQ(with_room.scratch().data_ptr(), roomy.data_ptr());
  pg::StreamedBlocks without_room(stored, x, bias, true, pg::Blocking::kWholeRows, small);
  EXPECT_TRUE(at::equal(without_room.multiply(), expected));
  EXPECT_NE(without_room.scratch().data_ptr(), small.data_ptr());
  EXPECT_GE(without_room.scratch().numel(), 64 * 3000);
}

TEST(Paging, AConvertedLoadNeverReusesAViewsPages) {
  // "a" is served as a view (kept in float32), "b" converted to bfloat16: the same byte size, so
  // evicting "a" for "b" must not hand "a"'s mapped pages to "b" as memory to write into.
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes({{"a", values(256, 1.0f)}, {"b", values(512, 5000.0f)}}));
  auto source = open(path);
  pg::PagerOptions options;
  options.budget_bytes = 1024;
  options.prefetch = 0;
  options.dtype = at::kBFloat16;
  options.keep_float32 = {"a"};
  auto pager = c10::make_intrusive<pg::LayerPager>(source, options);
  for (int pass = 0; pass < 3; ++pass) {
    EXPECT_TRUE(at::equal(pager->acquire("a"), values(256, 1.0f)));
    EXPECT_TRUE(at::equal(pager->acquire("b"), values(512, 5000.0f).to(at::kBFloat16)));
  }
  EXPECT_EQ(pager->stats().misses, 6);
}

TEST(Paging, ConcurrentAcquiresLoadOnce) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(2, 1 << 20)));
  auto pager = make_pager(open(path), 16 << 20);
  constexpr int kThreads = 8;
  std::vector<at::Tensor> got(kThreads);
  std::vector<std::thread> threads;
  std::atomic<int> ready{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ready++;
      while (ready.load() < kThreads) std::this_thread::yield();
      got[t] = pager->acquire("t1");
    });
  }
  for (auto& th : threads) th.join();
  const auto s = pager->stats();
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.hits, kThreads - 1);
  EXPECT_EQ(s.bytes_loaded, 4 << 20);
  for (const auto& t : got) EXPECT_EQ(t.data_ptr(), got[0].data_ptr());
  EXPECT_TRUE(at::equal(got[0], values(1 << 20, 1000.0f)));
}

TEST(Paging, BadArguments) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(1, 4)));
  expect_error([&] { make_pager(open(path), -1); }, {"budget_bytes", "m.safetensors"});
  expect_error([&] { make_pager(open(path), 1, pg::EvictionPolicy::LRU, -2); }, {"prefetch"});
  expect_error([&] { torch_ext::enum_from_name<pg::EvictionPolicy>("fifo"); }, {"fifo"});
}

TEST(Paging, CudaTargetLoadsExactDataOnTheDeviceWithinTheBudget) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA device";
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(6, 4096)));
  pg::PagerOptions options;
  options.budget_bytes = 3 * 4096 * 4;
  options.policy = pg::EvictionPolicy::ScanResistant;
  options.prefetch = 2;
  options.device = c10::Device(c10::kCUDA);
  auto pager = c10::make_intrusive<pg::LayerPager>(open(path), options);
  for (int pass = 0; pass < 3; ++pass) {
    pager->begin_pass();
    for (int i = 0; i < 6; ++i) {
      const at::Tensor t = pager->acquire("t" + std::to_string(i));
      EXPECT_TRUE(t.is_cuda());
      EXPECT_TRUE(at::equal(t.cpu(), values(4096, 1000.0f * i))) << "pass " << pass << " tensor " << i;
      EXPECT_LE(pager->resident_bytes(), options.budget_bytes);
    }
  }
  EXPECT_EQ(pager->stats().bytes_loaded % (4096 * 4), 0);
  EXPECT_GT(pager->stats().hits, 0);  // the recorded order keeps tensors the next pass reuses
}

// ---------------------------------------------------------------- reliability (issue 16)

namespace {

// A source whose first read blocks until `go` (to catch a load under way); later reads do not.
class BlockingSource : public pg::PagerSource {
 public:
  explicit BlockingSource(c10::intrusive_ptr<pg::SafetensorsSource> inner) : inner_(std::move(inner)) {}
  std::vector<std::string> names() const override { return inner_->names(); }
  bool contains(const std::string& name) const override { return inner_->contains(name); }
  const pg::TensorInfo& info(const std::string& name) const override { return inner_->info(name); }
  at::Tensor load(const std::string& name, bool pin_memory) const override {
    block();
    return inner_->load(name, pin_memory);
  }
  void read_into(const std::string& name, void* dst) const override {
    block();
    inner_->read_into(name, dst);
  }
  std::string describe() const override { return inner_->describe(); }

  mutable std::atomic<bool> blocked{false};
  std::atomic<bool> go{false};

 private:
  void block() const {
    if (calls_++ != 0) return;
    blocked = true;
    while (!go) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  c10::intrusive_ptr<pg::SafetensorsSource> inner_;
  mutable std::atomic<int> calls_{0};
};

bool wait_until(const std::function<bool()>& done, double seconds = 30) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace

TEST(PagingBudget, ParsesIntsFloatsAndStringsAndRejectsTheRest) {
  const auto parse = [](const c10::IValue& v) { return pg::ByteBudget::parse(v, "budget_bytes"); };
  EXPECT_EQ(parse(int64_t{1024}).bytes, 1024);
  EXPECT_EQ(parse(1.5e9).bytes, 1500000000);
  EXPECT_EQ(parse(std::string("1GB")).bytes, 1000000000);
  EXPECT_EQ(parse(std::string("512MiB")).bytes, int64_t{512} << 20);
  EXPECT_EQ(parse(std::string("1.5 gib")).bytes, int64_t{3} << 29);
  EXPECT_EQ(parse(std::string("4096")).bytes, 4096);
  EXPECT_EQ(parse(std::string("30%")).percent, 30.0);
  EXPECT_EQ(parse(std::string("30%")).resolve(1000), 300);
  for (const c10::IValue& bad : {c10::IValue(int64_t{-1}), c10::IValue(-2.0), c10::IValue(std::string("abc")),
                                 c10::IValue(std::string("1 parsec")), c10::IValue(std::string("")),
                                 c10::IValue(std::string("-1GB")), c10::IValue(std::string("nan")),
                                 c10::IValue(std::string("9223372036854775808")), c10::IValue(1e19),
                                 c10::IValue(true)}) {
    try {
      parse(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("budget_bytes"), std::string::npos) << e.what();
    }
  }
}

TEST(PagingBudget, PercentResolvesAgainstTheSourceAndSmallBudgetsAreFlagged) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(4, 256)));  // 4 x 1 KiB
  pg::PagerOptions options;
  options.budget_bytes = pg::ByteBudget::of_percent(50);
  pg::LayerPager half(open(path), options);
  EXPECT_EQ(half.options().budget_bytes.bytes, 2048);
  EXPECT_FALSE(half.stats().budget_below_largest_tensor);
  EXPECT_EQ(half.stats().largest_tensor_bytes, 1024);
  auto small = make_pager(open(path), 512);
  EXPECT_TRUE(small->stats().budget_below_largest_tensor);
  small->reset_stats();
  EXPECT_TRUE(small->stats().budget_below_largest_tensor);
}

TEST(PagingBudget, ReleasedTensorsBringThePagerBackWithinItsBudgetAtOnce) {
  // The issue's case: 8 threads hold 1 MiB tensors past a 512 KiB budget; once they let go the
  // pager must be within budget, not wait for a miss that never comes.
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(8, 256 << 10)));
  auto pager = make_pager(open(path), 512 << 10);
  {
    std::vector<at::Tensor> held(8);
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) threads.emplace_back([&, t] { held[t] = pager->acquire("t" + std::to_string(t)); });
    for (auto& th : threads) th.join();
    EXPECT_EQ(pager->resident_bytes(), 8 << 20);
    at::Tensor view = held[3].view({-1}).slice(0, 0, 10);  // views keep their tensor held
    held.clear();
    EXPECT_EQ(pager->resident_bytes(), 1 << 20);
    EXPECT_TRUE(at::equal(view, values(10, 3000.0f)));
  }
  EXPECT_LE(pager->resident_bytes(), 512 << 10);
  for (int i = 0; i < 1000; ++i) EXPECT_TRUE(pager->acquire("t0").defined());
  EXPECT_LE(pager->resident_bytes(), 512 << 10);
  EXPECT_GE(pager->stats().release_evictions, 8);
}

TEST(PagingBudget, HeldTensorsOutliveThePager) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(2, 4096)));
  at::Tensor kept;
  {
    auto pager = make_pager(open(path), 1 << 20);
    kept = pager->acquire("t1");
  }
  EXPECT_TRUE(at::equal(kept, values(4096, 1000.0f)));
}

TEST(PagingWaits, AWaitForAnotherThreadsLoadIsBounded) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(2, 1024)));
  auto source = c10::make_intrusive<BlockingSource>(open(path));
  pg::PagerOptions options;
  options.budget_bytes = 1 << 20;
  options.prefetch = 0;
  options.wait_timeout_seconds = 0.2;
  pg::LayerPager pager(source, options);
  std::thread loader([&] { pager.acquire("t1"); });
  ASSERT_TRUE(wait_until([&] { return source->blocked.load(); }));
  expect_error([&] { pager.acquire("t1"); }, {"m.safetensors", "\"t1\"", "wait_timeout_seconds"});
  source->go = true;
  loader.join();
  EXPECT_TRUE(at::equal(pager.acquire("t1"), values(1024, 1000.0f)));
}

TEST(PagingFork, AChildReloadsATensorThatWasLoadingAtFork) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(2, 1024)));
  auto source = c10::make_intrusive<BlockingSource>(open(path));
  pg::PagerOptions options;
  options.budget_bytes = 1 << 20;
  options.prefetch = 1;
  pg::LayerPager pager(source, options);
  std::thread loader([&] { pager.acquire("t1"); });  // blocks inside the source's read
  ASSERT_TRUE(wait_until([&] { return source->blocked.load(); }));
  const int code = torch_ext::testing::run_in_child([&] {
    return at::equal(pager.acquire("t1"), values(1024, 1000.0f)) && pager.resident_count() == 1 ? 0 : 3;
  });
  source->go = true;
  loader.join();
  EXPECT_EQ(code, 0) << "-1: the child hung";
}

TEST(PagingFork, AChildDestroysAnInheritedPagerAndItsPrefetcherRestartsThere) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  write_bytes(path, safetensors_bytes(layers(4, 1024)));
  auto pager = make_pager(open(path), 1 << 20, pg::EvictionPolicy::ScanResistant, /*prefetch=*/2);
  pager->set_order({"t0", "t1", "t2", "t3"});
  pager->acquire("t0");
  ASSERT_TRUE(wait_until([&] { return pager->is_resident("t2"); }));  // the parent's prefetcher works
  pager->evict_all();
  const int code = torch_ext::testing::run_in_child([&] {
    pager->begin_pass();
    pager->acquire("t0");
    if (!wait_until([&] { return pager->is_resident("t1") && pager->is_resident("t2"); }, 20)) return 4;
    pager.reset();  // destroys the pager: joins the child's own prefetcher, not the parent's
    return 0;
  });
  EXPECT_EQ(code, 0) << "-1: the child hung";
  EXPECT_TRUE(at::equal(pager->acquire("t3"), values(1024, 3000.0f)));  // the parent is unaffected
}

TEST(PagingStress, EightThreadsKeepTheBudgetTheDataAndTheCounts) {
  TempDir dir;
  const auto path = dir.file("m.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::mt19937 sizes(7);
  int64_t total = 0;
  for (int i = 0; i < 32; ++i) {
    const int64_t n = 256 + static_cast<int64_t>(sizes() % 16384);
    tensors.emplace_back("t" + std::to_string(i), values(n, 100000.0f * i));
    total += 4 * n;
  }
  write_bytes(path, safetensors_bytes(tensors));
  const int64_t budget = total / 4;
  for (const bool zero_copy : {false, true}) {
    pg::PagerOptions options;
    options.budget_bytes = budget;
    options.prefetch = 3;
    options.zero_copy = zero_copy;
    pg::LayerPager pager(open(path), options);
    constexpr int kThreads = 8;
    std::atomic<int64_t> acquires{0};
    std::atomic<bool> failed{false};
    const auto stop = std::chrono::steady_clock::now() + std::chrono::duration<double>(torch_ext::testing::stress_seconds());
    std::atomic<bool> done{false};
    // At each phase's end nobody holds a tensor: the pager must be within its budget then.
    std::barrier phase(kThreads, [&]() noexcept {
      if (pager.resident_bytes() > budget) failed = true;
      const auto s = pager.stats();
      if (s.hits + s.misses != acquires.load() || s.prefetch_hits > s.prefetches) failed = true;
      if (std::chrono::steady_clock::now() > stop) done = true;
    });
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(t);
        while (!done) {
          for (int op = 0; op < 50; ++op) {
            const int i = static_cast<int>(rng() % tensors.size());
            const int what = static_cast<int>(rng() % 100);
            if (what < 2) {
              pager.evict_all();
            } else if (what < 4) {
              pager.begin_pass();
            } else {
              std::vector<std::string> ids{tensors[i].first, tensors[(i + 1) % tensors.size()].first};
              const auto got = pager.acquire_many(ids);
              acquires += 2;
              if (!at::equal(got[0], tensors[i].second) ||
                  !at::equal(got[1], tensors[(i + 1) % tensors.size()].second)) {
                failed = true;
              }
            }
          }
          phase.arrive_and_wait();
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_FALSE(failed) << (zero_copy ? "zero_copy" : "copy") << ": budget, data or counts broken";
    EXPECT_GT(acquires.load(), 0);
  }
}
