// Unit tests of the multi-tensor launch packing that the CUDA kernels use. The kernels' own tests
// need a GPU; the packing does not, so it is tested here with tiny limits (many launches from
// few tensors) and random size lists, as well as with the kernels' real limits.
#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "optim/multi_tensor_plan.hpp"
#include "test.hpp"

using megart::optim::MultiTensorLaunch;
using megart::optim::plan_multi_tensor;

namespace {

// A launch copied out of the callback, which reuses its storage for the next one.
struct Recorded {
  int tensors = 0;  // as reported, before any clamping to the capacity
  int blocks = 0;
  std::vector<int> tensor;                     // slot -> tensor number
  std::vector<std::pair<int, int64_t>> block;  // block -> (slot, chunk)
};

template <int kMaxTensors, int kMaxBlocks>
std::vector<Recorded> record(const std::vector<int64_t>& sizes, int64_t chunk) {
  std::vector<Recorded> launches;
  const bool finished = plan_multi_tensor<kMaxTensors, kMaxBlocks>(
      sizes.data(), static_cast<int>(sizes.size()), chunk, true,
      [&](const MultiTensorLaunch<kMaxTensors, kMaxBlocks>& plan) {
        Recorded r;
        r.tensors = plan.tensors;
        r.blocks = plan.blocks;
        // Clamped so that a planner breaking its limits is reported, not read out of bounds.
        r.tensor.assign(plan.tensor, plan.tensor + std::clamp(plan.tensors, 0, kMaxTensors));
        for (int b = 0; b < std::clamp(plan.blocks, 0, kMaxBlocks); ++b) {
          r.block.emplace_back(plan.block_map.slot[b], plan.block_map.chunk[b]);
        }
        launches.push_back(std::move(r));
        return true;
      });
  CHECK(finished);
  return launches;
}

// "[slot tensors] slot:chunk ... | ..." for comparing with a plan worked out by hand.
std::string show(const std::vector<Recorded>& launches) {
  std::ostringstream os;
  for (const Recorded& r : launches) {
    if (os.tellp() > 0) os << " | ";
    os << '[';
    for (size_t s = 0; s < r.tensor.size(); ++s) os << (s ? " " : "") << r.tensor[s];
    os << ']';
    for (const auto& [slot, chunk] : r.block) os << ' ' << slot << ':' << chunk;
  }
  return os.str();
}

int64_t chunks_of(int64_t size, int64_t chunk) { return (size + chunk - 1) / chunk; }

// Everything a plan must satisfy; returns what it breaks first, or "" when it is right.
std::string violation(const std::vector<int64_t>& sizes, int64_t chunk, int max_tensors,
                      int max_blocks, const std::vector<Recorded>& launches) {
  const int count = static_cast<int>(sizes.size());
  // Element ranges [begin, end) seen per tensor, and the order in which blocks came.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges(sizes.size());
  std::vector<std::pair<int, int64_t>> order;
  for (size_t k = 0; k < launches.size(); ++k) {
    const Recorded& r = launches[k];
    const std::string at = "launch " + std::to_string(k) + ": ";
    if (r.tensors < 1 || r.tensors > max_tensors) return at + "slot count out of range";
    if (r.blocks < 1 || r.blocks > max_blocks) return at + "block count out of range";
    // Slots hold distinct non-empty tensors, in list order, so slot 0 is the continued one.
    for (int s = 0; s < r.tensors; ++s) {
      const int t = r.tensor[s];
      if (t < 0 || t >= count || sizes[t] <= 0) return at + "slot holds no non-empty tensor";
      if (s > 0 && t <= r.tensor[s - 1]) return at + "slots out of list order";
    }
    std::vector<bool> used(r.tensor.size(), false);
    for (const auto& [slot, c] : r.block) {
      if (slot < 0 || slot >= r.tensors) return at + "block names an unused slot";
      // A block may only open the next slot: slots fill in the order blocks reach them.
      if (slot > 0 && !used[slot - 1]) return at + "block skips a slot";
      used[slot] = true;
      const int t = r.tensor[slot];
      if (c < 0 || c >= chunks_of(sizes[t], chunk)) return at + "chunk past the tensor's end";
      ranges[t].emplace_back(c * chunk, std::min((c + 1) * chunk, sizes[t]));
      order.emplace_back(t, c);
    }
    if (!std::all_of(used.begin(), used.end(), [](bool u) { return u; })) {
      return at + "slot without a block";
    }
    // Packed greedily: only the last launch may leave both blocks and slots free.
    if (k + 1 < launches.size() && r.blocks < max_blocks && r.tensors < max_tensors) {
      return at + "handed over before it was full";
    }
  }
  // Every element of every tensor exactly once: each tensor's ranges tile [0, size).
  for (int t = 0; t < count; ++t) {
    std::sort(ranges[t].begin(), ranges[t].end());
    int64_t covered = 0;
    for (const auto& [begin, end] : ranges[t]) {
      if (begin != covered || end <= begin) return "tensor " + std::to_string(t) + " not tiled";
      covered = end;
    }
    if (covered != sizes[t]) return "tensor " + std::to_string(t) + " not covered to its end";
  }
  // The chunks come tensor by tensor, in order, as the kernels have always launched them.
  if (!std::is_sorted(order.begin(), order.end())) return "blocks out of (tensor, chunk) order";
  return "";
}

std::string describe(const std::vector<int64_t>& sizes, int64_t chunk) {
  std::string s = "chunk " + std::to_string(chunk) + ", sizes";
  for (const int64_t n : sizes) s += " " + std::to_string(n);
  return s;
}

// A size from the cases that matter for packing: empty, one element (a 0-d tensor), around one
// chunk, exactly one full launch, and tensors spanning several launches.
int64_t pick_size(std::mt19937_64& rng, int64_t chunk, int max_blocks) {
  const int64_t full_launch = chunk * max_blocks;
  switch (rng() % 9) {
    case 0:
      return 0;
    case 1:
      return 1;
    case 2:
      return chunk - 1;
    case 3:
      return chunk;
    case 4:
      return chunk + 1;
    case 5:
      return full_launch;
    case 6:
      return full_launch * static_cast<int64_t>(1 + rng() % 3) + static_cast<int64_t>(rng() % 2);
    case 7:
      return full_launch * static_cast<int64_t>(2 + rng() % 3) +
             static_cast<int64_t>(rng() % chunk);
    default:
      return 1 + static_cast<int64_t>(rng() % (3 * chunk));
  }
}

// Plans `lists` random size lists per chunk size and checks each; returns how many it checked.
template <int kMaxTensors, int kMaxBlocks>
int check_random_lists(uint64_t seed, int lists, const std::vector<int64_t>& chunks) {
  // Raw engine output reduced by %, not std::*_distribution, so the cases are the same with
  // every standard library.
  std::mt19937_64 rng(seed);
  int checked = 0;
  for (const int64_t chunk : chunks) {
    for (int i = 0; i < lists; ++i) {
      // Long enough, at times, to run out of slots several times over.
      std::vector<int64_t> sizes(rng() % (3 * kMaxTensors + 4));
      for (int64_t& n : sizes) n = pick_size(rng, chunk, kMaxBlocks);
      const auto launches = record<kMaxTensors, kMaxBlocks>(sizes, chunk);
      const std::string broken = violation(sizes, chunk, kMaxTensors, kMaxBlocks, launches);
      CHECK_EQ(broken.empty() ? std::string() : broken + " (" + describe(sizes, chunk) + ")",
               std::string());
      ++checked;
    }
  }
  return checked;
}

}  // namespace

