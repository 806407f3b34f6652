#include "data/blending.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "common/error.hpp"

namespace megart::data {

void blending_indices(const std::vector<double>& weights, int64_t size, int16_t* which,
                      int64_t* nth) {
  const size_t most = static_cast<size_t>(std::numeric_limits<int16_t>::max());
  if (weights.empty() || weights.size() > most) {
    throw ConfigError("a blend needs between 1 and " + std::to_string(most) + " datasets, got " +
                      std::to_string(weights.size()));
  }
  if (size < 0) {
    throw ConfigError("a blend's size must be at least 0, got " + std::to_string(size));
  }
  std::vector<int64_t> counts(weights.size(), 0);
  for (int64_t i = 0; i < size; ++i) {
    const double n = std::max(static_cast<double>(i), 1.0);
    size_t best = 0;
    double err = weights[0] * n - static_cast<double>(counts[0]);
    for (size_t k = 1; k < weights.size(); ++k) {
      const double e = weights[k] * n - static_cast<double>(counts[k]);
      if (e > err) {  // strictly: the first dataset wins a tie
        best = k;
        err = e;
      }
    }
    which[i] = static_cast<int16_t>(best);
    nth[i] = counts[best]++;
  }
}

}  // namespace megart::data
