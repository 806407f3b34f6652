// The per-element arithmetic and index splitting of megart's CUDA kernels, in functions that also
// compile as plain C++ (no CUDA types, no CUDA headers), so that the C++ unit tests
// (cpp/tests/test_kernel_math.cpp) check them against float64 on machines without a GPU. The
// kernels convert bf16/fp16 to float before calling these.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define MEGART_HOST_DEVICE __host__ __device__ __forceinline__
#define MEGART_UNROLL _Pragma("unroll")
#else
#define MEGART_HOST_DEVICE inline
#define MEGART_UNROLL
#endif

namespace megart::cuda::math {

// ---- Splitting a range for 16-byte packed loads ----------------------------------------------

// Elements of T per 16-byte load.
template <typename T>
constexpr int kPack = 16 / static_cast<int>(sizeof(T));

template <int W>
using Width = std::integral_constant<int, W>;

// Calls f(i, Width<1>) or f(i, Width<kPack<T>>) so that together the calls of all threads cover
// [0, n) once: thread `first` of `stride` threads takes every stride-th piece. Packs start where
// `anchor` + i is 16-byte aligned; the elements before (head) and after (tail) go one by one.
// With vectorise false (the arrays f touches are not aligned alike) every element goes alone.
// `anchor` must be aligned to its element size (true of every torch tensor's data pointer).
template <typename T, typename F>
MEGART_HOST_DEVICE void for_each_piece(const T* anchor, int64_t n, bool vectorise, int64_t first,
                                       int64_t stride, F&& f) {
  constexpr int kV = kPack<T>;
  int64_t head = n;
  if (vectorise) {
    const auto misaligned = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(anchor) % 16);
    head = misaligned == 0 ? 0 : (16 - misaligned) / static_cast<int64_t>(sizeof(T));
    head = head < n ? head : n;
  }
  const int64_t packs = (n - head) / kV;
  const int64_t tail = head + packs * kV;
  for (int64_t i = first; i < head; i += stride) f(i, Width<1>{});
  for (int64_t p = first; p < packs; p += stride) f(head + p * kV, Width<kV>{});
  for (int64_t i = tail + first; i < n; i += stride) f(i, Width<1>{});
}

// Calls f(i, Width<W>) or f(i, Width<1>) so that together the calls of all threads cover
// [begin, end) once (the multi-tensor kernels' chunks). With vectorise (every array the caller
// touches is aligned for W elements at `begin`, so at begin + any multiple of W) whole packs of W
// go first, then the tail one by one; without it every element goes alone.
template <int W, typename F>
MEGART_HOST_DEVICE void for_each_in_chunk(int64_t begin, int64_t end, bool vectorise, int64_t first,
                                          int64_t stride, F&& f) {
  const int64_t packs = vectorise ? (end - begin) / W : 0;
  for (int64_t p = first; p < packs; p += stride) f(begin + p * W, Width<W>{});
  for (int64_t i = begin + packs * W + first; i < end; i += stride) f(i, Width<1>{});
}

// ---- Multi-tensor scale (fp16 loss scaling) --------------------------------------------------

// out = x * scale, and whether x was inf or NaN (the overflow check of loss scaling).
MEGART_HOST_DEVICE float scale_element(float x, float scale, bool& nonfinite) {
  nonfinite = nonfinite || !std::isfinite(x);
  return x * scale;
}

// ---- GeLU, tanh approximation (as GPT-2) -----------------------------------------------------

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// 0.5 z (1 + tanh(u)) written as z sigmoid(2u), u = sqrt(2/pi) (z + c z^3): the same function,
// but 1 + tanh(u) cancels for negative z (relative error eps / (1 + tanh u), 2e-3 at z = -4, all
// of it by z = -9), while 1 / (1 + exp(-2u)) keeps every element's relative error within a few
// ulp times (1 + |u|), the conditioning of exp (an H100 test found one fp32 element 2.3e-5 off).
MEGART_HOST_DEVICE float gelu_exp_minus_2u(float z) {
  return expf(-2.0f * kSqrt2OverPi * (z + kGeluCubic * z * z * z));
}

