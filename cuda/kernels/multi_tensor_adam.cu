// UNVERIFIED: never run (no GPU where it was written). See multi_tensor_adam.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernel_math.hpp"
#include "multi_tensor_adam.cuh"
#include "optim/multi_tensor_plan.hpp"

namespace megart::cuda {

namespace {

// As in multi_tensor_scale.cu: kernel arguments stay under the 4 KiB every supported
// architecture accepts, so one launch covers up to kMaxTensors tensors and kMaxBlocks chunks.
constexpr int kMaxTensors = 32;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 16384;  // elements per block
constexpr int kThreads = 256;
constexpr int kMaxSteps = 448;  // step counters per advance_steps launch
using Plan = optim::MultiTensorLaunch<kMaxTensors, kMaxBlocks>;

template <typename Model>
struct AdamLaunch {
  float* param[kMaxTensors];
  Model* model[kMaxTensors];
  const Model* grad[kMaxTensors];
  float* exp_avg[kMaxTensors];
  float* exp_avg_sq[kMaxTensors];
  const float* step[kMaxTensors];
  int64_t size[kMaxTensors];
  optim::MultiTensorBlockMap<kMaxBlocks> block_map;
};
static_assert(sizeof(AdamLaunch<float>) + sizeof(AdamHyper) + sizeof(int*) < 4000,
              "kernel arguments must stay under 4 KiB");

struct StepLaunch {
  float* step[kMaxSteps];
};
static_assert(sizeof(StepLaunch) + 2 * sizeof(int*) < 4000,
              "kernel arguments must stay under 4 KiB");

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store(__half* p, float x) { *p = __float2half_rn(x); }

__device__ __forceinline__ bool skipped(const int* found_inf) {
  return found_inf != nullptr && *found_inf != 0;
}

// Runs before the Adam launches on the same stream, so they read the advanced counts.
__global__ void advance_steps(StepLaunch args, int count, const int* found_inf) {
  if (skipped(found_inf)) return;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) *args.step[i] += 1.0f;
}

// torch.optim.Adam/AdamW's update (kernel_math.hpp's adam_update; see cpp/optim/adam.cpp for
// the op-by-op form), with the bias corrections computed in double from the device-side step
// count.
template <typename Model, bool kDecoupled>
__global__ void adam_kernel(AdamLaunch<Model> args, AdamHyper h, const int* found_inf) {
  if (skipped(found_inf)) return;
  const int t = args.block_map.slot[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(args.block_map.chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, args.size[t]);

  const math::AdamCoefficients c =
      math::adam_coefficients(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, *args.step[t]);
  float* param = args.param[t];
  float* exp_avg = args.exp_avg[t];
  float* exp_avg_sq = args.exp_avg_sq[t];
  const Model* grad = args.grad[t];
  Model* model = args.model[t];
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float p = param[i];
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    math::adam_update<kDecoupled>(load(grad + i), p, m, v, c);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (!std::is_same<Model, float>::value) store(model + i, p);
  }
}

cudaError_t launch_steps(float* const* steps, int count, const int* found_inf,
                         cudaStream_t stream) {
  for (int first = 0; first < count; first += kMaxSteps) {
    StepLaunch args{};
    const int n = count - first < kMaxSteps ? count - first : kMaxSteps;
    for (int i = 0; i < n; ++i) args.step[i] = steps[first + i];
    advance_steps<<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(args, n, found_inf);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename Model>
cudaError_t launch_adam(float* const* params, void* const* model_params, const void* const* grads,
                        float* const* exp_avgs, float* const* exp_avg_sqs, float* const* steps,
                        const int64_t* sizes, int count, const AdamHyper& hyper,
                        const int* found_inf, cudaStream_t stream) {
  const bool decoupled = hyper.decoupled_weight_decay || hyper.weight_decay == 0.0;
  return optim::plan_multi_tensor<kMaxTensors, kMaxBlocks>(
      sizes, count, kChunk, cudaSuccess, [&](const Plan& plan) {
        AdamLaunch<Model> args{};
        args.block_map = plan.block_map;
        for (int slot = 0; slot < plan.tensors; ++slot) {
          const int t = plan.tensor[slot];
          args.param[slot] = params[t];
          args.model[slot] =
              model_params == nullptr ? nullptr : static_cast<Model*>(model_params[t]);
          args.grad[slot] = static_cast<const Model*>(grads[t]);
          args.exp_avg[slot] = exp_avgs[t];
          args.exp_avg_sq[slot] = exp_avg_sqs[t];
          args.step[slot] = steps[t];
          args.size[slot] = sizes[t];
        }
        if (decoupled) {
          adam_kernel<Model, true><<<plan.blocks, kThreads, 0, stream>>>(args, hyper, found_inf);
        } else {
          adam_kernel<Model, false><<<plan.blocks, kThreads, 0, stream>>>(args, hyper, found_inf);
        }
        return cudaGetLastError();
      });
}

}  // namespace

cudaError_t multi_tensor_adam(float* const* params, void* const* model_params,
                              const void* const* grads, float* const* exp_avgs,
                              float* const* exp_avg_sqs, float* const* steps, const int64_t* sizes,
                              int count, AdamModelType model_type, const AdamHyper& hyper,
                              const int* found_inf, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (const cudaError_t err = launch_steps(steps, count, found_inf, stream); err != cudaSuccess) {
    return err;
  }
  switch (model_type) {
    case AdamModelType::kFloat32:
      return launch_adam<float>(params, nullptr, grads, exp_avgs, exp_avg_sqs, steps, sizes, count,
                                hyper, found_inf, stream);
    case AdamModelType::kBFloat16:
      return launch_adam<__nv_bfloat16>(params, model_params, grads, exp_avgs, exp_avg_sqs, steps,
                                        sizes, count, hyper, found_inf, stream);
    case AdamModelType::kFloat16:
      return launch_adam<__half>(params, model_params, grads, exp_avgs, exp_avg_sqs, steps, sizes,
                                 count, hyper, found_inf, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace megart::cuda
