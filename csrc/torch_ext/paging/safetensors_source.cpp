#include "torch_ext/paging/source.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <tuple>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include "torch_ext/common/json.h"

namespace torch_ext::paging {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kMaxHeaderBytes = 100 << 20;  // the format's own limit (100 MB)
constexpr int64_t kDirectAlignment = 4096;

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble},  {"F32", at::kFloat},   {"F16", at::kHalf},    {"BF16", at::kBFloat16},
    {"I64", at::kLong},    {"I32", at::kInt},     {"I16", at::kShort},   {"I8", at::kChar},
    {"U64", at::kUInt64},  {"U32", at::kUInt32},  {"U16", at::kUInt16},  {"U8", at::kByte},
    {"BOOL", at::kBool},   {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2},
    {"F8_E4M3FNUZ", at::kFloat8_e4m3fnuz}, {"F8_E5M2FNUZ", at::kFloat8_e5m2fnuz},
    {"C64", at::kComplexFloat},
};

std::string errno_text() { return std::strerror(errno); }

// Reads exactly n bytes at offset; throws naming the file on errors and on a short file.
void pread_exact(int fd, void* dst, int64_t n, int64_t offset, const std::string& path) {
  auto* out = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd, out, static_cast<size_t>(std::min<int64_t>(n, 1 << 30)), offset);
    if (got < 0) {
      if (errno == EINTR) continue;
      TORCH_CHECK(false, path, ": read of ", n, " bytes at offset ", offset, " failed: ", errno_text());
    }
    TORCH_CHECK(got > 0, path, ": unexpected end of file at offset ", offset, " (", n,
                " more bytes expected; was the file truncated after it was opened?)");
    out += got;
    offset += got;
    n -= got;
  }
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The tensor's byte size. Its strides (the products of trailing dimensions, zeros counted as
// ones, as at::empty computes them) must fit in 64 bits too, even when a zero dimension makes
// it empty.
template <class What>
int64_t checked_numel_bytes(const std::vector<int64_t>& shape, int64_t itemsize, const What& what) {
  int64_t total = itemsize;
  int64_t strides = itemsize;
  for (const int64_t d : shape) {
    TORCH_CHECK(d >= 0, what(), ": negative dimension ", d, " in shape");
    TORCH_CHECK(!__builtin_mul_overflow(strides, std::max<int64_t>(d, 1), &strides) &&
                    !__builtin_mul_overflow(total, d, &total),
                what(), ": shape ", shape_text(shape), "'s element count or strides overflow 64 bits");
  }
  return total;
}

// A name as an error message shows it: NUL and other control bytes escaped.
std::string printable(std::string_view text) {
  std::string out;
  for (const char c : text) {
    if (static_cast<unsigned char>(c) < 0x20) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[(c >> 4) & 0xF];
      out += hex[c & 0xF];
    } else {
      out += c;
    }
  }
  return out;
}


// Fresh multi-MB buffers about to be filled: transparent huge pages (where the system allows
// them) fault in 2 MiB at a time instead of 4 KiB. Advisory; failures are ignored.
void advise_huge_pages(void* data, int64_t nbytes) {
  constexpr uintptr_t kHuge = 2 << 20;
  if (nbytes < static_cast<int64_t>(2 * kHuge)) return;
  const auto begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const auto end = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(nbytes)) & ~(kHuge - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace

at::ScalarType safetensors_dtype(const std::string& dtype, const std::string& what) {
  for (const auto& d : kDtypes) {
    if (dtype == d.name) return d.type;
  }
  std::string known;
  for (const auto& d : kDtypes) known += std::string(known.empty() ? "" : " ") + d.name;
  TORCH_CHECK(false, what, ": unknown dtype \"", dtype, "\" (known: ", known, ")");
}

std::string safetensors_dtype_name(at::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (dtype == d.type) return d.name;
  }
  TORCH_CHECK(false, "safetensors has no dtype for ", c10::toString(dtype));
}

struct SafetensorsSource::File {
  std::string path;
  int fd = -1;
  int direct_fd = -1;
  int64_t size = 0;
  int64_t data_start = 0;  // the data buffer's offset: 8 + the header's length
  char* map = nullptr;
  // What the file was when opened: a read checks it still is (check_unchanged).
  dev_t device = 0;
  ino_t inode = 0;
  struct timespec mtime {};

  ~File() {
    if (map != nullptr) ::munmap(map, static_cast<size_t>(size));
    if (fd >= 0) ::close(fd);
    if (direct_fd >= 0) ::close(direct_fd);
  }

  void record(const struct stat& st) {
    size = st.st_size;
    device = st.st_dev;
    inode = st.st_ino;
    mtime = st.st_mtim;
  }

  // Throws naming the file and the tensor when the opened file's size or modification time
  // changed, or its path now names another file (replaced): reading a truncated mapping would
  // raise SIGBUS, and a rewritten one would serve other bytes than the header describes.
  void check_unchanged(const std::string& tensor) const {
    struct stat st {};
    TORCH_CHECK(::fstat(fd, &st) == 0, path, ": stat failed: ", errno_text());
    const bool same = st.st_size == size && st.st_mtim.tv_sec == mtime.tv_sec && st.st_mtim.tv_nsec == mtime.tv_nsec;
    TORCH_CHECK(same, path, ": the file changed after it was opened (size ", size, " -> ", st.st_size,
                " bytes, or its modification time), reading tensor \"", tensor,
                "\"; open it again (a SafetensorsSource requires its files to stay unchanged while in use)");
    // A removed path leaves the opened file intact; another file at the path is a replacement.
    if (::stat(path.c_str(), &st) == 0) {
      TORCH_CHECK(st.st_dev == device && st.st_ino == inode, path,
                  ": the file was replaced after it was opened, reading tensor \"", tensor,
                  "\"; open it again (a SafetensorsSource requires its files to stay unchanged while in use)");
    }
  }
};

