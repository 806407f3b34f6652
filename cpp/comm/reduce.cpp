// Element-wise reductions across n buffers. Loops are simple so the compiler vectorises them.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "comm/types.hpp"
#include "common/half.hpp"

namespace megart::comm {

namespace {

template <typename T>
struct Native {
  using Acc = T;
  static Acc load(T x) { return x; }
  static T store(Acc x) { return x; }
};
// 16-bit floats combine in float32, rounded once at the end.
template <typename Half>
struct Widened {
  using Acc = float;
  static Acc load(Half x) { return to_float(x); }
  static Half store(Acc x) {
    Half h;
    megart::store(&h, x);
    return h;
  }
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
      return reduce_typed<FP16, Widened<FP16>>(out, srcs, n, count, op);
    case DType::BFloat16:
      return reduce_typed<BF16, Widened<BF16>>(out, srcs, n, count, op);
    case DType::Int32:
      return reduce_typed<std::int32_t, Native<std::int32_t>>(out, srcs, n, count, op);
    case DType::Int64:
      return reduce_typed<std::int64_t, Native<std::int64_t>>(out, srcs, n, count, op);
    case DType::UInt8:
      return reduce_typed<std::uint8_t, Native<std::uint8_t>>(out, srcs, n, count, op);
  }
}

}  // namespace megart::comm
