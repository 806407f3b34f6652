// bf16 and fp16 as the core stores them (uint16_t bit patterns), and exact, round-to-nearest-
// even conversions to and from float, matching torch's. Shared by the reductions and the
// optimizer sweeps.
#pragma once

#include <cstdint>
#include <cstring>

namespace megart {

// Storage tags: the element type in memory, converted to float for arithmetic. Plain structs
// (not enums) so the sweeps are templates the compiler specialises and vectorises per type.
struct BF16 {
  uint16_t bits;
};
struct FP16 {
  uint16_t bits;
};

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float to_float(float x) { return x; }

// bf16 is the top half of a float: widening is a shift.
inline float to_float(BF16 x) { return float_of(static_cast<uint32_t>(x.bits) << 16); }

inline float to_float(FP16 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1Fu;
  const uint32_t mantissa = x.bits & 0x3FFu;
  if (exponent == 0x1F) return float_of(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in float.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  return float_of(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Round to nearest even, as torch does, so a bf16 copy equals param.to(torch.bfloat16).
inline void store(float* out, float x) { *out = x; }

inline void store(BF16* out, float x) {
  const uint32_t u = bits_of(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    out->bits = static_cast<uint16_t>((u >> 16) | 0x40u);  // keep NaN a (quiet) NaN
    return;
  }
  // Adding 0x7FFF plus the lowest kept bit rounds half-way cases to the even neighbour.
  out->bits = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline void store(FP16* out, float x) {
  const uint32_t u = bits_of(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  uint16_t h;
  if (magnitude > 0x7F800000u) {
    h = 0x7E00;  // NaN
  } else if (magnitude >= 0x477FF000u) {
    h = 0x7C00;  // inf, or finite values that round past 65504
  } else if (magnitude >= 0x38800000u) {
    // Normal half: rebias the exponent (127 -> 15) and round 23 mantissa bits to 10, to even.
    const uint32_t rebased = magnitude - 0x38000000u;
    h = static_cast<uint16_t>((rebased + 0xFFFu + ((rebased >> 13) & 1u)) >> 13);
  } else {
    // Subnormal half (units of 2^-24) or zero. Adding 2^23 to a float below 2^10 leaves the
    // value rounded to an integer (to even) in the low mantissa bits; 1024 lands on the smallest
    // normal's encoding, which is also right.
    const float scaled = float_of(magnitude) * 0x1p24f + 0x1p23f;
    h = static_cast<uint16_t>(bits_of(scaled) - 0x4B000000u);
  }
  out->bits = static_cast<uint16_t>(sign | h);
}

}  // namespace megart