MEGART_HOST_DEVICE float gelu_tanh(float z) { return z / (1.0f + gelu_exp_minus_2u(z)); }

// d gelu / dz = s + 2 z s (1 - s) u'(z), s = sigmoid(2u), u' = sqrt(2/pi) (1 + 3 c z^2): the
// tanh form's 0.5 (1 + t) + 0.5 z (1 - t^2) u' with 1 + t = 2s, 1 - t^2 = 4 s (1 - s). 1 - s is
// taken as e s (e = exp(-2u)) where s >= 1/2, so that it does not cancel either; where s < 1/2,
// e may be infinite, and 1 - s is exact enough.
MEGART_HOST_DEVICE float gelu_tanh_grad(float z) {
  const float e = gelu_exp_minus_2u(z);
  const float s = 1.0f / (1.0f + e);
  const float one_minus_s = s < 0.5f ? 1.0f - s : e * s;
  return s + 2.0f * z * s * one_minus_s * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * z * z);
}

// Bias add + GeLU: the forward output and the input gradient of one element.
MEGART_HOST_DEVICE float bias_gelu(float x, float bias) { return gelu_tanh(x + bias); }

MEGART_HOST_DEVICE float bias_gelu_grad(float grad, float x, float bias) {
  return grad * gelu_tanh_grad(x + bias);
}

// ---- LayerNorm of one row (the kernels split the row's sums over a block) --------------------

// 1 / sqrt(x): the fast hardware reciprocal square root on the device, the exact one on the host.
MEGART_HOST_DEVICE float reciprocal_sqrt(float x) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(x);
#else
  return 1.0f / std::sqrt(x);
#endif
}

// rstd from the row's sum of squared deviations from its mean (the second of two passes, so no
// cancellation when a few values are far larger than the rest).
MEGART_HOST_DEVICE float layer_norm_rstd(float sum_squared_deviations, int64_t n, float eps) {
  return reciprocal_sqrt(sum_squared_deviations / static_cast<float>(n) + eps);
}

MEGART_HOST_DEVICE float layer_norm_output(float v, float mean, float rstd, float weight,
                                           float bias) {
  return (v - mean) * rstd * weight + bias;
}

// The backward's first pass over a row, one element: adds to the row sums of g = dy * weight and
// g * xhat that the second pass needs, and to this column's weight and bias gradients.
struct LayerNormGradSums {
  float g = 0.0f;
  float g_xhat = 0.0f;
};

MEGART_HOST_DEVICE void layer_norm_grad_accumulate(float dy, float v, float weight, float mean,
                                                   float rstd, LayerNormGradSums& sums,
                                                   float& dweight, float& dbias) {
  const float xhat = (v - mean) * rstd;
  sums.g += dy * weight;
  sums.g_xhat += dy * weight * xhat;
  dweight += dy * xhat;
  dbias += dy;
}

// The second pass, one element: d loss / d v = rstd (g - mean(g) - xhat mean(g xhat)), plus the
// gradient that reached the residual sum directly (`extra`, 0 without one).
MEGART_HOST_DEVICE float layer_norm_input_grad(float dy, float v, float weight, float mean,
                                               float rstd, float mean_g, float mean_g_xhat,
                                               float extra) {
  const float xhat = (v - mean) * rstd;
  return rstd * (dy * weight - mean_g - xhat * mean_g_xhat) + extra;
}

// ---- Online softmax statistics (cross-entropy) -----------------------------------------------

constexpr float kLog2e = 1.4426950408889634f;

