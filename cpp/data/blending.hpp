// Megatron-Core's blended-dataset order: which dataset each sample of a blend comes from.
#pragma once

#include <cstdint>
#include <vector>

namespace megart::data {

// For each of `size` samples, writes the dataset it is drawn from (`which[i]`) and that
// dataset's own sample number (`nth[i]`). Sample i goes to the dataset whose weight times
// max(i, 1) exceeds the samples it has had so far by the most, the first such on ties: a greedy
// rule, each choice depending on the ones before (Megatron-Core's build_blending_indices, in
// double; the weights normalised by the caller). Throws ConfigError for no dataset, more than
// int16 can number, or a negative size.
void blending_indices(const std::vector<double>& weights, int64_t size, int16_t* which,
                      int64_t* nth);

}  // namespace megart::data