// A composition's program as a tree: the stored tensors at its leaves, ops above them.
struct SafetensorsSource::Composition {
  enum class Op { kTensor, kStack, kCat, kNarrow, kTranspose, kReshape, kDequantize };
  Op op = Op::kTensor;
  std::string item;            // the program's text for this op (named in errors)
  Entry stored;                // kTensor: the stored tensor (resolved when the program is checked)
  std::vector<int64_t> args;   // stack/cat: dim; narrow: dim, start, length; transpose: dims; reshape: shape
  std::vector<Composition> parts;
  std::vector<int64_t> shape;  // of the result, set when the program is checked

  // The op applied to its parts' results (a stored tensor has no op: `read` gives it).
  at::Tensor apply(const std::vector<at::Tensor>& inputs) const {
    switch (op) {
      case Op::kStack: return at::stack(inputs, args[0]);
      case Op::kCat: return at::cat(inputs, args[0]);
      case Op::kNarrow: return inputs[0].narrow(args[0], args[1], args[2]);
      case Op::kTranspose: return inputs[0].transpose(args[0], args[1]);
      case Op::kReshape: return inputs[0].reshape(args);
      case Op::kDequantize: return dequantize_blocks(inputs[0], inputs[1]);
      case Op::kTensor: break;
    }
    TORCH_INTERNAL_ASSERT(false, "Composition::apply on a stored tensor");
  }

  // The result, each stored tensor given by `read` (lazy views: nothing is copied but where an op
  // must, as reshape of a non-contiguous tensor or a dequantization).
  template <typename Read>
  at::Tensor value(const Read& read) const {
    if (op == Op::kTensor) return read(stored);
    std::vector<at::Tensor> inputs;
    for (const auto& part : parts) inputs.push_back(part.value(read));
    return apply(inputs);
  }

  // The result written into `out` (its shape): a stack or concatenation writes each part into its
  // slice of `out`, so no intermediate as large as the result is made.
  template <typename Read>
  void write(const Read& read, const at::Tensor& out) const {
    if (op == Op::kStack) {
      const int64_t dim = c10::maybe_wrap_dim(args[0], out.dim());
      for (size_t i = 0; i < parts.size(); ++i) parts[i].write(read, out.select(dim, static_cast<int64_t>(i)));
    } else if (op == Op::kCat) {
      const int64_t dim = c10::maybe_wrap_dim(args[0], out.dim());
      int64_t offset = 0;
      for (const auto& part : parts) {
        const int64_t size = part.shape[static_cast<size_t>(dim)];
        part.write(read, out.narrow(dim, offset, size));
        offset += size;
      }
    } else {
      out.copy_(value(read));
    }
  }

  // fn(leaf) for each stored tensor the program reads, in program order.
  template <typename Fn>
  void for_each_leaf(const Fn& fn) const { each_leaf(*this, fn); }
  template <typename Fn>
  void for_each_leaf(const Fn& fn) { each_leaf(*this, fn); }
  template <typename Node, typename Fn>
  static void each_leaf(Node& node, const Fn& fn) {
    if (node.op == Op::kTensor) {
      fn(node);
    } else {
      for (auto& part : node.parts) each_leaf(part, fn);
    }
  }

