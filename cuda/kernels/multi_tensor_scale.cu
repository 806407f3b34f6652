#include "multi_tensor_scale.cuh"

namespace megart::cuda {

namespace {

// Kernel arguments are passed by value; these capacities keep them under the 4 KiB that every
// supported architecture accepts. A launch covers up to kMaxTensors tensors and kMaxBlocks
// chunks; longer lists take more launches.
constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 16384;  // elements per block
constexpr int kThreads = 256;

struct Launch {
  const float* in[kMaxTensors];
  float* out[kMaxTensors];
  int64_t size[kMaxTensors];
  unsigned char block_tensor[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};
static_assert(sizeof(Launch) < 4000, "kernel arguments must stay under 4 KiB");

__global__ void scale_kernel(Launch args, float scale, int* found_nonfinite) {
  const int t = args.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(args.block_chunk[blockIdx.x]) * kChunk;
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
  Launch args{};
  int tensors = 0;
  int blocks = 0;
  auto flush = [&]() -> cudaError_t {
    if (blocks > 0) {
      scale_kernel<<<blocks, kThreads, 0, stream>>>(args, scale, found_nonfinite);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    tensors = 0;
    blocks = 0;
    return cudaSuccess;
  };
  for (int t = 0; t < count; ++t) {
    if (sizes[t] == 0) continue;
    if (tensors == kMaxTensors) {
      if (const cudaError_t err = flush(); err != cudaSuccess) return err;
    }
    args.in[tensors] = in[t];
    args.out[tensors] = out[t];
    args.size[tensors] = sizes[t];
    const int64_t chunks = (sizes[t] + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      args.block_tensor[blocks] = static_cast<unsigned char>(tensors);
      args.block_chunk[blocks] = static_cast<int>(c);
      if (++blocks == kMaxBlocks) {
        // The tensor may continue in the next launch: keep its slot as slot 0 there.
        const bool more = c + 1 < chunks;
        if (const cudaError_t err = flush(); err != cudaSuccess) return err;
        if (more) {
          args.in[0] = in[t];
          args.out[0] = out[t];
          args.size[0] = sizes[t];
          tensors = 0;
        } else {
          tensors = -1;  // incremented below to 0
        }
      }
    }
    ++tensors;
  }
  return flush();
}

}  // namespace megart::cuda