TEST(multi_tensor_plan_matches_hand_worked_packing) {
  // Two slots, three blocks, chunks of 4: an empty tensor, a one-element tensor, a tensor ending
  // exactly at the block limit, the slot limit reached, and a tensor continuing in slot 0.
  const std::vector<int64_t> sizes = {5, 0, 1, 12, 4, 3, 1, 13};
  const auto launches = record<2, 3>(sizes, 4);
  CHECK_EQ(show(launches), std::string("[0 2] 0:0 0:1 1:0 | [3] 0:0 0:1 0:2 | [4 5] 0:0 1:0"
                                       " | [6 7] 0:0 1:0 1:1 | [7] 0:2 0:3"));
}

TEST(multi_tensor_plan_launches_nothing_for_empty_lists) {
  // Locals, because the commas of record<,> would split a CHECK_EQ macro argument.
  const auto none = record<2, 3>({}, 4);
  const auto all_empty = record<2, 3>({0, 0, 0}, 4);
  const auto one_empty = record<64, 2048>({0}, 65536);
  CHECK_EQ(none.size(), size_t{0});
  CHECK_EQ(all_empty.size(), size_t{0});
  CHECK_EQ(one_empty.size(), size_t{0});
}

TEST(multi_tensor_plan_stops_when_a_launch_fails) {
  // An int status stands in for cudaError_t: 0 is success, the first failure is returned.
  const std::vector<int64_t> sizes = {10, 10, 10, 10};  // four launches of one chunk each
  int calls = 0;
  const int status =
      plan_multi_tensor<1, 1>(sizes.data(), static_cast<int>(sizes.size()), 16, 0,
                              [&](const MultiTensorLaunch<1, 1>&) { return ++calls == 2 ? 7 : 0; });
  CHECK_EQ(status, 7);
  CHECK_EQ(calls, 2);
}

TEST(multi_tensor_plan_covers_random_lists_with_tiny_limits) {
  const std::vector<int64_t> chunks = {1, 2, 3, 8};
  int checked = 0;
  checked += check_random_lists<1, 1>(1, 500, chunks);
  checked += check_random_lists<1, 4>(2, 500, chunks);
  checked += check_random_lists<4, 1>(3, 500, chunks);
  checked += check_random_lists<2, 3>(4, 500, chunks);
  checked += check_random_lists<3, 5>(5, 500, chunks);
  checked += check_random_lists<5, 16>(6, 500, chunks);
  CHECK_EQ(checked, 6 * 500 * 4);
}

TEST(multi_tensor_plan_covers_random_lists_with_kernel_limits) {
  // multi_tensor_adam.cu (64 slots) and multi_tensor_scale.cu (110 slots), 2048 chunks of 65536
  // elements per launch (multi_tensor_device.cuh). Fewer lists than with the tiny limits: each
  // holds thousands of chunks, and the check walks every one.
  int checked = 0;
  checked += check_random_lists<64, 2048>(7, 10, {65536});
  checked += check_random_lists<110, 2048>(8, 10, {65536});
  CHECK_EQ(checked, 2 * 10);
  // Past 2^31 elements (int64 sizes), next to an exactly full launch and a 0-d tensor.
  const std::vector<int64_t> huge = {3'000'000'000, 1, 0, 65536 * 2048, 65536 * 2048 + 1};
  const auto huge_launches = record<64, 2048>(huge, 65536);
  CHECK_EQ(violation(huge, 65536, 64, 2048, huge_launches), std::string());
}
