// The restart test in C++: a LibTorch program serves a plan cache of an exported program that
// Python saved (save_export_cache.py, run first by CTest as this test's fixture), with no Python
// and no compile. The folder comes in TORCH_EXT_PLAN_EXPORT_DIR.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "torch_ext/common/sha256.h"
#include "torch_ext/plan/plan_cache.h"

namespace fs = std::filesystem;
namespace plan = torch_ext::plan;

namespace {

std::string fixture() {
  const char* dir = std::getenv("TORCH_EXT_PLAN_EXPORT_DIR");
  return dir ? dir : "";
}

#define REQUIRE_FIXTURE()                                                                               \
  if (fixture().empty()) GTEST_SKIP() << "run through CTest, after plan.export_cache.save saved the cache"

std::string cache_dir() { return (fs::path(fixture()) / "cache").string(); }

// [ids, mask, output, ...] as Python's torch.save wrote them.
std::vector<at::Tensor> reference() {
  std::ifstream in((fs::path(fixture()) / "reference.pt").string(), std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<at::Tensor> out;
  for (const auto& v : torch::jit::pickle_load(bytes).toList().vec()) out.push_back(v.toTensor());
  return out;
}

// A copy of the saved folder to tamper with.
std::string copy_of_cache(const std::string& name) {
  const fs::path target = fs::temp_directory_path() / ("torch_ext_plan_export_" + name + std::to_string(getpid()));
  fs::remove_all(target);
  fs::copy(cache_dir(), target, fs::copy_options::recursive);
  return target.string();
}

// Each reference request served by the cache equals the eager model's output: AOTInductor's fused
// kernels (and TorchScript's) round differently from eager's; padded key positions are masked.
void expect_serves_the_reference(plan::PlanCache& cache) {
  const auto ref = reference();
  for (size_t i = 0; i + 2 < ref.size(); i += 3) {
    const auto out = cache.infer({ref[i], ref[i + 1]}).toTensor();
    EXPECT_TRUE(at::allclose(out, ref[i + 2], 1e-4, 1e-5)) << "request " << i / 3 << " of shape " << ref[i].sizes();
  }
}

plan::PlanCacheOptions serving(plan::MissMode mode = plan::MissMode::pad) {
  plan::PlanCacheOptions options;
  options.miss_mode = mode;
  options.warmup_calls = 1;
  return options;
}

}  // namespace

TEST(PlanExport, ACacheSavedByPythonServesInCppWithNoCompileAndEqualsEager) {
  REQUIRE_FIXTURE();
  plan::PlanCache cache(plan::ExportSource{cache_dir()}, serving());
  EXPECT_STREQ(cache.kind(), "export");
  EXPECT_EQ(cache.cached_buckets(), (std::vector<std::vector<int64_t>>{{4, 8}, {4, 16}}));
  // The saved layout came with the folder: batch and sequence, padded with the saved values.
  EXPECT_EQ(cache.options().dims, (std::vector<std::vector<int64_t>>{{1, 1}}));
  EXPECT_EQ(cache.options().pad_values, (std::vector<double>{0, 0}));
  expect_serves_the_reference(cache);
  const auto s = cache.stats();
  EXPECT_EQ(s.compiles, 0);
  EXPECT_EQ(s.builds, 2);
  EXPECT_EQ(s.calls, 4);
  EXPECT_GT(s.padded_elements, 0);  // 3x6 ran at 4x8; 2x12 at 4x16
}

TEST(PlanExport, TorchScriptPlansSavedByPythonServeInCppWithNoModuleGiven) {
  REQUIRE_FIXTURE();
  plan::PlanCache cache(plan::ExportSource{(fs::path(fixture()) / "script_cache").string()}, serving());
  EXPECT_EQ(cache.cached_buckets(), (std::vector<std::vector<int64_t>>{{4, 8}, {4, 16}}));
  expect_serves_the_reference(cache);
  const auto s = cache.stats();
  EXPECT_EQ(s.compiles, 0);
  EXPECT_EQ(s.padded_elements, 0);  // each request runs at its own sizes
  for (const auto& z : s.sizes) EXPECT_EQ(z.shapes, "script");
}

TEST(PlanExport, WithoutACompilerAMissIsPaddedEvenInExactModeOrRefusedClearly) {
  REQUIRE_FIXTURE();
  plan::PlanCache cache(plan::ExportSource{cache_dir()}, serving(plan::MissMode::exact));
  const auto ref = reference();
  // The batch has one bucket (4): a 2x12 request is in bucket 4x16, served padded to it, a hit.
  EXPECT_TRUE(at::allclose(cache.infer({ref[9], ref[10]}).toTensor(), ref[11], 1e-4, 1e-5));
  EXPECT_EQ(cache.stats().hits, 1);
  // Above the sizes the program accepts, nothing runs it.
  try {
    cache.infer({at::ones({4, 17}, at::kLong), at::ones({4, 17}, at::kLong)});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("seq 17 is above the largest size the module accepts, 16"), std::string::npos)
        << e.what();
  }
  // With no plan to pad to, a miss needs a compile, which a C++ process cannot do.
  cache.clear();
  try {
    cache.infer({at::ones({2, 8}, at::kLong), at::ones({2, 8}, at::kLong)});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no compiler for exported programs"), std::string::npos) << e.what();
  }
}

