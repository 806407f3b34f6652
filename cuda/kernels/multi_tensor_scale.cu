#include "multi_tensor_scale.cuh"
#include "optim/multi_tensor_plan.hpp"

namespace megart::cuda {

namespace {

// Kernel arguments are passed by value; these capacities keep them under the 4 KiB that every
// supported architecture accepts. A launch covers up to kMaxTensors tensors and kMaxBlocks
// chunks; longer lists take more launches.
constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 16384;  // elements per block
constexpr int kThreads = 256;
using Plan = optim::MultiTensorLaunch<kMaxTensors, kMaxBlocks>;

struct Launch {
  const float* in[kMaxTensors];
  float* out[kMaxTensors];
  int64_t size[kMaxTensors];
  optim::MultiTensorBlockMap<kMaxBlocks> block_map;
};
static_assert(sizeof(Launch) < 4000, "kernel arguments must stay under 4 KiB");

__global__ void scale_kernel(Launch args, float scale, int* found_nonfinite) {
  const int t = args.block_map.slot[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(args.block_map.chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, args.size[t]);
  const float* in = args.in[t];
  float* out = args.out[t];
  bool bad = false;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float x = in[i];
    bad |= !isfinite(x);
    out[i] = x * scale;
  }
  // One write per warp that saw a non-finite value; the flag only ever goes to 1.
  if (__any_sync(0xffffffffu, bad) && (threadIdx.x % 32) == 0) *found_nonfinite = 1;
}

}  // namespace

cudaError_t multi_tensor_scale(const float* const* in, float* const* out, const int64_t* sizes,
                               int count, float scale, int* found_nonfinite, cudaStream_t stream) {
  return optim::plan_multi_tensor<kMaxTensors, kMaxBlocks>(
      sizes, count, kChunk, cudaSuccess, [&](const Plan& plan) {
        Launch args{};
        args.block_map = plan.block_map;
        for (int slot = 0; slot < plan.tensors; ++slot) {
          const int t = plan.tensor[slot];
          args.in[slot] = in[t];
          args.out[slot] = out[t];
          args.size[slot] = sizes[t];
        }
        scale_kernel<<<plan.blocks, kThreads, 0, stream>>>(args, scale, found_nonfinite);
        return cudaGetLastError();
      });
}

}  // namespace megart::cuda
