// Device helpers shared by the fused and multi-tensor kernels: fp32 conversion of the element
// types, 16-byte packed loads and stores, and block-wide reductions. The loops that split a
// range into whole packs and scalar elements are kernel_math.hpp's (unit-tested on the host).
// Only .cu files include this.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "fused_ops.cuh"
#include "kernel_math.hpp"

namespace megart::cuda::fused {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

using math::for_each_piece;
using math::kPack;
using math::Width;

// W elements of T viewed as one unsigned integer type of the same size, so that a load or store
// of a 16-byte pack compiles to a single 128-bit instruction (LDG.E.128 / STG.E.128). Copying a
// struct of T[W] member by member let the compiler split the store into four 32-bit ones;
// tests/test_cuda_sass.py checks the built module's SASS for this.
template <int kBytes>
struct RawOf;
template <>
struct RawOf<16> {
  using type = uint4;
};
template <>
struct RawOf<8> {
  using type = uint2;
};
template <>
struct RawOf<4> {
  using type = unsigned int;
};
template <>
struct RawOf<2> {
  using type = unsigned short;
};

template <typename T, int W>
union Vec {
  using Raw = typename RawOf<W* static_cast<int>(sizeof(T))>::type;
  Raw raw;
  T v[W];
};

// A plain assignment through a uint4 pointer still came out as four 32-bit stores in the
// LayerNorm kernels (nvcc 13, sm_80 and sm_90; the SASS test shows it); the write-back store
// intrinsic is inline PTX st.global.wb.v4, one instruction with ordinary (write-back) caching.
// Its asm has a memory clobber, so the compiler does not move other memory accesses across it.
template <typename Raw>
__device__ __forceinline__ void store_raw(Raw* p, const Raw& raw) {
  if constexpr (sizeof(Raw) >= 4) {
    __stwb(p, raw);
  } else {
    *p = raw;
  }
}

// Loads W consecutive elements as floats; p is aligned to W * sizeof(T) bytes (16 for a pack).
template <int W, typename T>
__device__ __forceinline__ void load(const T* p, float (&out)[W]) {
  if constexpr (W == 1) {
    out[0] = to_float(*p);
  } else {
    Vec<T, W> vec;
    vec.raw = *reinterpret_cast<const typename Vec<T, W>::Raw*>(p);
#pragma unroll
    for (int k = 0; k < W; ++k) out[k] = to_float(vec.v[k]);
  }
}

template <int W, typename T>
__device__ __forceinline__ void store(T* p, const float (&in)[W]) {
  if constexpr (W == 1) {
    *p = from_float<T>(in[0]);
  } else {
    Vec<T, W> vec;
#pragma unroll
    for (int k = 0; k < W; ++k) vec.v[k] = from_float<T>(in[k]);
    store_raw(reinterpret_cast<typename Vec<T, W>::Raw*>(p), vec.raw);
  }
}

// The block's threads split one row between them.
template <typename T, typename F>
__device__ __forceinline__ void for_each_in_row(const T* row, int64_t n, bool vectorise, F&& f) {
  for_each_piece(row, n, vectorise, threadIdx.x, blockDim.x, f);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Sum (or max) over the block, returned to every thread. blockDim.x is a multiple of 32 and
// scratch holds 32 floats. The first barrier lets a previous call's readers finish with scratch;
// the barriers also make the block's earlier global writes visible to all of its threads.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
  v = kMax ? warp_max(v) : warp_sum(v);
  const int lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  const float identity = kMax ? -INFINITY : 0.0f;
  v = lane < warps ? scratch[lane] : identity;
  return kMax ? warp_max(v) : warp_sum(v);
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  return block_reduce<false>(v, scratch);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  return block_reduce<true>(v, scratch);
}

// Calls f(T{}) for the element type, so one generic lambda instantiates each kernel once per type.
template <typename F>
cudaError_t dispatch(FusedType type, F&& f) {
  switch (type) {
    case FusedType::kFloat32:
      return f(float{});
    case FusedType::kBFloat16:
      return f(__nv_bfloat16{});
    case FusedType::kFloat16:
      return f(__half{});
  }
  return cudaErrorInvalidValue;
}

// Kernels with one block per row launch `rows` blocks in x: at most 2^31 - 1 of them.
constexpr int64_t kMaxRows = 2147483647;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t misalignment(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16; }

// Threads for a block that handles one row of `n` elements in packs of `pack`: enough warps to
// give each thread about one pack, between one warp and 512 threads.
inline int row_threads(int64_t n, int pack) {
  const int64_t warps = ceil_div(ceil_div(n, pack), 32);
  return static_cast<int>(32 * (warps < 1 ? 1 : (warps > 16 ? 16 : warps)));
}

}  // namespace megart::cuda::fused
