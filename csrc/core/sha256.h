// SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104), for authenticating the TP peer without
// a crypto library dependency. Not constant-time in the data (it only ever hashes nonces and
// a secret key of fixed position); compare MACs with equal_ct().
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace tf {

using Digest256 = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  Digest256 finish();

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;  // bytes hashed so far
};

Digest256 sha256(const std::string& data);
Digest256 hmac_sha256(const std::string& key, const std::string& msg);
std::string to_hex(const uint8_t* p, size_t n);
// Equality that takes the same time wherever the strings differ (length is not secret).
bool equal_ct(const std::string& a, const std::string& b);

}  // namespace tf
