// out[i] = in[i] * scale over many tensors in few launches, flagging any non-finite input.
// Used for fp16 loss scaling (unscale the gradients, skip the step on overflow).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megart::cuda {

// in, out and sizes describe `count` float32 tensors (out may alias in). Sets *found_nonfinite
// to 1 when any input element is inf or NaN, and never clears it, so one flag can gather several
// calls. Returns the first CUDA error of the launches.
cudaError_t multi_tensor_scale(const float* const* in, float* const* out, const int64_t* sizes,
                               int count, float scale, int* found_nonfinite, cudaStream_t stream);

}  // namespace megart::cuda
