// The manifest of a saved cache: writing it, and reading it back strictly (every line known,
// every token consumed, every size a positive integer), with errors that name the file and line.
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "torch_ext/plan/persistence.h"
#include "torch_ext/common/sha256.h"

namespace torch_ext::plan {

namespace {

constexpr const char* kHeader = "torch_ext.PlanCache 2";

// One layout option as manifest tokens, and back.
struct LayoutField {
  const char* name;
  std::function<std::string(const PlanCacheOptions&)> write;
  std::function<void(PlanCacheOptions&, std::istringstream&, const std::function<void(const std::string&)>&)> read;
};

std::string ints(const std::vector<int64_t>& v) {
  std::ostringstream out;
  for (int64_t x : v) out << " " << x;
  return out.str();
}

std::string int_lists(const std::vector<std::vector<int64_t>>& v) {
  std::string out;
  for (const auto& list : v) out += " [" + ints(list) + " ]";
  return out;
}

std::string doubles(const std::vector<double>& v) {
  std::ostringstream out;
  out.precision(17);
  for (double x : v) out << " " << x;
  return out.str();
}

std::string names(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& x : v) out += " " + x;
  return out;
}

using Fail = std::function<void(const std::string&)>;

int64_t parse_int(const std::string& token, const Fail& fail) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(token.c_str(), &end, 10);
  if (token.empty() || *end != '\0' || errno != 0) fail("'" + token + "' is not an integer");
  return static_cast<int64_t>(v);
}

double parse_double(const std::string& token, const Fail& fail) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(token.c_str(), &end);
  if (token.empty() || *end != '\0' || errno != 0) fail("'" + token + "' is not a number");
  return v;
}

std::vector<int64_t> read_ints(std::istringstream& in, const Fail& fail) {
  std::vector<int64_t> out;
  for (std::string token; in >> token;) out.push_back(parse_int(token, fail));
  return out;
}

std::vector<std::vector<int64_t>> read_int_lists(std::istringstream& in, const Fail& fail) {
  std::vector<std::vector<int64_t>> out;
  for (std::string token; in >> token;) {
    if (token != "[") fail("expected '[' , got '" + token + "'");
    out.emplace_back();
    bool closed = false;
    while (in >> token) {
      if (token == "]") {
        closed = true;
        break;
      }
      out.back().push_back(parse_int(token, fail));
    }
    if (!closed) fail("a list is not closed with ']'");
  }
  return out;
}

const std::vector<LayoutField>& layout_fields() {
  using O = PlanCacheOptions;
  static const std::vector<LayoutField> fields = {
      {"batch_dims", [](const O& o) { return ints(o.batch_dims); },
       [](O& o, std::istringstream& in, const Fail& fail) { o.batch_dims = read_ints(in, fail); }},
      {"output_batch_dims", [](const O& o) { return ints(o.output_batch_dims); },
       [](O& o, std::istringstream& in, const Fail& fail) { o.output_batch_dims = read_ints(in, fail); }},
      {"dims", [](const O& o) { return int_lists(o.dims); },
       [](O& o, std::istringstream& in, const Fail& fail) { o.dims = read_int_lists(in, fail); }},
      {"output_dims", [](const O& o) { return int_lists(o.output_dims); },
       [](O& o, std::istringstream& in, const Fail& fail) { o.output_dims = read_int_lists(in, fail); }},
      {"dim_names", [](const O& o) { return names(o.dim_names); },
       [](O& o, std::istringstream& in, const Fail&) {
         o.dim_names.clear();
         for (std::string token; in >> token;) o.dim_names.push_back(token);
       }},
      {"size_ranges", [](const O& o) { return int_lists(o.size_ranges); },
       [](O& o, std::istringstream& in, const Fail& fail) { o.size_ranges = read_int_lists(in, fail); }},
      {"buckets", [](const O& o) { return int_lists(o.buckets); },
       [](O& o, std::istringstream& in, const Fail& fail) { o.buckets = read_int_lists(in, fail); }},
      {"pad_values", [](const O& o) { return doubles(o.pad_values); },
       [](O& o, std::istringstream& in, const Fail& fail) {
         o.pad_values.clear();
         for (std::string token; in >> token;) o.pad_values.push_back(parse_double(token, fail));
       }},
  };
  return fields;
}