  // Blockwise dequantization as transformers' FP8 loader does it (Fp8Dequantize): `scales`' last
  // two dims are a grid over `quantized`'s last two (they must divide them), each block multiplied
  // by its scale in float32; leading dims (experts) pair up, or one grid serves them all. A
  // floating-point `quantized` is read as its values; int8, uint8 and float4_e2m1fn_x2 as two
  // packed FP4 (e2m1) values a byte, low nibble first (MXFP4's blocks and transformers' FP8
  // loader's FP4 experts). uint8 scales are E8M0 exponents (2^(s-127)).
  static at::Tensor dequantize_blocks(const at::Tensor& quantized, const at::Tensor& scales) {
    const auto qtype = quantized.scalar_type();
    const bool packed_fp4 = qtype == at::kChar || qtype == at::kByte || qtype == at::kFloat4_e2m1fn_x2;
    TORCH_CHECK_VALUE(packed_fp4 || at::isFloatingType(qtype), "the quantized tensor is ", qtype,
                      " (expected a floating-point type, or int8 / uint8 / float4_e2m1fn_x2 holding packed FP4)");
    TORCH_CHECK_VALUE(at::isFloatingType(scales.scalar_type()) || scales.scalar_type() == at::kByte,
                      "the scales are ", scales.scalar_type(), " (expected a floating-point type, or uint8 E8M0)");
    TORCH_CHECK_VALUE(quantized.dim() >= 2, "the quantized tensor has ", quantized.dim(),
                      " dims (expected 2 or more: a grid of blocks over its last two)");
    std::vector<int64_t> shape = quantized.sizes().vec();  // of the values, and of the result
    if (packed_fp4) shape.back() *= 2;
    const int64_t rows = shape[shape.size() - 2], cols = shape.back();
    const int64_t scale_rows = scales.dim() >= 2 ? scales.size(-2) : 1;
    const int64_t scale_cols = scales.dim() >= 2 ? scales.size(-1) : 1;
    TORCH_CHECK_VALUE(scale_rows > 0 && scale_cols > 0 && rows % scale_rows == 0 && cols % scale_cols == 0,
                      "scales of grid (", scale_rows, ", ", scale_cols, ") do not divide the quantized tensor's (",
                      rows, ", ", cols, ")");
    const int64_t groups = c10::multiply_integers(shape.begin(), shape.end() - 2);
    const int64_t scale_groups =
        scales.dim() >= 2 ? c10::multiply_integers(scales.sizes().begin(), scales.sizes().end() - 2) : scales.numel();
    TORCH_CHECK_VALUE(scale_groups == groups || scale_groups == 1, "scales of shape ", scales.sizes(),
                      " hold ", scale_groups, " grid(s) for the quantized tensor's ", groups, " of shape ",
                      c10::IntArrayRef(shape));
    if (quantized.is_meta()) return at::empty(shape, at::TensorOptions().dtype(at::kFloat).device(c10::kMeta));
    at::Tensor values = decoded(quantized, packed_fp4, shape);
    const at::Tensor factors =
        scales.scalar_type() == at::kByte ? scales.to(at::kFloat).sub(127).exp2() : scales.to(at::kFloat);
    values.view({groups, scale_rows, rows / scale_rows, scale_cols, cols / scale_cols})
        .mul_(factors.reshape({scale_groups, scale_rows, 1, scale_cols, 1}));
    return values;
  }

  // The float32 values of `quantized` (of `shape`) in new memory the scales then multiply: each
  // byte of a float8 or packed FP4 tensor read through a table of its 256 values (torch's own
  // conversions: exact, and far faster than converting element by element); other floating-point
  // types copied (never the stored tensor itself, a view of the mapped file).
  static at::Tensor decoded(const at::Tensor& quantized, bool packed_fp4, const std::vector<int64_t>& shape) {
    const auto qtype = quantized.scalar_type();
    at::Tensor out = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
    if (!packed_fp4 && c10::elementSize(qtype) != 1) return out.copy_(quantized);
    TORCH_CHECK(quantized.device().is_cpu(), "dequantize reads stored tensors on the CPU, got ", quantized.device());
    std::array<float, 256> table{};
    if (packed_fp4) {
      static constexpr float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                          -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
      std::copy(std::begin(kE2M1), std::end(kE2M1), table.begin());
    } else {
      at::Tensor bytes = at::empty({256}, at::TensorOptions().dtype(at::kByte));
      for (int i = 0; i < 256; ++i) bytes.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(i);
      const at::Tensor all = bytes.view(qtype).to(at::kFloat);
      std::copy_n(all.data_ptr<float>(), 256, table.begin());
    }
    const at::Tensor stored = quantized.contiguous();
    const auto* in = static_cast<const uint8_t*>(stored.data_ptr());
    float* o = out.data_ptr<float>();
    const int64_t n = stored.numel();
    if (packed_fp4) {
      for (int64_t i = 0; i < n; ++i) {
        o[2 * i] = table[in[i] & 0x0F];
        o[2 * i + 1] = table[in[i] >> 4];
      }
    } else {
      for (int64_t i = 0; i < n; ++i) o[i] = table[in[i]];
    }
    return out;
  }
};

