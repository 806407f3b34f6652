// Ran on one H200 (2026-11-26). See multi_tensor_adam.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "fused_device.cuh"
#include "kernel_math.hpp"
#include "multi_tensor_adam.cuh"
#include "multi_tensor_device.cuh"
#include "optim/multi_tensor_plan.hpp"

namespace megart::cuda {

namespace {

using multi_tensor::kChunk;
using multi_tensor::kIlp;
using multi_tensor::kThreads;

// Kernel arguments are passed by value (see multi_tensor_device.cuh for their limit): one launch
// covers up to kMaxTensors tensors and kMaxBlocks chunks.
constexpr int kMaxTensors = 64;
constexpr int kMaxBlocks = 2048;
constexpr int kStepThreads = 256;
constexpr int kMaxSteps = 448;  // step counters per advance_steps launch (under 4 KiB)
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
static_assert(sizeof(AdamLaunch<float>) + sizeof(AdamHyper) + 16 < multi_tensor::kMaxArgumentBytes,
              "kernel arguments over the limit");

struct StepLaunch {
  float* step[kMaxSteps];
};
static_assert(sizeof(StepLaunch) + 2 * sizeof(int*) < 4000,
              "kernel arguments must stay under 4 KiB");

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
// count. Each step of a thread moves kIlp elements: one 128-bit load and store of each fp32
// array (the 16-bit gradient and model copy move 64 bits), when every array of the tensor is
// 16-byte aligned; otherwise, and for the tail, one element at a time.
template <typename Model, bool kDecoupled>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(AdamLaunch<Model> args, int entries, AdamHyper h, const int* found_inf) {
  if (skipped(found_inf)) return;
  constexpr bool kHasModel = !std::is_same<Model, float>::value;
  for (int e = blockIdx.x; e < entries; e += gridDim.x) {
    const int t = args.block_map.slot[e];
    const int64_t begin = static_cast<int64_t>(args.block_map.chunk[e]) * kChunk;
    const int64_t end = min(begin + kChunk, args.size[t]);
    const math::AdamCoefficients c =
        math::adam_coefficients(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, *args.step[t]);
    float* param = args.param[t];
    float* exp_avg = args.exp_avg[t];
    float* exp_avg_sq = args.exp_avg_sq[t];
    const Model* grad = args.grad[t];
    Model* model = args.model[t];
    const bool vectorise = multi_tensor::aligned(param, 16) && multi_tensor::aligned(exp_avg, 16) &&
                           multi_tensor::aligned(exp_avg_sq, 16) &&
                           multi_tensor::aligned(grad, 16) &&
                           (!kHasModel || multi_tensor::aligned(model, 16));
    math::for_each_in_chunk<kIlp>(begin, end, vectorise, threadIdx.x, blockDim.x,
                                  [&](int64_t i, auto width) {
                                    constexpr int W = decltype(width)::value;
                                    float g[W];
                                    float p[W];
                                    float m[W];
                                    float v[W];
                                    fused::load<W>(grad + i, g);
                                    fused::load<W>(param + i, p);
                                    fused::load<W>(exp_avg + i, m);
                                    fused::load<W>(exp_avg_sq + i, v);
#pragma unroll
                                    for (int k = 0; k < W; ++k)
                                      math::adam_update<kDecoupled>(g[k], p[k], m[k], v[k], c);
                                    fused::store<W>(param + i, p);
                                    fused::store<W>(exp_avg + i, m);
                                    fused::store<W>(exp_avg_sq + i, v);
                                    if constexpr (kHasModel) fused::store<W>(model + i, p);
                                  });
  }
}

cudaError_t launch_steps(float* const* steps, int count, const int* found_inf,
                         cudaStream_t stream) {
  for (int first = 0; first < count; first += kMaxSteps) {
    StepLaunch args{};
    const int n = count - first < kMaxSteps ? count - first : kMaxSteps;
    for (int i = 0; i < n; ++i) args.step[i] = steps[first + i];
    const int blocks = (n + kStepThreads - 1) / kStepThreads;
    advance_steps<<<blocks, kStepThreads, 0, stream>>>(args, n, found_inf);
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
  int resident = 0;
  const cudaError_t err = decoupled
                              ? multi_tensor::resident_blocks<adam_kernel<Model, true>>(&resident)
                              : multi_tensor::resident_blocks<adam_kernel<Model, false>>(&resident);
  if (err != cudaSuccess) return err;
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
        const int grid = multi_tensor::grid_for(plan.blocks, resident);
        if (decoupled) {
          adam_kernel<Model, true>
              <<<grid, kThreads, 0, stream>>>(args, plan.blocks, hyper, found_inf);
        } else {
          adam_kernel<Model, false>
              <<<grid, kThreads, 0, stream>>>(args, plan.blocks, hyper, found_inf);
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
