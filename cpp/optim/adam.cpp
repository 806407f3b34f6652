#include "optim/adam.hpp"

#include <cmath>
#include <string>
#include <type_traits>

#include "common/error.hpp"
#include "optim/parallel.hpp"

namespace megart::optim {

namespace {

// Scalars shared by every tensor of a call, rounded to float once, as torch rounds its Python
// scalars when it applies them to float tensors.
struct GroupScalars {
  float weight_decay;
  float w1;            // lerp weight of the first moment: 1 - beta1
  float w1_minus_one;  // for torch's lerp formula when w1 >= 0.5
  float beta2;
  float one_minus_beta2;
  float eps;
};

// Scalars that depend on a tensor's own step count (torch keeps one count per parameter).
struct TensorScalars {
  float decay;          // AdamW: 1 - lr * weight_decay
  float neg_step_size;  // -lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
};

// a * b + c, fused into one rounding where torch's vectorised kernels fuse it (their fmadd),
// separate where they are not.
template <bool kFma>
__attribute__((always_inline)) inline float madd(float a, float b, float c) {
  if constexpr (kFma) {
    return std::fma(a, b, c);
  } else {
    return a * b + c;
  }
}

// One element range of one tensor. Each statement is one torch op of _single_tensor_adam, in
// its order, rounded as torch's CPU kernels round it (which of them fuse a multiply-add was
// checked element by element against torch 2.13):
//   param.mul_(1 - lr*wd)                       | grad = grad.add(param, alpha=wd)   [fused]
//   exp_avg.lerp_(grad, 1 - beta1)                                                   [fused]
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)                     [fused add]
//   denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
//   param.addcdiv_(exp_avg, denom, value=-step_size)                                 [not fused]
// torch's vectorised sqrt is not always correctly rounded, so about one element in 150 still
// differs by an ulp in denom: trajectories agree closely, not bit for bit.
// The loop has no branches that depend on data, so the compiler vectorises it.
template <typename Model, bool kDecoupled, bool kSmallWeight, bool kFma>
__attribute__((always_inline)) inline void sweep_loop(float* __restrict param,
                                                      float* __restrict exp_avg,
                                                      float* __restrict exp_avg_sq,
                                                      const Model* __restrict grad,
                                                      Model* __restrict copy, int64_t n,
                                                      const GroupScalars g, const TensorScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    float gi = to_float(grad[i]);
    float pi = param[i];
    if constexpr (kDecoupled) {
      pi = pi * s.decay;
    } else {
      gi = madd<kFma>(g.weight_decay, pi, gi);
    }
    float mi = exp_avg[i];
    // torch's lerp switches formula at weight 0.5 to stay accurate for both ends.
    if constexpr (kSmallWeight) {
      mi = madd<kFma>(g.w1, gi - mi, mi);
    } else {
      mi = madd<kFma>(g.w1_minus_one, gi - mi, gi);
    }
    const float vi = madd<kFma>(g.one_minus_beta2 * gi, gi, exp_avg_sq[i] * g.beta2);
    const float denom = std::sqrt(vi) / s.bc2_sqrt + g.eps;
    pi = pi + s.neg_step_size * mi / denom;
    param[i] = pi;
    exp_avg[i] = mi;
    exp_avg_sq[i] = vi;
    if constexpr (!std::is_same_v<Model, float>) store(copy + i, pi);
  }
}

// x86-64 builds carry a second copy of the loop compiled for AVX2 and FMA (8 floats a vector
// instead of SSE2's 4), picked at run time, so the default build runs on any x86-64 CPU. At two
// threads the SSE2 loop is bound by sqrt and division, the AVX2 one by memory bandwidth.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MEGART_ADAM_AVX2 1
#endif

// The buffers arrive as restrict parameters and the scalars by value, so the compiler knows no
// store in the loop changes a scalar or another buffer and vectorises without runtime checks.
template <typename Model, bool kDecoupled, bool kSmallWeight>
void sweep_baseline(float* __restrict param, float* __restrict exp_avg,
                    float* __restrict exp_avg_sq, const Model* __restrict grad,
                    Model* __restrict copy, int64_t n, const GroupScalars g,
                    const TensorScalars s) {
  sweep_loop<Model, kDecoupled, kSmallWeight, false>(param, exp_avg, exp_avg_sq, grad, copy, n, g,
                                                     s);
}

