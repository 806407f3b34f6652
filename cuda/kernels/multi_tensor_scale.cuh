// out[i] = in[i] * scale over many tensors in few launches, flagging any non-finite input.
// Used for fp16 loss scaling (unscale the gradients, skip the step on overflow).
//
// Ran on one H200 (2026-11-26): tests/test_optim_cuda.py and tests/test_kernels.py pass there.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megart::cuda {

// Element type of the scaled tensors (in and out alike); the product is formed in fp32.
enum class ScaleType { kFloat32, kBFloat16, kFloat16 };

// in, out and sizes describe `count` tensors of `type` (out may alias in). Sets
// *found_nonfinite to 1 when any input element is inf or NaN, and never clears it, so one flag
// can gather several calls. Returns the first CUDA error of the launches.
cudaError_t multi_tensor_scale(const void* const* in, void* const* out, const int64_t* sizes,
                               int count, ScaleType type, float scale, int* found_nonfinite,
                               cudaStream_t stream);

}  // namespace megart::cuda
