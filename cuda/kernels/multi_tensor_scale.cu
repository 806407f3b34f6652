// Ran on one H200 (2026-11-26). See multi_tensor_scale.cuh.
#include "fused_device.cuh"
#include "kernel_math.hpp"
#include "multi_tensor_device.cuh"
#include "multi_tensor_scale.cuh"
#include "optim/multi_tensor_plan.hpp"

namespace megart::cuda {

namespace {

using multi_tensor::kChunk;
using multi_tensor::kThreads;

// Kernel arguments are passed by value (see multi_tensor_device.cuh for their limit). A launch
// covers up to kMaxTensors tensors and kMaxBlocks chunks; longer lists take more launches.
constexpr int kMaxTensors = 110;
constexpr int kMaxBlocks = 2048;
using Plan = optim::MultiTensorLaunch<kMaxTensors, kMaxBlocks>;

template <typename T>
struct Launch {
  const T* in[kMaxTensors];
  T* out[kMaxTensors];
  int64_t size[kMaxTensors];
  optim::MultiTensorBlockMap<kMaxBlocks> block_map;
};
static_assert(sizeof(Launch<float>) + 16 < multi_tensor::kMaxArgumentBytes,
              "kernel arguments over the limit");

// One 128-bit load and store per step: 4 fp32 or 8 bf16/fp16 elements.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    scale_kernel(Launch<T> args, int entries, float scale, int* found_nonfinite) {
  constexpr int kW = math::kPack<T>;
  bool bad = false;
  for (int e = blockIdx.x; e < entries; e += gridDim.x) {
    const int t = args.block_map.slot[e];
    const int64_t begin = static_cast<int64_t>(args.block_map.chunk[e]) * kChunk;
    const int64_t end = min(begin + kChunk, args.size[t]);
    const T* in = args.in[t];
    T* out = args.out[t];
    const bool vectorise = multi_tensor::aligned(in, 16) && multi_tensor::aligned(out, 16);
    math::for_each_in_chunk<kW>(begin, end, vectorise, threadIdx.x, blockDim.x,
                                [&](int64_t i, auto width) {
                                  constexpr int W = decltype(width)::value;
                                  float v[W];
                                  fused::load<W>(in + i, v);
#pragma unroll
                                  for (int k = 0; k < W; ++k) {
                                    v[k] = math::scale_element(v[k], scale, bad);
                                  }
                                  fused::store<W>(out + i, v);
                                });
  }
  // One write per warp that saw a non-finite value; the flag only ever goes to 1.
  if (__any_sync(0xffffffffu, bad) && (threadIdx.x % 32) == 0) *found_nonfinite = 1;
}

template <typename T>
cudaError_t launch_scale(const void* const* in, void* const* out, const int64_t* sizes, int count,
                         float scale, int* found_nonfinite, cudaStream_t stream) {
  int resident = 0;
  if (const cudaError_t err = multi_tensor::resident_blocks<scale_kernel<T>>(&resident);
      err != cudaSuccess) {
    return err;
  }
  return optim::plan_multi_tensor<kMaxTensors, kMaxBlocks>(
      sizes, count, kChunk, cudaSuccess, [&](const Plan& plan) {
        Launch<T> args{};
        args.block_map = plan.block_map;
        for (int slot = 0; slot < plan.tensors; ++slot) {
          const int t = plan.tensor[slot];
          args.in[slot] = static_cast<const T*>(in[t]);
          args.out[slot] = static_cast<T*>(out[t]);
          args.size[slot] = sizes[t];
        }
        const int grid = multi_tensor::grid_for(plan.blocks, resident);
        scale_kernel<T><<<grid, kThreads, 0, stream>>>(args, plan.blocks, scale, found_nonfinite);
        return cudaGetLastError();
      });
}

}  // namespace

cudaError_t multi_tensor_scale(const void* const* in, void* const* out, const int64_t* sizes,
                               int count, ScaleType type, float scale, int* found_nonfinite,
                               cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  switch (type) {
    case ScaleType::kFloat32:
      return launch_scale<float>(in, out, sizes, count, scale, found_nonfinite, stream);
    case ScaleType::kBFloat16:
      return launch_scale<__nv_bfloat16>(in, out, sizes, count, scale, found_nonfinite, stream);
    case ScaleType::kFloat16:
      return launch_scale<__half>(in, out, sizes, count, scale, found_nonfinite, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace megart::cuda
