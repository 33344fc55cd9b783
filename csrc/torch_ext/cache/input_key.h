#pragma once
// The key that makes a cached node output safe to reuse: what its inputs were, and the
// thread's grad-mode / inference-mode / autocast state, at the time it was computed.
//
// Tensors are keyed by identity (a weak reference to the TensorImpl, so a freed tensor whose
// address is reused can never match) plus version counter, data pointer, storage, sizes,
// strides, storage offset, dtype, device and requires_grad. Other values (ints, floats,
// bools, strings, devices, None) are keyed by value, containers (tuples, lists, dicts)
// element by element; any other object by identity (the key holds a strong reference).
//
// Writes that bypass the version counter cannot be seen: in-place writes through `.data`,
// through a NumPy view, or to inference tensors. A tensor whose writes are untracked
// (inference tensors) or whose storage cannot be identified (sparse, nested, functorch or
// __torch_dispatch__ subclass tensors) makes its inputs unkeyable: make() returns nullopt.
//
// Immutable after construction; safe to read from several threads.
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

namespace torch_ext::cache {

// Grad mode, inference mode and autocast state (CPU, CUDA, XPU, MPS) of the calling thread.
struct ModeKey {
  bool grad_enabled = false;
  bool inference_mode = false;
  uint8_t autocast_enabled = 0;  // one bit per device type, in the order above
  c10::ScalarType autocast_dtypes[4] = {c10::ScalarType::Undefined, c10::ScalarType::Undefined,
                                        c10::ScalarType::Undefined, c10::ScalarType::Undefined};

  static ModeKey current();
  bool operator==(const ModeKey& other) const;
};

// One tensor as it was when keyed. Also used for the outputs a cache entry holds.
struct TensorKey {
  explicit TensorKey(const c10::intrusive_ptr<c10::TensorImpl>& target) : impl(target) {}

  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  const void* storage = nullptr;  // StorageImpl address: compared, never dereferenced
  const void* data = nullptr;
  uint32_t version = 0;
  int64_t storage_offset = 0;
  c10::SmallVector<int64_t, 8> sizes_and_strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device{c10::kCPU};
  bool requires_grad = false;

  // nullopt when the tensor cannot be keyed safely (see the file comment).
  static std::optional<TensorKey> make(const at::Tensor& tensor);
  bool matches(const at::Tensor& tensor) const;
  // True once the tensor has been freed: nothing can match the key any more.
  bool expired() const { return impl.expired(); }
};

class InputKey {
 public:
  // nullopt when some input cannot be keyed safely.
  static std::optional<InputKey> make(c10::ArrayRef<c10::IValue> inputs);

  bool matches(c10::ArrayRef<c10::IValue> inputs) const;
  // True when a keyed tensor has been freed.
  bool expired() const;
  size_t tensor_count() const { return tensors_.size(); }

 private:
  enum class Kind : uint8_t { kTensor, kUndefinedTensor, kTuple, kList, kDict, kValue, kObject };
  struct Item {
    Kind kind;
    int64_t count = 0;    // containers: number of elements; tensors: index into tensors_
    c10::IValue value;    // kValue / kObject, and dict keys
  };

  bool add(const c10::IValue& value);
  bool match(const c10::IValue& value, size_t& position) const;

  std::vector<Item> items_;
  std::vector<TensorKey> tensors_;
};

}  // namespace torch_ext::cache
