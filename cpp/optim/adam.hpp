// Multi-tensor Adam and AdamW on the CPU: one pass over param, grad and both moments per element,
// all tensors of a call in one sweep split across threads. Follows torch.optim.Adam/AdamW
// (maximize=False, amsgrad=False) operation by operation, so fp32 trajectories match torch's.
#pragma once

#include <cstdint>
#include <vector>

#include "optim/dtype.hpp"

namespace megart::optim {

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // true: AdamW (param *= 1 - lr * weight_decay); false: Adam (grad += weight_decay * param).
  bool decoupled_weight_decay = true;
  bool amsgrad = false;  // not supported: raises ConfigError
};

// One parameter's buffers, all with `size` elements and contiguous.
struct AdamTensor {
  // The fp32 parameter, or the fp32 main weights of a low-precision parameter.
  float* param = nullptr;
  // The bf16/fp16 model copy written in the same pass; nullptr when the parameter is fp32.
  void* model_param = nullptr;
  // In the model parameter's dtype (fp32 when there is no low-precision copy).
  const void* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  // torch's per-parameter step count (a float32 scalar): incremented here before use.
  float* step = nullptr;
  int64_t size = 0;
};

// Applies one step to every tensor. `model_dtype` is the dtype of grad and model_param:
// kFloat32 means plain fp32 parameters (model_param must be null). threads <= 0 picks
// automatically (see resolve_threads).
void adam_step(const std::vector<AdamTensor>& tensors, DType model_dtype,
               const AdamOptions& options, int threads = 0);

}  // namespace megart::optim
