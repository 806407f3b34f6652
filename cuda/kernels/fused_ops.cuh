// Fused kernels for a GPT layer: bias + GeLU (tanh), LayerNorm with the residual add, and the
// per-token parts of vocab-parallel cross-entropy. Host declarations only (the bindings include
// this from plain C++). Inputs are fp32, bf16 or fp16; arithmetic and statistics are fp32.
//
// Ran on one H200 (2026-11-26): tests/test_fused_kernels_cuda.py, which compares each with a
// float64 torch reference, passes there (speed in bench/RESULTS.md); their per-element math
// (kernel_math.hpp) is unit-tested on the host (cpp/tests).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megart::cuda {

// Element type of the tensors a fused kernel reads and writes (statistics are always fp32).
enum class FusedType { kFloat32, kBFloat16, kFloat16 };

// Every pointer is a contiguous device buffer on the current device; every launch goes to
// `stream`. Each function returns the first CUDA error of its launches (cudaSuccess otherwise).

// out = gelu_tanh(x + bias), x and out [n / hidden, hidden], bias [hidden]. out may alias x.
cudaError_t bias_gelu_forward(const void* x, const void* bias, void* out, int64_t n, int64_t hidden,
                              FusedType type, cudaStream_t stream);

// grad_x = grad * gelu_tanh'(x + bias); the bias gradient is grad_x summed over rows (left to
// the caller). grad_x may alias grad.
cudaError_t bias_gelu_backward(const void* grad, const void* x, const void* bias, void* grad_x,
                               int64_t n, int64_t hidden, FusedType type, cudaStream_t stream);

// s = x + residual (rounded to the element type and written to sum when residual is not null),
// then out = (s - mean) * rstd * weight + bias over each row of `hidden` elements, as
// torch.nn.functional.layer_norm. mean and rstd (fp32, [rows]) are kept for the backward.
// residual/sum and bias may be null.
cudaError_t add_layer_norm_forward(const void* x, const void* residual, const void* weight,
                                   const void* bias, void* out, void* sum, float* mean, float* rstd,
                                   int64_t rows, int64_t hidden, float eps, FusedType type,
                                   cudaStream_t stream);

// How many blocks add_layer_norm_backward uses for `rows` rows: its workspace holds a [blocks,
// hidden] fp32 partial gradient for the weight (and another for the bias). 0 when a block's
// shared-memory accumulators for `hidden` columns do not fit this device. The device's limits
// are looked up once per device and shape, so calling this per backward costs no runtime call.
int add_layer_norm_backward_blocks(int64_t rows, int64_t hidden, bool has_bias, FusedType type);

// From grad_out and the forward's input s (the sum), mean and rstd: grad_in = d loss / d s, plus
// grad_sum when not null (the gradient that reached the sum through the residual stream), and
// the weight's (and, when grad_bias is not null, the bias's) gradient [hidden] in the element
// type. workspace is fp32, blocks * hidden elements (twice that with a bias), overwritten;
// `blocks` comes from add_layer_norm_backward_blocks.
cudaError_t add_layer_norm_backward(const void* grad_out, const void* grad_sum, const void* s,
                                    const void* weight, const float* mean, const float* rstd,
                                    void* grad_in, void* grad_weight, void* grad_bias,
                                    float* workspace, int64_t rows, int64_t hidden, int blocks,
                                    FusedType type, cudaStream_t stream);

// One pass over each row of logits [rows, vocab] (this rank's vocabulary slice, ids
// [start, start + vocab)): row_max, sum_exp = sum(exp(logit - row_max)) (0 for a row of -inf,
// NaN for a row holding a NaN, whose row_max skips it) and target_logit = logits[target - start]
// when that id is in this slice, else 0 (fp32 [rows]).
cudaError_t vocab_cross_entropy_forward(const void* logits, const int64_t* target, float* row_max,
                                        float* sum_exp, float* target_logit, int64_t rows,
                                        int64_t vocab, int64_t start, FusedType type,
                                        cudaStream_t stream);

// Overwrites logits with the gradient (exp(logit - max) / sum_exp - onehot(target)) * grad_loss
// row by row, from the all-reduced max and sum_exp (fp32 [rows]); grad_loss is fp32 [rows].
cudaError_t vocab_cross_entropy_backward(void* logits, const int64_t* target, const float* max,
                                         const float* sum_exp, const float* grad_loss, int64_t rows,
                                         int64_t vocab, int64_t start, FusedType type,
                                         cudaStream_t stream);

}  // namespace megart::cuda
