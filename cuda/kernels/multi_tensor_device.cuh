// What the multi-tensor kernels (Adam, scale) share: their chunk and block sizes, and the grid
// that fills the device. Only .cu files include this.
//
// The shape follows torch's multi-tensor apply: 64K-element chunks, 512 threads, 4 elements per
// thread per step (one 128-bit load of fp32), so that each thread keeps several loads in flight.
// Unlike torch, a launch's grid is sized from the SM count: the block map of a launch lists its
// chunks, and a grid of at most one full wave of resident blocks walks them, so a long list of
// tensors fills the GPU instead of stopping at a fixed number of blocks per launch.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace megart::cuda::multi_tensor {

constexpr int64_t kChunk = 65536;  // elements per block-map entry
constexpr int kThreads = 512;
constexpr int kIlp = 4;  // elements per thread per step: 128 bits of fp32

// Kernel arguments up to 32764 bytes are accepted from CUDA 12.1 on every architecture megart
// builds for (sm_80, sm_90); the launches stay well under it.
constexpr size_t kMaxArgumentBytes = 32764;

__host__ __device__ __forceinline__ bool aligned(const void* p, int bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(bytes) == 0;
}

// Blocks of kKernel (kThreads threads each) resident at once on the current device: SMs times
// blocks per SM, at least 1. Cached per kernel and device (it never changes for a process).
template <auto kKernel>
cudaError_t resident_blocks(int* blocks) {
  static std::atomic<int> cached[64] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= 0 && device < 64) {
    if (const int known = cached[device].load(std::memory_order_relaxed); known > 0) {
      *blocks = known;
      return cudaSuccess;
    }
  }
  int sms = 0;
  int per_sm = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, 0);
  }
  if (err != cudaSuccess) return err;
  *blocks = (sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  if (device >= 0 && device < 64) cached[device].store(*blocks, std::memory_order_relaxed);
  return cudaSuccess;
}

inline int grid_for(int entries, int resident) { return entries < resident ? entries : resident; }

}  // namespace megart::cuda::multi_tensor
