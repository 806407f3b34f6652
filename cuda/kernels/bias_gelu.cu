// Ran on one H200 (2026-11-26). See fused_ops.cuh.
//
// Bias add + GeLU (tanh approximation, as GPT-2) in one elementwise pass: the unfused form
// writes x + bias to memory and reads it back. The bias gradient is a column sum of grad_x,
// which torch's reduction does well, so the backward kernel stops at grad_x.
#include "fused_device.cuh"

namespace megart::cuda {

namespace {

using fused::for_each_piece;
using fused::load;
using fused::store;

constexpr int kThreads = 256;

// The bias of W consecutive elements starting at flat index i (one modulo per piece). With
// bias_packs (x and bias 16-byte aligned, rows a whole number of 16-byte packs) a pack of x
// never spans two rows and its bias is one aligned pack too: one 128-bit load.
template <int W, typename T>
__device__ __forceinline__ void load_bias(float (&b)[W], const T* bias, int64_t i, int64_t hidden,
                                          bool bias_packs) {
  int64_t c = i % hidden;
  if constexpr (W > 1) {
    if (bias_packs) {
      fused::load<W>(bias + c, b);
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < W; ++k) {
    b[k] = fused::to_float(bias[c]);
    if (++c == hidden) c = 0;
  }
}

template <typename T>
bool bias_in_packs(const void* x, const void* bias, int64_t hidden) {
  // x aligned too: otherwise rows start mid-pack and a pack of x can span two rows.
  return (hidden * static_cast<int64_t>(sizeof(T))) % 16 == 0 && fused::misalignment(x) == 0 &&
         fused::misalignment(bias) == 0;
}

template <typename T>
__global__ void bias_gelu_forward_kernel(const T* x, const T* bias, T* out, int64_t n,
                                         int64_t hidden, bool vectorise, bool bias_packs) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for_each_piece(x, n, vectorise, first, stride, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load<W>(x + i, v);
    float b[W];
    load_bias<W>(b, bias, i, hidden, bias_packs);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = math::bias_gelu(v[k], b[k]);
    store<W>(out + i, v);
  });
}

template <typename T>
__global__ void bias_gelu_backward_kernel(const T* grad, const T* x, const T* bias, T* grad_x,
                                          int64_t n, int64_t hidden, bool vectorise,
                                          bool bias_packs) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for_each_piece(x, n, vectorise, first, stride, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    float g[W];
    load<W>(x + i, v);
    load<W>(grad + i, g);
    float b[W];
    load_bias<W>(b, bias, i, hidden, bias_packs);
#pragma unroll
    for (int k = 0; k < W; ++k) g[k] = math::bias_gelu_grad(g[k], v[k], b[k]);
    store<W>(grad_x + i, g);
  });
}

// Enough blocks for one piece per thread, capped: the loop is grid-strided.
int elementwise_blocks(int64_t n, int pack) {
  const int64_t blocks = fused::ceil_div(fused::ceil_div(n, pack), kThreads);
  return static_cast<int>(blocks < 65536 ? blocks : 65536);
}

}  // namespace

cudaError_t bias_gelu_forward(const void* x, const void* bias, void* out, int64_t n, int64_t hidden,
                              FusedType type, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (hidden <= 0 || n % hidden != 0) return cudaErrorInvalidValue;
  return fused::dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    const bool vectorise = fused::misalignment(x) == fused::misalignment(out);
    bias_gelu_forward_kernel<T><<<elementwise_blocks(n, fused::kPack<T>), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(out), n, hidden,
        vectorise, bias_in_packs<T>(x, bias, hidden));
    return cudaGetLastError();
  });
}

cudaError_t bias_gelu_backward(const void* grad, const void* x, const void* bias, void* grad_x,
                               int64_t n, int64_t hidden, FusedType type, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (hidden <= 0 || n % hidden != 0) return cudaErrorInvalidValue;
  return fused::dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    const int64_t m = fused::misalignment(x);
    const bool vectorise = fused::misalignment(grad) == m && fused::misalignment(grad_x) == m;
    bias_gelu_backward_kernel<T><<<elementwise_blocks(n, fused::kPack<T>), kThreads, 0, stream>>>(
        static_cast<const T*>(grad), static_cast<const T*>(x), static_cast<const T*>(bias),
        static_cast<T*>(grad_x), n, hidden, vectorise, bias_in_packs<T>(x, bias, hidden));
    return cudaGetLastError();
  });
}

}  // namespace megart::cuda
