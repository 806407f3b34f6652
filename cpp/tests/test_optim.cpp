#include <cmath>
#include <limits>
#include <vector>

#include "common/error.hpp"
#include "optim/adam.hpp"
#include "optim/multi_tensor.hpp"
#include "optim/parallel.hpp"
#include "test.hpp"

using namespace megart::optim;

namespace {

// One Adam step on one element in double, for checking the sweep.
double adamw_reference(double p, double g, double lr, double wd, int step) {
  const double m = 0.1 * g;
  const double v = 0.001 * g * g;
  p *= 1.0 - lr * wd;
  const double denom = std::sqrt(v) / std::sqrt(1.0 - std::pow(0.999, step)) + 1e-8;
  return p - lr / (1.0 - std::pow(0.9, step)) * m / denom;
}

}  // namespace

TEST(adam_step_matches_formula_across_threads) {
  // Sizes straddling the per-thread split, including an empty tensor and a single element.
  const std::vector<int64_t> sizes = {1, 0, 70000, 7, 200003};
  for (int threads : {1, 2, 3}) {
    std::vector<std::vector<float>> p, g, m, v, p0;
    std::vector<float> steps(sizes.size(), 0.0f);
    std::vector<AdamTensor> tensors;
    for (size_t t = 0; t < sizes.size(); ++t) {
      const auto n = static_cast<size_t>(sizes[t]);
      p.emplace_back(n);
      g.emplace_back(n);
      m.emplace_back(n, 0.0f);
      v.emplace_back(n, 0.0f);
      for (size_t i = 0; i < n; ++i) {
        p[t][i] = 0.5f + 0.001f * static_cast<float>(i % 97);
        g[t][i] = -0.3f + 0.01f * static_cast<float>(i % 61);
      }
    }
    p0 = p;
    for (size_t t = 0; t < sizes.size(); ++t) {
      tensors.push_back(
          {p[t].data(), nullptr, g[t].data(), m[t].data(), v[t].data(), &steps[t], sizes[t]});
    }
    AdamOptions o;
    o.lr = 0.01;
    o.weight_decay = 0.1;
    adam_step(tensors, DType::kFloat32, o, threads);
    for (size_t t = 0; t < sizes.size(); ++t) {
      CHECK_EQ(steps[t], 1.0f);
      for (size_t i = 0; i < p[t].size(); ++i) {
        CHECK(std::fabs(p[t][i] - adamw_reference(p0[t][i], g[t][i], 0.01, 0.1, 1)) < 1e-6);
      }
    }
  }
}

TEST(adam_step_writes_bf16_copy) {
  std::vector<float> master = {1.0f, -2.0f, 3.0f};
  std::vector<BF16> model(3, BF16{0});
  std::vector<BF16> grad = {{0x3F80}, {0xBF80}, {0x0000}};  // 1, -1, 0
  std::vector<float> m(3, 0.0f), v(3, 0.0f);
  float step = 0.0f;
  AdamOptions o;
  o.lr = 0.1;
  adam_step({{master.data(), model.data(), grad.data(), m.data(), v.data(), &step, 3}},
            DType::kBFloat16, o, 1);
  for (size_t i = 0; i < 3; ++i) {
    BF16 expected{0};
    store(&expected, master[i]);
    CHECK_EQ(model[i].bits, expected.bits);
  }
  CHECK(std::fabs(master[0] - 0.9f) < 1e-6f);  // first step moves by lr against the gradient
  CHECK(std::fabs(master[1] + 1.9f) < 1e-6f);
  CHECK_EQ(master[2], 3.0f);  // zero gradient: no move
}

TEST(adam_rejects_amsgrad_and_missing_copy) {
  float p = 0, g = 0, m = 0, v = 0, step = 0;
  AdamOptions o;
  o.amsgrad = true;
  CHECK_THROWS(megart::ConfigError,
               adam_step({{&p, nullptr, &g, &m, &v, &step, 1}}, DType::kFloat32, o), "amsgrad");
  o.amsgrad = false;
  CHECK_THROWS(megart::ConfigError,
               adam_step({{&p, nullptr, &g, &m, &v, &step, 1}}, DType::kBFloat16, o), "model copy");
}

TEST(half_conversions_round_to_nearest_even) {
  FP16 h{0};
  store(&h, 1.0f);
  CHECK_EQ(h.bits, 0x3C00);
  store(&h, 65504.0f);
  CHECK_EQ(h.bits, 0x7BFF);
  store(&h, 65520.0f);  // half-way to the next binade: rounds to even, which is inf
  CHECK_EQ(h.bits, 0x7C00);
  store(&h, 0x1p-24f);  // smallest subnormal
  CHECK_EQ(h.bits, 0x0001);
  store(&h, 0x1p-25f);  // tie between 0 and the smallest subnormal: even is 0
  CHECK_EQ(h.bits, 0x0000);
  store(&h, -0x1p-14f);  // smallest normal
  CHECK_EQ(h.bits, 0x8400);
  // Every half value survives a round trip.
  for (uint32_t b = 0; b < 0x7C00; ++b) {
    FP16 back{0};
    store(&back, to_float(FP16{static_cast<uint16_t>(b)}));
    CHECK_EQ(back.bits, b);
  }
  BF16 bf{0};
  store(&bf, float_of(0x3F808000u));  // tie, lower neighbour even
  CHECK_EQ(bf.bits, 0x3F80);
  store(&bf, float_of(0x3F818000u));  // tie, upper neighbour even
  CHECK_EQ(bf.bits, 0x3F82);
}

TEST(sum_of_squares_and_scale) {
  std::vector<float> a(100001, 2.0f), b(3, -1.0f);
  std::vector<TensorRef> refs = {{a.data(), 100001}, {b.data(), 3}};
  CHECK_EQ(sum_of_squares(refs, DType::kFloat32, 2), 4.0 * 100001 + 3.0);
  CHECK(!scale(refs, refs, DType::kFloat32, 0.5f, 2));
  CHECK_EQ(a[100000], 1.0f);
  CHECK_EQ(b[2], -0.5f);
  b[1] = std::numeric_limits<float>::quiet_NaN();
  CHECK(scale(refs, refs, DType::kFloat32, 1.0f, 2));
  a[5] = std::numeric_limits<float>::infinity();
  b[1] = 0.0f;
  CHECK(scale(refs, refs, DType::kFloat32, 1.0f, 2));
}

TEST(resolve_threads_rejects_negative) {
  CHECK_EQ(resolve_threads(3), 3);
  CHECK(resolve_threads(0) >= 1);
  CHECK_THROWS(megart::ConfigError, resolve_threads(-1), "num_threads");
}
