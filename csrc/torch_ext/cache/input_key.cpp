#include "torch_ext/cache/input_key.h"

#include <atomic>
#include <algorithm>
#include <cstring>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <ATen/autocast_mode.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>

namespace torch_ext::cache {

namespace {

constexpr c10::DeviceType kAutocastDevices[4] = {c10::kCPU, c10::kCUDA, c10::kXPU, c10::kMPS};

// Values compared by value; everything else that is not a tensor or container is an object.
bool is_plain_value(const c10::IValue& v) {
  return v.isNone() || v.isInt() || v.isDouble() || v.isBool() || v.isString() || v.isDevice() ||
         v.isComplexDouble();
}

bool same_plain_value(const c10::IValue& a, const c10::IValue& b) {
  if (a.tagKind() != b.tagKind()) {
    return false;
  }
  if (a.isNone()) {
    return true;
  }
  if (a.isInt()) {
    return a.toInt() == b.toInt();
  }
  if (a.isDouble()) {
    // Bitwise: -0.0 and 0.0 differ (1 / x tells them apart), NaN equals the same NaN.
    const double x = a.toDouble();
    const double y = b.toDouble();
    return std::memcmp(&x, &y, sizeof(double)) == 0;
  }
  if (a.isBool()) {
    return a.toBool() == b.toBool();
  }
  if (a.isString()) {
    return a.toStringRef() == b.toStringRef();
  }
  if (a.isDevice()) {
    return a.toDevice() == b.toDevice();
  }
  const auto x = a.toComplexDouble();
  const auto y = b.toComplexDouble();
  return std::memcmp(&x, &y, sizeof(x)) == 0;
}

std::atomic<int> digest_bits_{128};

int64_t nbytes_of(const at::Tensor& tensor) { return static_cast<int64_t>(tensor.numel() * tensor.element_size()); }

bool same_object(const c10::IValue& a, const c10::IValue& b) {
  if (a.isPyObject() && b.isPyObject()) {
    return a.toPyObject() == b.toPyObject();
  }
  return a.isSameIdentity(b);
}

}  // namespace

Digest digest_of(const at::Tensor& tensor) {
  const XXH128_hash_t hash = XXH3_128bits(tensor.const_data_ptr(), static_cast<size_t>(nbytes_of(tensor)));
  Digest digest{hash.low64, hash.high64};
  const int bits = digest_bits_.load(std::memory_order_relaxed);
  if (bits < 128) {
    digest[1] = bits <= 64 ? 0 : digest[1] & ~(~uint64_t{0} >> (bits - 64));
    digest[0] = bits >= 64 ? digest[0] : (bits == 0 ? 0 : digest[0] & ~(~uint64_t{0} >> bits));
  }
  return digest;
}

const Digest& DigestMemo::of(const at::Tensor& tensor) {
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  for (const auto& [known, digest] : known_) {
    if (known == impl) {
      return digest;
    }
  }
  known_.emplace_back(impl, digest_of(tensor));
  return known_.back().second;
}

void set_digest_bits_for_testing(int bits) {
  TORCH_CHECK_VALUE(bits >= 0 && bits <= 128, "NodeCache: digest bits must be in [0, 128], got ", bits);
  digest_bits_.store(bits, std::memory_order_relaxed);
}

int digest_bits() { return digest_bits_.load(std::memory_order_relaxed); }

ModeKey ModeKey::current() {
  ModeKey key;
  key.grad_enabled = at::GradMode::is_enabled();
  key.inference_mode = c10::InferenceMode::is_enabled();
  for (int i = 0; i < 4; ++i) {
    if (at::autocast::is_autocast_available(kAutocastDevices[i]) &&
        at::autocast::is_autocast_enabled(kAutocastDevices[i])) {
      key.autocast_enabled |= static_cast<uint8_t>(1u << i);
      key.autocast_dtypes[i] = at::autocast::get_autocast_dtype(kAutocastDevices[i]);
    }
  }
  return key;
}

bool ModeKey::operator==(const ModeKey& other) const {
  if (grad_enabled != other.grad_enabled || inference_mode != other.inference_mode ||
      autocast_enabled != other.autocast_enabled) {
    return false;
  }
  for (int i = 0; i < 4; ++i) {
    if (autocast_dtypes[i] != other.autocast_dtypes[i]) {
      return false;
    }
  }
  return true;
}

bool TensorKey::content_eligible(const at::Tensor& tensor) {
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  // Bytes alone must determine the values, and a new object must not need its own autograd
  // history: plain contiguous CPU data that does not require grad.
  return impl->device_type() == c10::kCPU && impl->layout() == c10::kStrided && impl->has_storage() &&
         !impl->is_python_dispatch() && !impl->has_symbolic_sizes_strides() && !impl->requires_grad() &&
         !impl->is_conj() && !impl->is_neg() && !tensor.is_quantized() && impl->is_contiguous();
}

std::optional<TensorKey> TensorKey::make(const at::Tensor& tensor, std::optional<ContentBytes> by_content,
                                         DigestMemo* memo) {
  c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  // Inference tensors have no version counter; tensors without a plain strided storage
  // (sparse, nested, functorch wrappers, __torch_dispatch__ subclasses) cannot be identified.
  if (impl->is_inference() || !impl->has_storage() || impl->layout() != c10::kStrided ||
      impl->is_python_dispatch() || impl->has_symbolic_sizes_strides()) {
    return std::nullopt;
  }
  TensorKey key(tensor.getIntrusivePtr());
  const c10::Storage& storage = impl->storage();
  key.storage = storage.unsafeGetStorageImpl();
  key.data = storage.data();
  key.version = impl->version_counter().current_version();
  key.storage_offset = impl->storage_offset();
  const auto sizes = impl->sizes();
  const auto strides = impl->strides();
  key.sizes_and_strides.append(sizes.begin(), sizes.end());
  key.sizes_and_strides.append(strides.begin(), strides.end());
  key.dtype = c10::typeMetaToScalarType(impl->dtype());
  key.device = impl->device();
  key.requires_grad = impl->requires_grad();
  if (by_content && content_eligible(tensor)) {
    Content content;
    content.digest = memo ? memo->of(tensor) : digest_of(tensor);
    if (*by_content == ContentBytes::kCopy) {
      content.bytes = at::empty({nbytes_of(tensor)}, at::TensorOptions().dtype(at::kByte));
      if (content.bytes.numel() > 0) {
        std::memcpy(content.bytes.mutable_data_ptr(), tensor.const_data_ptr(), content.bytes.numel());
      }
    } else {
      content.bytes = tensor;
      content.version = key.version;
    }
    key.content = std::move(content);
  }
  return key;
}

bool TensorKey::same_sizes_and_strides(const c10::TensorImpl* current) const {
  const auto sizes = current->sizes();
  const auto strides = current->strides();
  const size_t dim = sizes.size();
  if (sizes_and_strides.size() != 2 * dim) {
    return false;
  }
  for (size_t i = 0; i < dim; ++i) {
    if (sizes[i] != sizes_and_strides[i] || strides[i] != sizes_and_strides[dim + i]) {
      return false;
    }
  }
  return true;
}

bool TensorKey::matches_content(const at::Tensor& tensor, DigestMemo* memo) const {
  const c10::TensorImpl* current = tensor.unsafeGetTensorImpl();
  if (c10::typeMetaToScalarType(current->dtype()) != dtype || current->device() != device ||
      !content_eligible(tensor)) {
    return false;
  }
  if (!same_sizes_and_strides(current)) {
    return false;
  }
  if ((memo ? memo->of(tensor) : digest_of(tensor)) != content->digest) {
    return false;
  }
  // A digest match is a candidate only: compare the bytes (a changed reference cannot confirm).
  const at::Tensor& bytes = content->bytes;
  if (content->version && bytes.unsafeGetTensorImpl()->version_counter().current_version() != *content->version) {
    return false;
  }
  const int64_t n = nbytes_of(tensor);
  return nbytes_of(bytes) == n && (n == 0 || std::memcmp(bytes.const_data_ptr(), tensor.const_data_ptr(), n) == 0);
}

bool TensorKey::stale() const {
  if (content) {
    return false;
  }
  const auto target = impl.lock();
  return !target || target->version_counter().current_version() != version;
}

bool TensorKey::matches(const at::Tensor& tensor, DigestMemo* memo) const {
  c10::TensorImpl* current = tensor.unsafeGetTensorImpl();
  // The weak reference keeps the TensorImpl's memory: a live tensor at this address is the
  // keyed one, never a newer tensor that reused a freed address.
  if (impl._unsafe_get_target() != current) {
    return content && matches_content(tensor, memo);
  }
  if (content && current->version_counter().current_version() != version) {
    return matches_content(tensor, memo);  // changed in place: the same values still match
  }
  if (current->version_counter().current_version() != version || current->storage_offset() != storage_offset ||
      c10::typeMetaToScalarType(current->dtype()) != dtype || current->device() != device || current->requires_grad() != requires_grad) {
    return false;
  }
  const c10::Storage& storage = current->storage();
  // A `.data` assignment or set_() swaps the storage; a resize may move the data.
  if (storage.unsafeGetStorageImpl() != this->storage || storage.data() != data) {
    return false;
  }
  return same_sizes_and_strides(current);
}

std::optional<InputKey> InputKey::make(c10::ArrayRef<c10::IValue> inputs, size_t content_inputs, ContentBytes bytes,
                                       DigestMemo* memo) {
  InputKey key;
  key.items_.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!key.add(inputs[i], i < content_inputs ? std::optional<ContentBytes>(bytes) : std::nullopt, memo)) {
      return std::nullopt;
    }
  }
  return key;
}

