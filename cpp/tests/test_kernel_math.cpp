// Host checks of the CUDA kernels' per-element arithmetic and index splitting
// (cuda/kernels/kernel_math.hpp, plain C++ outside nvcc) against float64 formulas. The kernels
// themselves need a GPU; these parts do not, so their mistakes show up here first.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernel_math.hpp"
#include "test.hpp"

namespace math = megart::cuda::math;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

void fail_at(const char* file, int line, const std::string& what) {
  megart::test::fail(file, line, what);
}

// Runs for_each_piece as `stride` threads would over n elements of T placed `offset` bytes past
// a 16-byte boundary, and checks that every element is visited once, that packs are whole,
// in bounds and 16-byte aligned, and that with vectorise the scalar head and tail are each
// shorter than a pack (so every pack that fits is used).
template <typename T>
void check_cover(int offset, int64_t n, bool vectorise, int64_t stride) {
  constexpr int kV = math::kPack<T>;
  alignas(16) static unsigned char buffer[16 + 256 * sizeof(float)];
  const T* anchor = reinterpret_cast<const T*>(buffer + offset);
  std::vector<int> hits(static_cast<size_t>(n), 0);
  int64_t scalar_head = 0;
  int64_t scalar_tail = 0;
  int64_t packs = 0;
  bool in_head = true;
  bool ok = true;
  // The threads' calls, merged in element order afterwards: (index, width).
  std::vector<std::pair<int64_t, int>> calls;
  for (int64_t first = 0; first < stride; ++first) {
    math::for_each_piece(anchor, n, vectorise, first, stride, [&](int64_t i, auto width) {
      constexpr int W = decltype(width)::value;
      static_assert(W == 1 || W == kV, "a piece is one element or one pack");
      calls.emplace_back(i, W);
    });
  }
  std::sort(calls.begin(), calls.end());
  for (const auto& [i, w] : calls) {
    if (i < 0 || i + w > n) {
      ok = false;
      continue;
    }
    if (w > 1) {
      in_head = false;
      ++packs;
      if (reinterpret_cast<std::uintptr_t>(anchor + i) % 16 != 0) ok = false;
    } else if (in_head) {
      ++scalar_head;
    } else {
      ++scalar_tail;
    }
    for (int k = 0; k < w; ++k) ++hits[static_cast<size_t>(i + k)];
  }
  for (int h : hits) ok = ok && h == 1;
  if (!vectorise) {
    ok = ok && packs == 0;
  } else if (n >= 2 * kV) {
    // Not vectorised only when the range is too short for a pack after the head.
    ok = ok && packs > 0 && scalar_head < kV && scalar_tail < kV;
  }
  if (!ok) {
    std::ostringstream os;
    os << "for_each_piece: element size " << sizeof(T) << ", offset " << offset << ", n " << n
       << ", vectorise " << vectorise << ", stride " << stride << ": packs " << packs << ", head "
       << scalar_head << ", tail " << scalar_tail;
    fail_at(__FILE__, __LINE__, os.str());
  }
}

template <typename T>
void check_all_covers() {
  for (int offset = 0; offset < 16; offset += static_cast<int>(sizeof(T))) {
    for (int64_t n = 0; n <= 70; ++n) {
      for (bool vectorise : {false, true}) {
        for (int64_t stride : {1, 3, 32}) check_cover<T>(offset, n, vectorise, stride);
      }
    }
  }
}

constexpr double kPi = 3.14159265358979323846;

// The float64 references in the sigmoid form too: in float64, 1 + tanh(u) itself cancels
// below z = -7 (-0 at z = -9, where the value is -1.3e-28).
double gelu_u64(double z) { return std::sqrt(2.0 / kPi) * (z + 0.044715 * z * z * z); }

double gelu64(double z) { return z / (1.0 + std::exp(-2.0 * gelu_u64(z))); }

// The derivative (s + 2 z s (1 - s) u') and the size of its terms, which bounds its rounding.
std::pair<double, double> gelu_grad64(double z) {
  const double e = std::exp(-2.0 * gelu_u64(z));
  const double s = 1.0 / (1.0 + e);
  const double one_minus_s = s < 0.5 ? 1.0 - s : e * s;
  const double term =
      2.0 * z * s * one_minus_s * std::sqrt(2.0 / kPi) * (1.0 + 3.0 * 0.044715 * z * z);
  return {s + term, s + std::fabs(term)};
}

std::vector<float> gelu_points() {
  std::vector<float> zs;
  for (int i = -1200; i <= 1200; ++i) zs.push_back(static_cast<float>(i) * 0.01f);
  for (float z : {0.0f, 1e-30f, 30.0f, 1e3f, 1e10f}) {
    zs.push_back(z);
    zs.push_back(-z);
  }
  return zs;
}

// A block's reduction of several threads' partials: the maximum over them, then each sum
// rescaled to it, as cross_entropy_forward_kernel does with block_max and block_sum.
struct RowStats {
  float max;
  float sum;
};

