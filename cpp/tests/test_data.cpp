#include <cmath>
#include <cstdint>
#include <vector>

#include "common/error.hpp"
#include "data/blending.hpp"
#include "test.hpp"

using megart::data::blending_indices;

TEST(blending_ties_go_to_the_first_dataset) {
  // Equal weights: every tie (steps 0, 2, 4, ...) goes to dataset 0, so they alternate.
  std::vector<int16_t> which(8);
  std::vector<int64_t> nth(8);
  blending_indices({0.5, 0.5}, 8, which.data(), nth.data());
  for (int64_t i = 0; i < 8; ++i) {
    CHECK_EQ(which[i], static_cast<int16_t>(i % 2));
    CHECK_EQ(nth[i], i / 2);
  }
}

TEST(blending_follows_the_weights_and_numbers_each_datasets_samples) {
  const std::vector<double> weights = {0.2, 0.5, 0.3};
  const int64_t size = 10000;
  std::vector<int16_t> which(size);
  std::vector<int64_t> nth(size);
  blending_indices(weights, size, which.data(), nth.data());
  std::vector<int64_t> counts(weights.size(), 0);
  for (int64_t i = 0; i < size; ++i) {
    const auto d = static_cast<size_t>(which[i]);
    CHECK(d < weights.size());
    CHECK_EQ(nth[i], counts[d]);  // each dataset's samples in order, none skipped
    ++counts[d];
    // The greedy rule keeps every dataset within one sample of its share.
    for (size_t k = 0; k < weights.size(); ++k) {
      CHECK(std::fabs(weights[k] * static_cast<double>(i + 1) - counts[k]) < 1.0 + 1e-9);
    }
  }
}

TEST(blending_refuses_no_dataset_and_a_negative_size) {
  int16_t which = 0;
  int64_t nth = 0;
  CHECK_THROWS(megart::ConfigError, blending_indices({}, 1, &which, &nth), "got 0");
  CHECK_THROWS(megart::ConfigError, blending_indices({1.0}, -1, &which, &nth), "got -1");
}