#ifdef MEGART_ADAM_AVX2
template <typename Model, bool kDecoupled, bool kSmallWeight>
__attribute__((target("avx2,fma"))) void sweep_avx2(float* __restrict param,
                                                    float* __restrict exp_avg,
                                                    float* __restrict exp_avg_sq,
                                                    const Model* __restrict grad,
                                                    Model* __restrict copy, int64_t n,
                                                    const GroupScalars g, const TensorScalars s) {
  sweep_loop<Model, kDecoupled, kSmallWeight, true>(param, exp_avg, exp_avg_sq, grad, copy, n, g,
                                                    s);
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

template <typename Model, bool kDecoupled, bool kSmallWeight>
void sweep(const AdamTensor& t, const GroupScalars& g, const TensorScalars& s, int64_t lo,
           int64_t hi) {
  Model* copy = t.model_param == nullptr ? nullptr : static_cast<Model*>(t.model_param) + lo;
  const Model* grad = static_cast<const Model*>(t.grad) + lo;
#ifdef MEGART_ADAM_AVX2
  if (cpu_has_avx2()) {
    sweep_avx2<Model, kDecoupled, kSmallWeight>(t.param + lo, t.exp_avg + lo, t.exp_avg_sq + lo,
                                                grad, copy, hi - lo, g, s);
    return;
  }
#endif
  sweep_baseline<Model, kDecoupled, kSmallWeight>(t.param + lo, t.exp_avg + lo, t.exp_avg_sq + lo,
                                                  grad, copy, hi - lo, g, s);
}

using SweepFn = void (*)(const AdamTensor&, const GroupScalars&, const TensorScalars&, int64_t,
                         int64_t);

template <typename Model>
SweepFn pick_sweep(bool decoupled, bool small_weight) {
  if (decoupled) {
    return small_weight ? &sweep<Model, true, true> : &sweep<Model, true, false>;
  }
  return small_weight ? &sweep<Model, false, true> : &sweep<Model, false, false>;
}

void check_options(const AdamOptions& o) {
  if (o.amsgrad) {
    throw ConfigError("amsgrad=True is not supported by megart's Adam; use amsgrad=False");
  }
  if (!(o.lr >= 0.0)) throw ConfigError("Adam needs lr >= 0, got " + std::to_string(o.lr));
  if (!(o.eps >= 0.0)) throw ConfigError("Adam needs eps >= 0, got " + std::to_string(o.eps));
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0)) {
    throw ConfigError("Adam needs 0 <= beta1 < 1, got " + std::to_string(o.beta1));
  }
  if (!(o.beta2 >= 0.0 && o.beta2 < 1.0)) {
    throw ConfigError("Adam needs 0 <= beta2 < 1, got " + std::to_string(o.beta2));
  }
  if (!(o.weight_decay >= 0.0)) {
    throw ConfigError("Adam needs weight_decay >= 0, got " + std::to_string(o.weight_decay));
  }
}

void check_tensor(const AdamTensor& t, size_t index, DType model_dtype) {
  const std::string where = "adam_step: tensor " + std::to_string(index);
  if (t.size < 0) throw ConfigError(where + " has a negative size");
  if (t.step == nullptr) throw ConfigError(where + " has no step counter");
  if (t.size == 0) return;
  if (t.param == nullptr || t.grad == nullptr || t.exp_avg == nullptr || t.exp_avg_sq == nullptr) {
    throw ConfigError(where + " has a null param, grad or moment buffer");
  }
  const bool low_precision = model_dtype != DType::kFloat32;
  if (low_precision && t.model_param == nullptr) {
    throw ConfigError(where + ": a " + dtype_name(model_dtype) +
                      " parameter needs its model copy as well as fp32 main weights");
  }
  if (!low_precision && t.model_param != nullptr) {
    throw ConfigError(where + ": a float32 parameter has no separate model copy");
  }
}

}  // namespace

void adam_step(const std::vector<AdamTensor>& tensors, DType model_dtype,
               const AdamOptions& options, int threads) {
  check_options(options);
  for (size_t i = 0; i < tensors.size(); ++i) check_tensor(tensors[i], i, model_dtype);
  const int workers = resolve_threads(threads);

  // With no weight decay both forms are the same update; the decoupled loop multiplies by
  // exactly 1, which leaves every value (NaN included) as torch's skipped op would.
  const bool decoupled = options.decoupled_weight_decay || options.weight_decay == 0.0;
  const float w1 = static_cast<float>(1.0 - options.beta1);
  const GroupScalars group{static_cast<float>(options.weight_decay),
                           w1,
                           w1 - 1.0f,
                           static_cast<float>(options.beta2),
                           static_cast<float>(1.0 - options.beta2),
                           static_cast<float>(options.eps)};
  const bool small_weight = std::fabs(w1) < 0.5f;

  std::vector<TensorScalars> scalars(tensors.size());
  std::vector<int64_t> sizes(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    // The count is advanced first and used as a double, as torch does with step_t.item().
    *tensors[i].step += 1.0f;
    const double step = *tensors[i].step;
    const double bias_correction1 = 1.0 - std::pow(options.beta1, step);
    const double bias_correction2 = 1.0 - std::pow(options.beta2, step);
    scalars[i] = {static_cast<float>(1.0 - options.lr * options.weight_decay),
                  static_cast<float>(-(options.lr / bias_correction1)),
                  static_cast<float>(std::pow(bias_correction2, 0.5))};
    sizes[i] = tensors[i].size;
  }

  SweepFn fn = nullptr;
  switch (model_dtype) {
    case DType::kFloat32:
      fn = pick_sweep<float>(decoupled, small_weight);
      break;
    case DType::kBFloat16:
      fn = pick_sweep<BF16>(decoupled, small_weight);
      break;
    case DType::kFloat16:
      fn = pick_sweep<FP16>(decoupled, small_weight);
      break;
  }

  const auto offsets = flat_offsets(sizes);
  parallel_for(offsets.back(), workers, [&](int, int64_t begin, int64_t end) {
    for_each_piece(offsets, begin, end, [&](size_t t, int64_t lo, int64_t hi) {
      fn(tensors[t], group, scalars[t], lo, hi);
    });
  });
}

}  // namespace megart::optim
