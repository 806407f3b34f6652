// Ran on one H200 (2026-11-26). See fused_ops.cuh.
//
// The per-token work of vocab-parallel cross-entropy, without a second buffer the size of the
// logits. The forward reads each row once, keeping a running maximum and a sum of exponentials
// rescaled whenever the maximum grows (an online softmax), and picks out the target's logit.
// Between the two kernels the caller all-reduces the three numbers per token across the
// tensor-parallel group. The backward overwrites the logits with their gradient, so the forward
// saves nothing the size of the logits either.
#include "fused_device.cuh"

namespace megart::cuda {

namespace {

using fused::for_each_in_row;
using fused::load;
using fused::store;

template <typename T>
__global__ void cross_entropy_forward_kernel(const T* logits, const int64_t* target, float* row_max,
                                             float* sum_exp, float* target_logit, int64_t vocab,
                                             int64_t start) {
  __shared__ float scratch[32];
  const T* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  // This thread's running maximum and sum of exponentials (see SoftmaxPartial for -inf and NaN).
  math::SoftmaxPartial part;
  for_each_in_row(row, vocab, true, [&](int64_t j, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load<W>(row + j, v);
    part.add(v);
  });
  const float block_top = fused::block_max(part.maximum, scratch);
  const float total = fused::block_sum(part.sum_at(block_top), scratch);
  if (threadIdx.x == 0) {
    row_max[blockIdx.x] = block_top;
    sum_exp[blockIdx.x] = total;
    const int64_t t = target[blockIdx.x] - start;
    target_logit[blockIdx.x] = (t >= 0 && t < vocab) ? fused::to_float(row[t]) : 0.0f;
  }
}

template <typename T>
__global__ void cross_entropy_backward_kernel(T* logits, const int64_t* target, const float* max,
                                              const float* sum_exp, const float* grad_loss,
                                              int64_t vocab, int64_t start) {
  T* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  const float top = max[blockIdx.x];
  const float g = grad_loss[blockIdx.x];
  const float scale = g / sum_exp[blockIdx.x];
  const int64_t t = target[blockIdx.x] - start;  // outside [0, vocab): not on this rank
  for_each_in_row(row, vocab, true, [&](int64_t j, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load<W>(row + j, v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      v[k] = math::cross_entropy_grad(v[k], top, scale, g, j + k == t);
    }
    store<W>(row + j, v);
  });
}

// One block per row of `vocab` logits: calls launch(T{}, blocks, threads) for the element type.
template <typename Launch>
cudaError_t per_row(int64_t rows, int64_t vocab, FusedType type, Launch&& launch) {
  if (rows == 0) return cudaSuccess;
  if (rows < 0 || rows > fused::kMaxRows || vocab <= 0) return cudaErrorInvalidValue;
  return fused::dispatch(type, [&](auto tag) {
    launch(tag, static_cast<unsigned>(rows),
           fused::row_threads(vocab, fused::kPack<decltype(tag)>));
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t vocab_cross_entropy_forward(const void* logits, const int64_t* target, float* row_max,
                                        float* sum_exp, float* target_logit, int64_t rows,
                                        int64_t vocab, int64_t start, FusedType type,
                                        cudaStream_t stream) {
  return per_row(rows, vocab, type, [&](auto tag, unsigned blocks, int threads) {
    using T = decltype(tag);
    cross_entropy_forward_kernel<T><<<blocks, threads, 0, stream>>>(
        static_cast<const T*>(logits), target, row_max, sum_exp, target_logit, vocab, start);
  });
}

cudaError_t vocab_cross_entropy_backward(void* logits, const int64_t* target, const float* max,
                                         const float* sum_exp, const float* grad_loss, int64_t rows,
                                         int64_t vocab, int64_t start, FusedType type,
                                         cudaStream_t stream) {
  return per_row(rows, vocab, type, [&](auto tag, unsigned blocks, int threads) {
    using T = decltype(tag);
    cross_entropy_backward_kernel<T><<<blocks, threads, 0, stream>>>(
        static_cast<T*>(logits), target, max, sum_exp, grad_loss, vocab, start);
  });
}

}  // namespace megart::cuda