namespace {

void check_no_nul(const std::string& text, const std::string& what, const char* kind) {
  TORCH_CHECK_VALUE(text.find('\0') == std::string::npos, what, ": ", kind, " \"", printable(text),
                    "\" contains a NUL byte");
}

std::string read_small_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, path, ": cannot open the index: ", errno_text());
  struct stat st {};
  std::string text;
  try {
    TORCH_CHECK(::fstat(fd, &st) == 0, path, ": stat failed: ", errno_text());
    TORCH_CHECK(S_ISREG(st.st_mode), path, ": not a regular file");
    TORCH_CHECK(st.st_size <= kMaxHeaderBytes, path, ": index of ", st.st_size, " bytes is larger than ",
                kMaxHeaderBytes);
    text.resize(static_cast<size_t>(st.st_size));
    pread_exact(fd, text.data(), st.st_size, 0, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return text;
}

struct Shard {
  std::string path;  // resolved (realpath), inside the index's folder
  std::vector<std::string> names;
};

// A shard path of the index, resolved with realpath: it must name a file inside the index's
// folder (symbolic links included), relative, with no NUL.
std::string resolve_shard(const fs::path& folder, const std::string& file, const std::string& index,
                          const std::string& tensor) {
  const std::string what = index + ": weight_map[\"" + printable(tensor) + "\"] = \"" + printable(file) + "\"";
  TORCH_CHECK(file.find('\0') == std::string::npos, what, ": a shard path must not contain a NUL byte");
  const fs::path relative(file);
  TORCH_CHECK(!file.empty() && relative.is_relative() &&
                  std::none_of(relative.begin(), relative.end(), [](const fs::path& part) { return part == ".."; }),
              what, ": must be a relative path inside the checkpoint's folder");
  std::error_code ec;
  const fs::path resolved = fs::canonical(folder / file, ec);
  TORCH_CHECK(!ec, what, ": cannot open the shard: ", ec.message());
  const std::string inside = folder.string() + "/";
  TORCH_CHECK(resolved.string().compare(0, inside.size(), inside) == 0, what, ": resolves to ", resolved.string(),
              ", outside the checkpoint's folder ", folder.string());
  return resolved.string();
}

// A sharded checkpoint's index: {"metadata": {...}, "weight_map": {"name": "shard file", ...}}.
std::vector<Shard> read_index(const std::string& index) {
  const std::string text = read_small_file(index);
  const JsonDocument doc = parse_json(text, index);
  const JsonValue root = doc.root();
  TORCH_CHECK(root.kind() == JsonValue::Kind::Object, index, ": the index must be a JSON object");
  const auto map = root.find("weight_map");
  TORCH_CHECK(map && map->kind() == JsonValue::Kind::Object, index, ": the index has no \"weight_map\" object");
  TORCH_CHECK(map->size() > 0, index, ": the index's weight_map is empty");
  std::error_code ec;
  const fs::path folder = fs::canonical(fs::absolute(fs::path(index)).parent_path(), ec);
  TORCH_CHECK(!ec, index, ": cannot resolve the index's folder: ", ec.message());
  std::vector<Shard> shards;
  std::unordered_map<std::string, size_t> shard_of;
  for (const auto& [key, file] : map->members()) {
    const std::string name(key);
    check_no_nul(name, index, "tensor name");
    TORCH_CHECK(file.kind() == JsonValue::Kind::String, index, ": weight_map[\"", name,
                "\"] must be a file name string");
    const std::string path = resolve_shard(folder, std::string(file.string()), index, name);
    auto [it, inserted] = shard_of.try_emplace(path, shards.size());
    if (inserted) shards.push_back({path, {}});
    shards[it->second].names.push_back(name);
  }
  return shards;
}

}  // namespace

SafetensorsSource::SafetensorsSource(const std::string& path, SourceOptions options)
    : path_(path), options_(options) {
  check_no_nul(path, "SafetensorsSource", "path");
  std::error_code ec;
  fs::path p(path);
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "model.safetensors.index.json", ec)) {
      p /= "model.safetensors.index.json";
    } else if (fs::exists(p / "model.safetensors", ec)) {
      p /= "model.safetensors";
    } else {
      TORCH_CHECK(false, path, ": directory holds neither model.safetensors.index.json nor model.safetensors");
    }
  }
  const std::string resolved = p.string();
  if (resolved.size() >= 5 && resolved.compare(resolved.size() - 5, 5, ".json") == 0) {
    for (const auto& shard : read_index(resolved)) add_file(shard.path, &shard.names);
  } else {
    add_file(resolved, nullptr);
  }
}

SafetensorsSource::~SafetensorsSource() = default;