namespace {

void count_bytes(const c10::IValue& value, InputKey::Bytes& bytes) {
  if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    if (tensor.defined()) {
      (TensorKey::content_eligible(tensor) ? bytes.hashable : bytes.other) += nbytes_of(tensor);
    }
  } else if (value.isTuple()) {
    for (const auto& element : value.toTupleRef().elements()) {
      count_bytes(element, bytes);
    }
  } else if (value.isList()) {
    for (const auto& element : value.toListRef()) {
      count_bytes(element, bytes);
    }
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) {
      count_bytes(entry.value(), bytes);
    }
  }
}

}  // namespace

InputKey::Bytes InputKey::tensor_bytes(c10::ArrayRef<c10::IValue> inputs, size_t begin, size_t end) {
  Bytes bytes;
  for (size_t i = begin; i < std::min(end, inputs.size()); ++i) {
    count_bytes(inputs[i], bytes);
  }
  return bytes;
}

std::vector<at::Tensor> InputKey::content_copies() const {
  std::vector<at::Tensor> copies;
  for (const auto& tensor : tensors_) {
    if (tensor.content && !tensor.content->version) {
      copies.push_back(tensor.content->bytes);
    }
  }
  return copies;
}

bool InputKey::add(const c10::IValue& value, std::optional<ContentBytes> by_content, DigestMemo* memo) {
  if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    if (!tensor.defined()) {
      items_.push_back({Kind::kUndefinedTensor, 0, c10::IValue()});
      return true;
    }
    auto tensor_key = TensorKey::make(tensor, by_content, memo);
    if (!tensor_key) {
      return false;
    }
    items_.push_back({Kind::kTensor, static_cast<int64_t>(tensors_.size()), c10::IValue()});
    tensors_.push_back(std::move(*tensor_key));
    return true;
  }
  if (value.isTuple()) {
    const auto& elements = value.toTupleRef().elements();
    items_.push_back({Kind::kTuple, static_cast<int64_t>(elements.size()), c10::IValue()});
    for (const auto& element : elements) {
      if (!add(element, by_content, memo)) {
        return false;
      }
    }
    return true;
  }
  if (value.isList()) {
    const auto list = value.toListRef();
    items_.push_back({Kind::kList, static_cast<int64_t>(list.size()), c10::IValue()});
    for (const auto& element : list) {
      if (!add(element, by_content, memo)) {
        return false;
      }
    }
    return true;
  }
  if (value.isGenericDict()) {
    const auto dict = value.toGenericDict();
    items_.push_back({Kind::kDict, static_cast<int64_t>(dict.size()), c10::IValue()});
    for (const auto& entry : dict) {
      if (!is_plain_value(entry.key())) {
        return false;
      }
      items_.push_back({Kind::kValue, 0, entry.key()});
      if (!add(entry.value(), by_content, memo)) {
        return false;
      }
    }
    return true;
  }
  items_.push_back({is_plain_value(value) ? Kind::kValue : Kind::kObject, 0, value});
  return true;
}

