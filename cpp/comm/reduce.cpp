// Element-wise reductions across n buffers. Loops are simple so the compiler vectorises them.
#include <algorithm>
#include <cstring>

#include "comm/types.hpp"

namespace megart::comm {

namespace {

float bf16_to_float(std::uint16_t h) {
  const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::uint16_t float_to_bf16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<std::uint16_t>(bits >> 16);
}

float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf or nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::uint16_t float_to_fp16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // nan
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf
  if (abs < 0x38800000u) {                        // subnormal or zero in half
    if (abs < 0x33000000u) return sign;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);
    const std::uint32_t half = mant >> shift;
    const std::uint32_t rest = mant & ((1u << shift) - 1);
    const std::uint32_t mid = 1u << (shift - 1);
    const bool up = rest > mid || (rest == mid && (half & 1u));
    return sign | static_cast<std::uint16_t>(half + (up ? 1 : 0));
  }
  std::uint32_t h = ((abs >> 13) - (112u << 10));
  const std::uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<std::uint16_t>(h);
}

template <typename T>
struct Native {
  using Acc = T;
  static Acc load(T x) { return x; }
  static T store(Acc x) { return x; }
};
struct BF16 {
  using Acc = float;
  static Acc load(std::uint16_t x) { return bf16_to_float(x); }
  static std::uint16_t store(Acc x) { return float_to_bf16(x); }
};
struct FP16 {
  using Acc = float;
  static Acc load(std::uint16_t x) { return fp16_to_float(x); }
  static std::uint16_t store(Acc x) { return float_to_fp16(x); }
};

template <typename T, typename Conv>
void reduce_typed(void* out_v, const void* const* srcs_v, int n, std::size_t count, ReduceOp op) {
  using Acc = typename Conv::Acc;
  T* out = static_cast<T*>(out_v);
  constexpr std::size_t kBlock = 1024;  // accumulate a block at a time: out may alias a source
  Acc acc[kBlock];
  for (std::size_t base = 0; base < count; base += kBlock) {
    const std::size_t len = std::min(kBlock, count - base);
    const T* first = static_cast<const T*>(srcs_v[0]) + base;
    for (std::size_t i = 0; i < len; ++i) acc[i] = Conv::load(first[i]);
    for (int q = 1; q < n; ++q) {
      const T* src = static_cast<const T*>(srcs_v[q]) + base;
      switch (op) {
        case ReduceOp::Sum:
        case ReduceOp::Avg:
          for (std::size_t i = 0; i < len; ++i) acc[i] += Conv::load(src[i]);
          break;
        case ReduceOp::Max:
          for (std::size_t i = 0; i < len; ++i) acc[i] = std::max(acc[i], Conv::load(src[i]));
          break;
        case ReduceOp::Min:
          for (std::size_t i = 0; i < len; ++i) acc[i] = std::min(acc[i], Conv::load(src[i]));
          break;
      }
    }
    if (op == ReduceOp::Avg) {
      for (std::size_t i = 0; i < len; ++i) acc[i] = static_cast<Acc>(acc[i] / static_cast<Acc>(n));
    }
    for (std::size_t i = 0; i < len; ++i) out[base + i] = Conv::store(acc[i]);
  }
}

}  // namespace

void reduce(void* out, const void* const* srcs, int n, std::size_t count, DType t, ReduceOp op) {
  switch (t) {
    case DType::Float32:
      return reduce_typed<float, Native<float>>(out, srcs, n, count, op);
    case DType::Float64:
      return reduce_typed<double, Native<double>>(out, srcs, n, count, op);
    case DType::Float16:
      return reduce_typed<std::uint16_t, FP16>(out, srcs, n, count, op);
    case DType::BFloat16:
      return reduce_typed<std::uint16_t, BF16>(out, srcs, n, count, op);
    case DType::Int32:
      return reduce_typed<std::int32_t, Native<std::int32_t>>(out, srcs, n, count, op);
    case DType::Int64:
      return reduce_typed<std::int64_t, Native<std::int64_t>>(out, srcs, n, count, op);
    case DType::UInt8:
      return reduce_typed<std::uint8_t, Native<std::uint8_t>>(out, srcs, n, count, op);
  }
}

}  // namespace megart::comm