namespace {

// The file opened and its JSON header read and parsed (the header's own size checks included).
JsonDocument read_header(SafetensorsSource::File& file) {
  const std::string& what = file.path;
  file.fd = ::open(what.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(file.fd >= 0, what, ": cannot open: ", errno_text());
  struct stat st {};
  TORCH_CHECK(::fstat(file.fd, &st) == 0, what, ": stat failed: ", errno_text());
  TORCH_CHECK(S_ISREG(st.st_mode), what, ": not a regular file");
  file.record(st);
  TORCH_CHECK(file.size >= 8, what, ": file of ", file.size,
              " bytes is truncated: a safetensors file starts with an 8-byte header length");
  unsigned char length_bytes[8];
  pread_exact(file.fd, length_bytes, 8, 0, what);
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | length_bytes[i];
  TORCH_CHECK(header_length <= static_cast<uint64_t>(kMaxHeaderBytes), what, ": absurd header length ",
              header_length, " (the format allows at most ", kMaxHeaderBytes, " bytes)");
  TORCH_CHECK(static_cast<int64_t>(header_length) <= file.size - 8, what, ": header length ", header_length,
              " exceeds the ", file.size - 8, " bytes after the length field (truncated file?)");
  TORCH_CHECK(header_length >= 2, what, ": header length ", header_length, " is too short for a JSON object");
  const int64_t n = static_cast<int64_t>(header_length);
  std::string header(static_cast<size_t>(n), '\0');
  pread_exact(file.fd, header.data(), n, 8, what);
  TORCH_CHECK(header[0] == '{', what, ": the header must start with '{'");
  JsonDocument doc = parse_json(header, what);
  TORCH_CHECK(doc.root().kind() == JsonValue::Kind::Object, what, ": the header must be a JSON object");
  file.data_start = 8 + n;
  return doc;
}

void read_metadata(const JsonValue& value, const std::string& what, std::map<std::string, std::string>& metadata) {
  TORCH_CHECK(value.kind() == JsonValue::Kind::Object, what, ": __metadata__ must be an object of strings");
  for (const auto& [k, v] : value.members()) {
    TORCH_CHECK(v.kind() == JsonValue::Kind::String, what, ": __metadata__[\"", printable(k),
                "\"] must be a string, found ", JsonValue::kind_name(v.kind()));
    metadata[std::string(k)] = std::string(v.string());
  }
}

// One tensor's header entry, validated against the data buffer's size.
TensorInfo read_tensor(const std::string& name, const JsonValue& value, const std::string& what, int64_t data_bytes,
                       int64_t& begin) {
  // Built only for an error message (TORCH_CHECK evaluates its message on failure only): a header
  // may hold 100,000s of tensors.
  const auto tensor = [&] { return what + ": tensor \"" + printable(name) + "\""; };
  check_no_nul(name, what, "tensor name");
  TORCH_CHECK(value.kind() == JsonValue::Kind::Object, tensor(), ": entry must be an object, found ",
              JsonValue::kind_name(value.kind()));
  for (const auto& [k, v] : value.members()) {
    TORCH_CHECK(k == "dtype" || k == "shape" || k == "data_offsets", tensor(), ": unexpected field \"",
                printable(k), "\" (expected dtype, shape, data_offsets)");
  }
  const auto dtype = value.find("dtype");
  const auto shape = value.find("shape");
  const auto offsets = value.find("data_offsets");
  TORCH_CHECK(dtype && dtype->kind() == JsonValue::Kind::String, tensor(), ": \"dtype\" must be a string");
  TORCH_CHECK(shape && shape->kind() == JsonValue::Kind::Array, tensor(), ": \"shape\" must be an array of integers");
  TORCH_CHECK(offsets && offsets->kind() == JsonValue::Kind::Array && offsets->size() == 2, tensor(),
              ": \"data_offsets\" must be an array [begin, end]");
  TensorInfo info;
  info.name = name;
  info.dtype = safetensors_dtype(std::string(dtype->string()), tensor());
  for (const auto& d : shape->elements()) {
    TORCH_CHECK(d.kind() == JsonValue::Kind::Int && d.integer() >= 0, tensor(),
                ": shape entries must be non-negative integers");
    info.shape.push_back(d.integer());
  }
  const auto bounds = offsets->elements();
  for (const auto& o : bounds) {
    TORCH_CHECK(o.kind() == JsonValue::Kind::Int, tensor(), ": data_offsets must be integers");
  }
  begin = bounds[0].integer();
  const int64_t end = bounds[1].integer();
  TORCH_CHECK(0 <= begin && begin <= end && end <= data_bytes, tensor(), ": data_offsets [", begin, ", ", end,
              "] are out of range: the data buffer holds ", data_bytes, " bytes");
  info.nbytes = checked_numel_bytes(info.shape, c10::elementSize(info.dtype), tensor);
  TORCH_CHECK(end - begin == info.nbytes, tensor(), ": data_offsets [", begin, ", ", end, "] span ", end - begin,
              " bytes but dtype ", dtype->string(), " and shape ", shape_text(info.shape), " need ", info.nbytes);
  return info;
}

// The tensors' byte ranges must tile the data buffer: no overlaps, no holes, no trailing data.
void check_coverage(std::vector<std::tuple<int64_t, int64_t, const std::string*>> spans, int64_t data_bytes,
                    const std::string& what) {
  std::sort(spans.begin(), spans.end());
  int64_t covered = 0;
  const std::string* previous = nullptr;
  for (const auto& [begin, end, name] : spans) {
    TORCH_CHECK(begin >= covered, what, ": tensors \"", printable(*previous), "\" and \"", printable(*name),
                "\" have overlapping data_offsets");
    TORCH_CHECK(begin == covered, what, ": ", begin - covered, " bytes before tensor \"", printable(*name),
                "\" belong to no tensor (the data buffer must have no holes)");
    covered = end;
    previous = name;
  }
  TORCH_CHECK(covered == data_bytes, what, ": the data buffer holds ", data_bytes, " bytes but its tensors cover ",
              covered, " (", data_bytes - covered, " bytes of trailing data)");
}

}  // namespace

void SafetensorsSource::add_file(const std::string& file_path, const std::vector<std::string>* expected) {
  auto file = std::make_shared<File>();
  file->path = file_path;
  const std::string& what = file->path;
  const JsonDocument doc = read_header(*file);
  const int64_t data_bytes = file->size - file->data_start;
  std::vector<Entry> found;
  std::map<std::string, std::string> metadata;
  for (const auto& [key, value] : doc.root().members()) {
    if (key == "__metadata__") {
      read_metadata(value, what, metadata);
      continue;
    }
    int64_t begin = 0;
    Entry e;
    e.file = file;
    e.info = read_tensor(std::string(key), value, what, data_bytes, begin);
    e.offset = file->data_start + begin;
    found.push_back(std::move(e));
  }
  std::vector<std::tuple<int64_t, int64_t, const std::string*>> spans;
  spans.reserve(found.size());
  for (const auto& e : found) spans.emplace_back(e.offset - file->data_start, e.offset - file->data_start + e.info.nbytes, &e.info.name);
  check_coverage(std::move(spans), data_bytes, what);
  std::unordered_set<std::string> wanted;
  if (expected != nullptr) {
    std::unordered_set<std::string> in_file;
    for (const auto& e : found) in_file.insert(e.info.name);
    for (const auto& name : *expected) {
      TORCH_CHECK(in_file.count(name), path_, ": the index places tensor \"", printable(name), "\" in ", what,
                  ", which does not hold it");
    }
    wanted.insert(expected->begin(), expected->end());
  }
  for (const auto& e : found) {
    const auto other = entries_.find(e.info.name);
    TORCH_CHECK(other == entries_.end(), path_, ": tensor \"", printable(e.info.name), "\" appears in ",
                other == entries_.end() ? "" : other->second.file->path, " and in ", what);
  }
  map_file(*file);
  for (auto& e : found) {
    if (expected != nullptr && !wanted.count(e.info.name)) continue;
    std::string name = e.info.name;
    total_bytes_ += e.info.nbytes;
    order_.push_back(name);
    entries_.emplace(std::move(name), std::move(e));
  }
  for (auto& [k, v] : metadata) metadata_[k] = v;
  files_.push_back(std::move(file));
}

void SafetensorsSource::map_file(File& file) const {
  if (file.size > 0) {
    void* map = ::mmap(nullptr, static_cast<size_t>(file.size), PROT_READ | PROT_WRITE, MAP_PRIVATE, file.fd, 0);
    TORCH_CHECK(map != MAP_FAILED, file.path, ": mmap failed: ", errno_text());
    file.map = static_cast<char*>(map);
  }
  if (options_.direct_io) {
    file.direct_fd = ::open(file.path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    TORCH_CHECK(file.direct_fd >= 0, file.path, ": cannot open with O_DIRECT (direct_io=True): ", errno_text());
  }
}

std::vector<std::string> SafetensorsSource::names() const { return order_; }

bool SafetensorsSource::contains(const std::string& name) const { return entries_.count(name) != 0; }

const SafetensorsSource::Entry& SafetensorsSource::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  TORCH_CHECK(it != entries_.end(), path_, ": no tensor named \"", name, "\"");
  return it->second;
}

const TensorInfo& SafetensorsSource::info(const std::string& name) const { return entry(name).info; }

std::vector<std::string> SafetensorsSource::files() const {
  std::vector<std::string> out;
  for (const auto& f : files_) out.push_back(f->path);
  return out;
}

void SafetensorsSource::read_into(const std::string& name, void* dst) const {
  const Entry& e = entry(name);
  if (e.composition) {
    compose_into(e, at::from_blob(dst, e.info.shape, at::TensorOptions().dtype(e.info.dtype)));
    return;
  }
  e.file->check_unchanged(name);
  pread_exact(e.file->fd, dst, e.info.nbytes, e.offset, e.file->path);
}

at::Tensor SafetensorsSource::load(const std::string& name, bool pin_memory) const {
  const Entry& e = entry(name);
  if (e.composition) {
    at::Tensor out = at::empty(e.info.shape, at::TensorOptions().dtype(e.info.dtype).pinned_memory(pin_memory));
    compose_into(e, out);
    return out;
  }
  return load_of(e, pin_memory);
}

at::Tensor SafetensorsSource::load_of(const Entry& e, bool pin_memory) const {
  const std::string& name = e.info.name;
  const auto options = at::TensorOptions().dtype(e.info.dtype).pinned_memory(pin_memory);
  e.file->check_unchanged(name);
  if (!options_.direct_io || e.info.nbytes == 0) {
    at::Tensor out = at::empty(e.info.shape, options);
    advise_huge_pages(out.data_ptr(), e.info.nbytes);
    pread_exact(e.file->fd, out.data_ptr(), e.info.nbytes, e.offset, e.file->path);
    return out;
  }
  // O_DIRECT: offset, length and buffer aligned to 4096; read the aligned span into an aligned
  // region of a byte buffer and return a view of the tensor's bytes inside it (no extra copy).
  const int64_t begin = e.offset & ~(kDirectAlignment - 1);
  const int64_t end = e.offset + e.info.nbytes;
  const int64_t span = ((end + kDirectAlignment - 1) & ~(kDirectAlignment - 1)) - begin;
  at::Tensor buffer =
      at::empty({span + kDirectAlignment}, at::TensorOptions().dtype(at::kByte).pinned_memory(pin_memory));
  const auto base = reinterpret_cast<uintptr_t>(buffer.data_ptr());
  const auto mask = ~static_cast<uintptr_t>(kDirectAlignment - 1);
  char* aligned = reinterpret_cast<char*>((base + kDirectAlignment - 1) & mask);
  int64_t got = 0;
  while (got < end - begin) {
    const ssize_t r = ::pread(e.file->direct_fd, aligned + got, static_cast<size_t>(span - got), begin + got);
    if (r < 0) {
      if (errno == EINTR) continue;
      TORCH_CHECK(false, e.file->path, ": O_DIRECT read of tensor \"", name, "\" failed: ", errno_text());
    }
    TORCH_CHECK(r > 0, e.file->path, ": unexpected end of file reading tensor \"", name, "\"");
    got += r;
    TORCH_CHECK(got >= end - begin || got % kDirectAlignment == 0, e.file->path,
                ": unaligned short O_DIRECT read of tensor \"", name, "\"");
  }
  char* data = aligned + (e.offset - begin);
  if (reinterpret_cast<uintptr_t>(data) % c10::elementSize(e.info.dtype) != 0) {
    at::Tensor out = at::empty(e.info.shape, options);
    std::memcpy(out.data_ptr(), data, static_cast<size_t>(e.info.nbytes));
    return out;
  }
  return at::from_blob(data, e.info.shape, [buffer](void*) {}, at::TensorOptions().dtype(e.info.dtype));
}

at::Tensor SafetensorsSource::view(const std::string& name) const {
  const Entry& e = entry(name);
  TORCH_CHECK(!e.composition, path_, ": \"", name, "\" is a composition of stored tensors, not stored itself: it has ",
              "no zero-copy view (load() it)");
  return view_of(e);
}

at::Tensor SafetensorsSource::view_of(const Entry& e) const {
  if (e.info.nbytes == 0) return at::empty(e.info.shape, at::TensorOptions().dtype(e.info.dtype));
  e.file->check_unchanged(e.info.name);
  char* data = e.file->map + e.offset;
  if (reinterpret_cast<uintptr_t>(data) % c10::elementSize(e.info.dtype) != 0) return load_of(e, false);
  std::shared_ptr<File> keep = e.file;
  return at::from_blob(data, e.info.shape, [keep](void*) {}, at::TensorOptions().dtype(e.info.dtype));
}

void SafetensorsSource::populate(const std::string& name) const {
  const Entry& e = entry(name);
  if (e.composition) {
    e.composition->for_each_leaf([this](const Composition& leaf) { populate_of(leaf.stored); });
  } else {
    populate_of(e);
  }
}

void SafetensorsSource::populate_of(const Entry& e) const {
  if (e.info.nbytes == 0) return;
  e.file->check_unchanged(e.info.name);
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(e.file->map + e.offset) & ~(page - 1);
  const auto end = reinterpret_cast<uintptr_t>(e.file->map + e.offset + e.info.nbytes);
  if (::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ) == 0) return;
  // EFAULT / EIO: the pages are beyond the file's end or unreadable (changed under the mapping
  // after the check above); touching them would raise SIGBUS.
  TORCH_CHECK(errno == EINVAL, e.file->path, ": cannot map tensor \"", e.info.name, "\" in: ", errno_text(),
              " (did the file change after it was opened?)");
  // Kernels before 5.14: fault the pages in by reading one byte of each.
  volatile char sink = 0;
  for (uintptr_t p = begin; p < end; p += page) sink = sink + *reinterpret_cast<const char*>(p);
}

