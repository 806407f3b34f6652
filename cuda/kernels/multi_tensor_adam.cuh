// Multi-tensor Adam/AdamW on the GPU: few launches for many tensors, the step counts and an
// overflow flag read on the device, so a training step never waits on the host.
//
// Ran on one H200 (2026-11-26): tests/test_optim_cuda.py, which compares it with
// torch.optim.AdamW(fused=True), passes there (speed in bench/RESULTS.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megart::cuda {

// dtype of the model parameters and gradients; fp32 main weights and moments in every case.
enum class AdamModelType { kFloat32, kBFloat16, kFloat16 };

struct AdamHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool decoupled_weight_decay;  // AdamW when true, Adam (L2 added to the gradient) when false
};

// One step over `count` tensors, all on the current device, in the order of the stream:
//  - steps[i] (torch's per-parameter float32 step tensor) is incremented on the device;
//  - params[i] (fp32 parameter, or fp32 main weights when model_type is 16-bit), exp_avgs[i],
//    exp_avg_sqs[i] (fp32) are updated from grads[i] (model_type), and for 16-bit types
//    model_params[i] receives the rounded new weights in the same pass (model_params is ignored
//    for kFloat32 and may be null).
// When found_inf is not null and the int32 it points to is nonzero when the kernels run, nothing
// changes, step counts included. Returns the first CUDA error of the launches.
cudaError_t multi_tensor_adam(float* const* params, void* const* model_params,
                              const void* const* grads, float* const* exp_avgs,
                              float* const* exp_avg_sqs, float* const* steps, const int64_t* sizes,
                              int count, AdamModelType model_type, const AdamHyper& hyper,
                              const int* found_inf, cudaStream_t stream);

}  // namespace megart::cuda
