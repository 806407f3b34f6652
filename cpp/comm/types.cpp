#include "comm/types.hpp"

#include <array>

#include "common/error.hpp"

namespace megart::comm {

namespace {
constexpr std::array<const char*, 7> kDTypes = {"float32", "float16", "bfloat16", "float64",
                                                "int32",   "int64",   "uint8"};
constexpr std::array<std::size_t, 7> kSizes = {4, 2, 2, 8, 4, 8, 1};
constexpr std::array<const char*, 4> kOps = {"sum", "avg", "max", "min"};
}  // namespace

std::size_t dtype_size(DType t) { return kSizes[static_cast<int>(t)]; }
const char* dtype_name(DType t) { return kDTypes[static_cast<int>(t)]; }
const char* reduce_op_name(ReduceOp op) { return kOps[static_cast<int>(op)]; }

DType dtype_from_name(const std::string& name) {
  for (size_t i = 0; i < kDTypes.size(); ++i) {
    if (name == kDTypes[i]) return static_cast<DType>(i);
  }
  throw ConfigError("dtype " + name +
                    " cannot be communicated; use float32, float16, bfloat16, float64, int32, "
                    "int64 or uint8");
}

ReduceOp reduce_op_from_name(const std::string& name) {
  for (size_t i = 0; i < kOps.size(); ++i) {
    if (name == kOps[i]) return static_cast<ReduceOp>(i);
  }
  throw ConfigError("unknown reduction '" + name + "'; use sum, avg, max or min");
}

std::string split_mismatch(const Buffer& whole, const Buffer& part, int size,
                           const char* whole_name, const char* part_name) {
  const std::size_t expected = part.count * static_cast<std::size_t>(size);
  if (whole.count == expected && whole.dtype == part.dtype) return "";
  return std::string("the ") + whole_name + " must hold size x " + part_name + " = " +
         std::to_string(expected) + " elements of the " + part_name + "'s dtype, not " +
         std::to_string(whole.count);
}

}  // namespace megart::comm