void SafetensorsSource::release_pages(const std::string& name) const {
  const Entry& e = entry(name);
  if (e.composition) {
    e.composition->for_each_leaf([this](const Composition& leaf) { release_pages_of(leaf.stored); });
  } else {
    release_pages_of(e);
  }
}

void SafetensorsSource::release_pages_of(const Entry& e) const {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  // Only pages wholly inside the tensor: its neighbours may still be in use.
  const auto begin = (reinterpret_cast<uintptr_t>(e.file->map + e.offset) + page - 1) & ~(page - 1);
  const auto end = reinterpret_cast<uintptr_t>(e.file->map + e.offset + e.info.nbytes) & ~(page - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

namespace {

std::vector<int64_t> program_integers(const std::string& text, const std::string& what) {
  std::vector<int64_t> out;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == ' ' || text[i] == ',') {
      ++i;
      continue;
    }
    int64_t value = 0;
    const auto [end, ec] = std::from_chars(text.data() + i, text.data() + text.size(), value);
    TORCH_CHECK_VALUE(ec == std::errc() && (end == text.data() + text.size() || *end == ' ' || *end == ','), what,
                      ": expected integers, got \"", text, "\"");
    out.push_back(value);
    i = static_cast<size_t>(end - text.data());
  }
  return out;
}

// Parses a postfix program into its tree; raises ValueError naming `what` and the op.
SafetensorsSource::Composition parse_program(const std::vector<std::string>& program, const std::string& what) {
  using Composition = SafetensorsSource::Composition;
  using Op = Composition::Op;
  std::vector<Composition> stack;
  for (const auto& item : program) {
    const auto space = item.find(' ');
    const std::string op = item.substr(0, space);
    const std::string rest = space == std::string::npos ? "" : item.substr(space + 1);
    const std::string where = what + ": \"" + item + "\"";
    Composition node;
    node.item = item;
    if (op == "tensor") {
      TORCH_CHECK_VALUE(!rest.empty(), where, ": names no tensor");
      node.stored.info.name = rest;
      stack.push_back(std::move(node));
      continue;
    }
    node.args = program_integers(rest, where);
    size_t pops = 1;
    if (op == "stack" || op == "cat") {
      node.op = op == "stack" ? Op::kStack : Op::kCat;
      TORCH_CHECK_VALUE(node.args.size() == 2 && node.args[1] >= 1, where, ": expected \"", op, " DIM N\" with N >= 1");
      pops = static_cast<size_t>(node.args[1]);
      node.args.resize(1);
    } else if (op == "narrow") {
      node.op = Op::kNarrow;
      TORCH_CHECK_VALUE(node.args.size() == 3, where, ": expected \"narrow DIM START LENGTH\"");
    } else if (op == "transpose") {
      node.op = Op::kTranspose;
      TORCH_CHECK_VALUE(node.args.size() == 2, where, ": expected \"transpose DIM0 DIM1\"");
    } else if (op == "reshape") {
      node.op = Op::kReshape;
    } else if (op == "dequantize") {
      node.op = Op::kDequantize;
      TORCH_CHECK_VALUE(node.args.empty(), where, ": expected \"dequantize\" (it takes no arguments)");
      pops = 2;
    } else {
      TORCH_CHECK_VALUE(false, where, ": unknown op \"", op,
                        "\" (expected tensor, stack, cat, narrow, transpose, reshape or dequantize)");
    }
    TORCH_CHECK_VALUE(stack.size() >= pops, where, ": needs ", pops, " tensor(s), the program has ", stack.size(),
                      " before it");
    node.parts.assign(std::make_move_iterator(stack.end() - static_cast<std::ptrdiff_t>(pops)),
                      std::make_move_iterator(stack.end()));
    stack.resize(stack.size() - pops);
    stack.push_back(std::move(node));
  }
  TORCH_CHECK_VALUE(stack.size() == 1, what, ": a program must leave one tensor, it leaves ", stack.size());
  return std::move(stack.back());
}

// Sets the shape of every node by running its op on meta tensors (each op once), the leaves
// given by `meta`; raises ValueError naming `what` and the op that does not apply.
at::Tensor check_shapes(SafetensorsSource::Composition& node, const std::string& what,
                        const std::function<at::Tensor(const SafetensorsSource::Composition&)>& meta) {
  using Op = SafetensorsSource::Composition::Op;
  at::Tensor result;
  if (node.op == Op::kTensor) {
    result = meta(node);
  } else {
    std::vector<at::Tensor> inputs;
    for (auto& part : node.parts) inputs.push_back(check_shapes(part, what, meta));
    const std::string where = what + ": \"" + node.item + "\"";
    if (node.op == Op::kStack || node.op == Op::kCat) {
      for (size_t i = 1; i < inputs.size(); ++i) {
        TORCH_CHECK_VALUE(inputs[i].scalar_type() == inputs[0].scalar_type(), where, ": joins tensors of ",
                          inputs[0].scalar_type(), " and ", inputs[i].scalar_type(), " (the ",
                          node.parts[i].item, "); they must have one dtype");
      }
    }
    try {
      result = node.apply(inputs);
    } catch (const c10::Error& error) {
      TORCH_CHECK_VALUE(false, where, ": does not apply to the stored tensors' shapes and dtypes: ",
                        error.what_without_backtrace());
    } catch (const std::exception& error) {  // a meta kernel written in Python (torch._meta_registrations)
      TORCH_CHECK_VALUE(false, where, ": does not apply to the stored tensors' shapes and dtypes: ", error.what());
    }
  }
  node.shape = result.sizes().vec();
  return result;
}

}  // namespace

