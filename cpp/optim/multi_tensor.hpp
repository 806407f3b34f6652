// Multi-tensor helpers for gradient clipping and loss scaling, on raw CPU buffers of one dtype.
#pragma once

#include <cstdint>
#include <vector>

#include "optim/dtype.hpp"

namespace megart::optim {

struct TensorRef {
  void* data = nullptr;
  int64_t size = 0;
};

// Sum of squares of every element of every tensor, accumulated in double (the caller takes the
// square root, after summing across ranks when the tensors are sharded). inf or NaN inputs give
// inf or NaN.
double sum_of_squares(const std::vector<TensorRef>& tensors, DType dtype, int threads = 0);

// out[i] = in[i] * scale for each pair of tensors (out may be in itself), rounding to the
// dtype. Returns true when any input element is inf or NaN; every element is still written.
bool scale(const std::vector<TensorRef>& in, const std::vector<TensorRef>& out, DType dtype,
           float scale, int threads = 0);

}  // namespace megart::optim
