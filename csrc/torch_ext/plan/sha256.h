#pragma once
// SHA-256 (FIPS 180-4), for the content hashes of a saved plan cache: stable across runs,
// machines and compilers, unlike std::hash. Sha256 is a plain value; use one per thread.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace torch_ext::plan {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, std::size_t size);
  void update(std::string_view text) { update(text.data(), text.size()); }
  // The digest as 64 lowercase hex digits; the object is spent afterwards.
  std::string hex_digest();

 private:
  void block(const uint8_t* chunk);
  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_{};
  std::size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

std::string sha256_hex(std::string_view text);
// The SHA-256 of a file's bytes; throws naming the file when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace torch_ext::plan
