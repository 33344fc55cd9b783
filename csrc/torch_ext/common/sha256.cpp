#include "torch_ext/common/sha256.h"

#include <openssl/evp.h>

#include <fstream>
#include <vector>

#include <c10/util/Exception.h>

namespace torch_ext {

struct Sha256::Context {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  bool spent = false;
  ~Context() { EVP_MD_CTX_free(ctx); }
};

Sha256::Sha256() : context_(std::make_unique<Context>()) {
  TORCH_CHECK(context_->ctx != nullptr && EVP_DigestInit_ex(context_->ctx, EVP_sha256(), nullptr) == 1,
              "Sha256: OpenSSL could not start a SHA-256 digest");
}

Sha256::~Sha256() = default;
Sha256::Sha256(Sha256&&) noexcept = default;
Sha256& Sha256::operator=(Sha256&&) noexcept = default;

void Sha256::update(const void* data, std::size_t size) {
  TORCH_CHECK(!context_->spent, "Sha256: update() after hex_digest()");
  if (size == 0) return;
  TORCH_CHECK(EVP_DigestUpdate(context_->ctx, data, size) == 1, "Sha256: OpenSSL's digest update failed");
}

std::string Sha256::hex_digest() {
  TORCH_CHECK(!context_->spent, "Sha256: hex_digest() called twice");
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  TORCH_CHECK(EVP_DigestFinal_ex(context_->ctx, digest, &length) == 1 && length == 32,
              "Sha256: OpenSSL's digest failed");
  context_->spent = true;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(2 * length, '0');
  for (unsigned int i = 0; i < length; ++i) {
    out[2 * i] = kHex[digest[i] >> 4];
    out[2 * i + 1] = kHex[digest[i] & 15];
  }
  return out;
}

std::string sha256_hex(std::string_view text) {
  Sha256 h;
  h.update(text);
  return h.hex_digest();
}

std::string sha256_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), path, " does not exist or cannot be read");
  Sha256 h;
  std::vector<char> chunk(1 << 20);
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    h.update(chunk.data(), static_cast<std::size_t>(in.gcount()));
  }
  TORCH_CHECK(in.eof(), "reading ", path, " failed");
  return h.hex_digest();
}

}  // namespace torch_ext
