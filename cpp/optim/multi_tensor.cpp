#include "optim/multi_tensor.hpp"

#include <string>

#include "common/error.hpp"
#include "optim/parallel.hpp"

namespace megart::optim {

namespace {

// Eight independent accumulators: the sum needs no reassociation to vectorise, and its order is
// fixed, so the result depends only on the inputs and the split across threads.
template <typename T>
double squares(const T* __restrict x, int64_t n) {
  constexpr int kLanes = 8;
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const double v = to_float(x[i + k]);
      acc[k] += v * v;
    }
  }
  for (; i < n; ++i) {
    const double v = to_float(x[i]);
    acc[0] += v * v;
  }
  double total = 0.0;
  for (double a : acc) total += a;
  return total;
}

bool nonfinite(float x) { return (bits_of(x) & 0x7F800000u) == 0x7F800000u; }

// In place gets its own loop: with two pointers that may be equal the compiler must assume they
// overlap and would not vectorise.
template <typename T>
bool scale_in_place(T* __restrict x, int64_t n, float s) {
  unsigned bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    bad |= nonfinite(v);
    store(x + i, v * s);
  }
  return bad != 0;
}

template <typename T>
bool scale_copy(const T* __restrict in, T* __restrict out, int64_t n, float s) {
  unsigned bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(in[i]);
    bad |= nonfinite(v);
    store(out + i, v * s);
  }
  return bad != 0;
}

std::vector<int64_t> sizes_of(const std::vector<TensorRef>& tensors, const char* what) {
  std::vector<int64_t> sizes(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].size > 0 && tensors[i].data == nullptr) {
      throw ConfigError(std::string(what) + ": tensor " + std::to_string(i) + " has no data");
    }
    sizes[i] = tensors[i].size;
  }
  return sizes;
}

template <typename T>
double sum_of_squares_typed(const std::vector<TensorRef>& tensors, int threads) {
  const auto offsets = flat_offsets(sizes_of(tensors, "sum_of_squares"));
  std::vector<double> partial(static_cast<size_t>(threads), 0.0);
  parallel_for(offsets.back(), threads, [&](int worker, int64_t begin, int64_t end) {
    double acc = 0.0;
    for_each_piece(offsets, begin, end, [&](size_t t, int64_t lo, int64_t hi) {
      acc += squares(static_cast<const T*>(tensors[t].data) + lo, hi - lo);
    });
    partial[static_cast<size_t>(worker)] = acc;
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

template <typename T>
bool scale_typed(const std::vector<TensorRef>& in, const std::vector<TensorRef>& out, float s,
                 int threads) {
  const auto offsets = flat_offsets(sizes_of(in, "scale"));
  sizes_of(out, "scale");
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i].size != out[i].size) {
      throw ConfigError("scale: tensor " + std::to_string(i) + " has " +
                        std::to_string(in[i].size) + " inputs but " + std::to_string(out[i].size) +
                        " outputs");
    }
  }
  std::vector<char> found(static_cast<size_t>(threads), 0);
  parallel_for(offsets.back(), threads, [&](int worker, int64_t begin, int64_t end) {
    bool bad = false;
    for_each_piece(offsets, begin, end, [&](size_t t, int64_t lo, int64_t hi) {
      T* dst = static_cast<T*>(out[t].data) + lo;
      const T* src = static_cast<const T*>(in[t].data) + lo;
      bad |= src == dst ? scale_in_place(dst, hi - lo, s) : scale_copy(src, dst, hi - lo, s);
    });
    found[static_cast<size_t>(worker)] = bad;
  });
  for (char f : found) {
    if (f) return true;
  }
  return false;
}

}  // namespace

double sum_of_squares(const std::vector<TensorRef>& tensors, DType dtype, int threads) {
  const int n = resolve_threads(threads);
  switch (dtype) {
    case DType::kFloat32:
      return sum_of_squares_typed<float>(tensors, n);
    case DType::kBFloat16:
      return sum_of_squares_typed<BF16>(tensors, n);
    case DType::kFloat16:
      return sum_of_squares_typed<FP16>(tensors, n);
  }
  return 0.0;
}

bool scale(const std::vector<TensorRef>& in, const std::vector<TensorRef>& out, DType dtype,
           float s, int threads) {
  if (in.size() != out.size()) {
    throw ConfigError("scale needs as many outputs as inputs, got " + std::to_string(out.size()) +
                      " and " + std::to_string(in.size()));
  }
  const int n = resolve_threads(threads);
  switch (dtype) {
    case DType::kFloat32:
      return scale_typed<float>(in, out, s, n);
    case DType::kBFloat16:
      return scale_typed<BF16>(in, out, s, n);
    case DType::kFloat16:
      return scale_typed<FP16>(in, out, s, n);
  }
  return false;
}

}  // namespace megart::optim