bool InputKey::match(const c10::IValue& value, size_t& position, DigestMemo* memo) const {
  if (position >= items_.size()) {
    return false;
  }
  const Item& item = items_[position++];
  switch (item.kind) {
    case Kind::kTensor:
      return value.isTensor() && tensors_[item.count].matches(value.toTensor(), memo);
    case Kind::kUndefinedTensor:
      return value.isTensor() && !value.toTensor().defined();
    case Kind::kTuple: {
      if (!value.isTuple()) {
        return false;
      }
      const auto& elements = value.toTupleRef().elements();
      if (static_cast<int64_t>(elements.size()) != item.count) {
        return false;
      }
      for (const auto& element : elements) {
        if (!match(element, position, memo)) {
          return false;
        }
      }
      return true;
    }
    case Kind::kList: {
      if (!value.isList()) {
        return false;
      }
      const auto list = value.toListRef();
      if (static_cast<int64_t>(list.size()) != item.count) {
        return false;
      }
      for (const auto& element : list) {
        if (!match(element, position, memo)) {
          return false;
        }
      }
      return true;
    }
    case Kind::kDict: {
      if (!value.isGenericDict()) {
        return false;
      }
      const auto dict = value.toGenericDict();
      if (static_cast<int64_t>(dict.size()) != item.count) {
        return false;
      }
      for (const auto& entry : dict) {
        if (position >= items_.size() || !same_plain_value(items_[position++].value, entry.key()) ||
            !match(entry.value(), position, memo)) {
          return false;
        }
      }
      return true;
    }
    case Kind::kValue:
      return is_plain_value(value) && same_plain_value(item.value, value);
    case Kind::kObject:
      return !value.isTensor() && !is_plain_value(value) && same_object(item.value, value);
  }
  return false;
}

bool InputKey::matches(c10::ArrayRef<c10::IValue> inputs, DigestMemo* memo) const {
  size_t position = 0;
  for (const auto& input : inputs) {
    if (!match(input, position, memo)) {
      return false;
    }
  }
  return position == items_.size();
}

bool InputKey::expired() const {
  for (const auto& tensor : tensors_) {
    if (tensor.expired()) {
      return true;
    }
  }
  return false;
}

bool InputKey::stale() const {
  for (const auto& tensor : tensors_) {
    if (tensor.stale()) {
      return true;
    }
  }
  return false;
}

}  // namespace torch_ext::cache
