// How one token's K and V sit in a paged cache slot (shared by the KV write and attention kernels).
//
//   plain (the model dtype): K [heads][dim], V [heads][dim]
//   int8 / fp8 (e4m3):       K codes [heads][dim], V codes [heads][dim] (1 byte each),
//                            K scales [heads] fp32, V scales [heads] fp32, zero padding to
//                            a multiple of 16 bytes (GPUs load a slot's rows 16-byte aligned)
//
// A token is always one contiguous run of `token_bytes`, so KV transports move 8-bit caches
// (scales included) exactly like plain ones. Quantization is per token and head:
// scale = max|x| / 127 (int8) or / 448 (fp8's largest normal), code = x / scale.
#pragma once
#include <c10/util/Float8_e4m3fn.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace pdserve {

struct KVFormat {
  enum Kind : int64_t { kPlain = 0, kInt8 = 1, kFp8 = 2 };
  Kind kind;
  int64_t heads, dim, elem_bytes, token_bytes;

  KVFormat(Kind kind, int64_t heads, int64_t dim, int64_t elem_bytes)
      : kind(kind), heads(heads), dim(dim), elem_bytes(elem_bytes),
        token_bytes(kind == kPlain ? 2 * heads * dim * elem_bytes : (2 * heads * dim + 2 * heads * 4 + 15) / 16 * 16) {}

  // From an op's arguments, refusing what no cache has (a kind past fp8, no heads, no dims).
  static KVFormat checked(int64_t kind, int64_t heads, int64_t dim, int64_t elem_bytes) {
    TORCH_CHECK(kind >= kPlain && kind <= kFp8, "kv_format must be 0 (plain), 1 (int8) or 2 (fp8), not ", kind);
    TORCH_CHECK(heads > 0 && dim > 0, "a KV cache needs kv heads and a head dim > 0, not ", heads, " and ", dim);
    return KVFormat(static_cast<Kind>(kind), heads, dim, elem_bytes);
  }

  bool quantized() const { return kind != kPlain; }
  float max_code() const { return kind == kInt8 ? 127.f : 448.f; }

  // Offsets of K/V codes and scales of head h within a token.
  int64_t code_offset(int kv, int64_t h) const { return (kv * heads + h) * dim * (quantized() ? 1 : elem_bytes); }
  int64_t scale_offset(int kv, int64_t h) const { return 2 * heads * dim + (kv * heads + h) * 4; }

  template <typename T>
  void store_token(uint8_t* dst, const T* k, const T* v) const {
    if (!quantized()) {
      std::memcpy(dst, k, heads * dim * sizeof(T));
      std::memcpy(dst + heads * dim * sizeof(T), v, heads * dim * sizeof(T));
      return;
    }
    for (int kv = 0; kv < 2; ++kv) {
      const T* src = kv == 0 ? k : v;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = src + h * dim;
        float amax = 0.f;
        for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
        const float scale = amax / max_code();
        const float inv = amax > 0.f ? max_code() / amax : 0.f;
        uint8_t* codes = dst + code_offset(kv, h);
        if (kind == kInt8) {
          for (int64_t d = 0; d < dim; ++d) {
            codes[d] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(static_cast<float>(x[d]) * inv)));
          }
        } else {
          for (int64_t d = 0; d < dim; ++d) codes[d] = c10::Float8_e4m3fn(static_cast<float>(x[d]) * inv).x;
        }
        std::memcpy(dst + scale_offset(kv, h), &scale, 4);
      }
    }
  }

  float scale(const uint8_t* token, int kv, int64_t h) const {
    float s;
    std::memcpy(&s, token + scale_offset(kv, h), 4);
    return s;
  }
};

// fp8 e4m3 -> fp32 through fp16: e4m3 bits s.eeee.mmm placed as fp16 s.0eeee.mmm0000000 have
// the same mantissa and an exponent 8 smaller (biases 7 vs 15), for normal and subnormal
// values alike; the factor 2^8 is folded into the caller's scale.
constexpr float kFp8ViaHalfFactor = 256.f;
inline uint16_t fp8_as_half_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
}

}  // namespace pdserve
