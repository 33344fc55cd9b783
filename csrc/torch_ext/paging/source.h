#pragma once
// Backing stores for LayerPager.
//
// PagerSource: named tensors with a known dtype and shape that can be loaded on demand.
// SafetensorsSource: one .safetensors file, or a sharded checkpoint (model.safetensors.index.json
// and its shards, or a directory holding either), validated completely when opened. Files are
// mapped with mmap: view() is zero-copy (the tensor keeps the mapping alive, writes stay private
// to the process); load() copies into memory the caller owns with pread, or with O_DIRECT reads
// when options.direct_io is set (for files larger than the page cache). Files must stay unchanged
// while in use: every read first checks a file's size, modification time and inode against what
// it was when opened and raises otherwise; views already handed out alias the file (the remaining
// window is docs/paging.md's contract). Immutable after construction: every method is thread-safe.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>

#include "torch_ext/fields.h"

namespace torch_ext::paging {

struct TensorInfo {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t nbytes = 0;
};

class PagerSource : public torch::CustomClassHolder {
 public:
  ~PagerSource() override = default;
  // Names in file order.
  virtual std::vector<std::string> names() const = 0;
  virtual bool contains(const std::string& name) const = 0;
  // Throws naming the source and the tensor when `name` is unknown.
  virtual const TensorInfo& info(const std::string& name) const = 0;
  // A new tensor owning its memory; pinned host memory when pin_memory is set.
  virtual at::Tensor load(const std::string& name, bool pin_memory = false) const = 0;
  // Reads the tensor's bytes (info(name).nbytes) into dst.
  virtual void read_into(const std::string& name, void* dst) const = 0;
  // Whether read_into() is as good as load() for any destination (false: load() needs its own
  // buffers, e.g. aligned ones for O_DIRECT), so a pager may reuse evicted memory.
  virtual bool reads_into_any_buffer() const { return true; }
  // Zero-copy sources (a mapped file): view() aliases the stored bytes; populate() maps them in
  // ahead of use; release_pages() returns their memory to the system (the data stays stored).
  virtual bool supports_views() const { return false; }
  // Whether view(name) is zero-copy for this tensor (a source with views may hold some without).
  virtual bool has_view(const std::string& name) const { return supports_views(); }
  virtual at::Tensor view(const std::string& name) const {
    TORCH_CHECK(false, describe(), ": this source serves no zero-copy views");
  }
  virtual void populate(const std::string& name) const {}
  virtual void release_pages(const std::string& name) const {}
  // The tensor written into `out` (its shape, any dtype: converted as it is written), from the
  // mapped pages, which go back to the system afterwards, where there is a view.
  virtual void convert_into(const std::string& name, const at::Tensor& out) const {
    if (has_view(name)) {
      out.copy_(view(name));
      release_pages(name);
    } else {
      out.copy_(load(name));
    }
  }
  // What the source reads from (file names), for error messages.
  virtual std::string describe() const = 0;
};

struct SourceOptions {
  bool direct_io = false;

  static constexpr auto fields() {
    return std::make_tuple(field("direct_io", &SourceOptions::direct_io,
                                 "read with O_DIRECT, bypassing the page cache (for files larger than it)"));
  }
};

class SafetensorsSource : public PagerSource {
 public:
  explicit SafetensorsSource(const std::string& path, SourceOptions options = {});
  ~SafetensorsSource() override;

  std::vector<std::string> names() const override;
  bool contains(const std::string& name) const override;
  const TensorInfo& info(const std::string& name) const override;
  at::Tensor load(const std::string& name, bool pin_memory = false) const override;
  std::string describe() const override { return path_; }

  // Zero-copy view of the mapped file (a copy when the data is not aligned for its dtype).
  at::Tensor view(const std::string& name) const override;
  bool supports_views() const override { return true; }
  void populate(const std::string& name) const override;       // MADV_POPULATE_READ
  void release_pages(const std::string& name) const override;  // MADV_DONTNEED on whole pages
  // Reads the tensor's bytes into dst (info(name).nbytes bytes) with pread, through the page cache.
  void read_into(const std::string& name, void* dst) const override;
  bool reads_into_any_buffer() const override { return !options_.direct_io; }
  // The __metadata__ of every file (keys of later shards win on conflicts).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::vector<std::string> files() const;
  int64_t total_bytes() const { return total_bytes_; }
  const SourceOptions& options() const { return options_; }
  const std::string& path() const { return path_; }

  // This source, also serving compositions: tensors a model needs that the file holds in parts or
  // quantized (transformers' checkpoint conversions: experts stacked into one tensor, projections
  // concatenated, split or transposed; FP8 / FP4 weights dequantized by their block scales).
  // programs: {name: its program}, postfix ops over stored tensors, one op per item:
  //   "tensor NAME"                            push the stored tensor NAME
  //   "stack DIM N", "cat DIM N"               pop N, push them stacked / concatenated along DIM
  //   "narrow DIM START LENGTH"                pop 1, push that slice
  //   "transpose DIM0 DIM1", "reshape S0 S1 ..."  pop 1, push it transposed / reshaped
  //   "dequantize"                             pop scales and quantized, push float32 values:
  //                                            each block of the quantized tensor's last two dims
  //                                            times its scale, as transformers' FP8 loader does
  // "tensor NAME" reads NAME as this source serves it: a stored tensor, or a composition of an
  // earlier composed() (its program is read in place of the name). Each program is run on meta
  // tensors here: one result, every op valid (stack and cat join one dtype), else ValueError naming
  // the composition and the op. A composition may take the name of a stored tensor it reads (a
  // weight served dequantized in its place). names() lists each composition in place of the first
  // tensor it reads, and no longer the tensors compositions read (contains(), info() and view()
  // still take those that kept their names). load() and read_into() of a composition write each
  // stored part from the mapped file straight to its place in the result (direct_io does not apply:
  // the parts are read through the mapping); a composition has no view (has_view false).
  c10::intrusive_ptr<SafetensorsSource> composed(const std::map<std::string, std::vector<std::string>>& programs) const;
  bool has_view(const std::string& name) const override;
  // A composition converts part by part: no copy of the whole tensor in its own dtype is made.
  void convert_into(const std::string& name, const at::Tensor& out) const override;

  struct File;         // one mapped .safetensors file
  struct Composition;  // a parsed program

 private:
  struct Entry {
    TensorInfo info;
    std::shared_ptr<File> file;  // null for a composition
    int64_t offset = 0;          // absolute offset of the data in the file
    std::shared_ptr<const Composition> composition;
  };
  // The composition's result written into `out` (its shape and dtype), part by part.
  void compose_into(const Entry& e, const at::Tensor& out) const;
  // A stored tensor's load(), view(), populate() and release_pages().
  at::Tensor load_of(const Entry& e, bool pin_memory) const;
  at::Tensor view_of(const Entry& e) const;
  void populate_of(const Entry& e) const;
  void release_pages_of(const Entry& e) const;
  const Entry& entry(const std::string& name) const;
  void add_file(const std::string& file_path, const std::vector<std::string>* expected);
  void map_file(File& file) const;

  std::string path_;
  SourceOptions options_;
  std::vector<std::string> order_;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::shared_ptr<File>> files_;
  int64_t total_bytes_ = 0;
};

// "F32" -> at::kFloat; throws naming `what` for an unknown dtype.
at::ScalarType safetensors_dtype(const std::string& dtype, const std::string& what);
std::string safetensors_dtype_name(at::ScalarType dtype);

}  // namespace torch_ext::paging
