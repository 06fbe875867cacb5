// SHA-256 over OpenSSL's EVP interface.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace dsec {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  void update(const void* data, size_t n);
  // Lower-case hex digest; the object cannot be updated afterwards.
  std::string hexDigest();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::string sha256Hex(std::string_view data);
// HMAC-SHA256(key, msg) as lower-case hex (64 characters); "" if OpenSSL fails.
std::string hmacSha256Hex(std::string_view key, std::string_view msg);
Result<std::string> sha256File(const std::string& path);

}  // namespace dsec