c10::intrusive_ptr<SafetensorsSource> SafetensorsSource::composed(
    const std::map<std::string, std::vector<std::string>>& programs) const {
  auto out = c10::make_intrusive<SafetensorsSource>(*this);
  std::unordered_map<std::string, std::vector<std::string>> readers;  // stored tensor -> the compositions reading it
  for (const auto& item : programs) {
    const std::string& name = item.first;  // not a structured binding: the lambda below captures it
    const std::string what = path_ + ": composition \"" + name + "\"";
    auto composition = std::make_shared<Composition>(parse_program(item.second, what));
    bool reads_its_name = false;
    composition->for_each_leaf([&](Composition& leaf) {
      const std::string read = leaf.stored.info.name;
      const auto it = entries_.find(read);
      TORCH_CHECK_VALUE(it != entries_.end(), what, ": reads \"", read, "\", which the source does not hold");
      reads_its_name = reads_its_name || (read == name && !it->second.composition);
      readers[read].push_back(name);
      if (it->second.composition) {
        leaf = *it->second.composition;  // an earlier composition: its program in place of the name
      } else {
        leaf.stored = it->second;
      }
    });
    TORCH_CHECK_VALUE(entries_.count(name) == 0 || reads_its_name, what,
                      ": the source holds a tensor of that name (a composition may take the name of a stored ",
                      "tensor only when it reads it, as a dequantization does)");
    const at::Tensor meta = check_shapes(*composition, what, [](const Composition& leaf) {
      return at::empty(leaf.stored.info.shape, at::TensorOptions().dtype(leaf.stored.info.dtype).device(c10::kMeta));
    });
    Entry e;
    e.info.name = name;
    e.info.dtype = meta.scalar_type();
    e.info.shape = meta.sizes().vec();
    e.info.nbytes = meta.numel() * static_cast<int64_t>(meta.element_size());
    e.composition = std::move(composition);
    out->entries_[name] = std::move(e);
  }
  // Each composition goes where the first tensor it reads was (in file order).
  out->order_.clear();
  std::unordered_set<std::string> listed;
  for (const auto& name : order_) {
    const auto it = readers.find(name);
    if (it == readers.end()) {
      out->order_.push_back(name);
      continue;
    }
    for (const auto& composition : it->second) {
      if (listed.insert(composition).second) out->order_.push_back(composition);
    }
  }
  return out;
}

bool SafetensorsSource::has_view(const std::string& name) const { return !entry(name).composition; }

void SafetensorsSource::convert_into(const std::string& name, const at::Tensor& out) const {
  const Entry& e = entry(name);
  if (e.composition) {
    compose_into(e, out);
  } else {
    PagerSource::convert_into(name, out);
  }
}

void SafetensorsSource::compose_into(const Entry& e, const at::Tensor& out) const {
  e.composition->write([this](const Entry& stored) { return view_of(stored); }, out);
  // The parts were read through the mapping: give their pages back, as a copy read with pread
  // leaves none mapped (another reader of a part faults its pages in again from the file).
  e.composition->for_each_leaf([this](const Composition& leaf) { release_pages_of(leaf.stored); });
}

}  // namespace torch_ext::paging
