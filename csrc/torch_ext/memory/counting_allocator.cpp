#include "torch_ext/memory/counting_allocator.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <new>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

namespace torch_ext::memory {
namespace {

std::atomic<int64_t> current_bytes{0};
std::atomic<int64_t> peak_bytes{0};
std::atomic<int64_t> allocation_count{0};

void raise_peak(int64_t candidate) {
  int64_t peak = peak_bytes.load(std::memory_order_relaxed);
  while (candidate > peak &&
         !peak_bytes.compare_exchange_weak(peak, candidate, std::memory_order_relaxed)) {
  }
}

// Each counted allocation is prefixed by a header holding its size and the
// delegate's own context and deleter. The prefix keeps data == context (a
// "simple" DataPtr, as raw_allocate and copy-on-write require) without a
// second heap allocation per tensor. Its size keeps the delegate's alignment.
struct Header {
  size_t nbytes;
  void* delegate_context;
  c10::DeleterFnPtr delegate_deleter;
};
constexpr size_t kHeaderBytes = 64;
static_assert(sizeof(Header) <= kHeaderBytes);

void counting_delete(void* data) {
  if (data == nullptr) {
    return;
  }
  Header header;
  std::memcpy(&header, static_cast<char*>(data) - kHeaderBytes, sizeof(Header));
  current_bytes.fetch_sub(static_cast<int64_t>(header.nbytes), std::memory_order_relaxed);
  header.delegate_deleter(header.delegate_context);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* delegate) : delegate_(delegate) {}

  c10::Allocator* delegate() const { return delegate_; }

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) {
      return delegate_->allocate(0);
    }
    TORCH_CHECK(nbytes <= SIZE_MAX - kHeaderBytes, "torch_ext counting allocator: cannot allocate ",
                nbytes, " bytes");
    c10::DataPtr block = delegate_->allocate(nbytes + kHeaderBytes);
    char* base = static_cast<char*>(block.get());
    const Header header{nbytes, block.get_context(), block.get_deleter()};
    std::memcpy(base, &header, sizeof(Header));
    c10::Device device = block.device();
    // Ownership passes to the header; counting_delete hands it back to the delegate.
    block.release_context();
    const int64_t now =
        current_bytes.fetch_add(static_cast<int64_t>(nbytes), std::memory_order_relaxed) +
        static_cast<int64_t>(nbytes);
    allocation_count.fetch_add(1, std::memory_order_relaxed);
    raise_peak(now);
    void* data = base + kHeaderBytes;
    return {data, data, &counting_delete, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* delegate_;
};

std::mutex install_mutex;
CountingAllocator* installed = nullptr;  // guarded by install_mutex

// Installed at load time: see the header for why.
[[maybe_unused]] const bool installed_at_load = install_counting_allocator();

}  // namespace

MemoryStats stats() {
  return {current_bytes.load(std::memory_order_relaxed), peak_bytes.load(std::memory_order_relaxed),
          allocation_count.load(std::memory_order_relaxed)};
}

void reset_peak() { peak_bytes.store(current_bytes.load(std::memory_order_relaxed), std::memory_order_relaxed); }

bool install_counting_allocator() {
  std::lock_guard<std::mutex> lock(install_mutex);
  c10::Allocator* current = c10::GetCPUAllocator();
  if (installed != nullptr && current == installed) {
    return true;
  }
  // The wrapper is never freed: it is reinstalled after an uninstall, and is
  // only replaced if another allocator took its delegate's place meanwhile.
  CountingAllocator* wrapper = installed;
  if (wrapper == nullptr || wrapper->delegate() != current) {
    wrapper = new CountingAllocator(current);
  }
  c10::SetCPUAllocator(wrapper, /*priority=*/0);
  if (c10::GetCPUAllocator() != wrapper) {
    if (wrapper != installed) {
      delete wrapper;
    }
    return false;
  }
  installed = wrapper;
  return true;
}

void uninstall_counting_allocator() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (installed != nullptr && c10::GetCPUAllocator() == installed) {
    c10::SetCPUAllocator(installed->delegate(), /*priority=*/0);
  }
}

bool counting_allocator_installed() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return installed != nullptr && c10::GetCPUAllocator() == installed;
}

}  // namespace torch_ext::memory
