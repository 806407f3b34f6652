// Typed device buffers for the stand-in tests: values are made as doubles that the dtype holds
// exactly, so the float64 reference sees the very inputs the transport moved.
#pragma once

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "comm/types.hpp"
#include "common/half.hpp"

namespace megart::standin {

inline double get(const void* p, std::size_t i, comm::DType t) {
  switch (t) {
    case comm::DType::Float32:
      return static_cast<const float*>(p)[i];
    case comm::DType::Float16:
      return to_float(static_cast<const FP16*>(p)[i]);
    case comm::DType::BFloat16:
      return to_float(static_cast<const BF16*>(p)[i]);
    case comm::DType::Float64:
      return static_cast<const double*>(p)[i];
    case comm::DType::Int32:
      return static_cast<const std::int32_t*>(p)[i];
    case comm::DType::Int64:
      return static_cast<double>(static_cast<const std::int64_t*>(p)[i]);
    case comm::DType::UInt8:
      return static_cast<const std::uint8_t*>(p)[i];
  }
  return 0;
}

inline void put(void* p, std::size_t i, comm::DType t, double v) {
  switch (t) {
    case comm::DType::Float32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      return;
    case comm::DType::Float16:
      store(static_cast<FP16*>(p) + i, static_cast<float>(v));
      return;
    case comm::DType::BFloat16:
      store(static_cast<BF16*>(p) + i, static_cast<float>(v));
      return;
    case comm::DType::Float64:
      static_cast<double*>(p)[i] = v;
      return;
    case comm::DType::Int32:
      static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v);
      return;
    case comm::DType::Int64:
      static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v);
      return;
    case comm::DType::UInt8:
      static_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(v);
      return;
  }
}

inline bool is_float(comm::DType t) {
  return t == comm::DType::Float32 || t == comm::DType::Float16 || t == comm::DType::BFloat16 ||
         t == comm::DType::Float64;
}

// Unit roundoff of the type (0 for integers: their results are exact).
inline double eps(comm::DType t) {
  switch (t) {
    case comm::DType::Float32:
      return std::ldexp(1.0, -24);
    case comm::DType::Float16:
      return std::ldexp(1.0, -11);
    case comm::DType::BFloat16:
      return std::ldexp(1.0, -8);
    case comm::DType::Float64:
      return std::ldexp(1.0, -53);
    default:
      return 0;
  }
}

// Inputs of rank `rank`: floats in [-4, 4) rounded to the type, integers small enough that
// sums of a few ranks stay exact and in range (uint8: 0..50).
inline std::vector<double> inputs(int rank, std::size_t n, comm::DType t, unsigned seed) {
  std::mt19937 rng(seed * 7919u + static_cast<unsigned>(rank));
  std::vector<double> out(n);
  std::vector<char> cell(8);
  for (auto& v : out) {
    double x = is_float(t) ? std::uniform_real_distribution<double>(-4, 4)(rng)
                           : static_cast<double>(rng() % 51);
    if (is_float(t) && t != comm::DType::Float64) {
      put(cell.data(), 0, t, x);
      x = get(cell.data(), 0, t);
    }
    v = x;
  }
  return out;
}

// |got - want| <= tol, tol growing with the number of roundings a reduction over `terms` makes.
inline bool close(double got, double want, double magnitude, comm::DType t, int terms) {
  const double tol = (terms + 1) * eps(t) * std::max(1.0, magnitude);
  return std::fabs(got - want) <= tol;
}

}  // namespace megart::standin