TEST(PlanExport, ATamperedPackageOrManifestIsRefusedNamingTheFile) {
  REQUIRE_FIXTURE();
  const std::string dir = copy_of_cache("tampered");
  const std::string package = (fs::path(dir) / "plans" / "4x8-static.pt2").string();
  {
    std::fstream f(package, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('X');
  }
  try {
    plan::PlanCache cache(plan::ExportSource{dir}, serving());
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(package + " is not the package that was saved"), std::string::npos) << e.what();
  }
  fs::copy_file(fs::path(cache_dir()) / "plans" / "4x8-static.pt2", package, fs::copy_options::overwrite_existing);
  std::ofstream(fs::path(dir) / "manifest.txt", std::ios::app) << "plan 0 lower 0 static\n";
  try {
    plan::PlanCache cache(plan::ExportSource{dir}, serving());
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("nothing may follow 'end'"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(PlanExport, APinnedManifestDigestServesThatFolderAndRefusesAnotherBeforeLoadingIt) {
  REQUIRE_FIXTURE();
  plan::PlanCacheOptions options = serving();
  options.manifest_sha256 = torch_ext::sha256_file((fs::path(cache_dir()) / "manifest.txt").string());
  plan::PlanCache pinned(plan::ExportSource{cache_dir()}, options);
  EXPECT_EQ(pinned.stats().compiles, 0);
  EXPECT_FALSE(pinned.cached_buckets().empty());
  // Another folder (here: the same one with its manifest changed and every package replaced by
  // bytes that could not load): refused by the pin before any of it is read.
  const std::string dir = copy_of_cache("pinned");
  std::ofstream(fs::path(dir) / "manifest.txt", std::ios::app) << "\n";
  for (const auto& entry : fs::recursive_directory_iterator(fs::path(dir) / "plans")) {
    if (entry.is_regular_file()) std::ofstream(entry.path(), std::ios::trunc) << "not a package";
  }
  try {
    plan::PlanCache cache(plan::ExportSource{dir}, options);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not the manifest_sha256 this cache trusts"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("nothing in the folder was loaded"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(PlanExport, LayoutOptionsThatDisagreeWithTheSavedOnesAreRefused) {
  REQUIRE_FIXTURE();
  plan::PlanCacheOptions options = serving();
  options.pad_values = {1, 1};
  options.dims = {{1, 1}};
  try {
    plan::PlanCache cache(plan::ExportSource{cache_dir()}, options);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("was saved with"), std::string::npos) << e.what();
  }
}

namespace {

// A compiler that blocks until released, then fails: a compile in progress for as long as a test
// needs one.
struct BlockingCompiler {
  std::shared_ptr<std::promise<void>> started = std::make_shared<std::promise<void>>();
  std::shared_ptr<std::promise<void>> release = std::make_shared<std::promise<void>>();
  std::shared_future<void> released = release->get_future().share();

  plan::CompileFn fn() {
    return [started = started, released = released](const plan::CompileRequest& request) {
      try {
        started->set_value();
      } catch (const std::future_error&) {  // a second compile
      }
      while (released.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready) {
        if (request.cancelled()) break;
      }
      TORCH_CHECK(false, "released without a package");
    };
  }
};

std::vector<c10::IValue> tokens(int64_t n, int64_t length) {
  return {at::ones({n, length}, at::kLong), at::ones({n, length}, at::kLong)};
}

}  // namespace

TEST(PlanExport, WaitsForAnotherThreadsCompileAreBounded) {
  REQUIRE_FIXTURE();
  plan::PlanCacheOptions options = serving(plan::MissMode::exact);
  options.timeout_seconds = 0.2;
  plan::PlanCache cache(plan::ExportSource{(fs::path(cache_dir()) / "program.pt2").string()}, options);
  BlockingCompiler compiler;
  cache.set_compiler(compiler.fn());
  std::thread first([&] { EXPECT_THROW(cache.infer(tokens(2, 8)), c10::Error); });
  compiler.started->get_future().wait();
  try {
    cache.infer(tokens(2, 8));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("waited timeout_seconds=0.2 s for another thread's build"), std::string::npos)
        << e.what();
  }
  compiler.release->set_value();
  first.join();
  EXPECT_EQ(cache.stats().build_failures, 1);
}

TEST(PlanExport, AForkedChildGetsAnErrorInsteadOfWaitingForTheParentsWorker) {
  REQUIRE_FIXTURE();
  plan::PlanCacheOptions options = serving(plan::MissMode::pad);
  options.background_builds = true;
  auto cache = std::make_unique<plan::PlanCache>(plan::ExportSource{cache_dir()}, options);
  BlockingCompiler compiler;
  cache->set_compiler(compiler.fn());
  cache->clear();
  // Queued for the worker, whose compile blocks; nothing in a C++ process serves it meanwhile.
  EXPECT_THROW(cache->infer(tokens(4, 8)), c10::Error);
  compiler.started->get_future().wait();
  const pid_t pid = fork();
  if (pid == 0) {
    int status = 1;
    try {
      cache->wait_for_builds();  // used to wait for the parent's worker, which the child does not have
    } catch (const c10::Error& e) {
      status = std::string(e.what()).find("forked") != std::string::npos ? 0 : 2;
    }
    cache.reset();  // must not join that worker either
    _exit(status);
  }
  int status = -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      compiler.release->set_value();
      FAIL() << "the forked child hung";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  compiler.release->set_value();
  cache->wait_for_builds();
  EXPECT_EQ(cache->stats().build_failures, 1);
}
