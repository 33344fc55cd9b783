#pragma once
// Internal to the plan cache: where each dynamic dimension (the batch, then the options' dims)
// sits in each input and output, which sizes it takes, its buckets, and how inputs and outputs
// are padded, sliced and joined along it. Immutable once made: any thread may use it.
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "torch_ext/plan/plan_cache.h"

namespace torch_ext::plan {

class Layout {
 public:
  explicit Layout(const PlanCacheOptions& options);

  int rank() const { return rank_; }
  const std::string& name(int k) const { return names_[k]; }
  // The tensor dimension of dynamic dimension k in input i / output j; -1 where it has none.
  int64_t input_dim(size_t i, int k) const;
  int64_t output_dim(size_t j, int k) const;
  // Whether requests may be padded along k: the batch always, the others when pad values are given.
  bool pads(int k) const { return k == 0 || !pad_values_.empty(); }
  int64_t min_size(int k) const { return min_[k]; }
  int64_t max_size(int k) const { return max_[k]; }  // 0: no limit

  // A request's size in each dynamic dimension, checked: one size per dimension over the inputs,
  // within the accepted range (below the minimum only where it may be padded).
  Bucket sizes_of(const std::vector<c10::IValue>& inputs) const;
  // The bucket holding these sizes (its largest sizes), and a bucket's smallest sizes.
  Bucket bucket_of(const Bucket& sizes) const;
  Bucket lower_of(const Bucket& bucket) const;
  // Checks a bucket named by a caller or a file: every size within its dimension's range.
  void check_bucket(const Bucket& bucket, const std::string& who) const;
  std::string describe(const Bucket& sizes) const;  // "batch size 8", "batch 8 x seq 64"

  // Inputs padded from sizes to target in every dynamic dimension: the batch repeats its last
  // row, the others fill pad_values.
  std::vector<c10::IValue> pad(const std::vector<c10::IValue>& inputs, const Bucket& sizes, const Bucket& target) const;
  // Inputs brought to target by repeating their last position (or narrowing): examples for builds.
  std::vector<c10::IValue> resize(const std::vector<c10::IValue>& inputs, const Bucket& target) const;
  // Inputs narrowed to [start, start + length) along the batch.
  std::vector<c10::IValue> slice_batch(const std::vector<c10::IValue>& inputs, int64_t start, int64_t length) const;
  // An output computed at `padded` sizes narrowed back to `sizes`; checks each output's sizes.
  c10::IValue slice_output(const c10::IValue& output, const Bucket& sizes, const Bucket& padded) const;
  // Checks that each output has `sizes` along its dynamic dimensions (the plan of bucket `plan`
  // ran the request unpadded); raises naming the plan and the first output that does not.
  void check_output(const c10::IValue& output, const Bucket& sizes, const Bucket& plan) const;
  // Rows [start, start + length) of an output along the batch (the batcher's per-caller rows).
  c10::IValue output_rows(const c10::IValue& output, int64_t start, int64_t length) const;
  // Outputs of consecutive batch pieces joined along the batch.
  c10::IValue concat_outputs(const std::vector<c10::IValue>& outputs) const;
  // Inputs of several requests joined along the batch (each already at the same other sizes).
  std::vector<c10::IValue> concat_inputs(const std::vector<std::vector<c10::IValue>>& requests) const;

 private:
  int rank_ = 1;
  std::vector<std::vector<int64_t>> input_dims_;   // [k][i]
  std::vector<std::vector<int64_t>> output_dims_;  // [k][j]
  std::vector<std::string> names_;
  std::vector<int64_t> min_, max_;
  std::vector<std::vector<int64_t>> buckets_;
  std::vector<double> pad_values_;
};

}  // namespace torch_ext::plan
