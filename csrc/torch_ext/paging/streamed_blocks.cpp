#include "torch_ext/paging/streamed_blocks.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

// n bfloat16 values widened to float32: exact, a bfloat16 being the upper half of its float32.
// Interleaving zeros below each value does it 8 values at a time (SSE2, every x86-64), 16 with
// AVX2 where the CPU has it. `ahead`: how far past each value, in values, the data read after
// this run lies; it is prefetched, which keeps the conversion at the speed of a memcpy of the
// file's bytes (measured: the hardware prefetcher alone left it 1.3x slower).
#if defined(__x86_64__)
__attribute__((target("avx2"))) void widen_bf16_avx2(uint32_t* out, const uint16_t* in, int64_t n, int64_t ahead) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(in + i + ahead), _MM_HINT_T0);
    for (int64_t k = i; k < i + 32; k += 8) {
      const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + k)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm256_slli_epi32(v, 16));
    }
  }
  for (; i < n; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
}
#endif

void widen_bf16(uint32_t* out, const uint16_t* in, int64_t n, int64_t ahead) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return widen_bf16_avx2(out, in, n, ahead);
#endif
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  for (; i + 32 <= n; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(in + i + ahead), _MM_HINT_T0);
    for (int64_t k = i; k < i + 32; k += 8) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + k));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm_unpacklo_epi16(zero, v));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k + 4), _mm_unpackhi_epi16(zero, v));
    }
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
}

// dst = src converted to the served dtype (dst contiguous, same 2-D shape; src's rows may be
// strided, as a run of a Conv1D weight's columns is). bfloat16 to float32, the common case (bf16
// checkpoints served as fp32), row by row; any other pair through at::Tensor::copy_.
void convert(const at::Tensor& dst, const at::Tensor& src) {
  if (src.scalar_type() == at::kBFloat16 && dst.scalar_type() == at::kFloat && dst.is_contiguous() &&
      src.stride(1) == 1) {
    const auto* in = static_cast<const uint16_t*>(src.const_data_ptr());
    auto* out = static_cast<uint32_t*>(dst.data_ptr());
    const int64_t rows = src.size(0), n = src.size(1), stride = src.stride(0);
    // A run of whole rows reads on; a strided one reads the next rows next: 16 rows ahead (with
    // 4, greedy generates of a bf16 GPT-2 served as fp32 ran 2% to 7% slower on the Intel Xeon VM,
    // in interleaved rounds; 32 did no better, 64 worse).
    const int64_t ahead = stride == n ? 1024 : 16 * stride;
    for (int64_t r = 0; r < rows; ++r) widen_bf16(out + r * n, in + r * stride, n, ahead);
    return;
  }
  dst.copy_(src);
}

}  // namespace

StreamedBlocks::StreamedBlocks(at::Tensor stored, at::Tensor flat, std::optional<at::Tensor> bias, bool transposed,
                               Blocking blocking, at::Tensor scratch)
    : stored_(std::move(stored)),
      flat_(std::move(flat)),
      bias_(std::move(bias)),
      transposed_(transposed),
      whole_rows_(transposed && blocking == Blocking::kWholeRows) {
  in_ = stored_.size(transposed_ ? 0 : 1);
  out_features_ = stored_.size(transposed_ ? 1 : 0);
  const auto element = static_cast<int64_t>(flat_.element_size());
  if (whole_rows_) {
    block_ = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(1, out_features_ * element));
    blocks_ = in_ == 0 ? 0 : (in_ + block_ - 1) / block_;
    const bool fits = scratch.defined() && scratch.scalar_type() == flat_.scalar_type() &&
                      scratch.numel() >= in_ * out_features_;
    scratch_ = fits ? std::move(scratch) : at::empty({in_ * out_features_}, flat_.options());
    whole_ = scratch_.narrow(0, 0, in_ * out_features_).view({in_, out_features_});
  } else {  // blocks of output features, multiples of 64
    const int64_t fit = kBlockBytes / std::max<int64_t>(1, in_ * element);
    block_ = std::min(out_features_, std::max<int64_t>(64, fit / 64 * 64));
    blocks_ = block_ == 0 ? 0 : (out_features_ + block_ - 1) / block_;
  }
  out_ = at::empty({flat_.size(0), out_features_}, flat_.options());
}

at::Tensor StreamedBlocks::block_buffer() const {
  if (whole_rows_) return at::Tensor();
  // Each thread keeps its buffer for its next product (512 KiB, or 64 output features of an input
  // wider than 2,048 values): a new one is given back to the kernel when freed and faulted in again page by
  // page, 2.5 us a page on the Intel Xeon VM, which made a 1-token GPT-2 forward fault 4,000 times.
  thread_local at::Tensor kept;
  if (!kept.defined() || kept.numel() < block_ * in_ || kept.scalar_type() != flat_.scalar_type()) {
    kept = at::empty({block_ * in_}, flat_.options());
  }
  return kept;
}

void StreamedBlocks::make(int64_t index, const at::Tensor& buffer) {
  if (whole_rows_) {
    const int64_t start = index * block_, n = std::min(block_, in_ - start);
    convert(whole_.narrow(0, start, n), stored_.narrow(0, start, n));
    return;
  }
  // The same addmm/mm calls at::linear (or Conv1D) makes, for the block's output features.
  const int64_t start = index * block_, n = std::min(block_, out_features_ - start);
  at::Tensor w;  // the block as the product takes it: (in, n)
  if (transposed_) {
    w = buffer.narrow(0, 0, in_ * n).view({in_, n});
    convert(w, stored_.narrow(1, start, n));
  } else {
    const at::Tensor rows = buffer.narrow(0, 0, n * in_).view({n, in_});
    convert(rows, stored_.narrow(0, start, n));
    w = rows.t();
  }
  at::Tensor part = out_.narrow(1, start, n);
  if (bias_) {
    at::addmm_out(part, bias_->narrow(0, start, n), flat_, w);
  } else {
    at::mm_out(part, flat_, w);
  }
}

at::Tensor StreamedBlocks::multiply() {
  const at::Tensor buffer = block_buffer();
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
  if (whole_rows_) {  // transformers' Conv1D.forward on the converted weight
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
      if (!buffer.defined()) buffer = block_buffer();
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