// Reads `plan <upper...> lower <lower...> static|dynamic|script [<file> <sha256>]`.
ManifestPlan read_plan(std::istringstream& in, const Fail& fail) {
  ManifestPlan plan;
  std::vector<int64_t> upper, lower;
  std::string token;
  while (in >> token && token != "lower") upper.push_back(parse_int(token, fail));
  if (token != "lower") fail("expected 'lower' after the bucket's sizes");
  const auto is_kind = [](const std::string& t) { return t == "static" || t == "dynamic" || t == "script"; };
  while (in >> token && !is_kind(token)) lower.push_back(parse_int(token, fail));
  if (!is_kind(token)) fail("expected 'static', 'dynamic' or 'script' after the lower sizes");
  plan.script = token == "script";
  plan.dynamic = token != "static";
  if (upper.empty() || upper.size() > static_cast<size_t>(kMaxDims) || lower.size() != upper.size()) {
    fail("a plan needs 1 to " + std::to_string(kMaxDims) + " sizes and as many lower sizes");
  }
  for (size_t k = 0; k < upper.size(); ++k) {
    if (upper[k] < 1 || lower[k] < 1 || lower[k] > upper[k]) fail("sizes must satisfy 1 <= lower <= upper");
  }
  plan.upper = Bucket::of(upper);
  plan.lower = Bucket::of(lower);
  if (in >> plan.file) {
    if (!(in >> plan.sha256) || plan.sha256.size() != 64) fail("a plan's file needs its SHA-256 after it");
  }
  return plan;
}

}  // namespace

void copy_layout(const PlanCacheOptions& from, PlanCacheOptions& to) {
  to.batch_dims = from.batch_dims;
  to.output_batch_dims = from.output_batch_dims;
  to.dims = from.dims;
  to.output_dims = from.output_dims;
  to.dim_names = from.dim_names;
  to.size_ranges = from.size_ranges;
  to.buckets = from.buckets;
  to.pad_values = from.pad_values;
}

std::string layout_difference(const PlanCacheOptions& a, const PlanCacheOptions& b, std::string& a_text,
                              std::string& b_text) {
  for (const auto& field : layout_fields()) {
    a_text = field.write(a);
    b_text = field.write(b);
    if (a_text != b_text) return field.name;
  }
  return "";
}

void Manifest::add_file(const std::string& dir, const std::string& name) {
  files[name] = sha256_file((std::filesystem::path(dir) / name).string());
}

std::string Manifest::checked_file(const std::string& dir, const std::string& name) const {
  auto it = files.find(name);
  TORCH_CHECK(it != files.end(), "PlanCache.load: ", path, " lists no file ", name);
  const std::string file = (std::filesystem::path(dir) / name).string();
  TORCH_CHECK(std::filesystem::is_regular_file(file), "PlanCache.load: ", file, " does not exist");
  const std::string actual = sha256_file(file);
  TORCH_CHECK(actual == it->second, "PlanCache.load: ", file, " is not the file that was saved (its SHA-256 is ",
              actual, ", ", path, " records ", it->second, "); the folder was changed after save()");
  return file;
}

const std::string& Manifest::value(const std::string& key) const {
  auto it = values.find(key);
  TORCH_CHECK(it != values.end(), "PlanCache.load: ", path, " has no '", key, "' line");
  return it->second;
}

void write_manifest(const std::string& dir, const Manifest& manifest) {
  const auto file = (std::filesystem::path(dir) / "manifest.txt").string();
  std::ostringstream out;
  out << kHeader << "\nkind " << manifest.kind << "\n";
  for (const auto& [key, value] : manifest.values) out << "value " << key << " " << value << "\n";
  for (const auto& [name, sha] : manifest.files) out << "file " << name << " " << sha << "\n";
  for (const auto& field : layout_fields()) out << "layout " << field.name << field.write(manifest.layout) << "\n";
  for (const auto& plan : manifest.plans) {
    out << "plan" << ints(plan.upper.vec()) << " lower" << ints(plan.lower.vec()) << " "
        << (plan.script ? "script" : plan.dynamic ? "dynamic" : "static");
    if (!plan.file.empty()) out << " " << plan.file << " " << plan.sha256;
    out << "\n";
  }
  for (const auto& row : manifest.traffic) out << "traffic" << ints(row) << "\n";
  out << "end\n";
  std::ofstream stream(file, std::ios::trunc);
  stream << out.str();
  TORCH_CHECK(stream.good(), "PlanCache.save: writing ", file, " failed");
}