template <int W>
RowStats block_stats(const std::vector<float>& row, int threads) {
  std::vector<math::SoftmaxPartial> parts(static_cast<size_t>(threads));
  const int64_t n = static_cast<int64_t>(row.size());
  for (int t = 0; t < threads; ++t) {
    // Pieces of W values (W = 1: every element alone; W = 4: float packs, tail alone).
    for (int64_t i = static_cast<int64_t>(t) * W; i < n; i += static_cast<int64_t>(threads) * W) {
      if (i + W <= n) {
        float v[W];
        for (int k = 0; k < W; ++k) v[k] = row[static_cast<size_t>(i + k)];
        parts[static_cast<size_t>(t)].add(v);
      } else {
        for (int64_t j = i; j < n; ++j) {
          const float v[1] = {row[static_cast<size_t>(j)]};
          parts[static_cast<size_t>(t)].add(v);
        }
      }
    }
  }
  float top = -kInf;
  for (const auto& p : parts) top = std::fmax(top, p.maximum);
  float sum = 0.0f;
  for (const auto& p : parts) sum += p.sum_at(top);
  return {top, sum};
}

}  // namespace

TEST(kernel_for_each_piece_covers_every_element_once_with_aligned_packs) {
  check_all_covers<float>();
  check_all_covers<std::uint16_t>();  // bf16 and fp16: 2-byte elements, 8 per pack
}

TEST(kernel_for_each_piece_indexes_past_2_to_the_31) {
  // 2^33 + 7 floats: 2^31 + 1 packs (pack numbers past int32) and a tail of 3. The pieces the
  // threads take near the end are in bounds and the last pack meets the tail. A stride past n
  // gives each thread one piece per loop, so only the threads named here run.
  alignas(16) static float base[4];
  const int64_t n = (int64_t{1} << 33) + 7;  // floats: 2^31 + 1 packs and a tail of 3
  const int64_t packs = (n - 0) / 4;
  int64_t last_pack_end = -1;
  int64_t tail_hits = 0;
  for (int64_t first : {packs - 1, int64_t{0}, int64_t{1}, int64_t{2}}) {
    math::for_each_piece(base, n, true, first, n, [&](int64_t i, auto width) {
      constexpr int W = decltype(width)::value;
      CHECK(i >= 0 && i + W <= n);
      if (W > 1 && first == packs - 1) last_pack_end = i + W;
      if (W == 1) ++tail_hits;
    });
  }
  CHECK_EQ(last_pack_end, n - 3);
  CHECK_EQ(tail_hits, int64_t{3});
}

TEST(kernel_gelu_tanh_and_its_derivative_match_float64_to_a_few_ulp_per_element) {
  // Each element's error against float64, relative to its own size times 1 + |u| (exp's
  // conditioning), not to the largest value's: GeLU's negative tail is small, and training
  // still sums it. The tanh form, 0.5 z (1 + tanh(u)), misses this by 5e4 times (2e-3 of the
  // value at z = -4). Values below 1e-30 are subnormal-adjacent in fp32 and are held absolutely.
  const auto check = [](const char* name, float z, double got, double ref, double size) {
    const double bound = 2e-6 * size * (1.0 + std::fabs(gelu_u64(z))) + 1e-30;
    if (!(std::fabs(got - ref) <= bound)) {
      fail_at(__FILE__, __LINE__,
              std::string(name) + "(" + std::to_string(z) + ") = " + std::to_string(got) +
                  ", float64 " + std::to_string(ref));
    }
  };
  for (float z : gelu_points()) {
    check("gelu_tanh", z, math::gelu_tanh(z), gelu64(z), std::fabs(gelu64(z)));
    const auto [grad, size] = gelu_grad64(z);
    check("gelu_tanh_grad", z, math::gelu_tanh_grad(z), grad, size);
  }
  // The analytic derivative (the float64 one above) against a central difference of the
  // float64 GeLU, and the float64 GeLU against GPT-2's tanh form where that form is accurate:
  // checks the formulas themselves, not only their rounding.
  for (int i = -800; i <= 800; ++i) {
    const double z = i * 0.01 + 0.003;
    const double h = 1e-5;
    const double numeric = (gelu64(z + h) - gelu64(z - h)) / (2 * h);
    CHECK(std::fabs(numeric - gelu_grad64(z).first) < 1e-8);
    const double tanh_form = 0.5 * z * (1.0 + std::tanh(gelu_u64(z)));
    CHECK(std::fabs(tanh_form - gelu64(z)) < 1e-15 * (1.0 + std::fabs(z)));
  }
}

TEST(kernel_softmax_partials_give_the_row_max_and_sum_of_exponentials) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 8.0f);
  for (int64_t n : {1, 3, 4, 13, 64, 1000, 4099}) {
    std::vector<float> row(static_cast<size_t>(n));
    for (auto& v : row) v = normal(rng);
    if (n > 10) std::fill(row.end() - 5, row.end(), -kInf);  // padded vocabulary ids
    double top = -INFINITY;
    for (float v : row) top = std::max(top, static_cast<double>(v));
    double sum = 0.0;
    for (float v : row) sum += std::exp(static_cast<double>(v) - top);
    for (int threads : {1, 7, 32, 512}) {
      for (const RowStats got : {block_stats<1>(row, threads), block_stats<4>(row, threads)}) {
        CHECK_EQ(static_cast<double>(got.max), top);
        CHECK(std::fabs(got.sum - sum) <= 1e-5 * sum);
      }
    }
  }
}

