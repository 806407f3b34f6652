// The NCCL stand-in's element values: NCCL's data types loaded and stored through double, and
// the reductions over them.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/half.hpp"
#include "nccl_standin_state.hpp"

namespace nccl_standin {

std::size_t type_size(int t) {
  switch (t) {
    case kInt8:
    case kUint8:
      return 1;
    case kF16:
    case kBf16:
      return 2;
    case kInt32:
    case kUint32:
    case kF32:
      return 4;
    case kInt64:
    case kUint64:
    case kF64:
      return 8;
  }
  return 0;
}

namespace {

double load(const void* p, std::size_t i, int t) {
  switch (t) {
    case kInt8:
      return static_cast<const std::int8_t*>(p)[i];
    case kUint8:
      return static_cast<const std::uint8_t*>(p)[i];
    case kInt32:
      return static_cast<const std::int32_t*>(p)[i];
    case kUint32:
      return static_cast<const std::uint32_t*>(p)[i];
    case kInt64:
      return static_cast<double>(static_cast<const std::int64_t*>(p)[i]);
    case kUint64:
      return static_cast<double>(static_cast<const std::uint64_t*>(p)[i]);
    case kF16:
      return megart::to_float(static_cast<const megart::FP16*>(p)[i]);
    case kBf16:
      return megart::to_float(static_cast<const megart::BF16*>(p)[i]);
    case kF32:
      return static_cast<const float*>(p)[i];
    case kF64:
      return static_cast<const double*>(p)[i];
  }
  return 0;
}

void store(void* p, std::size_t i, int t, double v) {
  switch (t) {
    case kInt8:
      static_cast<std::int8_t*>(p)[i] = static_cast<std::int8_t>(v);
      return;
    case kUint8:
      static_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(v);
      return;
    case kInt32:
      static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v);
      return;
    case kUint32:
      static_cast<std::uint32_t*>(p)[i] = static_cast<std::uint32_t>(v);
      return;
    case kInt64:
      static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v);
      return;
    case kUint64:
      static_cast<std::uint64_t*>(p)[i] = static_cast<std::uint64_t>(v);
      return;
    case kF16:
      megart::store(static_cast<megart::FP16*>(p) + i, static_cast<float>(v));
      return;
    case kBf16:
      megart::store(static_cast<megart::BF16*>(p) + i, static_cast<float>(v));
      return;
    case kF32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      return;
    case kF64:
      static_cast<double*>(p)[i] = v;
      return;
  }
}

}  // namespace

void reduce_into(void* out, const std::vector<const void*>& in, std::size_t count, int t, int op) {
  std::vector<double> acc(count);
  for (std::size_t i = 0; i < count; ++i) {
    double a = load(in[0], i, t);
    for (std::size_t r = 1; r < in.size(); ++r) {
      const double b = load(in[r], i, t);
      switch (op) {
        case kSum:
        case kAvg:
          a += b;
          break;
        case kProd:
          a *= b;
          break;
        case kMax:
          a = std::max(a, b);
          break;
        case kMin:
          a = std::min(a, b);
          break;
      }
    }
    if (op == kAvg) a /= static_cast<double>(in.size());
    acc[i] = a;
  }
  for (std::size_t i = 0; i < count; ++i) store(out, i, t, acc[i]);
}

}  // namespace nccl_standin
