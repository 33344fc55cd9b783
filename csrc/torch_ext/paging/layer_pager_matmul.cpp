// LayerPager::matmul: a linear layer's product with a paged weight, streamed from the mapped file
// block by block where loading the weight would convert (and write, then reread) all of it.
#include <algorithm>
#include <cstdint>
#include <sstream>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>

#include "torch_ext/paging/layer_pager.h"
#include "torch_ext/paging/streamed_blocks.h"

namespace torch_ext::paging {
namespace {

at::Tensor whole_matmul(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        bool transposed) {
  if (!transposed) return at::linear(input, weight, bias);
  std::vector<int64_t> sizes = input.sizes().vec();  // transformers' Conv1D.forward
  sizes.back() = weight.size(1);
  const at::Tensor flat = input.view({-1, input.size(-1)});
  return (bias ? at::addmm(*bias, flat, weight) : at::mm(flat, weight)).view(sizes);
}

// The product computed over blocks of the weight (streamed_blocks.h), shaped as the input.
std::shared_ptr<StreamedBlocks> streamed_blocks(const at::Tensor& input, at::Tensor stored,
                                                const std::optional<at::Tensor>& bias, bool transposed,
                                                Blocking blocking, at::Tensor scratch = at::Tensor()) {
  return std::make_shared<StreamedBlocks>(std::move(stored), input.reshape({-1, input.size(-1)}), bias, transposed,
                                          blocking, std::move(scratch));
}

at::Tensor blocked_product(const at::Tensor& input, StreamedBlocks& blocks) {
  const at::Tensor out = blocks.multiply();
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = out.size(1);
  return out.view(sizes);
}

std::string shape_key(const at::Tensor& input, const std::vector<int64_t>& weight_shape,
                      const std::optional<at::Tensor>& bias, bool transposed) {
  std::ostringstream key;
  // The alignment too: a BLAS may take another path for differently aligned rows.
  key << input.numel() / input.size(-1) << 'x' << weight_shape[0] << 'x' << weight_shape[1] << (transposed ? 't' : 'n')
      << (bias ? 'b' : '-') << c10::toString(input.scalar_type()) << '@'
      << reinterpret_cast<uintptr_t>(input.data_ptr()) % 64;
  return key.str();
}

}  // namespace

bool LayerPager::keep_mapped_locked(Entry& e) {
  if (e.mapped_bytes > 0) return true;
  // Only pages that cost less than the converted weight: such an entry is never loaded whole
  // but by acquire(), which stops counting them first.
  if (e.state != State::Absent || e.pinned || !prefers_streaming_locked(e) || resident_bytes_ + e.file_nbytes > budget_) {
    return false;
  }
  e.mapped_bytes = e.file_nbytes;
  resident_bytes_ += e.file_nbytes;
  return true;
}

bool LayerPager::streams(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = entries_.find(id);
  TORCH_CHECK(it != entries_.end(), "LayerPager(", source_->describe(), "): no tensor \"", id, "\" in the source");
  return it->second.streamable;
}

bool LayerPager::prefers_streaming_locked(const Entry& e) const {
  return budget_below_source_ && e.file_nbytes <= e.nbytes;
}

bool LayerPager::stream_matmul_locked(Entry& e, const at::Tensor& input) {
  e.streamed = true;
  // A dtype at::linear refuses, or room for the weight where its pages would not cost less: acquire() it.
  return e.state == State::Absent && !e.pinned && input.scalar_type() == e.dtype &&
         (prefers_streaming_locked(e) || resident_bytes_ + e.nbytes > budget_);
}

void LayerPager::offer_to_prefetcher(const std::shared_ptr<StreamedBlocks>& blocks) {
  std::lock_guard<std::mutex> lock(mutex_);
  // One product at a time: another thread's may be under way.
  if (blocks->blocks() < 2 || !prefetcher_.joinable() || helped_blocks_) return;
  helped_blocks_ = blocks;
  prefetch_wake_.notify_all();
}

at::Tensor LayerPager::matmul(const std::string& id, const at::Tensor& input, const std::optional<at::Tensor>& bias,
                              bool transposed) {
  const bool for_autograd = at::GradMode::is_enabled() && (input.requires_grad() || (bias && bias->requires_grad()));
  bool stream = false, compare = false;
  bool known = false;                // the first call of this shape compares the blockings
  std::optional<Blocking> blocking;  // known: the one equal to the whole product, if any
  std::string shape;
  at::Tensor scratch;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    check_usable_locked();
    Entry& e = entry_locked(id);
    const TensorInfo& info = source_->info(id);
    if (!for_autograd && e.streamable && input.dim() >= 2 && input.is_contiguous() &&
        input.size(-1) == info.shape[transposed ? 0 : 1]) {
      shape = shape_key(input, info.shape, bias, transposed);
      const auto found = exact_shapes_.find(shape);
      if (found != exact_shapes_.end()) {
        known = true;
        blocking = found->second;
      }
      const bool streamable_now = stream_matmul_locked(e, input);
      stream = streamable_now && blocking;
      if (stream) {
        note_access_locked(e);  // acquire() notes the others
        if (e.mapped_bytes > 0) ++stats_.streamed_from_mapped_pages;
        // Another product meanwhile makes its own.
        if (*blocking == Blocking::kWholeRows) scratch = std::move(conversion_scratch_);
      }
      // Compared while the weight is loaded anyway (see matmul() in the header).
      compare = !known && input.scalar_type() == e.dtype && (streamable_now || budget_below_source_);
    }
  }
  if (stream) {
    const auto blocks = streamed_blocks(input, source_->view(id), bias, transposed, *blocking, std::move(scratch));
    offer_to_prefetcher(blocks);
    at::Tensor out = blocked_product(input, *blocks);
    std::unique_lock<std::mutex> lock(mutex_);
    if (!keep_mapped_locked(entry_locked(id))) {
      lock.unlock();
      source_->release_pages(id);  // a product that kept them meanwhile faults them in again
      lock.lock();
    }
    if (helped_blocks_ == blocks) helped_blocks_.reset();  // the thread did not take it
    const at::Tensor& used = blocks->scratch();
    if (used.defined() && (!conversion_scratch_.defined() || used.numel() > conversion_scratch_.numel())) {
      conversion_scratch_ = used;
    }
    ++stats_.streamed_matmuls;
    stats_.streamed_blocks_by_prefetcher += blocks->made_by_helper();
    return out;
  }
  // The loaded weight, within the budget as any acquire(); the first call of a shape compares
  // the blocked product with it once.
  at::Tensor whole = whole_matmul(input, acquire(id), bias, transposed);
  if (compare) {
    // Blocks of output features read the file once on two threads; a Conv1D weight converted
    // whole is the resident weight's own call, the fallback where a BLAS blocks them differently.
    std::optional<Blocking> equal;
    for (const Blocking candidate : {Blocking::kOutputFeatures, Blocking::kWholeRows}) {
      if (candidate == Blocking::kWholeRows && !transposed) break;
      if (at::equal(blocked_product(input, *streamed_blocks(input, source_->view(id), bias, transposed, candidate)),
                    whole)) {
        equal = candidate;
        break;
      }
    }
    source_->release_pages(id);
    std::vector<at::Tensor> dead;  // freed after the lock
    std::lock_guard<std::mutex> lock(mutex_);
    if (exact_shapes_.emplace(shape, equal).second && !equal) ++stats_.unstreamed_shapes;
    // Loaded only to compare: a weight that streams leaves the budget to file pages, which cost less.
    Entry& e = entry_locked(id);
    if (equal && prefers_streaming_locked(e) && evictable_locked(e)) evict_locked(e, dead);
  }
  return whole;
}

}  // namespace torch_ext::paging
