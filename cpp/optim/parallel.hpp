// Splitting one flat piece of work (the elements of many tensors, end to end) across threads.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace megart::optim {

// The number of worker threads a sweep uses. `requested` > 0 wins; otherwise the environment
// variable MEGART_NUM_THREADS; otherwise the CPUs this process may run on. Raises ConfigError for
// a negative request or a malformed variable.
int resolve_threads(int requested);

// Prefix sums of tensor sizes: offsets[i] is where tensor i starts in the flat index space and
// offsets.back() the total.
std::vector<int64_t> flat_offsets(const std::vector<int64_t>& sizes);

// Calls body(worker, begin, end) for `workers` contiguous, disjoint ranges covering [0, total),
// one per thread, and returns when all have finished. Uses fewer workers when there is too
// little work for each to pay for its thread. Returns the number of workers used.
int parallel_for(int64_t total, int threads,
                 const std::function<void(int worker, int64_t begin, int64_t end)>& body);

// Calls piece(tensor, lo, hi) for each tensor overlapping the flat range [begin, end), with
// [lo, hi) in that tensor's own element indices.
template <typename Piece>
void for_each_piece(const std::vector<int64_t>& offsets, int64_t begin, int64_t end,
                    Piece&& piece) {
  // Binary search for the first tensor that ends after `begin`; then walk forwards.
  size_t lo = 0;
  size_t hi = offsets.size() - 1;
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (offsets[mid + 1] <= begin) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  for (size_t t = lo; t + 1 < offsets.size() && offsets[t] < end; ++t) {
    const int64_t a = begin > offsets[t] ? begin : offsets[t];
    const int64_t b = end < offsets[t + 1] ? end : offsets[t + 1];
    if (a < b) piece(t, a - offsets[t], b - offsets[t]);
  }
}

}  // namespace megart::optim
