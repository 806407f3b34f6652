// Element types the optimizer sweeps understand, and scalar conversions between the 16-bit
// formats and float. The core sees raw buffers, so bf16 and fp16 travel as uint16_t bit patterns.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "common/error.hpp"
#include "common/half.hpp"

namespace megart::optim {

enum class DType { kFloat32, kBFloat16, kFloat16 };

inline DType dtype_from_name(const std::string& name) {
  if (name == "float32") return DType::kFloat32;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "float16") return DType::kFloat16;
  throw ConfigError("unsupported dtype '" + name + "': use float32, bfloat16 or float16");
}

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
  }
  return "?";
}

// The 16-bit storage types and their conversions live in common/half.hpp.
using megart::BF16;
using megart::bits_of;
using megart::float_of;
using megart::FP16;
using megart::store;
using megart::to_float;

}  // namespace megart::optim
