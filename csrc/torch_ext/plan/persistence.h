#pragma once
// Internal to the plan cache: the manifest of a saved cache (manifest.txt). A line-based format,
// parsed strictly: every line is known, every token read, every file listed with its SHA-256,
// every size checked against the cache's layout. Plain values: no shared state.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "torch_ext/plan/plan_cache.h"

namespace torch_ext::plan {

struct ManifestPlan {
  Bucket upper, lower;
  bool dynamic = false;
  bool script = false;  // a TorchScript plan of an exported program's cache (dynamic too)
  std::string file;    // an exported program's package, relative to the folder; empty for TorchScript
  std::string sha256;  // of that file
  int line = 0;
};

struct Manifest {
  std::string path;  // where it was read from (for messages)
  std::string kind;
  std::map<std::string, std::string> values;  // what identifies the source (method, hashes of code, weights)
  std::map<std::string, std::string> files;   // file name -> SHA-256
  PlanCacheOptions layout;                    // the layout options (PlanCacheOptions' first eight)
  std::vector<ManifestPlan> plans;
  // The traffic log as PlanCache::traffic() gives it (sizes, then the count), and each row's line.
  std::vector<std::vector<int64_t>> traffic;
  std::vector<int> traffic_lines;

  // Adds a file written to dir: its hash is taken now.
  void add_file(const std::string& dir, const std::string& name);
  // Checks that a listed file is in dir with the hash recorded; returns its path.
  std::string checked_file(const std::string& dir, const std::string& name) const;
  const std::string& value(const std::string& key) const;
};

void write_manifest(const std::string& dir, const Manifest& manifest);
// Reads dir/manifest.txt. With `expected_sha256` (non-empty) a manifest whose bytes have another
// SHA-256 is refused before anything in it is parsed or any file it lists is opened.
Manifest read_manifest(const std::string& dir, const std::string& expected_sha256 = "");

// Copies the layout options of `from` into `to`.
void copy_layout(const PlanCacheOptions& from, PlanCacheOptions& to);
// The first layout option in which a and b differ ("" when none), with both values as text.
std::string layout_difference(const PlanCacheOptions& a, const PlanCacheOptions& b, std::string& a_text,
                              std::string& b_text);

}  // namespace torch_ext::plan
