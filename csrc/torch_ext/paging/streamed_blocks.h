#pragma once
// StreamedBlocks: one streamed product (LayerPager::matmul) of an input with a weight that stays
// in the file's dtype, converted block by block as it is multiplied.
//
// Blocking::kOutputFeatures: each block is a run of output features, converted into a buffer that
// stays in the core's cache and multiplied there into its own columns of the output, so both
// threads (below) convert and multiply, and the file's bytes are read once. A weight stored (out,
// in) (nn.Linear) has such a run contiguous in the file; one stored (in, out) (transformers'
// Conv1D) has it strided across every row, and is gathered row by row.
// Blocking::kWholeRows, for a weight stored (in, out): each block is a run of rows, converted into
// one buffer of the whole weight, and the product is made once over it, the same call torch
// makes for the resident weight: equal to it in every bit on any BLAS, where a product over
// output features may not be (LayerPager::matmul compares the two once per shape).
//
// The calling thread makes blocks until none is left to claim; one other thread may help() at
// the same time (the pager's prefetch thread, which has nothing to load then: the budget has no
// room). Each block is made by the same calls whoever makes it (the helper first takes torch's
// thread settings), and blocks write disjoint memory, so the product does not depend on which
// thread made which block, or on whether a helper came.
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch_ext::paging {

// How a streamed product splits its weight (see above).
enum class Blocking : uint8_t { kOutputFeatures, kWholeRows };

class StreamedBlocks {
 public:
  // `stored`: the weight as the file holds it, (out, in), or (in, out) when `transposed`
  // (transformers' Conv1D). `flat`: the input, rows x in, in the dtype the weight is served in.
  // The product is at::linear's (or Conv1D's addmm with `bias`). `scratch`, for kWholeRows: a
  // buffer to convert the weight into, used when it has room (the caller keeps it for the next
  // product; see scratch()).
  StreamedBlocks(at::Tensor stored, at::Tensor flat, std::optional<at::Tensor> bias, bool transposed,
                 Blocking blocking, at::Tensor scratch = at::Tensor());

  // Calling thread: makes blocks until none is left, waits for the helper's, and returns the
  // product (rows x out). A block whose conversion failed on the helper is made again here.
  at::Tensor multiply();
  // Helper thread: makes blocks until none is left to claim.
  void help();

  int64_t blocks() const { return blocks_; }
  int64_t made_by_helper() const;  // final once multiply() has returned
  // kWholeRows' conversion buffer (undefined otherwise), for the next product.
  const at::Tensor& scratch() const { return scratch_; }
  // The calling thread's buffer for one block of kOutputFeatures (undefined for kWholeRows), the
  // same memory for each of its products while it has room.
  at::Tensor block_buffer() const;

 private:
  // Converts block `index`, and multiplies it unless kWholeRows; `buffer` is the thread's own for
  // kOutputFeatures.
  void make(int64_t index, const at::Tensor& buffer);

  const at::Tensor stored_, flat_;
  const std::optional<at::Tensor> bias_;
  const bool transposed_;
  const bool whole_rows_;
  int64_t in_ = 0, out_features_ = 0, block_ = 0, blocks_ = 0;
  at::Tensor out_;
  at::Tensor scratch_;  // kWholeRows: a flat buffer of the served dtype, at least in x out
  at::Tensor whole_;    // kWholeRows: the converted weight, (in, out), over scratch_

  mutable std::mutex mutex_;
  std::condition_variable finished_;
  int64_t next_ = 0;          // the next block either thread may claim
  int64_t helper_claimed_ = 0;
  int64_t helper_done_ = 0;   // made, or failed (listed in failed_)
  int64_t made_by_helper_ = 0;
  std::vector<int64_t> failed_;
};

}  // namespace torch_ext::paging
