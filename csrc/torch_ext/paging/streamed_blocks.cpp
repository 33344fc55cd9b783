#include "torch_ext/paging/streamed_blocks.h"

#include <emmintrin.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

namespace torch_ext::paging {
namespace {

// A block of converted weight stays in a core's L2 cache while it is multiplied (or written).
constexpr int64_t kBlockBytes = 512 << 10;

// dst = src converted to the served dtype (contiguous, same shape). bfloat16 to float32 is the
// common case (bf16 checkpoints served as fp32) and exact: a bfloat16 is the upper half of its
// float32. Interleaving zeros below each value does it 8 values at a time (SSE2, every x86-64);
// measured 25% faster than at::Tensor::copy_ on GPT-2's weights.
void convert(const at::Tensor& dst, const at::Tensor& src) {
#if defined(__SSE2__)
  if (src.scalar_type() == at::kBFloat16 && dst.scalar_type() == at::kFloat && src.is_contiguous() &&
      dst.is_contiguous()) {
    const auto* in = static_cast<const uint16_t*>(src.const_data_ptr());
    auto* out = static_cast<uint32_t*>(dst.data_ptr());
    const int64_t n = src.numel();
    const __m128i zero = _mm_setzero_si128();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_unpacklo_epi16(zero, v));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i + 4), _mm_unpackhi_epi16(zero, v));
    }
    for (; i < n; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
    return;
  }
#endif
  dst.copy_(src);
}

}  // namespace

StreamedBlocks::StreamedBlocks(at::Tensor stored, at::Tensor flat, std::optional<at::Tensor> bias, bool transposed,
                               at::Tensor scratch)
    : stored_(std::move(stored)), flat_(std::move(flat)), bias_(std::move(bias)), transposed_(transposed) {
  in_ = stored_.size(transposed_ ? 0 : 1);
  out_features_ = stored_.size(transposed_ ? 1 : 0);
  const auto element = static_cast<int64_t>(flat_.element_size());
  if (transposed_) {  // blocks of whole rows
    block_ = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(1, out_features_ * element));
    blocks_ = in_ == 0 ? 0 : (in_ + block_ - 1) / block_;
    const bool fits = scratch.defined() && scratch.scalar_type() == flat_.scalar_type() &&
                      scratch.numel() >= in_ * out_features_;
    scratch_ = fits ? std::move(scratch) : at::empty({in_ * out_features_}, flat_.options());
    whole_ = scratch_.narrow(0, 0, in_ * out_features_).view({in_, out_features_});
  } else {  // blocks of output features, multiples of 64
    const int64_t fit = kBlockBytes / (in_ * element);
    block_ = std::min(out_features_, std::max<int64_t>(64, fit / 64 * 64));
    blocks_ = block_ == 0 ? 0 : (out_features_ + block_ - 1) / block_;
  }
  out_ = at::empty({flat_.size(0), out_features_}, flat_.options());
}

void StreamedBlocks::make(int64_t index, const at::Tensor& buffer) {
  if (transposed_) {
    const int64_t start = index * block_, n = std::min(block_, in_ - start);
    convert(whole_.narrow(0, start, n), stored_.narrow(0, start, n));
    return;
  }
  // The same addmm/mm calls at::linear makes, for the block's output features.
  const int64_t start = index * block_, n = std::min(block_, out_features_ - start);
  at::Tensor w = buffer.narrow(0, 0, n * in_).view({n, in_});
  convert(w, stored_.narrow(0, start, n));
  at::Tensor part = out_.narrow(1, start, n);
  if (bias_) {
    at::addmm_out(part, bias_->narrow(0, start, n), flat_, w.t());
  } else {
    at::mm_out(part, flat_, w.t());
  }
}

at::Tensor StreamedBlocks::multiply() {
  const at::Tensor buffer = transposed_ ? at::Tensor() : at::empty({block_ * in_}, flat_.options());
  while (true) {
    int64_t index;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (next_ >= blocks_) break;
      index = next_++;
    }
    make(index, buffer);
  }
  std::vector<int64_t> failed;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [&] { return helper_done_ == helper_claimed_; });
    failed = std::move(failed_);
  }
  for (const int64_t index : failed) make(index, buffer);  // raises here if it fails again
  if (transposed_) {  // transformers' Conv1D.forward on the converted weight
    if (bias_) {
      at::addmm_out(out_, *bias_, flat_, whole_);
    } else {
      at::mm_out(out_, flat_, whole_);
    }
  }
  return out_;
}

void StreamedBlocks::help() {
  at::init_num_threads();  // this thread's OpenMP and MKL settings, as torch's threads take them
  at::Tensor buffer;
  while (true) {
    int64_t index;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (next_ >= blocks_) return;
      index = next_++;
      ++helper_claimed_;
    }
    bool made = false;
    try {
      if (!transposed_ && !buffer.defined()) buffer = at::empty({block_ * in_}, flat_.options());
      make(index, buffer);
      made = true;
    } catch (...) {  // the calling thread makes it again, and raises there if it fails again
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++helper_done_;
      if (made) {
        ++made_by_helper_;
      } else {
        failed_.push_back(index);
      }
    }
    finished_.notify_all();
  }
}

int64_t StreamedBlocks::made_by_helper() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return made_by_helper_;
}

}  // namespace torch_ext::paging
