#pragma once
// CPU memory accounting: a counting wrapper around c10's CPU allocator.
//
// The wrapper is installed when libtorch_ext.so loads, so every CPU tensor
// allocated after that point is counted, whichever API (Python, TorchScript,
// C++) asks first. It delegates to the allocator it replaced; tensors that
// allocator handed out before the install keep their own deleter and are freed
// by it, uncounted. Thread-safe and lock-free: counters are atomics.
#include <cstdint>

namespace torch_ext::memory {

struct MemoryStats {
  int64_t current_bytes = 0;  // bytes of live CPU tensor memory
  int64_t peak_bytes = 0;     // maximum of current_bytes since the last reset_peak()
  int64_t allocations = 0;    // number of non-empty allocations counted so far
};

MemoryStats stats();

// Sets peak_bytes to current_bytes.
void reset_peak();

// Makes the counting wrapper c10's CPU allocator (idempotent). Returns false,
// changing nothing, when an allocator registered with a higher priority is in
// place. Allocations are counted only while the wrapper is installed; frees of
// counted allocations are always counted.
bool install_counting_allocator();

// Restores the allocator the wrapper replaced (idempotent).
void uninstall_counting_allocator();

bool counting_allocator_installed();

}  // namespace torch_ext::memory
