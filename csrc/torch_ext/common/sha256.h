#pragma once
// SHA-256 from OpenSSL's libcrypto, for content hashes that are stable across runs, machines and
// compilers (a saved plan cache's manifest), unlike std::hash. Sha256 is a plain value that owns
// its OpenSSL context; use one per thread.
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace torch_ext {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(Sha256&&) noexcept;
  Sha256& operator=(Sha256&&) noexcept;
  void update(const void* data, std::size_t size);
  void update(std::string_view text) { update(text.data(), text.size()); }
  // The digest as 64 lowercase hex digits; the object is spent afterwards.
  std::string hex_digest();

 private:
  struct Context;
  std::unique_ptr<Context> context_;
};

std::string sha256_hex(std::string_view text);
// The SHA-256 of a file's bytes; throws naming the file when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace torch_ext
