// Host checks of the rest of the CUDA kernels' arithmetic in kernel_math.hpp against float64: the
// multi-tensor chunk split and scale, bias-GeLU, LayerNorm's row forward and backward (composed
// from the per-element functions the kernels call, with the row sums in float as a block forms
// them) and the cross-entropy gradient of a row.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernel_math.hpp"
#include "test.hpp"

namespace math = megart::cuda::math;

namespace {

void fail_at(int line, const std::string& what) { megart::test::fail(__FILE__, line, what); }

// for_each_in_chunk as `stride` threads: every element of [begin, end) once, packs whole and
// starting at begin + a multiple of W, the scalar tail shorter than a pack.
template <int W>
void check_chunk(int64_t begin, int64_t end, bool vectorise, int64_t stride) {
  std::vector<int> hits(static_cast<size_t>(end - begin), 0);
  int64_t scalar = 0;
  bool ok = true;
  for (int64_t first = 0; first < stride; ++first) {
    math::for_each_in_chunk<W>(begin, end, vectorise, first, stride, [&](int64_t i, auto width) {
      constexpr int kW = decltype(width)::value;
      if (i < begin || i + kW > end || (kW > 1 && (i - begin) % W != 0)) ok = false;
      if (kW == 1) ++scalar;
      for (int k = 0; k < kW && ok; ++k) ++hits[static_cast<size_t>(i - begin + k)];
    });
  }
  for (int h : hits) ok = ok && h == 1;
  ok = ok && scalar == (vectorise ? (end - begin) % W : end - begin);
  if (!ok) {
    std::ostringstream os;
    os << "for_each_in_chunk<" << W << ">(" << begin << ", " << end << ", " << vectorise << ", "
       << stride << " threads)";
    fail_at(__LINE__, os.str());
  }
}

double gelu64(double z) {
  return 0.5 * z * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (z + 0.044715 * z * z * z)));
}

double gelu_grad64(double z) {
  const double u = std::sqrt(2.0 / M_PI) * (z + 0.044715 * z * z * z);
  const double t = std::tanh(u);
  return 0.5 * (1.0 + t) +
         0.5 * z * (1.0 - t * t) * std::sqrt(2.0 / M_PI) * (1.0 + 3.0 * 0.044715 * z * z);
}

double norm(const std::vector<double>& v) {
  double s = 0.0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

double distance(const std::vector<float>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s);
}

// One row through the LayerNorm kernels' steps in float: the forward (two passes) and the
// backward's two passes, with the sums formed by `threads` partial sums then added (a block).
struct RowResult {
  float mean, rstd;
  std::vector<float> out, grad, dweight, dbias;
};

RowResult layer_norm_row(const std::vector<float>& s, const std::vector<float>& w,
                         const std::vector<float>& b, const std::vector<float>& dy, float eps,
                         int threads) {
  const auto n = static_cast<int64_t>(s.size());
  const auto block_sum = [&](auto term) {
    std::vector<float> part(static_cast<size_t>(threads), 0.0f);
    for (int64_t j = 0; j < n; ++j) part[static_cast<size_t>(j % threads)] += term(j);
    float total = 0.0f;
    for (float p : part) total += p;
    return total;
  };
  RowResult r;
  r.mean = block_sum([&](int64_t j) { return s[j]; }) / static_cast<float>(n);
  r.rstd = math::layer_norm_rstd(
      block_sum([&](int64_t j) { return (s[j] - r.mean) * (s[j] - r.mean); }), n, eps);
  for (int64_t j = 0; j < n; ++j) {
    r.out.push_back(math::layer_norm_output(s[j], r.mean, r.rstd, w[j], b[j]));
  }
  std::vector<math::LayerNormGradSums> sums(static_cast<size_t>(threads));
  r.dweight.assign(s.size(), 0.0f);
  r.dbias.assign(s.size(), 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    math::layer_norm_grad_accumulate(dy[j], s[j], w[j], r.mean, r.rstd,
                                     sums[static_cast<size_t>(j % threads)], r.dweight[j],
                                     r.dbias[j]);
  }
  float sum_g = 0.0f;
  float sum_g_xhat = 0.0f;
  for (const auto& p : sums) {
    sum_g += p.g;
    sum_g_xhat += p.g_xhat;
  }
  const float inv_n = 1.0f / static_cast<float>(n);
  for (int64_t j = 0; j < n; ++j) {
    r.grad.push_back(math::layer_norm_input_grad(dy[j], s[j], w[j], r.mean, r.rstd, sum_g * inv_n,
                                                 sum_g_xhat * inv_n, 0.0f));
  }
  return r;
}

}  // namespace

TEST(kernel_for_each_in_chunk_covers_every_element_once) {
  for (int64_t begin : {int64_t{0}, int64_t{65536}, int64_t{3} << 32}) {
    for (int64_t len : {1, 3, 4, 5, 8, 1023, 65536}) {
      for (int64_t stride : {1, 3, 32, 512}) {
        for (bool vectorise : {true, false}) {
          check_chunk<4>(begin, begin + len, vectorise, stride);
          check_chunk<8>(begin, begin + len, vectorise, stride);
        }
      }
    }
  }
}

