#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>

#include "torch_ext/memory/counting_allocator.h"

namespace mem = torch_ext::memory;

namespace {

at::Tensor bytes(int64_t n) { return at::empty({n}, at::kByte); }

}  // namespace

TEST(Memory, InstalledWhenLibraryLoads) { EXPECT_TRUE(mem::counting_allocator_installed()); }

TEST(Memory, AllocateAndFreeMoveCurrentExactly) {
  const auto before = mem::stats();
  {
    at::Tensor t = bytes(1 << 20);
    const auto during = mem::stats();
    EXPECT_EQ(during.current_bytes - before.current_bytes, 1 << 20);
    EXPECT_EQ(during.allocations - before.allocations, 1);
  }
  EXPECT_EQ(mem::stats().current_bytes, before.current_bytes);
}

TEST(Memory, PeakIsTheHighestPointSinceReset) {
  mem::reset_peak();
  const auto base = mem::stats();
  EXPECT_EQ(base.peak_bytes, base.current_bytes);
  { at::Tensor big = bytes(3 << 20); }
  at::Tensor small = bytes(1 << 20);
  const auto after = mem::stats();
  EXPECT_EQ(after.peak_bytes - base.current_bytes, 3 << 20);
  EXPECT_EQ(after.current_bytes - base.current_bytes, 1 << 20);
  mem::reset_peak();
  EXPECT_EQ(mem::stats().peak_bytes, after.current_bytes);
}

TEST(Memory, EmptyTensorsAreNotCounted) {
  const auto before = mem::stats();
  at::Tensor t = bytes(0);
  EXPECT_EQ(mem::stats().allocations, before.allocations);
  EXPECT_EQ(mem::stats().current_bytes, before.current_bytes);
}

TEST(Memory, ConcurrentThreadsKeepCountsExact) {
  constexpr int kThreads = 8;
  constexpr int kIterations = 2000;
  const auto before = mem::stats();
  std::vector<std::vector<at::Tensor>> kept(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &kept] {
      for (int i = 0; i < kIterations; ++i) {
        at::Tensor x = bytes(1 + (i * 37 + t) % 4096);
        if (i % 10 == 0) {
          kept[t].push_back(x);
        }
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  int64_t kept_bytes = 0;
  for (const auto& list : kept) {
    for (const auto& x : list) {
      kept_bytes += static_cast<int64_t>(x.nbytes());
    }
  }
  const auto after = mem::stats();
  EXPECT_EQ(after.current_bytes - before.current_bytes, kept_bytes);
  EXPECT_EQ(after.allocations - before.allocations, int64_t{kThreads} * kIterations);
  kept.clear();
  EXPECT_EQ(mem::stats().current_bytes, before.current_bytes);
}

TEST(Memory, TensorsFromBeforeTheInstallAreFreedByTheirOwnAllocator) {
  mem::uninstall_counting_allocator();
  EXPECT_FALSE(mem::counting_allocator_installed());
  const auto before = mem::stats();
  at::Tensor uncounted = bytes(1 << 16);
  EXPECT_EQ(mem::stats().current_bytes, before.current_bytes);
  ASSERT_TRUE(mem::install_counting_allocator());
  at::Tensor counted = bytes(1 << 10);
  uncounted.reset();
  EXPECT_EQ(mem::stats().current_bytes - before.current_bytes, 1 << 10);
  // A counted tensor freed while the wrapper is uninstalled is still subtracted.
  mem::uninstall_counting_allocator();
  counted.reset();
  EXPECT_EQ(mem::stats().current_bytes, before.current_bytes);
  ASSERT_TRUE(mem::install_counting_allocator());
  EXPECT_TRUE(mem::counting_allocator_installed());
}

TEST(Memory, RawAllocateIsCountedAndKeepsDataAsContext) {
  c10::Allocator* allocator = c10::GetCPUAllocator();
  const auto before = mem::stats();
  void* p = allocator->raw_allocate(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(mem::stats().current_bytes - before.current_bytes, 1000);
  allocator->raw_deallocate(p);
  EXPECT_EQ(mem::stats().current_bytes, before.current_bytes);
}