Manifest read_manifest(const std::string& dir, const std::string& expected_sha256) {
  Manifest manifest;
  manifest.path = (std::filesystem::path(dir) / "manifest.txt").string();
  std::ifstream file(manifest.path, std::ios::binary);
  TORCH_CHECK(file.good(), "PlanCache.load: ", manifest.path, " does not exist or cannot be read");
  // The bytes hashed are the bytes parsed: read once, so the file cannot change in between.
  std::ostringstream bytes;
  bytes << file.rdbuf();
  TORCH_CHECK(!file.bad(), "PlanCache.load: reading ", manifest.path, " failed");
  const std::string text = std::move(bytes).str();
  if (!expected_sha256.empty()) {
    const std::string actual = sha256_hex(text);
    TORCH_CHECK(actual == expected_sha256, "PlanCache.load: refusing ", dir, ": the SHA-256 of its manifest ",
                manifest.path, " is ", actual, ", not the manifest_sha256 this cache trusts (", expected_sha256,
                "); nothing in the folder was loaded");
  }
  std::istringstream in(text);
  std::string line;
  int number = 0;
  std::getline(in, line);
  ++number;
  TORCH_CHECK(line == kHeader, "PlanCache.load: ", manifest.path, " is not a PlanCache manifest of this version ",
              "(first line '", line, "', expected '", kHeader, "')");
  bool ended = false;
  std::map<std::string, bool> layout_seen;
  while (std::getline(in, line)) {
    ++number;
    const Fail fail = [&](const std::string& why) {
      TORCH_CHECK(false, "PlanCache.load: ", manifest.path, " line ", number, " ('", line, "'): ", why);
    };
    if (ended) fail("nothing may follow 'end'");
    std::istringstream tokens(line);
    std::string key;
    tokens >> key;
    if (key == "end") {
      ended = true;
    } else if (key == "kind") {
      if (!manifest.kind.empty()) fail("a second 'kind' line");
      tokens >> manifest.kind;
      if (manifest.kind != "torchscript" && manifest.kind != "export") fail("kind must be torchscript or export");
    } else if (key == "value" || key == "file") {
      std::string name, value;
      if (!(tokens >> name >> value)) fail("expected a name and a value");
      auto& map = key == "value" ? manifest.values : manifest.files;
      if (!map.emplace(name, value).second) fail("a second line for '" + name + "'");
      if (key == "file" && value.size() != 64) fail("expected a SHA-256 (64 hex digits)");
    } else if (key == "layout") {
      std::string name;
      tokens >> name;
      bool known = false;
      for (const auto& field : layout_fields()) {
        if (name != field.name) continue;
        if (layout_seen[name]) fail("a second line for layout option " + name);
        field.read(manifest.layout, tokens, fail);
        layout_seen[name] = known = true;
      }
      if (!known) fail("unknown layout option '" + name + "'");
    } else if (key == "plan") {
      manifest.plans.push_back(read_plan(tokens, fail));
      manifest.plans.back().line = number;
    } else if (key == "traffic") {  // checked against the layout by the cache that loads it
      manifest.traffic.push_back(read_ints(tokens, fail));
      manifest.traffic_lines.push_back(number);
    } else {
      fail("unknown line");
    }
    std::string extra;
    if (tokens >> extra) fail("unexpected '" + extra + "'");
  }
  TORCH_CHECK(ended, "PlanCache.load: ", manifest.path, " is truncated (no 'end' line)");
  TORCH_CHECK(!manifest.kind.empty(), "PlanCache.load: ", manifest.path, " has no 'kind' line");
  TORCH_CHECK(layout_seen.size() == layout_fields().size(), "PlanCache.load: ", manifest.path,
              " does not list every layout option");
  return manifest;
}

}  // namespace torch_ext::plan