TEST(kernel_scale_element_multiplies_and_flags_inf_and_nan) {
  bool bad = false;
  CHECK_EQ(math::scale_element(3.0f, 0.25f, bad), 0.75f);
  CHECK(!bad);
  CHECK_EQ(math::scale_element(-0.0f, 1e30f, bad), 0.0f);
  CHECK(!bad);
  CHECK_EQ(math::scale_element(1e30f, 1e10f, bad), std::numeric_limits<float>::infinity());
  CHECK(!bad);  // the product overflowing is not an input overflow
  math::scale_element(std::numeric_limits<float>::infinity(), 0.5f, bad);
  CHECK(bad);
  bool nan = false;
  math::scale_element(std::numeric_limits<float>::quiet_NaN(), 0.5f, nan);
  math::scale_element(1.0f, 0.5f, nan);
  CHECK(nan);  // stays set
}

TEST(kernel_bias_gelu_and_its_gradient_match_float64) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int i = 0; i < 2000; ++i) {
    const float x = normal(rng);
    const float bias = normal(rng) * 0.3f;
    const float g = normal(rng);
    const double z = static_cast<double>(x) + bias;
    const double tol = 4e-6 * (1.0 + std::fabs(z));
    CHECK(std::fabs(math::bias_gelu(x, bias) - gelu64(z)) <= tol);
    CHECK(std::fabs(math::bias_gelu_grad(g, x, bias) - g * gelu_grad64(z)) <=
          tol * (1.0 + std::fabs(g)));
  }
}

TEST(kernel_layer_norm_row_forward_and_backward_match_float64) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float eps = 1e-5f;
  for (int n : {1, 2, 7, 64, 1000, 4099}) {
    for (int threads : {1, 32, 512}) {
      std::vector<float> s(n), w(n), b(n), dy(n);
      for (int j = 0; j < n; ++j) {
        // An offset mean and a few large channels, as residual streams have.
        s[j] = 3.0f + normal(rng) * (j % 97 == 5 ? 40.0f : 1.0f);
        w[j] = normal(rng);
        b[j] = normal(rng);
        dy[j] = normal(rng);
      }
      const RowResult got = layer_norm_row(s, w, b, dy, eps, threads);
      // float64 reference.
      double mean = 0.0;
      for (float v : s) mean += v;
      mean /= n;
      double var = 0.0;
      for (float v : s) var += (v - mean) * (v - mean);
      var /= n;
      const double rstd = 1.0 / std::sqrt(var + eps);
      std::vector<double> out(n), xhat(n), g(n), grad(n), dweight(n), terms(n);
      double mean_g = 0.0;
      double mean_gx = 0.0;
      for (int j = 0; j < n; ++j) {
        xhat[j] = (s[j] - mean) * rstd;
        out[j] = xhat[j] * w[j] + b[j];
        g[j] = static_cast<double>(dy[j]) * w[j];
        dweight[j] = static_cast<double>(dy[j]) * xhat[j];
        mean_g += g[j] / n;
        mean_gx += g[j] * xhat[j] / n;
      }
      for (int j = 0; j < n; ++j) {
        grad[j] = rstd * (g[j] - mean_g - xhat[j] * mean_gx);
        // The terms whose rounding rstd magnifies: with one column the gradient is exactly 0
        // but not the terms, so the bound is relative to them (the row's condition).
        terms[j] = rstd * (std::fabs(g[j]) + std::fabs(mean_g) + std::fabs(xhat[j] * mean_gx));
      }
      const double tol = 1e-5;
      const bool ok = std::fabs(got.mean - mean) <= tol * (1.0 + std::fabs(mean)) &&
                      std::fabs(got.rstd - rstd) <= tol * rstd &&
                      distance(got.out, out) <= tol * norm(out) &&
                      distance(got.grad, grad) <= tol * std::max(norm(grad), norm(terms)) &&
                      distance(got.dweight, dweight) <= tol * norm(dweight) &&
                      distance(got.dbias, std::vector<double>(dy.begin(), dy.end())) == 0.0;
      if (!ok) {
        std::ostringstream os;
        os << "layer norm row of " << n << " with " << threads << " threads: mean " << got.mean
           << " vs " << mean << ", rstd " << got.rstd << " vs " << rstd << ", out err "
           << distance(got.out, out) / norm(out) << ", grad err " << distance(got.grad, grad)
           << " (||grad|| " << norm(grad) << ", ||terms|| " << norm(terms) << ")";
        fail_at(__LINE__, os.str());
      }
    }
  }
}

TEST(kernel_cross_entropy_row_gradient_matches_float64) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 8.0f);
  for (int n : {1, 13, 1000}) {
    std::vector<float> row(n);
    for (auto& v : row) v = normal(rng);
    double top = -INFINITY;
    for (float v : row) top = std::max(top, static_cast<double>(v));
    double sum = 0.0;
    for (float v : row) sum += std::exp(v - top);
    const int target = n / 2;
    const float grad_loss = 0.37f;
    const auto scale = static_cast<float>(grad_loss / sum);
    std::vector<float> got(n);
    std::vector<double> ref(n);
    for (int j = 0; j < n; ++j) {
      got[j] =
          math::cross_entropy_grad(row[j], static_cast<float>(top), scale, grad_loss, j == target);
      ref[j] = grad_loss * (std::exp(row[j] - top) / sum - (j == target ? 1.0 : 0.0));
    }
    CHECK(distance(got, ref) <= 1e-5 * norm(ref));
    // The gradient of a row sums to 0 (softmax sums to 1, minus the one-hot).
    double total = 0.0;
    for (float v : got) total += v;
    CHECK(std::fabs(total) <= 1e-5 * grad_loss * std::sqrt(static_cast<double>(n)));
  }
}
