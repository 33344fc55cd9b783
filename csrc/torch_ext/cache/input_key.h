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
// Content keys: a tensor among the leading `content_inputs` inputs (see NodeCache::put and
// NodeCacheOptions::keys_by_content) may be keyed by its bytes instead: an XXH3 128-bit digest
// of them with its sizes, strides, dtype and device, so that an equal tensor in another object
// matches. A digest match is only a candidate: the bytes are then compared with the ones keyed
// (a private copy, or the keyed tensor itself while its version is unchanged), so a collision
// is a miss, never a wrong match. Only contiguous CPU tensors that do not require grad (and are
// no conjugate / negative views, nor quantized) can be keyed by content; others keep identity.
//
// Immutable after construction; safe to read from several threads.
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
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

// XXH3 128-bit digest of a contiguous tensor's bytes, truncated to digest_bits() bits.
using Digest = std::array<uint64_t, 2>;
Digest digest_of(const at::Tensor& tensor);
// Test hook: keep only the first `bits` (0 to 128) bits of every digest computed from now on, so
// that tests can force collisions. Process-wide; 128 (the default) restores full digests.
void set_digest_bits_for_testing(int bits);
int digest_bits();

// The digests of one lookup's tensors, each computed once however many keys it is compared with
// (a node's entries, a source's recent values). Valid while those tensors are unchanged: within
// one NodeCache call.
class DigestMemo {
 public:
  const Digest& of(const at::Tensor& tensor);

 private:
  c10::SmallVector<std::pair<const c10::TensorImpl*, Digest>, 4> known_;
};

// How bytes keyed by content are kept for the comparison that confirms a digest match.
enum class ContentBytes : uint8_t {
  kCopy,       // a private copy (cache entries: the input may be changed or freed later)
  kReference,  // the tensor itself, valid while its version is unchanged (observed sources)
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
  // Content keys only: the digest and the bytes it was computed from.
  struct Content {
    Digest digest{};
    at::Tensor bytes;                  // a uint8 copy, or the keyed tensor (kReference)
    std::optional<uint32_t> version;   // kReference: the tensor's version when keyed
  };
  std::optional<Content> content;

  // nullopt when the tensor cannot be keyed safely (see the file comment). by_content: key it
  // by its bytes where it can be (content_eligible), by identity otherwise.
  static std::optional<TensorKey> make(const at::Tensor& tensor, std::optional<ContentBytes> by_content = std::nullopt,
                                       DigestMemo* memo = nullptr);
  // Whether a tensor can be keyed by content (and how many bytes that hashes).
  static bool content_eligible(const at::Tensor& tensor);
  bool matches(const at::Tensor& tensor, DigestMemo* memo = nullptr) const;
  // True once an identity-keyed tensor has been freed: nothing can match the key any more.
  bool expired() const { return !content && impl.expired(); }
  // True once nothing can match the key any more: an identity-keyed tensor freed or changed in
  // place (versions only grow).
  bool stale() const;

 private:
  bool matches_content(const at::Tensor& tensor, DigestMemo* memo) const;
  bool same_sizes_and_strides(const c10::TensorImpl* current) const;
};

class InputKey {
 public:
  // nullopt when some input cannot be keyed safely. Tensors in the first content_inputs inputs
  // (inside containers too) are keyed by content where they can be, their bytes kept as given.
  static std::optional<InputKey> make(c10::ArrayRef<c10::IValue> inputs, size_t content_inputs = 0,
                                      ContentBytes bytes = ContentBytes::kCopy, DigestMemo* memo = nullptr);
  // Bytes of the tensors in inputs[begin, end) that content keys would hash (content_eligible),
  // and of all the other tensors there.
  struct Bytes {
    int64_t hashable = 0;
    int64_t other = 0;
  };
  static Bytes tensor_bytes(c10::ArrayRef<c10::IValue> inputs, size_t begin, size_t end);

  bool matches(c10::ArrayRef<c10::IValue> inputs, DigestMemo* memo = nullptr) const;
  // True when a keyed tensor has been freed.
  bool expired() const;
  // True when nothing can match any more (TensorKey::stale).
  bool stale() const;
  size_t tensor_count() const { return tensors_.size(); }
  // The private copies of content-keyed bytes this key holds (for memory accounting).
  std::vector<at::Tensor> content_copies() const;

 private:
  enum class Kind : uint8_t { kTensor, kUndefinedTensor, kTuple, kList, kDict, kValue, kObject };
  struct Item {
    Kind kind;
    int64_t count = 0;    // containers: number of elements; tensors: index into tensors_
    c10::IValue value;    // kValue / kObject, and dict keys
  };

  bool add(const c10::IValue& value, std::optional<ContentBytes> by_content, DigestMemo* memo);
  bool match(const c10::IValue& value, size_t& position, DigestMemo* memo) const;

  std::vector<Item> items_;
  std::vector<TensorKey> tensors_;
};

}  // namespace torch_ext::cache