TEST(kernel_softmax_partials_of_padding_and_nan) {
  // A row of padding only: maximum -inf and a sum of 0 (the slice adds nothing to the group's).
  const std::vector<float> padding(37, -kInf);
  for (const RowStats got : {block_stats<1>(padding, 4), block_stats<4>(padding, 4)}) {
    CHECK(got.max == -kInf);
    CHECK_EQ(got.sum, 0.0f);
  }
  // A NaN reaches the sum wherever it is, including in a pack whose other values are -inf
  // (fmaxf skips NaN, so the maximum alone would not see it) and before any finite value.
  for (size_t at : {size_t{0}, size_t{2}, size_t{20}, size_t{36}}) {
    for (float rest : {-kInf, 1.5f}) {
      std::vector<float> row(37, rest);
      for (size_t i = 8; i < 12; ++i) row[i] = 1.0f;  // some finite values after the NaN
      row[at] = kNaN;
      for (int threads : {1, 4}) {
        CHECK(std::isnan(block_stats<1>(row, threads).sum));
        CHECK(std::isnan(block_stats<4>(row, threads).sum));
      }
    }
  }
}

namespace {

// torch.optim.Adam/AdamW's update in float64, op by op (torch/optim/adam.py,
// _single_tensor_adam), for one element.
struct Adam64 {
  double p, m = 0.0, v = 0.0;
  void step(double g, int step, double lr, double beta1, double beta2, double eps, double wd,
            bool decoupled) {
    if (decoupled) {
      p *= 1.0 - lr * wd;
    } else {
      g += wd * p;
    }
    m = beta1 * m + (1.0 - beta1) * g;
    v = beta2 * v + (1.0 - beta2) * g * g;
    const double bc1 = 1.0 - std::pow(beta1, step);
    const double bc2 = 1.0 - std::pow(beta2, step);
    p -= lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
  }
};

template <bool kDecoupled>
void check_adam(double lr, double beta1, double beta2, double wd) {
  const double eps = 1e-8;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int element = 0; element < 50; ++element) {
    float p = normal(rng);
    float m = 0.0f;
    float v = 0.0f;
    Adam64 ref{p};
    for (int step = 1; step <= 100; ++step) {
      // Gradients of varying scale, a zero one among them.
      const float g = step % 17 == 0 ? 0.0f : normal(rng) * std::pow(10.0f, (step % 5) - 2.0f);
      const auto c = math::adam_coefficients(lr, beta1, beta2, eps, wd, step);
      math::adam_update<kDecoupled>(g, p, m, v, c);
      ref.step(g, step, lr, beta1, beta2, eps, wd, kDecoupled);
    }
    // Float rounding over 100 steps: well under one step's movement (lr). The moments get a
    // floor: with L2 decay the last gradient is g + wd p, which can cancel to far below its
    // terms (about 1e-2 here), leaving p's own rounding as a large relative error.
    if (!(std::fabs(p - ref.p) <= 1e-5 * (1.0 + std::fabs(ref.p)) &&
          std::fabs(m - ref.m) <= 1e-5 * (1e-2 + std::fabs(ref.m)) &&
          std::fabs(v - ref.v) <= 1e-5 * (1e-4 + std::fabs(ref.v)))) {
      std::ostringstream os;
      os << "adam_update (decoupled " << kDecoupled << ", beta1 " << beta1 << ", wd " << wd
         << "): p " << p << " vs " << ref.p << ", m " << m << " vs " << ref.m << ", v " << v
         << " vs " << ref.v;
      fail_at(__FILE__, __LINE__, os.str());
    }
  }
}

}  // namespace

TEST(kernel_adam_update_matches_torch_formula_in_float64) {
  check_adam<true>(1e-2, 0.9, 0.999, 0.1);   // AdamW
  check_adam<false>(1e-2, 0.9, 0.999, 0.1);  // Adam, L2 added to the gradient
  check_adam<true>(1e-3, 0.3, 0.95, 0.0);    // 1 - beta1 >= 0.5: lerp's other branch
  check_adam<false>(1e-3, 0.0, 0.0, 0.01);   // no momentum at all
}

TEST(kernel_adam_first_step_moves_by_lr_against_the_gradient) {
  // Step 1 with the bias corrections: m / bc1 = g and sqrt(v / bc2) = |g|, so p moves by
  // lr * sign(g) (less eps): the step count the kernel reads must already be advanced to 1.
  const auto c = math::adam_coefficients(0.1, 0.9, 0.999, 1e-8, 0.0, 1.0);
  float p = 1.0f;
  float m = 0.0f;
  float v = 0.0f;
  math::adam_update<true>(-3.0f, p, m, v, c);
  CHECK(std::fabs(p - 1.1f) < 1e-6f);
  const auto c0 = math::adam_coefficients(0.1, 0.9, 0.999, 1e-8, 0.0, 0.0);
  CHECK(!std::isfinite(c0.neg_step_size));  // step 0 (not advanced) would divide by zero
}