// One thread's running maximum and sum of exp(v - max) over the values it has seen, rescaled
// whenever the maximum grows. -inf values (padded vocabulary ids) add nothing; while only -inf
// has been seen the sum stays 0, which keeps -inf - -inf out of it. A NaN value makes the sum
// NaN, as torch's logsumexp would be: fmaxf skips NaN, so without the flag a NaN in a pack of
// otherwise -inf values would vanish and the loss would come out finite.
struct SoftmaxPartial {
  float maximum = -INFINITY;
  float sum = 0.0f;
  bool saw_nan = false;

  template <int W>
  MEGART_HOST_DEVICE void add(const float (&v)[W]) {
    float top = maximum;
    MEGART_UNROLL
    for (int k = 0; k < W; ++k) top = fmaxf(top, v[k]);
    if (top == -INFINITY) {  // every value is -inf or NaN
      MEGART_UNROLL
      for (int k = 0; k < W; ++k) saw_nan = saw_nan || std::isnan(v[k]);
      return;
    }
    if (top > maximum) {
      sum = maximum == -INFINITY ? 0.0f : sum * exp2f((maximum - top) * kLog2e);
      maximum = top;
    }
    MEGART_UNROLL
    for (int k = 0; k < W; ++k) sum += exp2f((v[k] - maximum) * kLog2e);
  }

  // This partial's sum rescaled to a maximum `top` >= maximum (the block's or the group's).
  MEGART_HOST_DEVICE float sum_at(float top) const {
    if (saw_nan) return NAN;
    return maximum == -INFINITY ? 0.0f : sum * exp2f((maximum - top) * kLog2e);
  }
};

// Cross-entropy backward, one logit: softmax(v) * grad_loss - onehot * grad_loss, from the row's
// (all-reduced) maximum `top` and scale = grad_loss / sum of exponentials.
MEGART_HOST_DEVICE float cross_entropy_grad(float v, float top, float scale, float grad_loss,
                                            bool is_target) {
  return exp2f((v - top) * kLog2e) * scale - (is_target ? grad_loss : 0.0f);
}

// ---- Adam / AdamW ----------------------------------------------------------------------------

// The scalars of one tensor's update: torch.optim.Adam/AdamW's, with the bias corrections
// computed in double from the tensor's step count (already advanced for this step), then
// rounded to float once.
struct AdamCoefficients {
  float neg_step_size;  // -lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float decay;          // AdamW: 1 - lr * weight_decay
  float weight_decay;   // Adam: the L2 term added to the gradient
  float w1;             // lerp weight of the first moment: 1 - beta1
  float beta2;
  float one_minus_beta2;
  float eps;
};

MEGART_HOST_DEVICE AdamCoefficients adam_coefficients(double lr, double beta1, double beta2,
                                                      double eps, double weight_decay,
                                                      double step) {
  const double bias_correction1 = 1.0 - pow(beta1, step);
  const double bias_correction2 = 1.0 - pow(beta2, step);
  AdamCoefficients c;
  c.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  c.bc2_sqrt = static_cast<float>(sqrt(bias_correction2));
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.weight_decay = static_cast<float>(weight_decay);
  c.w1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  return c;
}

// One element: p (fp32 parameter or main weight), m and v (the moments) updated in place from
// the gradient g. AdamW (kDecoupled) decays p before the update; Adam adds weight_decay * p to g.
template <bool kDecoupled>
MEGART_HOST_DEVICE void adam_update(float g, float& p, float& m, float& v,
                                    const AdamCoefficients& c) {
  if (kDecoupled) {
    p *= c.decay;
  } else {
    g = fmaf(c.weight_decay, p, g);
  }
  // torch's lerp: the formula anchored at the nearer end.
  m = c.w1 < 0.5f ? fmaf(c.w1, g - m, m) : fmaf(c.w1 - 1.0f, g - m, g);
  v = fmaf(c.one_minus_beta2 * g, g, v * c.beta2);
  const float denom = sqrtf(v) / c.bc2_sqrt + c.eps;
  p = p + c.neg_step_size * m / denom;
}

}  // namespace megart::cuda::math
